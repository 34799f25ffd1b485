"""Bytes per element of each kind of per-rank tensor under the two precisions the trainer runs:
bf16 mixed precision and fp32."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """Bytes per element. bf16 mixed precision (DeepSpeed bf16, the ZeRO paper's accounting):
    bf16 weights, gradients and activations, an fp32 master copy and two fp32 Adam moments
    (2 + 2 + 12 = 16 bytes per parameter before ZeRO), plus the fp32 gradient accumulation the
    trainer configures (engine/deepspeed.py: data_types.grad_accum_dtype=fp32): `grad_accum` bytes
    per parameter beside the bf16 gradient (ZeRO-1: DeepSpeed's BF16_Optimizer keeps a full fp32
    buffer; ZeRO-2: an fp32 partition), and gradients reduced over DP in fp32 (`grad_reduce`).
    fp32 (CPU runs, tests): no master copy, the gradient is its own accumulator."""

    name: str
    weight: int
    grad: int
    act: int
    master: int
    moments: int
    grad_accum: int = 0          # fp32 accumulation buffer per parameter (0: the gradient itself)
    grad_reduce: int = 4         # bytes per element of the DP gradient reduction (fp32)

    @property
    def optimizer(self) -> int:
        return self.master + self.moments

    @property
    def zero_stages(self) -> tuple[int, ...]:
        """ZeRO stages the trainer runs with this precision: bf16 needs 1 or 2 (DeepSpeed
        accumulates bf16 gradients in fp32 only under ZeRO; config/validate.py refuses stage 0)."""
        return (1, 2) if self.grad_accum else (0, 1, 2)


BF16 = Precision("bf16", weight=2, grad=2, act=2, master=4, moments=8, grad_accum=4)
FP32 = Precision("fp32", weight=4, grad=4, act=4, master=0, moments=8)
PRECISIONS = {"bf16": BF16, "fp32": FP32}

__all__ = ["BF16", "FP32", "PRECISIONS", "Precision"]
