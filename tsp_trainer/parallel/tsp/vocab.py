"""TSP embedding and LM head + loss: each rank holds V/D vocabulary rows; the vocab shards pass
around the ring (tsp/ring.py), so full-vocabulary logits of all tokens never exist on one rank.

The head folds each [chunk, V/D] block of logits into an online log-sum-exp (chunks:
parallel/loss_chunks.py) and its backward recomputes them; weight gradients are summed in fp32
and travel home in fp32 accumulators; dX is summed over the shards in fp32 while the loss is not
tiled and in the activations' dtype once it is (`dx_accumulator_dtype`: no fp32 [N/D, h]; what
bf16 sums in fp32: docs/long_context/tiled_loss.md). No op's shape depends on the values of ids
or labels: tokens outside the shard in hand are masked arithmetically (no host sync). Schedule:
docs/parallelism.md, "TSP rings".
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tsp_trainer.model.transformer import IGNORE_INDEX, TokenStats
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.loss_chunks import (in_vocab_shard, mask_vocab_padding, resolve_loss_chunk_tokens,
                                              token_chunks)
from tsp_trainer.parallel.tsp.ring import pack, ring_backward, ring_forward


class TSPEmbedding(nn.Module):
    """Vocab-sharded lookup. Its backward takes the tokens in the loss's chunks
    (`loss_chunk_tokens`, `loss_budget_bytes`: the LM head's setting, resolved against the same
    shard): with more than one chunk a bf16 incoming gradient is cast to fp32 a chunk at a time."""

    def __init__(self, weight: torch.Tensor | nn.Parameter, *, comm: Comm, vocab_size: int,
                 loss_chunk_tokens: int | str = "auto", loss_budget_bytes: int | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.comm, self.vocab_size = comm, vocab_size
        self.loss_chunk_tokens, self.loss_budget_bytes = loss_chunk_tokens, loss_budget_bytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        chunk = resolve_loss_chunk_tokens(self.loss_chunk_tokens, ids.numel(), self.weight.shape[0],
                                          self.loss_budget_bytes)
        return _EmbeddingFn.apply(ids, self.weight, self.comm, chunk)


class TSPLMHead(nn.Module):
    """Vocab-sharded output projection; `loss_sum` is the training path, `forward` (full logits of
    the local tokens, assembled over the ring, no autograd) serves evaluation and parity tests.
    `loss_chunk_tokens` ("auto" or a token count) and `loss_budget_bytes` (the bound "auto" keeps
    the fp32 logits block under; None: parallel/loss_chunks.py's default) set the tiling."""

    def __init__(self, weight: torch.Tensor | nn.Parameter, *, comm: Comm, vocab_size: int,
                 loss_chunk_tokens: int | str = "auto", loss_budget_bytes: int | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.comm, self.vocab_size = comm, vocab_size
        self.loss_chunk_tokens, self.loss_budget_bytes = loss_chunk_tokens, loss_budget_bytes

    def chunk_tokens(self, local_tokens: int) -> int:
        """Tokens per chunk of the loss for `local_tokens` local tokens."""
        return resolve_loss_chunk_tokens(self.loss_chunk_tokens, local_tokens, self.weight.shape[0],
                                         self.loss_budget_bytes)

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor):
        count = (labels != IGNORE_INDEX).sum()
        chunk = self.chunk_tokens(labels.numel())
        return _HeadLossFn.apply(hidden, self.weight, labels, self.comm, chunk, self.vocab_size), count

    @torch.no_grad()
    def token_stats(self, hidden: torch.Tensor, labels: torch.Tensor) -> TokenStats:
        """Loss and argmax [B, T/D] of the local tokens (forward only, no autograd)."""
        flat_labels = labels.reshape(-1)
        lse, target, best = _vocab_ring_lse(hidden.reshape(-1, hidden.shape[-1]), self.weight,
                                            flat_labels, self.comm,
                                            self.chunk_tokens(flat_labels.numel()), with_argmax=True,
                                            vocab_size=self.vocab_size)
        loss = (lse - target) * (flat_labels != IGNORE_INDEX)
        return TokenStats(loss.view(labels.shape), best.view(labels.shape))

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        logits = hidden.new_empty(hidden.shape[:-1] + (rows * self.comm.size,))

        def step(j: int, w: torch.Tensor) -> None:
            logits[..., j * rows:(j + 1) * rows] = hidden @ w.view(rows, -1).T

        ring_forward(self.comm, pack(self.weight), step, tag="head.weights")
        return logits[..., :self.vocab_size]                  # the padding rows' columns cut off


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, comm: Comm, chunk: int | None = None):
        rows, h = weight.shape
        out = weight.new_zeros(ids.shape + (h,))

        def step(j: int, flat: torch.Tensor) -> None:
            # each token hits exactly one shard: add its row there, zeros elsewhere (exact)
            index, hit = _in_shard(ids, j, rows)
            out.add_(F.embedding(index, flat.view(rows, h)).masked_fill_(~hit[..., None], 0))

        ring_forward(comm, pack(weight), step, tag="embed.weights")
        ctx.save_for_backward(ids)
        ctx.comm, ctx.shape, ctx.dtype = comm, weight.shape, weight.dtype
        ctx.chunk = ids.numel() if chunk is None else chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        (ids,) = ctx.saved_tensors
        rows, h = ctx.shape
        dout = dout.reshape(-1, h)
        chunks = token_chunks(dout.shape[0], ctx.chunk)
        # fp32 once for all tokens ([N/D, h]; fp32 dout is itself), unless the loss is tiled and
        # dout is not fp32: then a chunk at a time, in every ring step
        whole = dout.float() if len(chunks) == 1 or dout.dtype == torch.float32 else None

        def grad_step(j: int, _flat: torch.Tensor) -> torch.Tensor:
            # rows of shard j summed in fp32; tokens of other shards go to a padding row (rows),
            # which embedding_dense_backward skips, and which is dropped (no atomics on a sink)
            index, hit = _in_shard(ids, j, rows)
            sink = torch.where(hit, index, rows).reshape(-1)
            if whole is not None:
                g = torch.ops.aten.embedding_dense_backward(whole, sink, rows + 1, rows, False)
            else:                                             # [rows + 1, h] fp32, over chunks
                g = None
                for c in chunks:
                    part = torch.ops.aten.embedding_dense_backward(dout[c].float(), sink[c], rows + 1,
                                                                   rows, False)
                    g = part if g is None else g.add_(part)
            return g[:rows].reshape(-1)

        # The lookup's gradient does not need the weights: only the (fp32) accumulators travel.
        full = ring_backward(ctx.comm, None, grad_step, tag="embed.weights")
        return None, full.view(rows, h).to(ctx.dtype), None, None


