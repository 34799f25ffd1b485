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

Every row is `longest_seq_len` of scheme tsp with that row's switches (activation checkpointing,
head buckets and ZeRO stage searched as usual), checked against HBM and the node's host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.hardware import HardwareProfile
from tsp_trainer.plan.layout import UNTILED
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


_UNTILED = {"loss_chunk_tokens": UNTILED, "mlp_chunk_tokens": UNTILED, "tiled_accumulators": False}
STEPS = (
    Step("baseline", _UNTILED),
    Step("+ tiled loss", {**_UNTILED, "loss_chunk_tokens": "auto"}),
    Step("+ tiled MLP", {**_UNTILED, "loss_chunk_tokens": "auto", "mlp_chunk_tokens": "auto"}),
    Step("+ tiled accumulators", {}),
    Step("+ optimizer offload", {}, offload_optimizer=True),
    Step("+ activation offload", {}, offload_optimizer=True, offload=True),
)


@dataclass
class AblationRow:
    step: Step
    longest: Longest

    def as_dict(self) -> dict:
        best = self.longest.best
        out = {"technique": self.step.name, "max_seq_len": self.longest.seq_len,
               "bound_by": self.longest.bound}
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
                                              fields=step.fields))
            for step in STEPS]


def format_ablation(rows: list[AblationRow], *, header: str) -> str:
    lines = [header, "", "| technique | longest sequence | peak GB/GPU | host GB/node | step time | "
             "bound by | layout |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        best = r.longest.best
        if best is None:
            lines.append(f"| {r.step.name} | nothing fits | - | - | - | {r.longest.bound} | - |")
            continue
        lines.append(f"| {r.step.name} | {r.longest.seq_len:,} | {best.memory['total'] / GB:.1f} | "
                     f"{best.memory['host_per_node'] / GB:,.0f} | {format_seconds(best.step_time)} | "
                     f"{r.longest.bound} | {best.layout.label()} |")
    return "\n".join(lines)


__all__ = ["STEPS", "AblationRow", "Step", "ablation", "format_ablation"]
