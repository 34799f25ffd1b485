"""tsp-plan: which layouts of a model fit on a cluster, and how fast each would train.

    tsp-plan --model 7b --seq-len 131072 --global-batch 128 --gpu mi300x --nodes 128 \\
             --json plan.json --plot plan.png
    tsp-plan --dry-run            # the 7B 128K recipe at world 1,024 on fake tensors (one process)
    tsp-plan --model llama3_8b --gpu h100 --nodes 1 --max-seq-len   # longest context per scheme
    tsp-plan --model llama3_8b --gpu h100 --nodes 1 --ablation      # ... as each technique is added
    python -m tsp_trainer.plan.peers   # ALST's published ablation beside the planner's ulysses rows

The planner lists every layout (scheme, D, DP, ZeRO stage, activation checkpointing, activation
offload, TSP recompute mode, head buckets, micro-batch x grad accumulation) that fits in GPU memory
and whose node's pinned host bytes fit its host memory, ranked by predicted
step time (plan/predict.py; docs/planner.md), then TSP beside the peers' stacks (ulysses, upipe,
sp_zero3: the peers' stacks as modelled in plan/peers.py, which the trainer runs as
parallel.scheme=ulysses, ulysses with head chunks and sp under ZeRO-3; --max-seq-len lists them too): for one scheme, D and batch split, the top row's
recompute mode, checkpointing and head buckets are what the trainer's `auto` settings choose
(plan/auto.py). Impossible requests (nothing fits, a global batch no layout can
split) exit with code 2 and say why.
"""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import asdict

from tsp_trainer.config.model_source import add_model_args
from tsp_trainer.config.schema import OffloadOptimizer, TspRecompute, TspRecomputeSetting
from tsp_trainer.plan.layout import SCHEMES
from tsp_trainer.plan.peers import PEER_SCHEMES
from tsp_trainer.plan.precision import PRECISIONS
from tsp_trainer.plan.predict import Assumptions

