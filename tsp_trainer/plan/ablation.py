"""TSP's longest sequence as the memory techniques are added one at a time (`tsp-plan --ablation`),
in the form of ALST's ablation table: each row keeps the techniques of the rows above it.

    baseline               no tiling (loss and MLP take all local tokens at once, fp32
                           accumulators), AdamW on the GPU, activations in HBM
    + tiled loss           parallel.loss_chunk_tokens: auto
    + tiled MLP            parallel.mlp_chunk_tokens: auto (accumulators still fp32)
    + tiled accumulators   a tiled layer's accumulators in the activation dtype (the trainer's
                           behaviour whenever the MLP is tiled)
    + optimizer offload    zero.offload_optimizer: cpu
    + activation offload   train.offload_activations: true (with or without checkpointing)
    + nested checkpointing train.checkpoint_segment_blocks: 1, 2, 3, 4 or 8 (only every k-th
                           block input kept, on the host with the offload)
    + lean replay          parallel.checkpoint_replay_keeps: attention or nothing as well as all
                           (the rows above keep all: the replay holds one block's attention items
                           and gate/up)
    + chunked attention    parallel.attention_chunk_tokens: auto (the rows above gather each
                           item's K/V whole)
    + norm handoff         a tiled layer's norms hand their work to the attention and the MLP,
                           which keep the norms' inputs, not their outputs (parallel/tsp/norm.py;
                           the trainer's behaviour whenever the MLP is tiled; the rows above keep
                           the outputs, `Layout.norm_handoff` False)

Every row is `longest_seq_len` of scheme tsp with that row's switches (activation checkpointing,
head buckets and ZeRO stage searched as usual), checked against HBM and the node's host memory.
A row whose prediction the dry run does not confirm (`Step.confirmed` False) is printed marked as
the planner's only, never as a result. Every row but the norm handoff's is confirmed: the dry run of the real code at
the Llama-3.1-8B rows' lengths on 8 x H100 and 8 x H200 (`python -m tsp_trainer.plan.dry_run`,
docs/long_context/longest_context.md) peaks within 10% of the planner and under usable HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.hardware import HardwareProfile
from tsp_trainer.plan.layout import NESTING_CANDIDATES, REPLAY_KEEPS, UNTILED
from tsp_trainer.plan.longest import Longest, format_seconds, longest_seq_len, peak_breakdown
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.predict import Assumptions

GB = 1e9


@dataclass(frozen=True)
class Step:
    """One row's switches: Layout fields set on every candidate, and the two offloads."""

    name: str
    fields: dict
    offload_optimizer: bool = False
    offload: bool = False
    replay_keeps: tuple[str, ...] = ("all",)    # checkpoint_replay_keeps under checkpointing
    segments: tuple[int, ...] = (1,)             # checkpoint_segment_blocks under checkpointing
    # False: the dry run of the real code at this row's length needs more memory than the planner
    # predicts (or has not run there), so the row is no result
    confirmed: bool = True


_KEPT_NORMS = {"norm_handoff": False}
_WHOLE_KV = {"attention_chunk_tokens": UNTILED, **_KEPT_NORMS}
_UNTILED = {"loss_chunk_tokens": UNTILED, "mlp_chunk_tokens": UNTILED, "tiled_accumulators": False, **_WHOLE_KV}
STEPS = (
    Step("baseline", _UNTILED),
    Step("+ tiled loss", {**_UNTILED, "loss_chunk_tokens": "auto"}),
    Step("+ tiled MLP", {**_UNTILED, "loss_chunk_tokens": "auto", "mlp_chunk_tokens": "auto"}),
    Step("+ tiled accumulators", _WHOLE_KV),
    Step("+ optimizer offload", _WHOLE_KV, offload_optimizer=True),
    Step("+ activation offload", _WHOLE_KV, offload_optimizer=True, offload=True),
    Step("+ nested checkpointing", _WHOLE_KV, offload_optimizer=True, offload=True,
         segments=NESTING_CANDIDATES),
    Step("+ lean replay", _WHOLE_KV, offload_optimizer=True, offload=True, replay_keeps=REPLAY_KEEPS,
         segments=NESTING_CANDIDATES),
    Step("+ chunked attention", _KEPT_NORMS, offload_optimizer=True, offload=True, replay_keeps=REPLAY_KEEPS,
         segments=NESTING_CANDIDATES),
    # the dry run confirms this row on H100 (within 10%, under usable HBM); on H200 it has not
    # run at the row's length: the planner's prediction until it has
    Step("+ norm handoff", {}, offload_optimizer=True, offload=True, replay_keeps=REPLAY_KEEPS,
         segments=NESTING_CANDIDATES, confirmed=False),
)


