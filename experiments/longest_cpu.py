"""The tiny model at the longest sequence 4 CPU ranks hold in 24 GiB of host memory, and the same
run with tiling off at a length where that still fits: equal losses.

    python experiments/longest_cpu.py                         # the plan only (seconds, no run)
    python experiments/longest_cpu.py --measure 16384,65536   # short runs: s/step, peak RSS per rank
    python experiments/longest_cpu.py --equal-at 65536        # tiled == untiled losses at that length
    python experiments/longest_cpu.py --run-longest --malloc-threshold 131072   # the planned length
    python experiments/longest_cpu.py --all-on --steps 3      # every technique on, at a stated budget

Every run is recipes/tiny_longest_cpu.yaml through the real launcher (tsp-launch, Accelerate,
DeepSpeed, 4 gloo ranks: TSP D=4, document masking, activation checkpointing and offload, loss and
MLP tiled). Each rank's peak RSS is its VmHWM (/proc/<pid>/status), read while the run goes.
With glibc's defaults that RSS grows about twice as fast as the plan (freed heap pages stay
resident); --malloc-threshold sets the ranks' mmap and trim thresholds, which keeps it below the
plan at the price of slower steps (docs/long_context/tiled_mlp.md, "A real run at the longest length on this
machine").

The budget: 24 GiB of host memory, 22 GiB of it usable by the run (the rest for the OS, the
launcher's own processes and page cache), 5.5 GiB per rank. Of a rank's 5.5 GiB the planner
(plan/state.py, plan/activations.py on the CPU attention path) gets what is left after the
process's fixed RSS (interpreter, torch, DeepSpeed, gloo: PROCESS_BASE_GIB) and the data loader's
host copies of the window (LOADER_BYTES_PER_TOKEN of the whole sequence, on every rank). On CPU
the offloaded activations stay in the same RAM, so they count against the budget too.

--all-on adds nesting, the replay keeping nothing and chunked attention (ALL_ON) and runs the
longest length the plan fits in a stated budget per rank (--rank-budget-gib), chosen so that 3
steps take minutes here; the machine's own budget and its planned length are reported beside it.

The results go to docs/results/longest_cpu.json: each mode updates its own section (plan, measured,
tiled_equals_untiled, longest_run, all_on; with --malloc-threshold T the runs' sections end in
_malloc_threshold_T).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from tsp_trainer.config import load_config
from tsp_trainer.plan.activations import activation_memory
from tsp_trainer.plan.auto import GIB, run_layout
from tsp_trainer.plan.precision import FP32
from tsp_trainer.plan.state import state_bytes

REPO = Path(__file__).resolve().parents[1]

RECIPE = REPO / "recipes" / "tiny_longest_cpu.yaml"
LAUNCH_CONFIG = REPO / "launch" / "accelerate" / "cpu_4proc.yaml"
RESULTS = REPO / "docs" / "results" / "longest_cpu.json"
RANKS = 4
HOST_GIB = 24.0
USABLE_GIB = 22.0                 # of HOST_GIB: the OS, the launcher's processes, page cache get 2
# A rank's RSS that does not grow with the sequence: Python, torch, DeepSpeed, gloo, the tokenizer
# (measured: the peak RSS of the shortest run less the planner's bytes at that length, rounded up)
PROCESS_BASE_GIB = 0.6
# The loader's host copies of the whole window, on every rank (docs/long_context/millions_of_tokens.md):
# the packed int64 stream (8 B a token), the (1, S + 1) int64 window (8), the batch's input_ids
# and labels (int64, 8 each) and document ids (int32, 4)
LOADER_BYTES_PER_TOKEN = 36
GRANULE = 1024                    # lengths the search tries: multiples of 1,024 (2D = 8 divides them)
LOSS_RTOL = 1e-6                  # tiled against untiled, fp32: the chunks change only fp32 sum order


def recipe_config(seq_len: int, overrides: list[str] = ()):
    """The recipe at seq_len (RoPE set up for it)."""
    return load_config(RECIPE, [f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}", *overrides])


def untiled_overrides(seq_len: int) -> list[str]:
    """Tiling and offload off: one loss chunk and one MLP chunk of all local tokens (a chunk larger
    than the tokens is one chunk), the block inputs kept in place."""
    return [f"parallel.loss_chunk_tokens={seq_len}", f"parallel.mlp_chunk_tokens={seq_len}",
            "train.offload_activations=false"]


VARIANTS = ("tiled", "untiled", "tiled_no_offload")
# every memory technique on at once, on top of the recipe's tiled loss and MLP, checkpointing and
# offload: nesting (both of the 2 blocks in one segment: one block input kept, the other regained
# in backward), the replay keeping nothing, K/V gathered in chunks of 1,024 local tokens
ALL_ON = ["train.checkpoint_segment_blocks=2", "parallel.checkpoint_replay_keeps=nothing",
          "parallel.attention_chunk_tokens=1024"]


def variant_overrides(variant: str, seq_len: int) -> list[str]:
    """The recipe as it is ("tiled"), with tiling and offload off ("untiled"), tiled without
    the activation offload ("tiled_no_offload": on CPU the offloaded copies stay in the same RAM),
    or with every technique on ("all_on": ALL_ON)."""
    if variant not in (*VARIANTS, "all_on"):
        raise ValueError(f"variant={variant!r} is not one of {', '.join(VARIANTS)}, all_on")
    return {"tiled": [], "untiled": untiled_overrides(seq_len),
            "tiled_no_offload": ["train.offload_activations=false"], "all_on": ALL_ON}[variant]


def planned_rank_bytes(seq_len: int, variant: str = "tiled") -> dict[str, float]:
    """One rank's planned peak at seq_len: the planner's model state and activation peak (and the
    offloaded copies, in the same RAM on CPU), plus the fixed process RSS and the loader's window."""
    cfg = _at_length(_variant_config(variant, seq_len if variant == "untiled" else 0), seq_len)
    model, p = cfg.model.to_model_config(), cfg.parallel
    ac = cfg.train.activation_checkpointing
    layout = dataclasses.replace(run_layout(cfg, RANKS), tsp_recompute=p.tsp_recompute,
                                 head_buckets=p.head_buckets, activation_checkpointing=ac,
                                 checkpoint_segment_blocks=cfg.train.checkpoint_segment_blocks if ac else 1,
                                 replay_keeps="all" if p.checkpoint_replay_keeps == "auto" else p.checkpoint_replay_keeps)
    state = state_bytes(model, layout, FP32)
    act = activation_memory(model, layout, seq_len, FP32, device="cpu", **layout.chunks)
    held = state["params"] + state["grads"] + state["optimizer"] + state["host_optimizer"]
    planner = held + act.peak + act.host
    loader = LOADER_BYTES_PER_TOKEN * seq_len
    return {"planner": planner, "activation_peak": act.peak, "peak_phase": act.peak_phase,
            "offloaded": act.host, "loader": loader, "process_base": PROCESS_BASE_GIB * GIB,
            "total": planner + loader + PROCESS_BASE_GIB * GIB}