def _in_shard(ids: torch.Tensor, shard: int, rows: int):
    """(ids - shard * rows clamped into the shard, mask of ids that fall in vocab shard `shard`)."""
    return in_vocab_shard(ids, shard * rows, rows)


def _vocab_ring_lse(x: torch.Tensor, weight: torch.Tensor, flat_labels: torch.Tensor, comm: Comm,
                    chunk: int, *, with_argmax: bool = False, vocab_size: int | None = None):
    """One pass of the vocab shards around the ring for the local tokens x [N/D, h]:
    (log-sum-exp [N/D] fp32, target logit [N/D] fp32, argmax [N/D] int64 or None). Each step takes
    the tokens `chunk` at a time and sees one [chunk, V/D] block of logits at a time; the argmax
    keeps the first index of the largest logit, as torch.argmax does, whatever order the shards
    arrive in. No boolean selection (no host sync)."""
    rows = weight.shape[0]
    run_max = torch.full((x.shape[0],), float("-inf"), device=x.device)
    run_sum = torch.zeros(x.shape[0], device=x.device)
    target = torch.zeros(x.shape[0], device=x.device)
    best = torch.zeros(x.shape[0], dtype=torch.long, device=x.device) if with_argmax else None
    chunks = token_chunks(x.shape[0], chunk)

    def step(j: int, w: torch.Tensor) -> None:
        w = w.view(rows, -1)
        for c in chunks:                                        # the shard serves every chunk
            logits = mask_vocab_padding((x[c] @ w.T).float(), j * rows, vocab_size)   # [chunk, V/D]
            block_max, block_idx = logits.max(dim=-1)
            if best is not None:
                # Shards arrive in ring order (p, p-1, ...): on a tie the lower vocabulary index wins.
                idx = block_idx + j * rows
                better = (block_max > run_max[c]) | ((block_max == run_max[c]) & (idx < best[c]))
                best[c] = torch.where(better, idx, best[c])
            index, hit = _in_shard(flat_labels[c], j, rows)
            target[c] += logits.gather(1, index[:, None]).squeeze(1).masked_fill_(~hit, 0.0)
            new_max = torch.maximum(run_max[c], block_max)
            # in place on the block (the logits are not needed after this): no second block
            run_sum[c] = (run_sum[c] * torch.exp(run_max[c] - new_max)
                          + logits.sub_(new_max[:, None]).exp_().sum(-1))
            run_max[c] = new_max

    ring_forward(comm, pack(weight), step, tag="head.weights")
    return run_max + torch.log(run_sum), target, best


