"""Turn per-rank measurements into one row per scheme, and rows into a terminal table, a JSON
document and a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import statistics

from tsp_trainer.bench.spec import BenchSpec
from tsp_trainer.parallel.baselines.comm_model import expected_ledger_bytes
from tsp_trainer.parallel.tsp.comm_model import tsp_step_comm

MIB = 2 ** 20


def summarize_scheme(spec: BenchSpec, scheme: str, ranks: list[dict]) -> dict:
    """One row: per-rank maxima of memory, per-rank bytes by op kind, step time (median over steps
    of the slowest rank), tokens/s of the whole group (B x N per step)."""
    state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in ranks)
    row = {"scheme": scheme, "layout": _layout(spec, scheme, ranks[0]["info"]),
           "param_bytes": max(r["param_bytes"] for r in ranks),
           "grad_bytes": max(r["grad_bytes"] for r in ranks),
           "optim_bytes": max(r["optim_bytes"] for r in ranks),
           "state_bytes": state,
           "peak_act_bytes": max(r["peak_act_bytes"] for r in ranks),
           "peak_total_bytes": max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] + r["peak_act_bytes"]
                                   for r in ranks),
           "first_loss": ranks[0]["first_loss"],
           "flops_per_rank": max(r["flops"] for r in ranks), "flops": sum(r["flops"] for r in ranks)}
    row["comm_by_tag"] = _max_over_ranks([{k: v["bytes"] for k, v in r["comm"].items()} for r in ranks])
    row["comm_by_op"] = _by_op(row["comm_by_tag"])
    # Ledger payload with P2P counted once (at the receiver), and the estimated bytes on the wire.
    row["comm_bytes"] = sum(v for k, v in row["comm_by_op"].items() if k != "send")
    row["wire_bytes"] = max(r["wire_bytes"] for r in ranks)
    # The formulas count one fwd + bwd; checkpointed blocks re-run their forward collectives.
    own = {k: v for k, v in row["comm_by_tag"].items() if not _zero3_tag(k)}
    row["comm_formula_match"] = (None if spec.activation_checkpointing else _formula(spec, scheme) == own)
    if spec.zero_stage(scheme) == 3:
        _zero3_bytes(row, ranks)
    steps = list(zip(*(r["step_times"] for r in ranks)))
    row["step_times"] = [max(s) for s in steps]          # the slowest rank's time, step by step
    _timing(spec, row)
    return row


def _zero3_tag(key: str) -> bool:
    return key.split("/")[1].startswith("zero3.")


def _zero3_bytes(row: dict, ranks: list[dict]) -> None:
    """ZeRO-3's all-gathers and reduce-scatters of one forward + backward (per-rank maxima): the
    bytes DeepSpeed handed to torch.distributed (`zero3_measured`, engine/zero3_bytes.py) beside
    the closed form the ledger holds (`zero3_closed_form`, parallel/sharded_weights.py), and
    whether they are equal. Checkpointed blocks included: the closed form counts their replay."""
    row["zero3_measured"] = _max_over_ranks([r["zero3_measured"] for r in ranks])
    row["zero3_closed_form"] = _by_op({k: v for k, v in row["comm_by_tag"].items() if _zero3_tag(k)})
    row["zero3_match"] = row["zero3_measured"] == row["zero3_closed_form"]
    row["reduce_bucket_bytes"] = max(r["reduce_bucket_bytes"] for r in ranks)
    if row["comm_formula_match"] is not None:
        row["comm_formula_match"] = row["comm_formula_match"] and row["zero3_match"]


def summarize_reference(spec: BenchSpec, name: str, ranks: list[dict]) -> dict:
    """One row for a reference stack run unmodified (bench/alst.py): memory read off its own
    tensors, FLOPs and step times as ours; its communication is DeepSpeed's, outside our ledger."""
    row = {"scheme": f"{name}_ref", "layout": f"HF+DS D={spec.degree} Z3",
           **{k: max(r[k] for r in ranks) for k in ("param_bytes", "grad_bytes", "optim_bytes", "peak_act_bytes")},
           "state_bytes": max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in ranks),
           "peak_total_bytes": max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] + r["peak_act_bytes"]
                                   for r in ranks),
           "first_loss": sum(r["loss_sum"] for r in ranks) / ranks[0]["total"],
           "flops_per_rank": max(r["flops"] for r in ranks), "flops": sum(r["flops"] for r in ranks),
           "comm_by_tag": None, "comm_by_op": None, "comm_bytes": None, "wire_bytes": None,
           "comm_formula_match": None}
    row["step_times"] = [max(s) for s in zip(*(r["step_times"] for r in ranks))]
    _timing(spec, row)
    return row