@functools.lru_cache(maxsize=None)
def _variant_config(variant: str, seq_len: int):
    """The recipe under a variant's overrides, loaded once (the searches call the plan at many
    lengths; seq_len matters only where the overrides name it: untiled's one chunk)."""
    return recipe_config(GRANULE, variant_overrides(variant, seq_len or GRANULE))


def _at_length(cfg, seq_len: int):
    """`cfg` at seq_len, RoPE set up for it (what recipe_config's overrides do)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len),
                               model=dataclasses.replace(cfg.model, max_seq_len=seq_len))


def rank_budget_bytes() -> float:
    return USABLE_GIB * GIB / RANKS


def longest_fitting(fits, granule: int = GRANULE) -> int:
    """The largest multiple of `granule` for which fits(tokens) holds (memory grows with the
    length): double until it fails, then bisect between the last fit and the first failure."""
    good, bad = 0, granule
    while fits(bad):
        good, bad = bad, 2 * bad
    while bad - good > granule:
        mid = (good + bad) // 2 // granule * granule
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def plan() -> dict:
    """The longest length of each variant, and what a rank holds there."""
    budget = rank_budget_bytes()
    out = {"host_gib": HOST_GIB, "usable_gib": USABLE_GIB, "ranks": RANKS,
           "rank_budget_gib": budget / GIB, "process_base_gib": PROCESS_BASE_GIB,
           "loader_bytes_per_token": LOADER_BYTES_PER_TOKEN}
    for name in VARIANTS:
        n = longest_fitting(lambda s, v=name: planned_rank_bytes(s, v)["total"] <= budget)
        at = planned_rank_bytes(n, name)
        out[name] = {"max_seq_len": n, "rank_gib": {k: (v / GIB if isinstance(v, (int, float)) else v)
                                                    for k, v in at.items()},
                     "planner_bytes_per_token": at["planner"] / n}
    return out


# ---- runs through the launcher -------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc/*/stat's parent ids)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def _rank_and_hwm(pid: int) -> tuple[int, int] | None:
    """(RANK from the environment, VmHWM in bytes) of a rank process; None for other processes."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        if "RANK" not in env or "LOCAL_RANK" not in env:
            return None
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(env["RANK"]), int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakRss:
    """Polls the launcher's rank processes and keeps each rank's largest VmHWM."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.pid, self.every_s, self.peak = pid, every_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            for child in _children(self.pid):
                seen = _rank_and_hwm(child)
                if seen is not None:
                    rank, hwm = seen
                    self.peak[rank] = max(self.peak.get(rank, 0), hwm)


def launch_command(seq_len: int, out_dir: Path, overrides: list[str] = ()) -> list[str]:
    return [str(REPO / ".venv" / "bin" / "tsp-launch"), "--config_file", str(LAUNCH_CONFIG), str(RECIPE),
            f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}", f"train.output_dir={out_dir}",
            *overrides]


def allocator_env(threshold: int | None) -> dict[str, str]:
    """glibc malloc settings for the ranks: with a threshold, blocks above it are mmap'ed and
    returned to the OS when freed, and the heap is trimmed above it (glibc otherwise raises its
    mmap threshold up to 32 MiB as blocks are freed and keeps freed heap pages resident)."""
    if threshold is None:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(threshold), "MALLOC_TRIM_THRESHOLD_": str(threshold)}


def run_recipe(seq_len: int, out_dir: Path, *, steps: int, overrides: list[str] = (),
               malloc_threshold: int | None = None) -> dict:
    """One run of the recipe through tsp-launch: per-step losses and times, each rank's peak RSS."""
    cmd = launch_command(seq_len, out_dir, [f"train.steps={steps}", *overrides])
    inherited = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    allocator = inherited | allocator_env(malloc_threshold)
    env = {**os.environ, "PYTHONPATH": str(REPO), **allocator}
    log = out_dir.parent / f"{out_dir.name}.log"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        with PeakRss(proc.pid) as rss:
            rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"run at seq_len={seq_len} exited {rc}; its log: {log}")
    if not rss.peak:
        raise RuntimeError(f"run at seq_len={seq_len}: no rank process (RANK, LOCAL_RANK set) was seen")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    return {"seq_len": seq_len, "steps": steps, "losses": [r["train/loss"] for r in rows],
            "step_time_s": [r["perf/step_time_s"] for r in rows],
            "peak_rss_gib_by_rank": {str(k): v / GIB for k, v in sorted(rss.peak.items())},
            "allocator_env": allocator, "wall_s": time.monotonic() - start}


