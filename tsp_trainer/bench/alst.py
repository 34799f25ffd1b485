"""tsp-bench --reference alst: the unmodified ALST stack (transformers' CausalLM under DeepSpeed
Ulysses and ZeRO-3, tsp_trainer/engine/alst_reference.py) on the bench's weights and batch, in a
launch of its own (the Ulysses registration patches transformers for the whole process).

Weights: our model initialised with the bench's seed (as every scheme is), loaded into
transformers' model of its family (run.build_hf_llama). Batch: run.make_batch, rank p fed its
contiguous slice [B, S/D] of input_ids and labels with the full sequence's positions. The step is
the bench's: forward, the loss summed over the local tokens divided by the global count, backward,
AdamW (ZeRO-3's). Each rank returns its loss sum; the parent adds them up (no collective here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsp_trainer.bench.run import (LR, _device, _dtype, _now, _tracked, build_hf_llama, executed_flops,
                                   make_batch, to_hf_state_dict)
from tsp_trainer.engine import alst_reference
from tsp_trainer.model import Transformer


def alst_rank(rank: int, world: int, job: dict) -> dict:
    """One rank of the ALST reference: a memory step, warm-ups, then `steps` timed steps."""
    cfg, b, s, device = job["model"], job["micro_batch"], job["seq_len"], _device(job["backend"], rank)
    ours = Transformer(cfg)
    ours.init_weights(job["seed"])
    hf = build_hf_llama(cfg, s, to_hf_state_dict(ours.state_dict())).to(device=device, dtype=_dtype(job))
    del ours
    if job["activation_checkpointing"]:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mpu = alst_reference.register_ulysses(hf, world=world, micro_batch=b, seq_len=s)
    engine = alst_reference.zero3_engine(hf, mpu, world=world, micro_batch=b, lr=LR,
                                         bf16=job.get("dtype") == "bf16")
    ids, labels = make_batch(cfg, b, s, job["seed"])
    t = s // world
    part = slice(rank * t, (rank + 1) * t)
    local_ids, local_labels = ids[:, part].to(device), labels[:, part].to(device)
    positions = torch.arange(rank * t, (rank + 1) * t, device=device).expand(b, t).contiguous()
    total = float(b * s)

    def fwd_bwd() -> torch.Tensor:
        logits = engine(input_ids=local_ids, position_ids=positions).logits.float()        # [B, S/D, V]
        loss_sum = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum")
        engine.backward(loss_sum / total)
        return loss_sum.detach().double()

    def step() -> None:
        fwd_bwd()
        engine.step()

    # the memory step, as StepRunner's: forward + backward tracked, ZeRO-3's standing state ignored
    standing = [x for xs in alst_reference.zero3_state(engine).values() for x in xs]
    with executed_flops() as flops:
        peak, loss_sum = _tracked(fwd_bwd, standing, [local_ids, local_labels, positions], device)
    engine.step()
    for _ in range(job["warmup"] - 1):
        step()
    times = []
    for _ in range(job["steps"]):
        t0 = _now(device)
        step()
        times.append(_now(device) - t0)
    return {"loss_sum": float(loss_sum), "total": total, "peak_act_bytes": peak,
            "flops": flops.get_total_flops(),
            "step_times": times, **alst_reference.zero3_state_bytes(engine)}