def _timing(spec: BenchSpec, row: dict) -> None:
    """Median step time (of the slowest rank, step by step), its spread and tokens/s."""
    times = row["step_times"]
    row["step_time"] = statistics.median(times) if times else None
    row["step_time_spread"] = spread(times)
    row["tokens_per_s"] = (spec.micro_batch * spec.seq_len / row["step_time"]) if row["step_time"] else None


def summarize_single(spec: BenchSpec, single: dict) -> dict:
    rows = {}
    for name in ("ours", "hf"):
        r = single[name]
        t = r["step_time"]
        rows[name] = {"state_bytes": r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"],
                      "peak_act_bytes": r["peak_act_bytes"], "step_time": t, "first_loss": r["first_loss"],
                      "peak_total_bytes": r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] + r["peak_act_bytes"],
                      "tokens_per_s": spec.micro_batch * spec.seq_len / t if t else None}
    ours, hf = rows["ours"]["step_time"], rows["hf"]["step_time"]
    rows["ours_over_hf_speed"] = hf / ours if ours and hf else None
    return rows


def _formula(spec: BenchSpec, scheme: str) -> dict[str, int]:
    """The closed-form ledger bytes per "op/tag" of one fwd + bwd (parallel/*/comm_model.py), less
    ZeRO-3's (`_zero3_bytes` checks those against the bytes DeepSpeed moved)."""
    kw = dict(degree=spec.degree, batch=spec.micro_batch, seq_len=spec.seq_len)
    e = 2 if spec.dtype == "bf16" else 4                  # weights and activations; gradients: fp32
    if scheme == "tsp":
        comm = tsp_step_comm(spec.model, head_buckets=spec.head_buckets, weight_bytes=e, act_bytes=e, **kw)
        return {f"{op}/{tag}": v["bytes"] for (op, tag), v in comm.items()}
    return expected_ledger_bytes(spec.model, scheme, **kw, dtype_bytes=e,
                                 sharded_weights=spec.zero_stage(scheme) == 3,
                                 **(spec.options(scheme) if scheme == "tp_x_sp" else {}))


def _layout(spec: BenchSpec, scheme: str, info: dict) -> str:
    if scheme == "tsp":
        return f"D={spec.degree}" + (f" b={spec.head_buckets}" if spec.head_buckets > 1 else "")
    weights = {3: " Z3", 0: " repl"}[spec.zero_stage(scheme)] if scheme in ("sp", "ulysses") else ""
    if scheme == "ulysses":
        return f"D={spec.degree} a2a" + weights
    t, s = info.get("tp_degree", 1), info.get("sp_degree", 1)
    return f"T{t}xS{s}" + ("+SP" if info.get("sequence_parallel") else "") + weights


def _max_over_ranks(per_rank: list[dict[str, int]]) -> dict[str, int]:
    keys = sorted({k for d in per_rank for k in d})
    return {k: max(d.get(k, 0) for d in per_rank) for k in keys}


