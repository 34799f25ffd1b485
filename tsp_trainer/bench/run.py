"""What each benchmark process runs: one rank of a scheme (`scheme_rank`), or the single-process
model against transformers' CausalLM of its family (`single_process`). Both return plain dicts.

One training step = forward + backward of the summed token loss over the global token count
(parallel/loss.py) + AdamW. The first warm-up step doubles as the memory step: gradients are
preallocated (zeros), so the tracked forward + backward sees only activations and transients;
AdamW then creates its moments. The memory step also counts the FLOPs the rank executes
(`executed_flops`). The ledger is reset before every step and the last step's records are kept;
timed steps run without the memory tracker. `sp` and `ulysses` run under DeepSpeed ZeRO-3 as the
trainer runs them (bench/zero3.py, the same interface) unless the job says zero_stage 0.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from tsp_trainer.config import ModelConfig
from tsp_trainer.engine.ulysses import scheme_options
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize
from tsp_trainer.tools.memory import LiveTensorMemory, state_bytes

LR = 1e-4


def make_batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int):
    """Random tokens; labels are the inputs shifted by one (what the data pipeline hands over)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def scheme_rank(rank: int, world: int, job: dict) -> dict:
    """One rank of `job["scheme"]` on a dp=1 mesh of `world` = D ranks."""
    run, finish = build_scheme(rank, world, job)
    run.memory_step()
    for _ in range(job["warmup"] - 1):
        run.step()
    run.times = [run.step() for _ in range(job["steps"])]
    return finish(run.result())