def with_prediction(run: dict) -> dict:
    """The run with the planned rank peak beside the measured ones."""
    planned = planned_rank_bytes(run["seq_len"], run.get("variant", "tiled"))
    return {**run, "planned_rank_gib": planned["total"] / GIB,
            "measured_over_planned": max(run["peak_rss_gib_by_rank"].values()) * GIB / planned["total"]}


def relative_differences(a: list[float], b: list[float]) -> list[float]:
    if len(a) != len(b):
        raise ValueError(f"loss lists differ in length: {len(a)} against {len(b)} steps")
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def compare_tiling(seq_len: int, work: Path, *, steps: int, malloc_threshold: int | None = None) -> dict:
    """The recipe at seq_len tiled and untiled; AssertionError unless every step's loss agrees
    within LOSS_RTOL."""
    tiled = with_prediction(run_recipe(seq_len, work / f"tiled_{seq_len}", steps=steps,
                                       malloc_threshold=malloc_threshold))
    plain = run_recipe(seq_len, work / f"untiled_{seq_len}", steps=steps,
                       overrides=untiled_overrides(seq_len), malloc_threshold=malloc_threshold)
    plain = with_prediction({**plain, "variant": "untiled"})
    rel = relative_differences(tiled["losses"], plain["losses"])
    assert max(rel) <= LOSS_RTOL, f"tiled losses {tiled['losses']} differ from untiled {plain['losses']}"
    return {"seq_len": seq_len, "rtol": LOSS_RTOL, "max_relative_difference": max(rel),
            "bit_identical": tiled["losses"] == plain["losses"], "tiled": tiled, "untiled": plain}


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def extrapolate(runs: list[dict], seq_len: int) -> dict:
    """Seconds per step and the largest rank's peak RSS at seq_len, from lines through the short
    runs (a run's fastest step: on a shared machine other work only adds time), and the longest
    length whose extrapolated rank RSS stays within the rank budget."""
    lengths = [r["seq_len"] for r in runs]
    secs = [min(r["step_time_s"]) for r in runs]
    rss = [max(r["peak_rss_gib_by_rank"].values()) for r in runs]
    t0, t1 = linear_fit(lengths, secs)
    m0, m1 = linear_fit(lengths, rss)
    fits = int((rank_budget_bytes() / GIB - m0) / m1) // GRANULE * GRANULE
    return {"seq_len": seq_len, "step_s": t0 + t1 * seq_len, "s_per_token": t1,
            "rank_rss_gib": m0 + m1 * seq_len, "rss_bytes_per_token": m1 * GIB, "rss_base_gib": m0,
            "longest_by_measured_rss": fits, "step_s_at_longest_by_measured_rss": t0 + t1 * fits}


