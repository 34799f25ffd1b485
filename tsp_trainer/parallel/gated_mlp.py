"""One block of a gated MLP's intermediate dim, by hand and in token chunks: shared by TSP's MLP
ring (parallel/tsp/mlp.py) and the baselines' column/row-parallel MLP (parallel/baselines/layers.py).

`TokenTiling` sets the chunks (`parallel.mlp_chunk_tokens`) and, once the tokens are tiled, keeps
the [tokens, h] accumulators in the activation dtype instead of fp32 (each GEMM adds into them
itself, summing in fp32 and rounding once per step). TSP's packed shard gives [W_gate; W_up] as
one view (`fused_weights`), so gate and up are one GEMM; the baselines hold them apart
(`split_gate_up`). Every accumulation goes through `add_matmul`, which sums inside the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tsp_trainer.parallel.loss_chunks import resolve_mlp_chunk_tokens, token_chunks


@dataclass(frozen=True)
class TokenTiling:
    """`setting`: parallel.mlp_chunk_tokens ("auto" or a token count); `inter_shard`: the MLP
    block's intermediate channels (I/D); `budget_bytes`: the bound "auto" keeps one chunk's
    intermediates under (None: parallel/loss_chunks.py's default)."""

    setting: int | str = "auto"
    inter_shard: int = 1
    budget_bytes: int | None = None

    def chunk(self, tokens: int, elem_bytes: int) -> int:
        """Tokens per chunk for `tokens` local tokens of `elem_bytes`-byte activations."""
        return resolve_mlp_chunk_tokens(self.setting, tokens, self.inter_shard, elem_bytes,
                                        self.budget_bytes)

    def chunks(self, x: torch.Tensor) -> list[slice]:
        """The row slices of x's tokens (x [..., h], flattened to [n, h]) one chunk each."""
        n = x.numel() // x.shape[-1]
        return token_chunks(n, self.chunk(n, x.element_size()))

    def accumulator_dtype(self, x: torch.Tensor) -> torch.dtype:
        """fp32 for an untiled block; x's dtype once its tokens are tiled (no fp32 [n, h])."""
        return x.dtype if len(self.chunks(x)) > 1 else torch.float32


def fused_weights(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The packed MLP shard's shapes (W_gate, W_up, W_down [, b_gate, b_up]) as its fused views:
    [W_gate; W_up] [2 I/D, h], W_down [h, I/D] [, [b_gate; b_up] [2 I/D]]. The shard packs W_gate
    and W_up (and the two biases) consecutively, so `unpack` with these shapes gives free views."""
    gate, up = shapes[0], shapes[1]
    fused = [(gate[0] + up[0],) + tuple(gate[1:]), shapes[2]]
    return fused + ([(shapes[3][0] + shapes[4][0],)] if len(shapes) > 3 else [])


def split_gate_up(params: list[torch.Tensor]) -> list:
    """W_gate, W_up, W_down [, b_gate, b_up] held apart (the baselines' own parameters, not
    adjacent in memory) in the list gated_mlp_forward_into takes: (W_gate, W_up), W_down
    [, (b_gate, b_up)]. The gate and up GEMMs then write the two halves of one [c, 2 I] buffer
    (two GEMMs, no copy of the weights)."""
    pair = [(params[0], params[1]), params[2]]
    return pair + ([(params[3], params[4])] if len(params) > 3 else [])


def _gate_up(x: torch.Tensor, w, bias) -> torch.Tensor:
    """[x W_gate^T (+ b_gate) | x W_up^T (+ b_up)] [c, 2 I]: one GEMM against the fused [W_gate;
    W_up] (a tensor), or one per half of the output for a (W_gate, W_up) pair."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    out = x.new_empty((x.shape[0], w[0].shape[0] + w[1].shape[0]))
    for half, wi, bi in zip(out.chunk(2, dim=-1), w, bias if bias is not None else (None, None)):
        if bi is None:
            torch.mm(x, wi.t(), out=half)
        else:
            torch.addmm(bi, x, wi.t(), out=half)
    return out


def _add_gate_up_grads(acc_w, acc_b, dgu: torch.Tensor, x: torch.Tensor) -> None:
    """[dW_gate; dW_up] += [dg | du]^T x (one GEMM into a fused accumulator, one per half for a
    pair) and the biases' column sums (fp32)."""
    if isinstance(acc_w, torch.Tensor):
        add_matmul(acc_w, dgu.t(), x)
        if acc_b is not None:
            acc_b.add_(dgu.sum(0, dtype=torch.float32))
        return
    for i, half in enumerate(dgu.chunk(2, dim=-1)):
        add_matmul(acc_w[i], half.t(), x)
        if acc_b is not None:
            acc_b[i].add_(half.sum(0, dtype=torch.float32))


def _add_gate_up_input_grad(dx: torch.Tensor, dgu: torch.Tensor, w) -> None:
    """dx += [dg | du] [W_gate; W_up]: one GEMM, or one per half for a pair."""
    if isinstance(w, torch.Tensor):
        add_matmul(dx, dgu, w)
        return
    for half, wi in zip(dgu.chunk(2, dim=-1), w):
        add_matmul(dx, half, wi)


def gated_mlp_forward_into(x2: torch.Tensor, ws: list[torch.Tensor], y2: torch.Tensor,
                           chunks: list[slice], kept: list | None = None) -> None:
    """y2[c] += gated_mlp(x2[c], block ws) chunk by chunk, two GEMMs a chunk: x2 [n, h] (or rows
    made per chunk by x2[c], TSP's tsp/norm.py NormedRows), y2 [n, h] (fp32 or x's dtype); ws = [W_gate; W_up] [2 I/D, h], W_down [h, I/D] (+ [b_gate; b_up]), as
    `fused_weights` lays them out, or with the (W_gate, W_up) pairs of `split_gate_up`. With `kept` (a list) each chunk's gate/up pre-activations
    [chunk, 2 I/D] (gate first) are appended to it for the backward."""
    bias = ws[2] if len(ws) > 2 else None
    for c in chunks:
        gu = _gate_up(x2[c], ws[0], bias)           # [chunk, 2 I/D]: gate | up
        if kept is not None:
            kept.append(gu)
        g, u = gu.chunk(2, dim=-1)
        add_matmul(y2[c], F.silu(g) * u, ws[1].t())  # = gated_mlp(x2[c], ...), down_proj summed in


def gated_mlp_backward_into(x: torch.Tensor, dy: torch.Tensor, ws: list[torch.Tensor],
                            acc: list[torch.Tensor], dx: torch.Tensor, chunks: list[slice],
                            kept: list | None = None) -> None:
    """Backward of `gated_mlp` for one block of the intermediate dim, chunk by chunk of tokens, by
    hand so that the weight gradients are added into `acc` (fp32, e.g. views of TSP's packed
    accumulator) without a gradient tensor of their own. x, dy [n, h] (x, or rows made per chunk
    by x[c] as in gated_mlp_forward_into); ws as in
    gated_mlp_forward_into; acc the same shapes in fp32; dx [n, h] (fp32 or x's dtype, added
    into). kept: the chunks' gate/up pre-activations, in chunk order (each released once used);
    None recomputes them from x. Per chunk four GEMMs with fused weights (five with the gate/up
    recompute)."""
    for i, c in enumerate(chunks):
        gu = kept[i] if kept is not None else None
        if kept is not None:
            kept[i] = None                           # freed as soon as its chunk is done
        _chunk_backward_into(x[c], dy[c], ws, acc, dx[c], gu)


def _chunk_backward_into(x, dy, ws, acc, dx, gu_kept) -> None:
    """One chunk of gated_mlp_backward_into: x, dy, dx [c, h]; the intermediates [c, I/D], the
    gate/up ones side by side in [c, 2 I/D] (gate first, as [W_gate; W_up]'s rows)."""
    w_gu, wd = ws[0], ws[1]
    gu = gu_kept if gu_kept is not None else _gate_up(x, w_gu, ws[2] if len(ws) > 2 else None)
    gu = gu.reshape(x.shape[0], -1)
    g, u = gu.chunk(2, dim=-1)
    sig = torch.sigmoid(g)
    a = g * sig                                  # silu(g)
    add_matmul(acc[1], dy.t(), a * u)           # dW_down [h, I/D] = dy^T (silu(g) * u)
    dgu = torch.empty_like(gu)                   # [dg | du], laid out as [W_gate; W_up]'s rows
    dg, du = dgu.chunk(2, dim=-1)
    torch.mm(dy, wd, out=dg)                     # dp [c, I/D]: the gradient of silu(g) * u
    torch.mul(dg, a, out=du)
    dg.mul_(u).mul_(sig * (1 + g * (1 - sig)))   # silu'(g) = sig (1 + g (1 - sig))
    _add_gate_up_grads(acc[0], acc[2] if len(acc) > 2 else None, dgu, x)   # [dW_gate; dW_up]
    _add_gate_up_input_grad(dx, dgu, w_gu)      # dx += [dg | du] [W_gate; W_up]


def add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, the sum taken inside one GEMM wherever the device can:
    - a, b in out's dtype (fp32; bf16 into a tiled layer's bf16 accumulator): out.addmm_(a, b), in
      place, no product tensor;
    - bf16/fp16 operands into an fp32 out on CUDA: one GEMM that reads and writes out in fp32
      (`_addmm_into_fp32`), so no bf16 product is written and read back;
    - otherwise (CPU's GEMMs have no fp32 output for bf16 operands): the product in the operands'
      dtype (summed in fp32 inside the GEMM, rounded once), then added."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        out.addmm_(a, b)
    elif gemm_writes_fp32(out, a):
        _addmm_into_fp32(out, a, b)
    else:
        out.add_(a @ b)


def gemm_writes_fp32(out: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether a GEMM of `a`'s dtype can accumulate into `out` in fp32 itself: CUDA's bf16/fp16
    GEMMs with an fp32 output (torch's out_dtype overloads)."""
    return (out.device.type == "cuda" and out.dtype == torch.float32
            and a.dtype in (torch.bfloat16, torch.float16))


def _addmm_into_fp32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out [m, n] fp32 += a [m, k] @ b [k, n] (bf16/fp16), one cuBLAS call reading and writing out
    in fp32: baddbmm's out_dtype overload with out as both the added input and the result, over a
    batch of one (addmm's out_dtype overload wants the added input in the operands' dtype)."""
    out3 = out.unsqueeze(0)
    torch.baddbmm(out3, a.unsqueeze(0), b.unsqueeze(0), out_dtype=torch.float32, out=out3)


__all__ = ["TokenTiling", "add_matmul", "fused_weights", "gated_mlp_backward_into",
           "gated_mlp_forward_into", "gemm_writes_fp32", "split_gate_up"]