class _HeadLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, comm: Comm, chunk: int, vocab_size: int | None = None):
        x = hidden.reshape(-1, hidden.shape[-1])                    # [N/D, h]
        flat_labels = labels.reshape(-1)
        lse, target, _ = _vocab_ring_lse(x, weight, flat_labels, comm, chunk, vocab_size=vocab_size)
        valid = flat_labels != IGNORE_INDEX
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.comm, ctx.chunk, ctx.vocab_size = comm, chunk, vocab_size
        return ((lse - target) * valid).sum()

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, labels, lse = ctx.saved_tensors
        rows = weight.shape[0]
        x = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        scale = (flat_labels != IGNORE_INDEX).float() * dloss        # d loss / d token loss
        chunks = token_chunks(x.shape[0], ctx.chunk)
        dx = torch.zeros(x.shape, dtype=dx_accumulator_dtype(x.dtype, len(chunks)), device=x.device)

        def grad_step(j: int, w: torch.Tensor) -> torch.Tensor:
            w = w.view(rows, -1)
            dw = None                                               # [V/D, h] fp32, over chunks
            for c in chunks:                                        # the shard serves every chunk
                dlogits = mask_vocab_padding((x[c] @ w.T).float(), j * rows, ctx.vocab_size)
                dlogits = dlogits.sub_(lse[c, None]).exp_()                # softmax [chunk, V/D]
                index, hit = _in_shard(flat_labels[c], j, rows)
                dlogits.scatter_add_(1, index[:, None], -hit.float()[:, None])   # - onehot
                dlogits = dlogits.mul_(scale[c, None]).to(w.dtype)  # matmuls in the weights' dtype
                _add_dx(dx[c], dlogits, w)                          # summed over shards
                dw = _add_product(dw, dlogits.T, x[c])
            return dw.reshape(-1)                                   # fp32 ring accumulator

        full = ring_backward(ctx.comm, pack(weight), grad_step, tag="head.weights")
        return (dx.to(hidden.dtype).view(hidden.shape), full.view(weight.shape).to(weight.dtype),
                None, None, None, None)


def dx_accumulator_dtype(dtype: torch.dtype, chunks: int) -> torch.dtype:
    """The dtype of the head's dX [N/D, h], summed over the D vocab shards: fp32 while the loss
    takes all local tokens at once (one chunk: the [N/D, V/D] fp32 logits block dwarfs it), the
    activations' `dtype` once they are tiled, so that no fp32 [N/D, h] exists (bf16: each shard's
    chunk product is summed in fp32 inside its GEMM and added to the chunk's rows with one rounding;
    fp32: the same as untiled)."""
    return dtype if chunks > 1 else torch.float32


def _add_dx(dx: torch.Tensor, dlogits: torch.Tensor, w: torch.Tensor) -> None:
    """dx [c, h] += dlogits [c, V/D] @ w [V/D, h]. Into an fp32 accumulator: the product, then
    added (for bf16 operands the product is rounded once, summed in fp32 across shards). Into a
    bf16 one of the operands' dtype: one GEMM that sums the product in fp32 and adds it to dx
    before rounding once (addmm_, no [c, h] product tensor)."""
    if dx.dtype != torch.float32 and dlogits.dtype == w.dtype == dx.dtype:
        dx.addmm_(dlogits, w)
    else:
        dx += dlogits @ w


def _add_product(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b in fp32 (acc None: a @ b in fp32): the product in the weights' dtype, then
    added (one product-sized temporary per chunk)."""
    return (a @ b).float() if acc is None else acc.add_(a @ b)
