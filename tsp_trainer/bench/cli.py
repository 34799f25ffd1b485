"""tsp-bench: run TSP and the baselines side by side on the same model and measure, per rank,
parameter/gradient/optimizer bytes, peak activation + transient bytes, communication bytes by op
kind (ledger), step time and tokens/s; and time the single-process model against transformers'
CausalLM of the model's family (Llama, Mistral, Qwen2). Every check on the request runs before any
process starts.

    tsp-bench --model tiny --seq-len 4096 --degree 4 --schemes tsp,tp,tp_sp,sp,tp_x_sp \\
              --tp-degree 2 --sp-degree 2 --steps 3 --json out.json --plot out.png

    tsp-bench --schemes tsp,ulysses,sp,tp_sp --reference alst    # + DeepSpeed's own ALST stack
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import sys
import typing

import torch

from tsp_trainer.bench.report import (format_table, summarize_reference, summarize_scheme, summarize_single,
                                      write_json, write_plot)
from tsp_trainer.bench.run import scheme_rank, single_process
from tsp_trainer.bench.spec import ALL_SCHEMES, REFERENCES, BenchSpec, parse_schemes, resolve_model, validate
from tsp_trainer.config import ModelConfig
from tsp_trainer.config.model_source import MODEL_DIM_FLAGS, add_model_args
from tsp_trainer.config.schema import DType, TspRecomputeSetting, resolved_dtype
from tsp_trainer.plan.resolve import choose_bench_settings
from tsp_trainer.tools import launch

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tsp-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, default="tiny", dims=True)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--degree", type=int, default=2, help="D: model-parallel ranks (processes) per scheme")
    p.add_argument("--schemes", default=",".join(ALL_SCHEMES))
    p.add_argument("--tp-degree", type=int, default=None, help="tp_x_sp: T (default: factor of D near sqrt)")
    p.add_argument("--sp-degree", type=int, default=None, help="tp_x_sp: S = D / T")
    p.add_argument("--tp-sequence-parallel", action="store_true", help="tp_x_sp: Megatron SP inside tp")
    p.add_argument("--head-buckets", type=int, default=1, help="tsp: K/V all-gather buckets")
    p.add_argument("--tsp-recompute", choices=typing.get_args(TspRecomputeSetting), default="auto",
                   help="tsp: auto (default: the trainer's choice, the fastest mode whose predicted "
                        "peak fits this device's memory), full (save X_p only), selective (keep each "
                        "shard's attention output) or none (also keep the MLP's gate/up "
                        "pre-activations: backward re-runs no forward GEMM)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (0: memory and bytes only)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps; the first measures memory")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="default: nccl when CUDA is available, else gloo")
    p.add_argument("--dtype", choices=typing.get_args(DType), default="auto",
                   help="weights and activations; auto: bf16 with nccl (GPUs), fp32 with gloo, as "
                        "the trainer's train.dtype=auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores / D)")
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block (all schemes)")
    p.add_argument("--reference", choices=REFERENCES, default=None,
                   help="also run a peer's own stack unmodified on the same weights and batch, in "
                        "processes of its own, and report it beside ours: alst = transformers' "
                        "CausalLM under DeepSpeed's Ulysses (UlyssesSPAttentionHF) and ZeRO-3 over "
                        "the D ranks (the ALST stack our `ulysses` scheme reproduces)")
    p.add_argument("--replicated-weights", action="store_true",
                   help="sp and ulysses with their weights whole on every rank under a plain AdamW "
                        "(default: sharded by DeepSpeed ZeRO-3 over the D ranks, gathered for each "
                        "use, as the trainer runs them with zero.stage auto)")
    p.add_argument("--no-hf", action="store_true", help="skip the single-process comparison with transformers")
    p.add_argument("--no-interleave", action="store_true",
                   help="launch each scheme on its own instead of all schemes in one launch with their "
                        "timed steps interleaved (tsp, tp, tsp, tp, ...; the default, for fair ratios on "
                        "a loaded machine)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile one step per scheme with torch.profiler: self "
                        "time per op, top ops, and grouped (attention, matmul, comm, norm, copy, other)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG: memory, bytes and throughput per scheme")
    return p


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    """Resolve defaults and validate; raises ValueError with the flag, value and a fix."""
    schemes = parse_schemes(args.schemes)
    model = resolve_model(args.model, {field: getattr(args, flag) for flag, field in MODEL_DIM_FLAGS.items()},
                          args.seq_len)
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend or ("nccl" if cuda else "gloo")
    tp, sp = _two_axes(args, schemes)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.degree))
    spec = BenchSpec(model_name=args.model, model=model, seq_len=args.seq_len, micro_batch=args.micro_batch,
                     degree=args.degree, schemes=schemes, tp_degree=tp, sp_degree=sp,
                     tp_sequence_parallel=args.tp_sequence_parallel, head_buckets=args.head_buckets,
                     tsp_recompute="full" if args.tsp_recompute == "auto" else args.tsp_recompute,
                     steps=args.steps, warmup=args.warmup, backend=backend,
                     dtype=resolved_dtype(args.dtype, cuda=backend == "nccl"), threads=threads,
                     activation_checkpointing=args.activation_checkpointing, compare_hf=not args.no_hf,
                     seed=args.seed, interleave=not args.no_interleave, profile=args.profile,
                     reference=args.reference, replicated_weights=args.replicated_weights)
    validate(spec, cuda_devices=cuda)
    if args.tsp_recompute == "auto":             # resolved once the rest is known to be valid
        spec = dataclasses.replace(spec, tsp_recompute=_tsp_recompute(args, model, cuda=backend == "nccl"))
    return spec


def _tsp_recompute(args: argparse.Namespace, model: ModelConfig, *, cuda: bool) -> str:
    """--tsp-recompute auto resolved as the trainer resolves it (plan/auto.py), said once."""
    choice = choose_bench_settings(
        model, degree=args.degree, seq_len=args.seq_len, micro_batch=args.micro_batch,
        head_buckets=args.head_buckets, activation_checkpointing=args.activation_checkpointing,
        dtype=resolved_dtype(args.dtype, cuda=cuda), cuda=cuda)
    print(f"tsp-bench: auto: tsp_recompute={choice.tsp_recompute} (the trainer's rule against "
          f"{choice.budget.source})", flush=True)
    return choice.tsp_recompute


def _two_axes(args, schemes) -> tuple[int | None, int | None]:
    """tp_x_sp's T and S: as given, one derived from the other, or T = the factor of D nearest
    sqrt(D) from below (2 x 2 for D = 4, 2 x 4 for D = 8)."""
    tp, sp, d = args.tp_degree, args.sp_degree, args.degree
    if "tp_x_sp" not in schemes or d < 1:
        return tp, sp
    if tp is None and sp is None:
        tp = max(t for t in range(1, math.isqrt(d) + 1) if d % t == 0)
    if tp is None and sp >= 1 and d % sp == 0:
        tp = d // sp
    if sp is None and tp >= 1 and d % tp == 0:
        sp = d // tp
    if tp is None or sp is None or tp * sp != d:
        raise ValueError(f"--tp-degree x --sp-degree = {tp} x {sp} is not --degree={d}; use T x S in "
                         + ", ".join(f"{t}x{d // t}" for t in range(1, d + 1) if d % t == 0))
    return tp, sp


def run(spec: BenchSpec, *, log=print) -> tuple[list[dict], dict | None, dict]:
    """Launch every scheme (D processes each), then the single-process comparison."""
    _prewarm(spec)
    rows = _run_interleaved(spec, log) if spec.interleave else []
    for scheme in (() if spec.interleave else spec.schemes):
        log(f"[tsp-bench] {scheme}: {spec.degree} ranks, seq {spec.seq_len} ...")
        job = {"scheme": scheme, "options": spec.options(scheme), "zero_stage": spec.zero_stage(scheme),
               **_common(spec)}
        try:
            ranks = launch.run_on_ranks(scheme_rank, spec.degree, job, backend=spec.backend,
                                        threads=spec.threads)
        except RuntimeError as err:       # e.g. out of memory: report it, go on with the others
            log(f"[tsp-bench] {scheme} failed: {str(err).splitlines()[0]}")
            rows.append({"scheme": scheme, "error": str(err)})
            continue
        rows.append(summarize_scheme(spec, scheme, ranks))
    if spec.reference == "alst":
        rows.append(_run_alst(spec, log))
    single = None
    if spec.compare_hf:
        log(f"[tsp-bench] single process: ours vs transformers {spec.model.family} CausalLM ...")
        # As many threads as one rank: a shared or loaded machine punishes multi-threaded
        # processes far more than single-threaded ones (measured: 15x at 2 threads under load).
        out = launch.run_on_ranks(single_process, 1, _common(spec), backend=spec.backend,
                                  threads=spec.threads)[0]
        single = summarize_single(spec, out)
        single["threads"] = spec.threads
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
           "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    return rows, single, env


def _run_interleaved(spec: BenchSpec, log) -> list[dict]:
    """Every scheme in one launch of D processes, timed steps interleaved (run.interleaved_ranks)."""
    from tsp_trainer.bench.run import interleaved_ranks

    log(f"[tsp-bench] {','.join(spec.schemes)} interleaved: {spec.degree} ranks, seq {spec.seq_len} ...")
    jobs = [{"scheme": s, "options": spec.options(s), "zero_stage": spec.zero_stage(s), "profile": spec.profile,
             **_common(spec)} for s in spec.schemes]
    try:
        per_rank = launch.run_on_ranks(interleaved_ranks, spec.degree, jobs, backend=spec.backend,
                                       threads=spec.threads)
    except RuntimeError as err:           # e.g. out of memory: every scheme of the launch fails
        log(f"[tsp-bench] interleaved run failed: {str(err).splitlines()[0]}")
        return [{"scheme": s, "error": str(err)} for s in spec.schemes]
    rows = []
    for i, scheme in enumerate(spec.schemes):
        ranks = [r[i] for r in per_rank]
        row = summarize_scheme(spec, scheme, ranks)
        if spec.profile:
            row["profile"] = ranks[0]["profile"]
        rows.append(row)
    return rows


def _run_alst(spec: BenchSpec, log) -> dict:
    """The ALST stack (bench/alst.py) in a launch of its own: DeepSpeed's registration patches
    transformers in the processes that run it, and in no other."""
    from tsp_trainer.bench.alst import alst_rank

    log(f"[tsp-bench] reference alst (transformers + DeepSpeed Ulysses + ZeRO-3): {spec.degree} ranks ...")
    try:
        ranks = launch.run_on_ranks(alst_rank, spec.degree, _common(spec), backend=spec.backend,
                                    threads=spec.threads)
    except RuntimeError as err:
        log(f"[tsp-bench] alst_ref failed: {str(err).splitlines()[0]}")
        return {"scheme": "alst_ref", "error": str(err)}
    return summarize_reference(spec, "alst", ranks)


def _prewarm(spec: BenchSpec) -> None:
    """Import in the parent what every forked rank would import on its own (seconds each):
    torch._dynamo is pulled in by the first optimizer, transformers by the comparison and the ALST
    reference, DeepSpeed by `ulysses`, ZeRO-3's `sp` and the reference (its CPU shared-memory op,
    which training never calls, left unbuilt: tens of seconds per rank)."""
    if spec.backend == "nccl":     # spawned ranks start from scratch: nothing to share
        return
    import torch._dynamo  # noqa: F401

    if spec.compare_hf or spec.reference:
        import transformers.models.llama.modeling_llama  # noqa: F401
    if any(s in spec.schemes for s in ("sp", "ulysses")) or spec.reference:
        from tsp_trainer.engine.deepspeed import skip_cpu_shm_build

        skip_cpu_shm_build()


def _common(spec: BenchSpec) -> dict:
    return {"model": spec.model, "seq_len": spec.seq_len, "micro_batch": spec.micro_batch,
            "steps": spec.steps, "warmup": spec.warmup, "seed": spec.seed, "backend": spec.backend,
            "dtype": spec.dtype,
            "activation_checkpointing": spec.activation_checkpointing}


def main(argv: list[str] | None = None) -> int:
    """Returns 0, or 1 when a scheme failed (its error is printed); bad arguments exit with 2
    before anything is launched, as argparse does."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as err:
        parser.error(str(err))            # usage + "tsp-bench: error: ...", SystemExit(2)
    rows, single, env = run(spec)
    ok = [r for r in rows if "error" not in r]
    if args.json:                         # files first: a closed stdout must not lose the results
        write_json(args.json, spec, rows, single, env)
    if args.plot and ok:
        write_plot(args.plot, spec, ok, single)
    print(format_table(spec, ok, single))
    if spec.profile:
        from tsp_trainer.bench.profile import format_profiles

        print(format_profiles(ok))
    for r in rows:
        if "error" in r:
            print(f"{r['scheme']}: FAILED\n{r['error']}", file=sys.stderr)
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