@dataclass
class AblationRow:
    step: Step
    longest: Longest

    def as_dict(self) -> dict:
        best = self.longest.best
        out = {"technique": self.step.name, "max_seq_len": self.longest.seq_len,
               "bound_by": self.longest.bound, "confirmed_by_dry_run": self.step.confirmed}
        if best is not None:
            out.update(layout=best.layout.label(), peak_bytes_per_gpu=best.memory["total"],
                       host_bytes_per_node=best.memory["host_per_node"], step_time_s=best.step_time,
                       peak_breakdown=peak_breakdown(best))
        return out


def ablation(cfg: ModelConfig, *, hw: HardwareProfile, nodes: int = 1, prec: Precision = BF16,
             assumptions: Assumptions = Assumptions(), max_degree: int = 64,
             granule: int = 1024) -> list[AblationRow]:
    """One row per entry of STEPS: TSP's longest sequence (one sequence per step) with the
    techniques of that row and the rows above."""
    return [AblationRow(step, longest_seq_len(cfg, "tsp", hw=hw, nodes=nodes, prec=prec,
                                              assumptions=assumptions, max_degree=max_degree,
                                              granule=granule, offload=step.offload,
                                              offload_optimizer=step.offload_optimizer,
                                              fields=step.fields, replay_keeps=step.replay_keeps,
                                              segments=step.segments))
            for step in STEPS]


