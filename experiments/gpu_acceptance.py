"""GPU acceptance run, one command, one GPU, at most ~8 minutes on an H200:

    python experiments/gpu_acceptance.py --out docs/results/gpu_acceptance.json           # on one H200 / H100
    python experiments/gpu_acceptance.py --device cpu --tiny --out /tmp/acc.json  # the CPU twin (tests)

It writes one JSON with four parts:

(a) plain model: our single-process model against transformers' LlamaForCausalLM, same config,
    weights and batch, steps interleaved (tsp_trainer/bench/run.py `single_process`): tokens/s and MFU, at a
    1B shape, 8K tokens, bf16 (tiny: the tiny model, 256 tokens, fp32);
(b) one TSP rank of the 7B 128K D = 8 recipe (recipes/7b_128k_8gpu.yaml: head buckets 4,
    activation checkpointing) run for real on this GPU. The other seven ranks do not exist: the
    process group is torch's fake backend (plan/dry_run.py `fake_world`), whose collectives and
    P2P ops return at once without moving data, so every buffer the rank receives has the right
    shape and device and garbage contents (the loss is meaningless; time and memory are real,
    less the communication). Reports the CUDA peak (torch.cuda.max_memory_allocated) of the
    forward + backward against the planner's activation peak (plan/activations.py), and the step time;
(c) which SDPA kernel ran: the kernel / aten op names of one profiled step that match flash,
    memory-efficient, cuDNN or math attention;
(d) MFU of that rank: model FLOPs of its tokens (S / D) per step time over the GPU's peak.

docs/benchmarks.md says which GPU figures have been measured; the CPU twin runs the same code path
at tiny sizes in tests/unit/test_gpu_acceptance.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tsp_trainer.bench import StepRunner, make_batch, single_process
from tsp_trainer.config.model import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.observability.flops import flops_per_token
from tsp_trainer.observability.metrics import detect_peak_flops

KERNEL_WORDS = ("flash", "efficient", "cudnn", "scaled_dot_product", "fmha", "sdpa")


def shapes(tiny: bool) -> dict:
    """(a) and (b) problem sizes: 1B at 8K and 7B at 128K on a GPU, seconds-sized on CPU."""
    if tiny:
        return {"plain": {"name": "tiny", "model": model_config("tiny"), "seq_len": 128, "dtype": "fp32"},
                "tsp": {"name": "tiny (8 heads)", "model": model_config("tiny", num_heads=8, num_kv_heads=8),
                        "seq_len": 512, "degree": 8, "head_buckets": 1, "dtype": "fp32"}}
    return {"plain": {"name": "1b", "model": model_config("1b"), "seq_len": 8192, "dtype": "bf16"},
            "tsp": {"name": "7b", "model": model_config("7b"), "seq_len": 131072, "degree": 8,
                    "head_buckets": 4, "dtype": "bf16"}}


def plain_model(device: torch.device, name: str, cfg, seq_len: int, dtype: str, steps: int,
                peak: float | None) -> dict:
    """(a): ours vs transformers, interleaved steps (tsp_trainer/bench/run.py single_process)."""
    job = {"model": cfg, "seq_len": seq_len, "micro_batch": 1, "steps": steps, "warmup": 1, "seed": 0,
           "backend": "nccl" if device.type == "cuda" else "gloo", "dtype": dtype,
           "activation_checkpointing": False}
    out = single_process(device.index or 0, 1, job)
    fpt = flops_per_token(cfg, seq_len)
    result = {"model": name, "seq_len": seq_len, "dtype": dtype}
    for name in ("ours", "hf"):
        t = out[name]["step_time"]
        tps = seq_len / t
        result[name] = {"step_time_s": t, "tokens_per_s": tps, "mfu": fpt * tps / peak if peak else None,
                        "peak_act_bytes": out[name]["peak_act_bytes"], "first_loss": out[name]["first_loss"]}
    result["ours_over_hf_tokens_per_s"] = result["ours"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    return result


def tsp_rank(device: torch.device, spec: dict, steps: int, peak: float | None) -> dict:
    """(b), (c), (d): rank 0 of a D-rank TSP group whose peers are the fake process group."""
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.plan.activations import activation_memory
    from tsp_trainer.plan.layout import Layout
    from tsp_trainer.plan.precision import BF16, FP32
    from tsp_trainer.plan.dry_run import fake_world
    from tsp_trainer.parallel.loss import global_count

    cfg, seq, d, nb = spec["model"], spec["seq_len"], spec["degree"], spec["head_buckets"]
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    with fake_world(d, 0):
        mesh = build_mesh(d, device=device)
        with torch.device("meta"):
            model = Transformer(cfg.replace(max_seq_len=max(seq, cfg.max_seq_len)))
        par = parallelize(model, "tsp", mesh, seq_len=seq, init_seed=0, head_buckets=nb)
        model.to(device=device, dtype=dtype)
        model.block_wrapper = _checkpointed
        ids, labels = make_batch(cfg, 1, seq, 0)
        batch = list(par.local_batch(ids.to(device), labels.to(device)))

        def fwd_bwd():
            loss_sum, count = par.loss_sum(*batch)
            total = global_count(count, par.token_comms)
            (loss_sum / total).backward()
            return loss_sum, total

        run = StepRunner(model, fwd_bwd, batch, device, mesh.ledger)
        run.memory_step()                           # CUDA: max_memory_allocated over fwd + bwd
        kernels = _sdpa_kernels(fwd_bwd, device)    # one more (untimed) step under the profiler
        run.times = [run.step() for _ in range(steps)]
        step_time = sorted(run.times)[len(run.times) // 2]
        state = {"param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    prec = BF16 if spec["dtype"] == "bf16" else FP32
    layout = Layout("tsp", d, dp=1, zero_stage=1, activation_checkpointing=True, head_buckets=nb)
    predicted = activation_memory(cfg, layout, seq, prec, device=device.type)
    fpt = flops_per_token(cfg, seq)
    local_tokens = seq // d
    return {"model": spec["name"], "seq_len": seq, "degree": d, "head_buckets": nb, "dtype": spec["dtype"],
            "peak_act_bytes": run.peak, "planner_peak_act_bytes": predicted.peak,
            "planner_peak_phase": predicted.peak_phase,
            "measured_over_planner": run.peak / predicted.peak if predicted.peak else None,
            "step_time_s": step_time, "step_times_s": run.times, "local_tokens": local_tokens,
            "tokens_per_s_this_rank": local_tokens / step_time,
            "mfu": fpt * local_tokens / step_time / peak if peak else None,
            "sdpa_kernels": kernels, **state,
            "note": "peers are torch's fake process group: no data moves, so the time excludes "
                    "communication and the loss is meaningless"}


def _checkpointed(block, x, rope):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(block, x, rope, use_reentrant=False)


def _sdpa_kernels(fwd_bwd, device: torch.device) -> dict[str, int]:
    """Names of the attention kernels (CUDA) or aten SDPA ops (CPU) one step ran, with counts."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fwd_bwd()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    counts: dict[str, int] = {}
    for ev in prof.events():
        name = ev.name
        if any(w in name.lower() for w in KERNEL_WORDS):
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU twin of the test suite)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per part (default 3)")
    p.add_argument("--skip-plain", action="store_true", help="only part (b)-(d)")
    p.add_argument("--out", default="gpu_acceptance.json", metavar="PATH")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu --tiny for the CPU twin")
    if args.steps < 1:
        p.error(f"--steps={args.steps} must be >= 1")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    peak = detect_peak_flops(device)
    sizes = shapes(args.tiny)
    start = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "peak_flops": peak, "torch": torch.__version__, "tiny": args.tiny}
    if not args.skip_plain:
        s = sizes["plain"]
        report["plain"] = plain_model(device, s["name"], s["model"], s["seq_len"], s["dtype"], args.steps, peak)
        print(f"[acceptance] (a) plain: {json.dumps(report['plain'], default=str)}", flush=True)
    report["tsp_rank"] = tsp_rank(device, sizes["tsp"], args.steps, peak)
    report["seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    t = report["tsp_rank"]
    print(f"[acceptance] (b) TSP rank: peak {t['peak_act_bytes'] / 2**30:.2f} GiB vs planner "
          f"{t['planner_peak_act_bytes'] / 2**30:.2f} GiB, step {t['step_time_s']:.2f} s; (c) kernels "
          f"{list(t['sdpa_kernels'])[:3]}; (d) MFU {t['mfu']}; wrote {args.out} in "
          f"{report['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
