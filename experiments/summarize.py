"""Summarize tsp-bench JSON results (docs/results/tsp_bench/*.json) into the markdown tables and the figure
of docs/benchmarks.md. Usage: python experiments/summarize.py [RESULTS_DIR] [--plot docs/results/benchmarks.png]

Prints: one table per run, a sweep table (per-rank peak memory and wire bytes against sequence
length, per scheme, for each degree), and the crossovers: the sequence length from which TSP's
per-rank peak memory / bytes on the wire fall below each baseline's (linear fits in N: bytes are
exactly a + b N per scheme; memory is close to it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

MIB = 2 ** 20
ORDER = ("tsp", "tp", "tp_sp", "sp", "tp_x_sp")


def load(results_dir: str) -> list[dict]:
    docs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        doc["name"] = os.path.splitext(os.path.basename(path))[0]
        docs.append(doc)
    return docs


def run_table(doc: dict) -> str:
    s = doc["spec"]
    lines = [f"**{doc['name']}**: seq {s['seq_len']} x batch {s['micro_batch']}, D={s['degree']}, "
             f"{s['backend']}, {s['threads']} thread(s)/rank, steps timed: {s['steps']}"
             + (", every block activation-checkpointed" if s["activation_checkpointing"] else ""), "",
             "| scheme | layout | params MiB | params+grads+AdamW MiB | peak act+transient MiB | "
             "peak total MiB | ledger MiB (AR/AG/RS/bcast+reduce/p2p) | wire MiB | step s | tokens/s | loss@1 |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in _rows(doc):
        ops = r["comm_by_op"]
        split = "/".join(f"{ops.get(k, 0) / MIB:.0f}" for k in ("all_reduce", "all_gather", "reduce_scatter"))
        split += f"/{(ops.get('broadcast', 0) + ops.get('reduce', 0)) / MIB:.0f}/{ops.get('recv', 0) / MIB:.0f}"
        lines.append(f"| {r['scheme']} | {r['layout']} | {r['param_bytes'] / MIB:.1f} | "
                     f"{r['state_bytes'] / MIB:.1f} | {r['peak_act_bytes'] / MIB:.1f} | "
                     f"{r['peak_total_bytes'] / MIB:.1f} | {r['comm_bytes'] / MIB:.1f} ({split}) | "
                     f"{r['wire_bytes'] / MIB:.1f} | {_f(r['step_time'], 1)} | {_f(r['tokens_per_s'], 0)} | "
                     f"{r['first_loss']:.5f} |")
    single = doc.get("single_process")
    if single:
        for name, label in (("ours", "1 process, ours"), ("hf", "1 process, HF Llama")):
            x = single[name]
            lines.append(f"| {label} | D=1 | | {x['state_bytes'] / MIB:.1f} | {x['peak_act_bytes'] / MIB:.1f} | "
                         f"{x['peak_total_bytes'] / MIB:.1f} | | | {_f(x['step_time'], 1)} | "
                         f"{_f(x['tokens_per_s'], 0)} | {x['first_loss']:.5f} |")
        lines.append("")
        lines.append(f"Single process, {single['threads']} thread: ours / transformers speed = "
                     f"{single['ours_over_hf_speed']:.2f}x")
    return "\n".join(lines)


def _rows(doc: dict) -> list[dict]:
    rows = [r for r in doc["schemes"] if "error" not in r]
    return sorted(rows, key=lambda r: ORDER.index(r["scheme"]))


def _f(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def sweeps(docs: list[dict]) -> dict[int, dict[str, dict[int, dict]]]:
    """degree -> scheme -> seq_len -> row (runs without activation checkpointing)."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for doc in docs:
        s = doc["spec"]
        if s["activation_checkpointing"]:
            continue
        for r in _rows(doc):
            out[s["degree"]][r["scheme"]][s["seq_len"]] = r
    return out


