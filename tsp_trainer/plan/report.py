"""The planner's outputs: a terminal table, a JSON document and a PNG chart (matplotlib, Agg)."""

from __future__ import annotations

import json

from tsp_trainer.plan.layout import RECOMPUTE_MARK
from tsp_trainer.plan.predict import Prediction
from tsp_trainer.plan.search import PlanResult, _family

GB = 1e9


def _row(rank: str, p: Prediction) -> list[str]:
    lay, m = p.layout, p.memory
    state = m["params"] + m["grads"] + m["optimizer"]
    exposed = p.times["exposed_comm_per_micro"] * lay.grad_accum + p.times["dp_exposed"]
    return [rank, _family(lay), str(lay.degree), str(lay.dp), str(lay.zero_stage),
            _ac_mark(lay),
            str(lay.head_buckets) if lay.scheme == "tsp" else "-", f"{lay.micro_batch}x{lay.grad_accum}",
            f"{state / GB:.1f}", f"{m['activations_peak'] / GB:.1f}", f"{m['total'] / GB:.1f}",
            _si(p.tokens_per_s), f"{p.tokens_per_s_per_gpu:,.0f}", f"{100 * p.mfu:.1f}",
            f"{p.step_time:.2f}", f"{100 * exposed / p.step_time:.0f}"]


def _ac_mark(lay) -> str:
    """The AC column: on / off / the TSP recompute mark, and +offload under activation offload."""
    mark = "on" if lay.activation_checkpointing else RECOMPUTE_MARK.get(lay.tsp_recompute, "off")
    return mark + ("+offload" if lay.offload_activations else "")


_COLS = ["#", "scheme", "D", "DP", "ZeRO", "AC", "nb", "mb x ga", "state GB", "act GB", "total GB",
         "tokens/s", "tok/s/GPU", "MFU %", "step s", "comm %"]


def distinct(preds: list[Prediction]) -> list[Prediction]:
    """One row per (scheme, D, AC / TSP recompute mode, activation offload, micro-batch): the first
    in ranking order (fastest, then the least memory among equally fast ZeRO stages / head-bucket
    counts)."""
    seen, out = set(), []
    for p in preds:
        lay = p.layout
        key = (_family(lay), lay.degree, lay.activation_checkpointing, lay.tsp_recompute,
               lay.offload_activations, lay.micro_batch)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def format_table(result: PlanResult, *, header: str, top: int = 15, capacity: float,
                 gpus_per_node: int = 8) -> str:
    shown = distinct(result.fitting)
    rows = [_row(str(i + 1), p) for i, p in enumerate(shown[:top])]
    lines = [header, _table(_COLS, rows)]
    if len(shown) > top:
        lines.append(f"... {len(shown) - top} more (--top N to list them)")
    lines.append(f"({len(shown)} distinct layouts fit; each row shows the best ZeRO stage and head-bucket "
                 f"count of its scheme / D / AC or recompute mode / micro-batch; --json lists all "
                 f"{len(result.fitting)})")
    if shown and shown[0].layout.offload_optimizer:
        lines.append(optimizer_offload_note(shown[0]))
    lines.append("")
    lines.append(f"best layout per scheme (memory limit {capacity / GB:.1f} GB per GPU):")
    best = sorted(result.best_per_scheme().values(), key=lambda p: (not p.fits, -p.tokens_per_s))
    rows = []
    for p in best:
        row = _row("fits" if p.fits else "NO", p)
        rows.append(row)
    lines.append(_table(["fits"] + _COLS[1:], rows))
    lines.append("AC sel = no activation checkpointing, TSP selective recompute; AC keep = no "
                 "activation checkpointing, TSP keeps attention and MLP gate/up (tsp_recompute none); "
                 "+offload = train.offload_activations (the blocks' saved tensors in host memory); "
                 "state = parameters + gradients + AdamW state; act = peak activations + transients; "
                 "comm % = share of the step spent in exposed communication; MFU counts model FLOPs "
                 "(causal attention halved) against dense bf16 peak.")
    if shown:
        lines += ["", *memory_breakdown(shown[0], gpus_per_node=gpus_per_node)]
    return "\n".join(lines)


RESERVE_NAMES = {"flash_dq_accum": "FA2 backward fp32 dQ accumulator",
                 "flash_gqa_dkv_expanded": "FA2 backward dK/dV per query head (GQA)",
                 "flash_split_kv": "FA2 forward split-KV partials",
                 "nccl_buffers": "NCCL buffers", "blas_workspaces": "cuBLAS + cuBLASLt workspaces",
                 "cuda_context": "CUDA context"}