def interleaved_ranks(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    """One rank of every scheme in `jobs` (same D ranks, one mesh each), their timed steps
    interleaved (tsp, tp, tsp, tp, ...) so that load from other processes on a shared machine hits
    every scheme alike; memory steps and warm-ups first, then with `profile` one profiled step each
    (tsp_trainer/bench/profile.py). Returns one result per job, as scheme_rank would."""
    built = [build_scheme(rank, world, job) for job in jobs]
    for run, _ in built:
        run.memory_step()
    for _ in range(jobs[0]["warmup"] - 1):
        for run, _ in built:
            run.step()
    for _ in range(jobs[0]["steps"]):
        for run, _ in built:
            run.times.append(run.step())
    out = []
    for (run, finish), job in zip(built, jobs):
        result = finish(run.result())
        if job.get("profile"):
            from tsp_trainer.bench.profile import profile_step

            result["profile"] = profile_step(run.fwd_bwd, run.device)
        out.append(result)
    return out


def build_scheme(rank: int, world: int, job: dict):
    """(step runner, finish(result) -> result) of one rank of `job["scheme"]`; `job["zero_stage"]`
    3 (sp, ulysses): weights sharded by DeepSpeed ZeRO-3 (bench/zero3.py), else whole on every
    rank under a plain AdamW."""
    cfg, device = job["model"], _device(job["backend"], rank)
    zero3 = job.get("zero_stage") == 3
    if zero3:                          # before DeepSpeed's comm start-up (engine/zero3_bytes.py)
        from tsp_trainer.bench.zero3 import install_counter

        install_counter()
    mesh = build_mesh(world, device=device)
    with torch.device("meta"):
        model = Transformer(cfg)
    par = parallelize(model, job["scheme"], mesh, seq_len=job["seq_len"], init_seed=job["seed"],
                      **job["options"], **scheme_options(job["scheme"], zero_stage=job.get("zero_stage", 0)))
    model.to(device=device, dtype=_dtype(job))
    if job["activation_checkpointing"]:
        model.block_wrapper = checkpointed_block
    if job.get("offload_activations"):                  # train.offload_activations (model/offload.py)
        from tsp_trainer.model.offload import ActivationOffload

        model.block_wrapper = ActivationOffload(model.block_wrapper)
    ids, labels = make_batch(cfg, job["micro_batch"], job["seq_len"], job["seed"])
    local_ids, local_labels, positions = par.local_batch(ids.to(device), labels.to(device))
    batch = [local_ids, local_labels, positions]

    def finish(out: dict) -> dict:
        out["first_loss"] = reduce_loss_value(out.pop("loss_sum"), out.pop("total"), par.token_comms)
        out["info"] = dict(par.info)
        return out

    if zero3:                          # sp, ulysses as the trainer runs them (bench/zero3.py)
        from tsp_trainer.bench.zero3 import Zero3StepRunner

        return Zero3StepRunner(par, mesh, batch, device, job), finish

    def fwd_bwd():
        loss_sum, count = par.loss_sum(*batch)
        total = global_count(count, par.token_comms)
        (loss_sum / total).backward()
        return loss_sum, total

    return StepRunner(model, fwd_bwd, batch, device, mesh.ledger), finish


def single_process(rank: int, world: int, job: dict) -> dict:
    """Our plain model and transformers' CausalLM (Llama / Mistral / Qwen2), same config, weights
    and batch."""
    cfg, device = job["model"], _device(job["backend"], rank)
    ids, labels = make_batch(cfg, job["micro_batch"], job["seq_len"], job["seed"])
    batch = [ids.to(device), labels.to(device)]
    ours = Transformer(cfg)
    ours.init_weights(job["seed"])
    hf = build_hf_llama(cfg, job["seq_len"], to_hf_state_dict(ours.state_dict()))
    ours.to(device=device, dtype=_dtype(job)), hf.to(device=device, dtype=_dtype(job))
    if job["activation_checkpointing"]:
        ours.block_wrapper = checkpointed_block
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def ours_step():
        loss_sum, count = ours.loss_sum(*batch)
        (loss_sum / count).backward()
        return loss_sum, count.double()

    def hf_step():
        logits = hf(batch[0]).logits.float()
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), reduction="sum")
        (loss_sum / batch[1].numel()).backward()
        return loss_sum, torch.tensor(float(batch[1].numel()), dtype=torch.float64)

    # Interleave the two models step by step, so that load from other processes on a shared
    # machine hits both alike (the ratio is what this comparison is for).
    runs = {"ours": StepRunner(ours, ours_step, batch, device, None),
            "hf": StepRunner(hf, hf_step, batch, device, None)}
    for run in runs.values():
        run.memory_step()
    for _ in range(job["warmup"] - 1):
        for run in runs.values():
            run.step()
    for _ in range(job["steps"]):
        for run in runs.values():
            run.times.append(run.step())
    result = {}
    for name, run in runs.items():
        r = run.result()
        r["first_loss"] = float(r.pop("loss_sum") / r.pop("total"))
        result[name] = r
    return result


class StepRunner:
    """Steps of one model: the first tracked for memory (fwd + bwd), the others timed."""

    def __init__(self, model, fwd_bwd, batch, device: torch.device, ledger):
        self.model, self.fwd_bwd, self.batch, self.device, self.ledger = model, fwd_bwd, batch, device, ledger
        self.params = list(model.parameters())
        for p in self.params:
            p.grad = torch.zeros_like(p)            # preallocated: not counted as activations
        self.opt = torch.optim.AdamW(self.params, lr=LR)
        self.times: list[float] = []

    def memory_step(self) -> None:
        if self.ledger is not None:
            self.ledger.reset()
        self.peak, (self.loss_sum, self.total) = _tracked(self.fwd_bwd, self.params, self.batch, self.device)
        self._update()
        # FLOPs from one more forward + backward, untracked and not applied: FlopCounterMode's
        # dispatch keeps tensors alive that the tracked step must not see (checkpointed replays);
        # the ledger keeps this step's records, the same ops
        if self.ledger is not None:
            self.ledger.reset()
        with executed_flops() as flops:
            self.fwd_bwd()
        self.flops = flops.get_total_flops()
        self.opt.zero_grad(set_to_none=False)

    def step(self) -> float:
        if self.ledger is not None:
            self.ledger.reset()
        t0 = _now(self.device)
        self.fwd_bwd()
        self._update()
        return _now(self.device) - t0

    def _update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def result(self) -> dict:
        return runner_result(self, state_bytes(self.model, self.opt))


