"""One block of a gated MLP's intermediate dim, by hand and in token chunks: shared by TSP's MLP
ring (parallel/tsp/mlp.py) and the baselines' column/row-parallel MLP (parallel/baselines/layers.py).

`TokenTiling` decides, per call, how many local tokens one chunk takes (`parallel.mlp_chunk_tokens`,
parallel/loss_chunks.py `resolve_mlp_chunk_tokens`) and, when the tokens are tiled, that the
block's [tokens, h] accumulators (MLP output, dX; TSP's attention output over owners and its dX)
are kept in the activation dtype instead of fp32 (docs/long_context.md section 10). In fp32 the
two are the same; in bf16 each chunk's product is still accumulated in fp32 inside its matmul and
rounded once as it is added (one rounding per ring step or item instead of one at the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tsp_trainer.model.layers import gated_mlp
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


def gate_up(x: torch.Tensor, ws: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up pre-activations x W_gate^T (+ b_gate), x W_up^T (+ b_up) of one block."""
    bg, bu = (ws[3], ws[4]) if len(ws) > 3 else (None, None)
    return F.linear(x, ws[0], bg), F.linear(x, ws[1], bu)


def gated_mlp_forward_into(x2: torch.Tensor, ws: list[torch.Tensor], y2: torch.Tensor,
                           chunks: list[slice], kept: list | None = None) -> None:
    """y2[c] += gated_mlp(x2[c], block ws) chunk by chunk: x2 [n, h], y2 [n, h] (fp32 or x's
    dtype); ws = W_gate, W_up [I/D, h], W_down [h, I/D] (+ b_gate, b_up). With `kept` (a list)
    each chunk's gate/up pre-activations [chunk, I/D] are appended to it for the backward."""
    for c in chunks:
        if kept is None:
            y2[c] += gated_mlp(x2[c], *ws)
            continue
        g, u = gate_up(x2[c], ws)
        kept.append((g, u))
        y2[c] += F.linear(F.silu(g) * u, ws[2])      # = gated_mlp(x2[c], *ws), same ops


def gated_mlp_backward_into(x: torch.Tensor, dy: torch.Tensor, ws: list[torch.Tensor],
                            acc: list[torch.Tensor], dx: torch.Tensor, chunks: list[slice],
                            kept: list | None = None) -> None:
    """Backward of `gated_mlp` for one block of the intermediate dim, chunk by chunk of tokens, by
    hand so that the weight gradients are added into `acc` (fp32, e.g. views of TSP's packed
    accumulator) without a gradient tensor of their own. x, dy [n, h]; ws as in
    gated_mlp_forward_into; acc the same shapes in fp32; dx [n, h] (fp32 or x's dtype, added
    into). kept: the chunks' gate/up pre-activations, in chunk order (each released once used);
    None recomputes them from x."""
    for i, c in enumerate(chunks):
        pair = kept[i] if kept is not None else None
        if kept is not None:
            kept[i] = None                           # freed as soon as its chunk is done
        _chunk_backward_into(x[c], dy[c], ws, acc, dx[c], pair)


def _chunk_backward_into(x, dy, ws, acc, dx, gate_up_kept) -> None:
    """One chunk of gated_mlp_backward_into: x, dy, dx [c, h]; the intermediates [c, I/D]."""
    wg, wu, wd = ws[:3]
    bg = ws[3] if len(ws) > 3 else None
    g, u = gate_up_kept if gate_up_kept is not None else gate_up(x, ws)
    g, u = g.reshape(x.shape[0], -1), u.reshape(x.shape[0], -1)
    sig = torch.sigmoid(g)
    a = g * sig                                  # silu(g)
    add_matmul(acc[2], dy.t(), a * u)           # dW_down [h, I/D] = dy^T (silu(g) * u)
    dp = dy @ wd                                 # [c, I/D] gradient of silu(g) * u
    du = dp * a
    dg = dp.mul_(u).mul_(sig * (1 + g * (1 - sig)))    # silu'(g) = sig (1 + g (1 - sig))
    add_matmul(acc[0], dg.t(), x)               # dW_gate [I/D, h]
    add_matmul(acc[1], du.t(), x)               # dW_up [I/D, h]
    if bg is not None:
        acc[3].add_(dg.sum(0, dtype=torch.float32))
        acc[4].add_(du.sum(0, dtype=torch.float32))
    dx.add_(dg @ wg).add_(du @ wu)


def add_matmul(out32: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out32 += a @ b: in place in fp32 (a weight gradient written into its packed fp32
    accumulator, no gradient tensor of its own); for bf16 operands through one product in their
    dtype."""
    if a.dtype == torch.float32:
        out32.addmm_(a, b)
    else:
        out32.add_(a @ b)


__all__ = ["TokenTiling", "add_matmul", "gate_up", "gated_mlp_backward_into",
           "gated_mlp_forward_into"]