def _by_op(by_tag: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, nbytes in by_tag.items():
        op = key.split("/")[0]
        out[op] = out.get(op, 0) + nbytes
    return out


# ---------------------------------------------------------------------------------------------
# Output


def format_table(spec: BenchSpec, rows: list[dict], single: dict | None) -> str:
    m = spec.model
    head = (f"model {spec.model_name} (h={m.hidden_size}, L={m.num_layers}, heads={m.num_heads}/"
            f"{m.num_kv_heads}, I={m.intermediate_size}, V={m.vocab_size}), seq {spec.seq_len} x "
            f"batch {spec.micro_batch}, D={spec.degree}, backend {spec.backend}, {spec.threads} thread(s)/rank"
            + (", activation checkpointing" if spec.activation_checkpointing else ""))
    cols = ["scheme", "layout", "state MiB", "act+trans MiB", "peak MiB", "GFLOP/rank", "ledger MiB",
            "AR / AG / RS / bc+red / p2p / a2a", "wire MiB", "step s [min-max]", "tok/s", "loss@1"]
    lines = [_row(cols, r) for r in rows]
    if single:
        for name, label in (("ours", "1 proc (ours)"), ("hf", "1 proc (HF)")):
            s = single[name]
            lines.append([label, "D=1", _mib(s["state_bytes"]), _mib(s["peak_act_bytes"]),
                          _mib(s["peak_total_bytes"]), "-", "-", "-", "-", _num(s["step_time"], 2),
                          _num(s["tokens_per_s"], 0), f"{s['first_loss']:.6f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [head, fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*map(str, line)) for line in lines]
    if single and single.get("ours_over_hf_speed"):
        out.append(f"single process: ours is {single['ours_over_hf_speed']:.2f}x the speed of "
                   f"transformers' {spec.model.family} CausalLM (same config, weights, batch; "
                   "fwd+bwd+AdamW)")
    spread = step_ratio_spread(rows)
    if spread:
        how = "steps interleaved in one launch" if spec.interleave else "one launch per scheme"
        out.append(f"step time / TP's, median [min-max] over {spec.steps} timed steps ({how}): "
                   + ", ".join(f"{k} {format_spread(v)}" for k, v in spread.items()))
    if any(r["comm_by_op"] is None for r in rows):
        out.append("*_ref: a stack run unmodified in processes of its own (--reference); its "
                   "communication is its own, outside our ledger")
    zero3 = [r for r in rows if "zero3_measured" in r]
    if zero3:
        out.append("ZeRO-3 (sp, ulysses as the trainer runs them: weights sharded over the D ranks), "
                   "all-gather / reduce-scatter MiB per rank per fwd+bwd, measured (DeepSpeed's calls) "
                   "vs closed form: " + "; ".join(
                       f"{r['scheme']} " + " / ".join(_mib(r["zero3_measured"].get(op, 0)) for op in _Z3_OPS)
                       + " vs " + " / ".join(_mib(r["zero3_closed_form"].get(op, 0)) for op in _Z3_OPS)
                       + ("" if r["zero3_match"] else " DIFFER") for r in zero3)
                   + f"; their state includes ZeRO-3's reduce buckets, {_mib(zero3[0]['reduce_bucket_bytes'])} "
                   "MiB per rank (the trainer's reduce_bucket_size, whatever the model)")
    bad = [r["scheme"] for r in rows if r.get("comm_formula_match") is False]
    if bad:
        out.append(f"WARNING: ledger bytes differ from the closed-form formula for {', '.join(bad)}")
    return "\n".join(out)


_Z3_OPS = ("all_gather", "reduce_scatter")


def ratios_to_tp(rows: list[dict]) -> dict[str, float]:
    """Each scheme's median step time over TP's ({} without a timed TP row)."""
    tp = next((r["step_time"] for r in rows if r["scheme"] == "tp" and r.get("step_time")), None)
    if not tp:
        return {}
    return {r["scheme"]: r["step_time"] / tp for r in rows if r.get("step_time")}


def ratio_spread(numer: list[float], denom: list[float]) -> dict[str, float] | None:
    """Repeat i of one variant over repeat i of another (interleaved repeats ran next to each other,
    so drifts of the machine's speed cancel): {"median", "min", "max", "repeats"}; None when there
    is no pair."""
    return spread([a / b for a, b in zip(numer, denom)])


def spread(values: list[float]) -> dict[str, float] | None:
    """{"median", "min", "max", "repeats"} of some repeats; None when there are none."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "repeats": len(values)}


def format_spread(spread: dict[str, float]) -> str:
    """'1.05x [1.01-1.12]': the median ratio and its min-max range."""
    return f"{spread['median']:.2f}x [{spread['min']:.2f}-{spread['max']:.2f}]"


def step_ratio_spread(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each scheme's step time over TP's step by step (`ratio_spread`), as {"median", "min",
    "max", "repeats"}; {} without a timed TP row."""
    tp = next((r.get("step_times") for r in rows if r["scheme"] == "tp" and r.get("step_times")), None)
    if not tp:
        return {}
    spreads = {r["scheme"]: ratio_spread(r.get("step_times") or [], tp) for r in rows}
    return {k: v for k, v in spreads.items() if v}


def _row(cols, r: dict) -> list[str]:
    ops = r["comm_by_op"]
    if ops is None:                       # a reference stack: no ledger
        split, ledger, wire = "-", "-", "-"
    else:
        split = " / ".join(_mib(ops.get(k, 0)) for k in ("all_reduce", "all_gather", "reduce_scatter"))
        split += (f" / {_mib(ops.get('broadcast', 0) + ops.get('reduce', 0))} / {_mib(ops.get('recv', 0))}"
                  f" / {_mib(ops.get('all_to_all', 0))}")
        ledger, wire = _mib(r["comm_bytes"]), _mib(r["wire_bytes"])
    return [r["scheme"], r["layout"], _mib(r["state_bytes"]), _mib(r["peak_act_bytes"]),
            _mib(r["peak_total_bytes"]), _num(r["flops_per_rank"] / 1e9, 3), ledger, split, wire,
            _step(r), _num(r["tokens_per_s"], 0), f"{r['first_loss']:.6f}"]


def _step(r: dict) -> str:
    """'0.12 [0.11-0.15]': the median step time and the range of the repeats."""
    sp = r.get("step_time_spread")
    return "-" if not sp else f"{sp['median']:.2f} [{sp['min']:.2f}-{sp['max']:.2f}]"


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f}"


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_json(path: str, spec: BenchSpec, rows: list[dict], single: dict | None, env: dict) -> None:
    with open(path, "w") as f:
        json.dump({"spec": spec.to_json(), "env": env, "schemes": rows, "single_process": single,
                   "step_time_over_tp": ratios_to_tp(rows),
                   "step_time_over_tp_by_step": step_ratio_spread(rows)},
                  f, indent=2)


def write_plot(path: str, spec: BenchSpec, rows: list[dict], single: dict | None) -> None:
    """PNG: per-rank memory, communication by op kind and (when steps were timed) throughput."""
    _draw(path, _title(spec.to_json()), rows, single)


def replot(json_path: str, png_path: str) -> None:
    """Redraw the PNG of a saved `tsp-bench --json` document (no run)."""
    with open(json_path) as f:
        doc = json.load(f)
    _draw(png_path, _title(doc["spec"]), [r for r in doc["schemes"] if "error" not in r],
          doc.get("single_process"))


def _title(spec: dict) -> str:
    m = spec["model"]
    return (f"h={m['hidden_size']} L={m['num_layers']} heads={m['num_heads']}/{m['num_kv_heads']}, "
            f"seq {spec['seq_len']}, D={spec['degree']}, {spec['backend']}")


def _draw(path: str, title: str, rows: list[dict], single: dict | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any(r.get("tokens_per_s") for r in rows)     # memory-only runs: no throughput panel
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(15 if timed else 10.5, 5.2))
    names = [f"{r['scheme']}\n{r['layout']}" for r in rows]
    _memory_panel(axes[0], names, rows, single)
    _comm_panel(axes[1], names, rows)
    if timed:
        _throughput_panel(axes[2], names, rows, single)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _legend_below(ax) -> None:
    """Under the axes, so that it never covers a bar."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)


def _headroom(ax, top: float) -> None:
    ax.set_ylim(0, top * 1.08 if top > 0 else 1.0)


def _memory_panel(ax, names, rows, single) -> None:
    state = [r["state_bytes"] / MIB for r in rows]
    act = [r["peak_act_bytes"] / MIB for r in rows]
    ax.bar(names, state, label="params + grads + AdamW")
    ax.bar(names, act, bottom=state, label="peak activations + transients")
    tops = [s + a for s, a in zip(state, act)]
    if single:
        one = single["ours"]["peak_total_bytes"] / MIB
        ax.axhline(one, color="k", ls="--", lw=1, label="1 process")
        tops.append(one)
    _headroom(ax, max(tops))
    ax.set_ylabel("MiB per rank")
    ax.set_title("per-rank peak memory")
    _legend_below(ax)


def _comm_panel(ax, names, rows) -> None:
    bottom = [0.0] * len(rows)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "recv", "all_to_all"):
        vals = [(r["comm_by_op"] or {}).get(op, 0) / MIB for r in rows]     # None: a reference stack
        if any(vals):
            ax.bar(names, vals, bottom=bottom, label=op)
            bottom = [b + v for b, v in zip(bottom, vals)]
    wire = [(r["wire_bytes"] or 0) / MIB for r in rows]
    ax.plot(names, wire, "k_", markersize=28, mew=2, label="received (ring estimate)")
    _headroom(ax, max(bottom + wire))
    ax.set_ylabel("MiB per rank per step (ledger; P2P = recv)")
    ax.set_title("communication by op kind")
    _legend_below(ax)


def _throughput_panel(ax, names, rows, single) -> None:
    tput = [r["tokens_per_s"] or 0 for r in rows]
    ax.bar(names, tput, color="tab:green")
    tops = list(tput)
    if single and single["ours"]["tokens_per_s"]:
        ax.axhline(single["ours"]["tokens_per_s"], color="k", ls="--", lw=1, label="1 process (ours)")
        ax.axhline(single["hf"]["tokens_per_s"], color="tab:red", ls=":", lw=1, label="1 process (HF)")
        tops += [single["ours"]["tokens_per_s"], single["hf"]["tokens_per_s"]]
        _legend_below(ax)
    _headroom(ax, max(tops))
    ax.set_ylabel("tokens / s (group)")
    ax.set_title("throughput (fwd + bwd + AdamW)")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m tsp_trainer.bench.report RESULT.json OUT.png  (redraw a saved run's PNG)")
    replot(sys.argv[1], sys.argv[2])
