"""RMSNorm as one autograd function: y = (x * rstd).to(x.dtype) * w, rstd = rsqrt(mean(x^2) + eps).

Why: autograd over the plain expression keeps an fp32 copy of x and the normalised input, its
forward holds two fp32 [tokens, h] temporaries and a bf16 cast (5x x in bf16) at once, and
its backward about five fp32 [tokens, h] temporaries at once. This function saves x and rstd
[tokens, 1] only, and its forward and backward walk the tokens in chunks of at most
`CHUNK_BYTES` of fp32, so the forward's transient is y plus two fp32 chunks and the
backward's dx plus two fp32 chunks whatever the sequence length (at millions of tokens a
one-pass forward would be the peak of a checkpointed block's replay). The forward is bit-identical
to the plain expression (every step is per token); the backward's closed form
dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, equals autograd's to fp32 rounding, and dw is
accumulated in fp32 across chunks (tests/unit/test_rms_norm.py). Shapes: x [..., h], w [h].

On CUDA `rms_norm` takes torch's fused kernel (F.rms_norm) instead: one kernel each way, which
saves the same x and rstd and holds no fp32 temporary, and runs a 128K-token rank's norm
([16,384, 4,096] bf16, forward + backward) about 7x faster than this function's chunk loop
(experiments/gqa_native_cost.py, docs/results/gqa_native_cost.json). It scales by w in fp32 before
its one cast, where this function casts first: the two differ by bf16 rounding (tests/gpu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# fp32 bytes of one forward or backward chunk [c, h]: 32 MiB keeps the Python loop to a few iterations per
# norm on a GPU at 7B shapes (h 4096: 2,048 tokens per chunk) and one iteration in the CPU tests.
CHUNK_BYTES = 32 * 2 ** 20


def chunk_rows(hidden: int) -> int:
    """Tokens per forward or backward chunk for a hidden size (the planner prices two fp32 chunks)."""
    return max(1, CHUNK_BYTES // (4 * hidden))


class RmsNormFn(torch.autograd.Function):
    """Forward: y = (x * rstd).to(x.dtype) * w, chunked over tokens, at most two fp32 [chunk, h]
    temporaries besides y. Saves x and rstd only. Backward: chunked over tokens, at most two fp32
    [chunk, h] temporaries besides dx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.shape[-1]
        x2 = x.reshape(-1, h)                                        # [n, h]
        y = x2.new_empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
        rstd = x2.new_empty((x2.shape[0], 1), dtype=torch.float32)   # [n, 1]
        rows = chunk_rows(h)
        # per token, so chunks give the same values as one pass; one pass would hold an fp32
        # [n, h] copy of x, the fp32 normalised x and its cast at once (5x x in bf16)
        for start in range(0, x2.shape[0], rows):
            stop = start + rows
            _chunk_forward(x2[start:stop], weight, eps, y[start:stop], rstd[start:stop])
        rstd = rstd.view(x.shape[:-1] + (1,))
        ctx.save_for_backward(x, rstd, weight)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h = x.shape[-1]
        x2, dy2, r2 = x.reshape(-1, h), dy.reshape(-1, h), rstd.reshape(-1, 1)   # [n, h], [n, 1]
        dx = torch.empty_like(x2) if need_dx else None
        dw = torch.zeros(h, dtype=torch.float32, device=x.device) if need_dw else None
        rows = chunk_rows(h)
        for start in range(0, x2.shape[0], rows):
            stop = start + rows
            _chunk_backward(x2[start:stop], dy2[start:stop], r2[start:stop], weight,
                            None if dx is None else dx[start:stop], dw)
        return (None if dx is None else dx.view_as(x),
                None if dw is None else dw.to(weight.dtype), None)


def _chunk_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, y_out: torch.Tensor,
                   rstd_out: torch.Tensor) -> None:
    """One chunk of tokens: x [c, h]; writes y_out [c, h] and rstd_out [c, 1]."""
    x32 = x.float()                                              # [c, h] (x itself in fp32)
    torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps, out=rstd_out)
    torch.mul((x32 * rstd_out).to(x.dtype), weight, out=y_out)