def sweep_table(degree: int, per_scheme: dict, key: str, label: str) -> str:
    seqs = sorted({n for rows in per_scheme.values() for n in rows})
    lines = [f"{label}, D={degree} (MiB per rank)", "",
             "| scheme | " + " | ".join(f"{n // 1024}K" for n in seqs) + " |",
             "|---|" + "---:|" * len(seqs)]
    for scheme in ORDER:
        if scheme in per_scheme:
            rows = per_scheme[scheme]
            cells = [f"{rows[n][key] / MIB:.1f}" if n in rows else "" for n in seqs]
            lines.append(f"| {scheme} ({next(iter(rows.values()))['layout']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossover(per_scheme: dict, key: str, other: str) -> str:
    """Where TSP's `key` falls below `other`'s: measured (the shortest run from which TSP is below at
    every longer run) and fitted (a + b N through the two longest runs; exact for bytes)."""
    common = sorted(set(per_scheme.get("tsp", {})) & set(per_scheme.get(other, {})))
    if len(common) < 2:
        return "n/a"
    below = [per_scheme["tsp"][n][key] < per_scheme[other][n][key] for n in common]
    first = next((n for i, n in enumerate(common) if all(below[i:])), None)
    measured = ("below at every measured length" if first == common[0] else
                f"below from {first // 1024}K" if first else "never below in the measured range")
    n1, n2 = common[-2], common[-1]
    fit = {}
    for scheme in ("tsp", other):
        y1, y2 = per_scheme[scheme][n1][key], per_scheme[scheme][n2][key]
        slope = (y2 - y1) / (n2 - n1)
        fit[scheme] = (y1 - slope * n1, slope)
    (a_t, b_t), (a_o, b_o) = fit["tsp"], fit[other]
    if b_t >= b_o * (1 - 1e-6):
        fitted = "TSP grows as fast or faster: no crossover" + (" (TSP always above)" if a_t > a_o else "")
    else:
        n_star = (a_t - a_o) / (b_o - b_t)
        fitted = "below for every N" if n_star <= 0 else f"crossover at {n_star / 1024:.1f}K tokens"
    return f"{measured}; linear fit: {fitted}"


def plot(docs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = sweeps(docs)
    # Memory and bytes only: they are exact. Step times on this shared CPU need interleaved repeats
    # (experiments/step_time_table.py), which single timed launches are not.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for degree, style in zip(sorted(data, reverse=True), ("-o", "--s", ":^")):
        for scheme in ORDER:
            rows = data.get(degree, {}).get(scheme)
            if not rows:
                continue
            seqs = sorted(rows)
            axes[0].plot(seqs, [rows[n]["peak_total_bytes"] / MIB for n in seqs], style, label=f"{scheme} D={degree}",
                         color=f"C{ORDER.index(scheme)}")
            axes[1].plot(seqs, [rows[n]["wire_bytes"] / MIB for n in seqs], style, label=f"{scheme} D={degree}",
                         color=f"C{ORDER.index(scheme)}")
    for ax, title in ((axes[0], "per-rank peak memory (state + activations + transients)"),
                      (axes[1], "bytes received per rank per step (ring estimate)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("h=256, 4 layers, 4 MHA heads, I=688, V=2048, fp32, gloo on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="?", default="docs/results/tsp_bench")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    docs = load(args.results)
    for doc in docs:
        print(run_table(doc), end="\n\n")
    for degree, per_scheme in sorted(sweeps(docs).items()):
        print(sweep_table(degree, per_scheme, "peak_total_bytes", "Per-rank peak memory"), end="\n\n")
        print(sweep_table(degree, per_scheme, "wire_bytes", "Bytes received per rank per step"), end="\n\n")
        for other in ORDER[1:]:
            if other in per_scheme:
                print(f"- D={degree}, TSP vs {other}: memory: {crossover(per_scheme, 'peak_total_bytes', other)}. "
                      f"Bytes: {crossover(per_scheme, 'wire_bytes', other)}.")
        print()
    if args.plot:
        plot(docs, args.plot)


if __name__ == "__main__":
    main()