def runner_result(run, state: dict) -> dict:
    """A step runner's result (StepRunner, bench/zero3.py's Zero3StepRunner): its tracked peak,
    `state` (the state's bytes), the timed steps and their median, the executed FLOPs, the first
    step's loss sum and token count, and the last step's ledger (none: no communication)."""
    return {"peak_act_bytes": run.peak, **state, "step_times": run.times, "flops": run.flops,
            "loss_sum": run.loss_sum.detach().double(), "total": run.total,
            "step_time": statistics.median(run.times) if run.times else None,
            "comm": run.ledger.summary() if run.ledger is not None else {},
            "wire_bytes": wire_bytes(run.ledger.records) if run.ledger is not None else 0}


# Bytes a rank receives per op, as a fraction of the ledger payload, for ring algorithms on a
# group of g ranks (averaged over the ranks for the rooted ops; P2P counted once, at the receiver;
# an all-to-all keeps 1/g of its tensor and receives the rest).
_WIRE_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
                "reduce_scatter": lambda g: (g - 1) / g, "broadcast": lambda g: (g - 1) / g,
                "reduce": lambda g: (g - 1) / g, "recv": lambda g: 1.0, "send": lambda g: 0.0,
                "all_to_all": lambda g: (g - 1) / g}


def wire_bytes(records) -> int:
    """Estimated bytes received per rank for the ledger records (see _WIRE_FACTOR)."""
    return int(sum(r.nbytes * _WIRE_FACTOR[r.op](r.group_size) for r in records))


def executed_flops():
    """torch's FlopCounterMode (matmuls and attention of forward and backward, 2 per
    multiply-add; attention counted as the full S x S product, causal or not), taught the ops it
    does not know: the in-place accumulating GEMMs and the CPU flash attention kernels (SDPA on CPU
    runs them). Use as `with executed_flops() as c:`,
    then c.get_total_flops()."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def heads_of_q(q, k):            # GQA: count every query head against its K/V (as expanded)
        return (*k[:1], q[1], *k[2:])

    def forward(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(q, heads_of_q(q, k), heads_of_q(q, v))

    def backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, q, heads_of_q(q, k), heads_of_q(q, v))

    def accumulate(acc, a, b, *args, out_shape=None, **kwargs) -> int:    # acc += a @ b, 2D or batched
        return 2 * math.prod(a[:-1]) * a[-1] * b[-1]

    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten.addmm_: accumulate, aten.baddbmm_: accumulate,     # in-place GEMMs (parallel/gated_mlp.py)
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward})


def _tracked(fwd_bwd, params, batch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fwd_bwd()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, result
    tracker = LiveTensorMemory()
    tracker.ignore(*params, *(p.grad for p in params), *batch)
    with tracker:
        result = fwd_bwd()
    return tracker.peak, result


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _device(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _dtype(job: dict) -> torch.dtype:
    """The trainer's rule (BenchSpec.dtype): bf16 on GPUs by default, fp32 on CPU."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[job.get("dtype", "fp32")]


# ---------------------------------------------------------------------------------------------
# transformers comparison


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names are transformers' minus the "model." prefix (lm_head.weight is top level)."""
    return {(name if name == "lm_head.weight" else "model." + name): t for name, t in state.items()}


def build_hf_llama(cfg: ModelConfig, seq_len: int, state: dict[str, torch.Tensor] | None = None):
    """transformers' CausalLM of cfg.family (LlamaForCausalLM, MistralForCausalLM,
    Qwen2ForCausalLM) with the same config (SDPA attention), optionally loaded with our weights."""
    from tsp_trainer.checkpoint.hf import hf_config, hf_model_class

    hf_cfg = hf_config(cfg.replace(max_seq_len=max(seq_len, cfg.max_seq_len)))
    hf_cfg._attn_implementation = "sdpa"
    model = hf_model_class(cfg)(hf_cfg)
    if state is not None:
        model.load_state_dict(state, strict=not cfg.tie_embeddings)
    return model