def format_ablation(rows: list[AblationRow], *, header: str) -> str:
    lines = [header, "", "| technique | longest sequence | peak GB/GPU | host GB/node | step time | "
             "bound by | layout |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        best = r.longest.best
        name = r.step.name if r.step.confirmed else f"{r.step.name} ({UNCONFIRMED})"
        if best is None:
            lines.append(f"| {name} | nothing fits | - | - | - | {r.longest.bound} | - |")
            continue
        length = (f"{r.longest.seq_len:,}" if r.step.confirmed
                  else f"not a result ({r.longest.seq_len:,} predicted)")
        lines.append(f"| {name} | {length} | {best.memory['total'] / GB:.1f} | "
                     f"{best.memory['host_per_node'] / GB:,.0f} | {format_seconds(best.step_time)} | "
                     f"{r.longest.bound} | {best.layout.label()} |")
    if not all(r.step.confirmed for r in rows):
        lines += ["", f"{UNCONFIRMED}: the dry run of the real code at that length needs more memory "
                      "than the planner predicts, or has not run there; plan on the rows above it"]
    return "\n".join(lines)


UNCONFIRMED = "planner only, the dry run does not confirm it"


# the published tables (docs/long_context/longest_context.md, docs/results/longest_ablation.json)
PUBLISHED = (("llama3_8b", "h100"), ("llama3_8b", "h200"), ("7b", "mi300x"))
COST_SEQ_LEN = 131072


def cost_at(cfg: ModelConfig, *, hw: HardwareProfile, seq_len: int = COST_SEQ_LEN, nodes: int = 1,
            prec: Precision = BF16, assumptions: Assumptions = Assumptions()) -> list[dict]:
    """What each technique costs where memory does not need it: the planner's step time of TSP's
    top layout at seq_len (one sequence per step, activations in HBM, auto chunks: no tiling at
    128K) without and with the technique forced on (a tiled loss or MLP in 4 chunks of the local
    tokens, bf16 accumulators with the MLP tiled, ZeRO-Offload, activation offload, nesting
    segments of 2 blocks against per-block checkpointing)."""
    from dataclasses import replace

    from tsp_trainer.plan.predict import predict
    from tsp_trainer.plan.search import plan

    model = cfg.replace(max_seq_len=max(cfg.max_seq_len, seq_len))
    base = plan(model, seq_len=seq_len, global_batch=1, hw=hw, nodes=nodes, schemes=("tsp",), prec=prec,
                assumptions=assumptions, tsp_recompute=("full",),
                offload_activations=(False,)).fitting[0].layout
    chunk = max(1, base.micro_batch * seq_len // base.degree // 4)
    pairs = (("tiled loss", {"loss_chunk_tokens": UNTILED}, {"loss_chunk_tokens": chunk}),
             ("tiled MLP", {"mlp_chunk_tokens": UNTILED, "tiled_accumulators": False},
              {"mlp_chunk_tokens": chunk, "tiled_accumulators": False}),
             ("tiled accumulators", {"mlp_chunk_tokens": chunk, "tiled_accumulators": False,
                                     "norm_handoff": False},
              {"mlp_chunk_tokens": chunk, "norm_handoff": False}),
             ("norm handoff", {"mlp_chunk_tokens": chunk, "norm_handoff": False}, {"mlp_chunk_tokens": chunk}),
             ("optimizer offload", {}, {"offload_optimizer": True, "zero_stage": max(1, base.zero_stage)}),
             ("activation offload", {}, {"offload_activations": True}),
             ("nested checkpointing (k=2)", {"activation_checkpointing": True},
              {"activation_checkpointing": True, "checkpoint_segment_blocks": 2}))
    rows = []
    for name, off, on in pairs:
        without, with_ = (predict(model, replace(base, **f), seq_len, hw, global_batch=1, prec=prec,
                                  assumptions=assumptions) for f in (off, on))
        rows.append({"technique": name, "layout": base.label(), "step_time_without_s": without.step_time,
                     "step_time_with_s": with_.step_time,
                     "cost": with_.step_time / without.step_time - 1})
    return rows


def format_cost(rows: list[dict], *, header: str) -> str:
    lines = [header, "", "| technique | step without | step with | cost |", "|---|---|---|---|"]
    lines += [f"| {r['technique']} | {r['step_time_without_s']:.2f} s | {r['step_time_with_s']:.2f} s | "
              f"{r['cost']:+.1%} |" for r in rows]
    return "\n".join(lines)


def published(prec: Precision = BF16) -> dict:
    """The ablation and the 128K costs of every PUBLISHED (model, GPU) on one node."""
    from tsp_trainer.config.model import model_config
    from tsp_trainer.plan.hardware import get_profile

    out = {}
    for model, gpu in PUBLISHED:
        cfg, hw = model_config(model), get_profile(gpu)
        out[f"{model} 8 x {gpu}"] = {
            "model": model, "gpu": gpu, "nodes": 1, "hbm_bytes": hw.hbm_bytes,
            "host_memory_bytes_per_node": hw.host_memory_bytes,
            "rows": [r.as_dict() for r in ablation(cfg, hw=hw, prec=prec)],
            "cost_at_128k": cost_at(cfg, hw=hw, prec=prec)}
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m tsp_trainer.plan.ablation --out docs/results/longest_ablation.json"""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m tsp_trainer.plan.ablation",
                                     description="the published ablation tables and 128K costs, as JSON")
    parser.add_argument("--out", required=True, metavar="PATH")
    args = parser.parse_args(argv)
    doc = published()
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for name, case in doc.items():
        print(name)
        for r in case["rows"]:
            print(f"  {r['technique']}: {r['max_seq_len']:,} ({r['bound_by']})")
    return 0


__all__ = ["COST_SEQ_LEN", "PUBLISHED", "STEPS", "AblationRow", "Step", "ablation", "cost_at",
           "format_ablation", "format_cost", "published"]


if __name__ == "__main__":
    raise SystemExit(main())