def _chunk_backward(x: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                    dx_out: torch.Tensor | None, dw_acc: torch.Tensor | None) -> None:
    """One chunk of tokens: x, dy [c, h]; rstd [c, 1]; writes dx_out [c, h], adds into dw_acc [h]."""
    xhat = x.float() * rstd                         # [c, h] fp32 (x.float() of fp32 x is x: no copy)
    if dw_acc is not None:
        # the gradient of `normed.to(x.dtype) * w` with respect to w, in y's dtype as autograd
        # computes it, summed over the chunk's tokens in fp32
        dw_acc += (dy * xhat.to(x.dtype)).sum(0, dtype=torch.float32)
    if dx_out is None:
        return
    g = (dy * weight).float()                       # [c, h] fp32: d(normed), as autograd casts it
    # mean over h of g * xhat per token as a batched dot product: [c, 1, h] @ [c, h, 1] -> [c, 1, 1]
    # (no third [c, h] temporary)
    dot = torch.matmul(g.unsqueeze(-2), xhat.unsqueeze(-1)).squeeze(-1) / x.shape[-1]   # [c, 1]
    g.sub_(xhat.mul_(dot)).mul_(rstd)               # rstd * (g - xhat * mean(g * xhat))
    dx_out.copy_(g)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = rms_norm(x) * weight: torch's fused kernel on CUDA (module docstring), RmsNormFn elsewhere."""
    if x.is_cuda and x.dtype == weight.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return RmsNormFn.apply(x, weight, eps)


def rms_norm_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd [n, 1] fp32 of x [n, h], as RmsNormFn's forward computes it (chunked: two fp32
    [chunk, h] temporaries at most)."""
    rstd = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    rows = chunk_rows(x.shape[-1])
    for start in range(0, x.shape[0], rows):
        x32 = x[start:start + rows].float()
        torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps, out=rstd[start:start + rows])
    return rstd


def rms_norm_apply(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm`'s output for rows x [c, h], bit for bit, for a caller that kept their rstd [c, 1]:
    on CUDA torch's fused kernel, as `rms_norm` (one kernel, rstd recomputed inside it); elsewhere
    y = (x * rstd).to(x.dtype) * w from the kept rstd, written chunk by chunk into y, so besides y
    the temporaries are two fp32 [chunk_rows, h] at most."""
    if x.is_cuda and x.dtype == weight.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    rows = chunk_rows(x.shape[-1])
    for start in range(0, x.shape[0], rows):
        c = slice(start, start + rows)
        torch.mul((x[c].float() * rstd[c]).to(x.dtype), weight, out=y[c])
    return y


def rms_norm_backward_in_place(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                               grad: torch.Tensor) -> torch.Tensor:
    """RmsNormFn's backward for x [n, h] with rstd [n, 1]: `grad` [n, h] holds the gradient at the
    norm's output and is overwritten, chunk by chunk, with the gradient at its input (no second
    [n, h]). Returns dw [h] fp32, this input's part."""
    dw = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
    rows = chunk_rows(x.shape[-1])
    for start in range(0, x.shape[0], rows):
        c = slice(start, start + rows)
        # each chunk reads its dy before it writes its dx (g is a new tensor until the last copy)
        _chunk_backward(x[c], grad[c], rstd[c], weight, grad[c], dw)
    return dw


def rms_norm_grads(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of y = rms_norm(x, weight, eps) for the incoming gradient dy, by RmsNormFn's
    backward (the same chunks and closed form): for a caller whose backward is written by hand
    (TSP attention's per-head q/k norms). x, dy [..., h]; dx like x; dw [h] fp32, this input's part."""
    h = x.shape[-1]
    x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
    rstd = torch.rsqrt(x2.float().pow(2).mean(-1, keepdim=True) + eps)        # [n, 1], as forward
    dx = torch.empty_like(x2)
    dw = torch.zeros(h, dtype=torch.float32, device=x.device)
    rows = chunk_rows(h)
    for start in range(0, x2.shape[0], rows):
        stop = start + rows
        _chunk_backward(x2[start:stop], dy2[start:stop], rstd[start:stop], weight, dx[start:stop], dw)
    return dx.view(x.shape), dw