def section_name(kind: str, malloc_threshold: int | None) -> str:
    """The results' key of a kind of run: runs under another allocator setting get their own."""
    return kind if malloc_threshold is None else f"{kind}_malloc_threshold_{malloc_threshold}"


def update_results(section: str, value, path: Path = RESULTS) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data[section] = value
    path.write_text(json.dumps(data, indent=1) + "\n")


# The all-on run's stated budget per rank: the 0.6 GiB a process holds anyway and 0.16 GiB for the
# sequence, where the plan's longest length trains 3 steps in ~10 minutes on this 2-core machine
# shared with other work; the machine's own budget is reported beside it (`machine_budget`)
ALL_ON_RANK_BUDGET_GIB = 0.76


def machine_budget() -> tuple[float, str]:
    """(bytes per rank, where from): what `auto` gives a rank of a 4-process CPU job on this
    machine (plan/auto.py device_budget: MemAvailable in whole GiB over the processes)."""
    from tsp_trainer.plan.auto import device_budget

    budget = device_budget(world_size=RANKS, cuda=False)
    return budget.bytes, budget.source


def longest_all_on(rank_budget: float) -> int:
    """The longest all_on length whose planned rank peak fits `rank_budget` bytes."""
    return longest_fitting(lambda s: planned_rank_bytes(s, "all_on")["total"] <= rank_budget)


def all_on_plan(rank_budget: float) -> dict:
    """The longest all_on length within `rank_budget` bytes a rank (and within the machine's
    budget), and what a rank holds there by the plan."""
    machine, source = machine_budget()
    out = {"overrides": ALL_ON, "rank_budget_gib": rank_budget / GIB, "machine_rank_budget_gib": machine / GIB,
           "machine_budget_source": source}
    for key, budget in (("stated", rank_budget), ("machine", machine)):
        n = longest_all_on(budget)
        at = planned_rank_bytes(n, "all_on")
        out[key] = {"max_seq_len": n, "rank_gib": {k: (v / GIB if isinstance(v, (int, float)) else v)
                                                   for k, v in at.items()}}
    return out