_DEFAULT_ASSUMPTIONS = Assumptions()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tsp-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, default="7b")
    p.add_argument("--seq-len", type=int, default=131072, help="tokens per sequence (default 131072)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (required unless --dry-run)")
    p.add_argument("--gpu", default="mi300x", help="hardware profile: mi300x, h100, h200")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 1; --dry-run: 128)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--host-memory-gb", type=float, default=None,
                   help="host memory per node in GB, which activation offload, optimizer offload "
                        "and the async checkpoint's staging pin (default: the profile's, 2,000 for "
                        "h100 and h200, 1,649 for mi300x; docs/planner.md gives the sources)")
    p.add_argument("--schemes", default=None,
                   help=f"comma-separated subset of {','.join(SCHEMES + PEER_SCHEMES)} (default: all; "
                        f"--dry-run: tsp,tp,tp_sp); {', '.join(PEER_SCHEMES)} are the peers' stacks "
                        "as modelled in plan/peers.py (the trainer runs them as parallel.scheme=ulysses, "
                        "with parallel.ulysses_head_chunks, and sp under ZeRO-3)")
    p.add_argument("--max-degree", type=int, default=64, help="largest model-parallel degree D tried")
    p.add_argument("--micro-batch", default=None,
                   help="comma-separated micro-batch sizes to try (default: all)")
    p.add_argument("--dtype", choices=sorted(PRECISIONS), default="bf16")
    p.add_argument("--efficiency", type=float, default=None,
                   help="one achieved fraction of peak FLOP/s for GEMMs and attention alike (default: "
                        "the GPU's per-kernel-family table, plan/efficiency.py)")
    p.add_argument("--efficiency-table", default=None, metavar="PATH",
                   help="kernel efficiency table JSON (python -m tsp_trainer.plan.efficiency "
                        "ACCEPTANCE.json --out PATH; default: the published table)")
    p.add_argument("--comm-efficiency", type=float, default=_DEFAULT_ASSUMPTIONS.comm_efficiency,
                   help="achieved fraction of link bandwidth (default %(default)s)")
    p.add_argument("--hbm-usable", type=float, default=_DEFAULT_ASSUMPTIONS.hbm_usable,
                   help="fraction of HBM available to tensors (default %(default)s)")
    p.add_argument("--top", type=int, default=15, help="rows of the ranking to print")
    p.add_argument("--max-seq-len", action="store_true",
                   help="report the longest sequence each scheme fits in HBM and host memory "
                        "(without and with activation offload to host memory, with and without "
                        "activation checkpointing; --global-batch defaults to 1), the limit that "
                        "bound it and its peak's pieces, instead of ranking layouts at --seq-len")
    p.add_argument("--ablation", action="store_true",
                   help="TSP's longest sequence as the memory techniques are added one by one "
                        "(none, + tiled loss, + tiled MLP, + tiled accumulators, + optimizer offload, "
                        "+ activation offload): length, peak, host memory per node, step time and "
                        "the limit that binds, per row (plan/ablation.py; --global-batch 1)")
    p.add_argument("--tsp-recompute", choices=typing.get_args(TspRecomputeSetting), default="auto",
                   help="TSP's parallel.tsp_recompute: auto (default: rank every mode, as the "
                        "trainer's auto does), full (backward recomputes projections, attention and "
                        "the MLP's gate/up from X_p), selective (keeps q, k/v and attention outputs, "
                        "~5 X_p more per layer) or none (also keeps gate/up, 2 B S/D I elements more "
                        "per layer; backward re-runs no forward GEMM); no activation checkpointing or "
                        "offload with selective or none. --max-seq-len and --dry-run take auto as full")
    p.add_argument("--zero-offload-optimizer", choices=typing.get_args(OffloadOptimizer), default="none",
                   help="the trainer's zero.offload_optimizer: none (default) or cpu (DeepSpeed's "
                        "ZeRO-Offload: the fp32 master and AdamW moments in pinned host memory, the "
                        "update on the CPU; costs PCIe and CPU time per step; ZeRO 1 or 2 for TSP and the "
                        "baselines, ZeRO-3 for the ulysses and sp peers)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="PNG chart of the layout ranking (not with --max-seq-len, --ablation or --dry-run)")
    g = p.add_argument_group("dry run (--dry-run): the real code on fake tensors and a fake process group")
    g.add_argument("--dry-run", action="store_true")
    g.add_argument("--degree", type=int, default=8, help="D for the dry run (default 8)")
    g.add_argument("--head-buckets", type=int, default=4, help="TSP head buckets (default 4, the recipe's)")
    g.add_argument("--micro-batch-size", type=int, default=1, help="dry run micro-batch (default 1)")
    g.add_argument("--no-activation-checkpointing", action="store_true",
                   help="dry run without activation checkpointing (the recipe has it on)")
    g.add_argument("--rank", type=int, default=0, help="global rank to simulate (default 0)")
    g.add_argument("--full-depth", action="store_true",
                   help="run all layers instead of extrapolating from 1 and 2 (slower)")
    g.add_argument("--attention", choices=("cpu", "cuda"), default="cpu",
                   help="attention path of the dry run: cpu (the fake tensors' own: key prefix and "
                        "causal diagonal merged by log-sum-exp, no mask) or cuda (the GPU route: "
                        "fused kernel, no mask), compared with the analytic model's matching "
                        "variant (default cpu)")
    g.add_argument("--attention-chunk-tokens", default="auto",
                   help="TSP's parallel.attention_chunk_tokens for the dry run: auto or local tokens "
                        "per K/V chunk (default auto)")
    return p


def _cluster(parser: argparse.ArgumentParser, args):
    """(--nodes, the GPU profile) checked: one line naming the flag on bad input."""
    from tsp_trainer.plan.hardware import get_profile

    nodes = 1 if args.nodes is None else args.nodes
    if nodes < 1:
        _fail(parser, f"--nodes={nodes} must be >= 1")
    try:
        hw = get_profile(args.gpu, gpus_per_node=args.gpus_per_node, host_memory_gb=args.host_memory_gb)
    except ValueError as err:
        _fail(parser, str(err))
    return nodes, hw


def _assumptions(parser, args, hw) -> Assumptions:
    """The planner's assumptions from the flags, each checked: one line naming the flag."""
    from tsp_trainer.plan.efficiency import read_table

    for flag, value in (("--efficiency", args.efficiency), ("--comm-efficiency", args.comm_efficiency),
                        ("--hbm-usable", args.hbm_usable)):
        if value is not None and not 0 < value <= 1:
            _fail(parser, f"{flag}={value} must be in (0, 1]")
    table = None
    if args.efficiency_table:
        try:
            rows = read_table(args.efficiency_table)
        except (OSError, ValueError) as err:
            _fail(parser, f"--efficiency-table={args.efficiency_table}: {err}")
        if hw.name not in rows:
            _fail(parser, f"--efficiency-table={args.efficiency_table} has no row for --gpu={hw.name} "
                          f"(rows: {', '.join(sorted(rows))})")
        table = rows[hw.name]
    return Assumptions(kernel_efficiency=table, compute_efficiency=args.efficiency,
                       comm_efficiency=args.comm_efficiency, hbm_usable=args.hbm_usable)


def _efficiencies(hw, assumptions: Assumptions):
    from tsp_trainer.plan.predict import efficiencies

    return efficiencies(hw, assumptions)


def _efficiency_text(hw, assumptions: Assumptions) -> str:
    """The compute efficiencies a prediction uses, for table headers."""
    eff = _efficiencies(hw, assumptions)
    if assumptions.compute_efficiency is not None:
        return f"{eff.gemm:.0%} of peak FLOP/s"
    return (f"GEMM {eff.gemm:.0%}, flash attention forward {eff.attention_forward:.0%} / backward "
            f"{eff.attention_backward:.0%} of peak FLOP/s ({eff.source}), elementwise "
            f"{eff.elementwise:.0%} of HBM bandwidth")


def _fail(parser: argparse.ArgumentParser, message: str) -> None:
    parser.print_usage(sys.stderr)
    print(f"tsp-plan: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _model(parser, name: str, seq_len: int):
    """--model: a named size or a Hugging Face folder / config.json (its shape, no weights)."""
    from tsp_trainer.config.model_source import model_from_name_or_path
    from tsp_trainer.config.validate import check_sliding_window

    if seq_len < 1:
        _fail(parser, f"--seq-len={seq_len} must be a positive number of tokens")
    try:
        cfg = model_from_name_or_path(name)
        check_sliding_window(cfg, seq_len, key="--seq-len")
    except ValueError as err:
        _fail(parser, str(err))
    return cfg.replace(max_seq_len=max(seq_len, cfg.max_seq_len))


def _modes(text: str) -> tuple[str, ...]:
    """--tsp-recompute as the modes to rank: auto ranks all of them."""
    return typing.get_args(TspRecompute) if text == "auto" else (text,)


def _one_mode(text: str) -> str:
    """--tsp-recompute for --max-seq-len and --dry-run, which take one mode: auto is full (the
    least memory, the longest sequence; the dry run's activation checkpointing needs it)."""
    return "full" if text == "auto" else text


def _schemes(parser, text: str | None, default) -> tuple[str, ...]:
    if text is None:
        return tuple(default)
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    known = SCHEMES + PEER_SCHEMES
    bad = [s for s in names if s not in known]
    if bad or not names:
        _fail(parser, f"--schemes={text!r}: use a comma-separated subset of {','.join(known)}")
    return names


def _split_peers(names: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the trainer's schemes, the peers the planner models) of --schemes."""
    return (tuple(s for s in names if s in SCHEMES), tuple(s for s in names if s in PEER_SCHEMES))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = _model(parser, args.model, args.seq_len)
    if args.gpus_per_node < 1:
        _fail(parser, f"--gpus-per-node={args.gpus_per_node} must be >= 1")
    if args.dry_run and args.zero_offload_optimizer != "none":
        _fail(parser, f"--zero-offload-optimizer={args.zero_offload_optimizer} is not modelled by "
                      "--dry-run (its fake tensors run no optimizer); use it with the ranking or "
                      "--max-seq-len")
    modes = [flag for flag, on in (("--max-seq-len", args.max_seq_len), ("--dry-run", args.dry_run),
                                   ("--ablation", args.ablation)) if on]
    if len(modes) > 1:
        _fail(parser, f"{' and '.join(modes)} are {('two', 'three')[len(modes) - 2]} modes; run them one at a time "
                      "(the dry run takes the length to check as --seq-len)")
    if args.plot and modes:
        _fail(parser, f"--plot draws the ranking of layouts (no mode flag); it cannot draw {modes[0]}'s "
                      "result: drop --plot, or use --json for a file")
    if args.dry_run:
        return _dry_run(parser, args, cfg)
    if args.ablation:
        return _ablation(parser, args, cfg)
    if args.max_seq_len:
        return _longest(parser, args, cfg)
    return _plan(parser, args, cfg)


def _longest(parser, args, cfg) -> int:
    import json

    from tsp_trainer.plan.longest import format_longest, longest_seq_len
    from tsp_trainer.plan.peers import peer_longest

    nodes, hw = _cluster(parser, args)
    args.tsp_recompute = _one_mode(args.tsp_recompute)
    batch = 1 if args.global_batch is None else args.global_batch
    if batch < 1:
        _fail(parser, f"--global-batch={batch} must be >= 1 (sequences per optimizer step)")
    assumptions = _assumptions(parser, args, hw)
    schemes, peers = _split_peers(_schemes(parser, args.schemes, SCHEMES + PEER_SCHEMES))
    world = nodes * hw.gpus_per_node
    offload_optimizer = args.zero_offload_optimizer == "cpu"
    report = {"model": args.model, "gpu": hw.name, "nodes": nodes, "world_size": world,
              "global_batch": batch, "dtype": args.dtype, "tsp_recompute": args.tsp_recompute,
              "zero_offload_optimizer": args.zero_offload_optimizer, "results": {}}
    for offload in (False, True):
        rows = [longest_seq_len(cfg, s, hw=hw, nodes=nodes, global_batch=batch,
                                prec=PRECISIONS[args.dtype], assumptions=assumptions,
                                max_degree=args.max_degree, offload=offload,
                                tsp_recompute=args.tsp_recompute,
                                offload_optimizer=offload_optimizer) for s in schemes]
        rows += [peer_longest(cfg, s, hw=hw, nodes=nodes, prec=PRECISIONS[args.dtype],
                              assumptions=assumptions, max_degree=args.max_degree, offload=offload,
                              offload_optimizer=offload_optimizer) for s in peers]
        what = "with activation offload to host" if offload else "activations in GPU memory"
        print(format_longest(rows, header=(
            f"longest sequence per scheme: {args.model} on {world} x {hw.name} ({nodes} nodes), global "
            f"batch {batch}, {args.dtype}, {_adamw_where(offload_optimizer)}, {what}, TSP recompute "
            f"{args.tsp_recompute}; "
            f"{hw.hbm_bytes / 1e9:.0f} GB x "
            f"{assumptions.hbm_usable:.2f} usable, {hw.host_memory_bytes / 1e9:,.0f} GB host "
            f"memory per node")))
        print()
        report["results"]["offload" if offload else "gpu"] = [r.as_dict() for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _ablation(parser, args, cfg) -> int:
    import json

    from tsp_trainer.plan.ablation import ablation, format_ablation

    nodes, hw = _cluster(parser, args)
    if args.global_batch not in (None, 1):
        _fail(parser, f"--global-batch={args.global_batch}: --ablation plans one sequence per step "
                      "(omit it or give 1)")
    assumptions = _assumptions(parser, args, hw)
    rows = ablation(cfg, hw=hw, nodes=nodes, prec=PRECISIONS[args.dtype], assumptions=assumptions,
                    max_degree=args.max_degree)
    print(format_ablation(rows, header=(
        f"TSP's longest sequence as each technique is added: {args.model} on "
        f"{nodes * hw.gpus_per_node} x {hw.name} ({nodes} nodes), one sequence per step, {args.dtype}; "
        f"{hw.hbm_bytes / 1e9:.0f} GB x {assumptions.hbm_usable:.2f} usable HBM, "
        f"{hw.host_memory_bytes / 1e9:,.0f} GB host memory per node")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpu": hw.name, "nodes": nodes, "dtype": args.dtype,
                       "host_memory_bytes_per_node": hw.host_memory_bytes,
                       "rows": [r.as_dict() for r in rows]}, f, indent=1)
    return 0


def _adamw_where(offload_optimizer: bool) -> str:
    return "AdamW offloaded to the host (ZeRO-Offload)" if offload_optimizer else "AdamW"


def _plan(parser, args, cfg) -> int:
    from tsp_trainer.plan.report import format_table, write_json, write_plot
    from tsp_trainer.plan.search import PlanError, plan

    if args.global_batch is None:
        _fail(parser, "--global-batch (sequences per optimizer step) is required to plan a job")
    nodes, hw = _cluster(parser, args)
    micro = None
    if args.micro_batch:
        try:
            micro = tuple(int(x) for x in args.micro_batch.split(","))
        except ValueError:
            _fail(parser, f"--micro-batch={args.micro_batch!r} must be comma-separated integers")
    assumptions = _assumptions(parser, args, hw)
    schemes, peers = _split_peers(_schemes(parser, args.schemes, SCHEMES + PEER_SCHEMES))
    if not schemes:
        _fail(parser, f"--schemes={args.schemes!r}: the ranking needs one of {','.join(SCHEMES)} "
                      f"beside the peers ({', '.join(PEER_SCHEMES)} are ranked against them)")
    try:
        result = plan(cfg, seq_len=args.seq_len, global_batch=args.global_batch, hw=hw, nodes=nodes,
                      schemes=schemes, prec=PRECISIONS[args.dtype], assumptions=assumptions,
                      max_degree=args.max_degree, micro_batches=micro,
                      tsp_recompute=_modes(args.tsp_recompute),
                      offload_optimizer=args.zero_offload_optimizer == "cpu")
    except PlanError as err:
        print(f"tsp-plan: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    world = nodes * hw.gpus_per_node
    capacity = hw.hbm_bytes * assumptions.hbm_usable
    header = (f"{args.model} at {args.seq_len} tokens, global batch {args.global_batch} sequences "
              f"({args.global_batch * args.seq_len:,} tokens/step) on {world} x {hw.name} "
              f"({nodes} nodes x {hw.gpus_per_node}); {args.dtype}, "
              f"{_adamw_where(args.zero_offload_optimizer == 'cpu')}, TSP recompute "
              f"{'auto (every mode ranked)' if args.tsp_recompute == 'auto' else args.tsp_recompute}; "
              f"assumed {_efficiency_text(hw, assumptions)} and "
              f"{assumptions.comm_efficiency:.0%} of link bandwidth; "
              f"{len(result.fitting)} of {len(result.candidates)} layouts fit")
    print(format_table(result, header=header, top=args.top, capacity=capacity,
                       gpus_per_node=hw.gpus_per_node))
    peer_best = {}
    if peers:
        from tsp_trainer.plan.peers import format_beside_peers, peer_ranking

        peer_best = peer_ranking(cfg, seq_len=args.seq_len, global_batch=args.global_batch, hw=hw,
                                 nodes=nodes, schemes=peers, prec=PRECISIONS[args.dtype],
                                 assumptions=assumptions, max_degree=args.max_degree,
                                 offload_optimizer=args.zero_offload_optimizer == "cpu")
        print()
        print(format_beside_peers(result.best_per_scheme(), peer_best, peers))
    request = {"model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch,
               "gpu": hw.as_dict(), "nodes": nodes, "world_size": world, "dtype": args.dtype,
               "assumptions": asdict(assumptions),
               "kernel_efficiency": _efficiencies(hw, assumptions).as_dict(), "schemes": list(schemes),
               "tsp_recompute": args.tsp_recompute, "zero_offload_optimizer": args.zero_offload_optimizer}
    if args.json:
        write_json(args.json, request, result, top=args.top,
                   peers={k: v.as_dict() for k, v in peer_best.items()})
    if args.plot:
        write_plot(args.plot, result, title=header.split(";")[0], top=args.top, capacity=capacity)
    return 0


def _dry_run(parser, args, cfg) -> int:
    import json

    from tsp_trainer.plan.dry_run import dry_run, format_dry_run

    nodes = 128 if args.nodes is None else args.nodes
    world = nodes * args.gpus_per_node
    if args.degree < 1 or world % args.degree:
        _fail(parser, f"--degree={args.degree} must divide the world size {world} "
                      f"(--nodes {nodes} x --gpus-per-node {args.gpus_per_node})")
    if not 0 <= args.rank < world:
        _fail(parser, f"--rank={args.rank} must be in [0, {world})")
    schemes = _schemes(parser, args.schemes, ("tsp", "tp", "tp_sp"))
    if _split_peers(schemes)[1]:
        _fail(parser, f"--schemes={args.schemes!r}: --dry-run runs the trainer's code; "
                      f"{', '.join(_split_peers(schemes)[1])} are peer stacks the dry run does not "
                      "model (it runs tsp, tp, tp_sp and sp)")
    args.tsp_recompute = _one_mode(args.tsp_recompute)
    if args.tsp_recompute != "full" and not args.no_activation_checkpointing:
        _fail(parser, f"--tsp-recompute={args.tsp_recompute} needs --no-activation-checkpointing (the "
                      f"dry run checkpoints every scheme by default, and the trainer refuses "
                      f"{args.tsp_recompute} with train.activation_checkpointing=true)")
    if "tp_x_sp" in schemes:
        _fail(parser, "--dry-run runs tsp, tp, tp_sp and sp; tp_x_sp needs its two degrees (not a "
                      "flag of the dry run yet)")
    chunk = args.attention_chunk_tokens
    if chunk != "auto":
        if not chunk.isdigit() or int(chunk) < 1:
            _fail(parser, f"--attention-chunk-tokens={chunk} must be auto or an integer >= 1")
        chunk = int(chunk)
    from tsp_trainer.config.validate import check_parallel_shapes

    for scheme in schemes:
        try:
            check_parallel_shapes(cfg, scheme=scheme, degree=args.degree, seq_len=args.seq_len,
                                  head_buckets=args.head_buckets if scheme == "tsp" else 1)
        except ValueError as err:
            _fail(parser, f"{scheme}: {err}")
    report = dry_run(cfg, seq_len=args.seq_len, world_size=world, degree=args.degree, schemes=schemes,
                     head_buckets=args.head_buckets, micro_batch=args.micro_batch_size,
                     activation_checkpointing=not args.no_activation_checkpointing, rank=args.rank,
                     full_depth=args.full_depth, attention=args.attention,
                     tsp_recompute=args.tsp_recompute, attention_chunk_tokens=chunk,
                     log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_dry_run(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not all(r["comm_equals_model"] for r in report["schemes"].values()):
        print("tsp-plan: the ledger differs from the analytic communication model (see DIFF lines)",
              file=sys.stderr)
        raise SystemExit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