def memory_breakdown(p: Prediction, *, gpus_per_node: int) -> list[str]:
    """One layout's GPU memory per rank, term by term, and the pinned host memory of its node."""
    from tsp_trainer.plan.reserved import pinned_host_per_node

    m = p.memory
    lines = [f"memory of #1 ({p.layout.label()}), per GPU:",
             f"  parameters {m['params'] / GB:.2f} GB, gradients {m['grads'] / GB:.2f} GB, "
             f"optimizer {m['optimizer'] / GB:.2f} GB, peak activations + transients "
             f"{m['activations_peak'] / GB:.2f} GB",
             f"  reserved beside the tensors {m['reserved'] / GB:.2f} GB (plan/reserved.py):"]
    lines += [f"    {RESERVE_NAMES[k]}: {v / GB:.3f} GB" for k, v in m["reserved_terms"].items()]
    lines.append(f"  total {m['total'] / GB:.2f} GB of {p.capacity / GB:.1f} GB usable")
    pinned = pinned_host_per_node(offloaded=m["host_offloaded"], staged=m["checkpoint_staging"],
                                  gpus_per_node=gpus_per_node)
    lines.append(f"pinned host memory per node ({gpus_per_node} GPUs): activation offload "
                 f"{pinned['activation_offload'] / GB:.1f} GB (train.offload_activations), async "
                 f"checkpoint staging {pinned['checkpoint_staging'] / GB:.1f} GB "
                 "(checkpoint.async_save; 0 with checkpoint.pinned_staging=false); page-locked "
                 "memory counts against the container's memory limit")
    return lines


def optimizer_offload_note(p: Prediction) -> str:
    """What ZeRO-Offload costs the layout `p`: pinned host memory per node, and the CPU Adam step
    and PCIe copies its step time includes."""
    per_node = p.memory["host_optimizer_per_node"]
    return (f"optimizer offloaded to the host (zero.offload_optimizer=cpu), layout 1: "
            f"{per_node / GB:.1f} GB pinned host memory per node "
            f"({p.memory['host_optimizer'] / GB:.1f} GB per GPU); per step {p.times['optimizer']:.3f} s "
            f"of CPU Adam and {p.times['optimizer_pcie']:.3f} s of PCIe copies (fp32 gradients down, "
            f"updated weights up), both in step s")


def _table(cols: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)] if rows else [len(c) for c in cols]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in rows]
    return "\n".join(out)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def write_json(path: str, request: dict, result: PlanResult, *, top: int, peers: dict | None = None) -> None:
    doc = {"request": request,
           "ranked": [p.as_dict() for p in result.fitting[:top]],
           "fitting": [{"label": p.layout.label(), "layout": p.layout.as_dict(),
                        "total_bytes": p.memory["total"], "tokens_per_s": p.tokens_per_s,
                        "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "mfu": p.mfu}
                       for p in result.fitting],
           "best_per_scheme": {k: v.as_dict() for k, v in result.best_per_scheme().items()},
           "rejected": result.rejected}
    if peers:
        doc["peers"] = peers
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


_COLORS = {"tsp": "tab:green", "tp": "tab:blue", "tp_sp": "tab:purple", "sp": "tab:orange",
           "tp_x_sp": "tab:brown"}


def _best_per_base_scheme(result: PlanResult) -> list[Prediction]:
    """best_per_scheme with the tp_x_sp factorisations folded into one entry."""
    out: dict[str, Prediction] = {}
    for p in result.best_per_scheme().values():
        name, cur = p.layout.scheme, out.get(p.layout.scheme)
        if cur is None or (p.fits, p.tokens_per_s if p.fits else -p.memory["total"]) > \
                (cur.fits, cur.tokens_per_s if cur.fits else -cur.memory["total"]):
            out[name] = p
    return sorted(out.values(), key=lambda p: p.memory["total"])


def write_plot(path: str, result: PlanResult, *, title: str, top: int, capacity: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(16, max(4.5, 0.32 * min(top, len(result.fitting)) + 1.5)),
                             gridspec_kw={"width_ratios": [3, 2]})
    shown = distinct(result.fitting)[:top][::-1]
    names = [p.layout.label() for p in shown]
    axes[0].barh(names, [p.tokens_per_s_per_gpu for p in shown],
                 color=[_COLORS.get(p.layout.scheme, "tab:gray") for p in shown])
    axes[0].set_xlabel("predicted tokens/s per GPU")
    axes[0].set_title(f"top {len(shown)} layouts that fit, ranked by tokens/s")
    axes[0].tick_params(axis="y", labelsize=7)
    best = _best_per_base_scheme(result)
    labels = [f"{_family(p.layout)}\nD={p.layout.degree} DP={p.layout.dp}\n"
              f"{'AC' if p.layout.activation_checkpointing else 'no AC'}"
              + ("" if p.fits else "\n(does not fit)") for p in best]
    state = [(p.memory["params"] + p.memory["grads"] + p.memory["optimizer"]) / GB for p in best]
    act = [p.memory["activations_peak"] / GB for p in best]
    axes[1].bar(labels, state, label="params + grads + AdamW", color="tab:gray")
    axes[1].bar(labels, act, bottom=state, label="peak activations + transients", color="tab:red")
    axes[1].axhline(capacity / GB, color="k", ls="--", lw=1, label="usable HBM")
    axes[1].set_ylabel("GB per GPU")
    axes[1].set_title("memory per GPU: fastest fitting layout per scheme")
    axes[1].legend(fontsize=8)
    axes[1].tick_params(axis="x", labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