def run_all_on(rank_budget: float, work: Path, *, steps: int, seq_len: int = 0,
               malloc_threshold: int | None = None) -> dict:
    """The all_on variant at the longest length the plan fits in `rank_budget` (or seq_len):
    per-step losses and times, each rank's peak RSS against the planned rank peak."""
    planned = all_on_plan(rank_budget)
    n = seq_len or planned["stated"]["max_seq_len"]
    run = run_recipe(n, work / f"all_on_{n}", steps=steps, overrides=ALL_ON, malloc_threshold=malloc_threshold)
    run = with_prediction({**run, "variant": "all_on"})
    command = " ".join(["python experiments/longest_cpu.py --all-on", f"--steps {steps}",
                        f"--rank-budget-gib {rank_budget / GIB:g}"] + ([f"--seq-len {seq_len}"] if seq_len else [])
                       + ([f"--malloc-threshold {malloc_threshold}"] if malloc_threshold else []))
    return {"plan": planned, "run": run, "command": command,
            # repository-relative: what it runs, from the checkout's root
            "launch": " ".join([f"{k}={v}" for k, v in allocator_env(malloc_threshold).items()]
                               + launch_command(n, work / f"all_on_{n}", [f"train.steps={steps}", *ALL_ON]))
            .replace(f"{REPO}/", "")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="longest_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", default="", help="comma-separated lengths to run briefly")
    p.add_argument("--equal-at", type=int, default=0, help="a length for the tiled/untiled runs")
    p.add_argument("--run-longest", action="store_true", help="run the planned length")
    p.add_argument("--seq-len", type=int, default=0,
                   help="with --run-longest: this length instead of the planned one")
    p.add_argument("--all-on", action="store_true",
                   help="run every technique on (ALL_ON) at the longest length the plan fits in "
                        "--rank-budget-gib, and report it against the plan")
    p.add_argument("--rank-budget-gib", type=float, default=ALL_ON_RANK_BUDGET_GIB,
                   help="with --all-on: the stated RAM budget per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--malloc-threshold", type=int, default=None,
                   help="bytes: the ranks' glibc mmap and trim thresholds (default: glibc's own)")
    p.add_argument("--work", default=str(REPO / "runs" / "longest_cpu"), help="run folders and their logs")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    out = Path(args.out)
    work = Path(args.work)
    planned = plan()
    update_results("plan", planned, out)
    longest = args.seq_len or planned["tiled"]["max_seq_len"]
    env = [f"{k}={v}" for k, v in allocator_env(args.malloc_threshold).items()]
    cmd = " ".join(env + launch_command(longest, work / "longest", [f"train.steps={args.steps}"]))
    print(json.dumps(planned, indent=1))
    print("the planned lengths: " + ", ".join(f"{v} {planned[v]['max_seq_len']:,}" for v in VARIANTS)
          + f"; the long run:\n  {cmd}")
    if args.measure:
        runs = [with_prediction(run_recipe(int(n), work / f"measure_{n}", steps=args.steps,
                                           malloc_threshold=args.malloc_threshold))
                for n in args.measure.split(",")]
        estimate = extrapolate(runs, longest) if len(runs) > 1 else None
        update_results(section_name("measured", args.malloc_threshold),
                       {"runs": runs, "estimate_at_longest": estimate}, out)
        print(json.dumps({"runs": runs, "estimate_at_longest": estimate}, indent=1))
    if args.equal_at:
        equal = compare_tiling(args.equal_at, work, steps=args.steps, malloc_threshold=args.malloc_threshold)
        update_results(section_name("tiled_equals_untiled", args.malloc_threshold), equal, out)
        print(json.dumps(equal, indent=1))
    if args.all_on:
        result = run_all_on(args.rank_budget_gib * GIB, work, steps=args.steps, seq_len=args.seq_len,
                            malloc_threshold=args.malloc_threshold)
        update_results(section_name("all_on", args.malloc_threshold), result, out)
        print(json.dumps(result, indent=1))
    if args.run_longest:
        run = with_prediction(run_recipe(longest, work / "longest", steps=args.steps,
                                         malloc_threshold=args.malloc_threshold))
        update_results(section_name("longest_run", args.malloc_threshold), run, out)
        print(json.dumps(run, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
