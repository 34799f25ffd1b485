"""Megatron-style autograd functions for the TP, TP+SP and TP x SP baselines: the weights stay with
their owners and the activations move (the opposite of TSP). All communication goes through `Comm`;
nothing here imports parallel/tsp. On a group of size 1 every function is the identity.
Activations are [B, T, h]; the sequence (dim 1) is split in contiguous blocks, block i on rank i.

| Function                     | Forward op                          | Backward op                     |
|------------------------------|-------------------------------------|---------------------------------|
| copy_to_region               | identity                            | all-reduce (sum)                |
| copy_weight_to_region        | identity                            | all-reduce (sum, fp32) of a     |
|                              |                                     | replicated weight's gradient    |
| reduce_from_region           | all-reduce (sum)                    | identity                        |
| gather_from_sequence         | all-gather along the sequence       | reduce-scatter                  |
| reduce_scatter_to_sequence   | reduce-scatter along the sequence   | all-gather                      |
| vocab_parallel_cross_entropy | all-reduce max, target, sum-exp     | none (softmax - onehot, local)  |
| tiled_vocab_parallel_loss    | the same, tokens in chunks          | none (logits recomputed)        |
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.grad_sync import SumGradOverGroup
from tsp_trainer.parallel.loss_chunks import in_vocab_shard, mask_vocab_padding, token_chunks


class _ReduceFromRegion(torch.autograd.Function):
    """Leave a TP region (after row-parallel matmuls). Forward: all-reduce (sum) of the partial
    outputs over `comm`. Backward: identity (every rank already holds the full gradient)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        out = x.clone()
        comm.all_reduce(out, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromSequence(torch.autograd.Function):
    """Enter a TP region from a sequence-parallel one (Megatron SP). Forward: all-gather the
    [B, T/D, h] blocks along the sequence -> [B, T, h]. Backward: reduce-scatter along the sequence
    (each rank's partial dX of all tokens is summed and returned to the token owner)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return _all_gather_seq(x, comm, tag)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comm, ctx.tag), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Leave a TP region into a sequence-parallel one (Megatron SP). Forward: reduce-scatter the
    partial [B, T, h] outputs along the sequence -> this rank's summed [B, T/D, h] block.
    Backward: all-gather the gradient blocks along the sequence."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return _reduce_scatter_seq(x, comm, tag)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.comm, ctx.tag), None, None


def copy_to_region(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    return x if comm.size == 1 else SumGradOverGroup.apply(x, comm, tag)


def copy_weight_to_region(w: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    """A weight replicated over `comm` whose ranks see different tokens: its gradient is summed
    over the group in fp32."""
    return w if comm.size == 1 else SumGradOverGroup.apply(w, comm, tag, True)


def reduce_from_region(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm, tag)


def gather_from_sequence(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    return x if comm.size == 1 else _GatherFromSequence.apply(x, comm, tag)


def reduce_scatter_to_sequence(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceScatterToSequence.apply(x, comm, tag)


def _all_gather_seq(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    # Comm.all_gather concatenates along dim 0, so gather [T/D, B, h] and move the sequence back.
    xt = x.transpose(0, 1).contiguous()                     # [T/D, B, h]; a view when B == 1
    out = xt.new_empty((comm.size * xt.shape[0],) + xt.shape[1:])
    comm.all_gather(out, xt, tag=tag)
    return out.transpose(0, 1).contiguous()                 # [B, T, h]


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    xt = x.transpose(0, 1).contiguous()                     # [T, B, h]
    if xt.shape[0] % comm.size:
        raise ValueError(f"sequence of {xt.shape[0]} tokens does not split over the {comm.axis} "
                         f"group of {comm.size} ranks (Megatron sequence parallelism)")
    out = xt.new_empty((xt.shape[0] // comm.size,) + xt.shape[1:])
    comm.reduce_scatter(out, xt, tag=tag)
    return out.transpose(0, 1).contiguous()                 # [B, T/D, h]


def vocab_parallel_lookup(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """This rank's part of the embedding of `ids` [B, T] with the rows vocab_start.. it holds
    ([V/D, h]): the row for ids in the shard, zeros elsewhere. The caller sums the parts over the
    group (reduce_from_region or reduce_scatter_to_sequence). Backward: the rows' gradient, local."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Token losses from vocab-sharded logits [B, T, V/D] (Megatron). Forward: three all-reduces
    over `comm` of [B, T] fp32 tensors: max (for stability), the target logit (held by one rank)
    and the sum of exponentials; loss = log(sum_exp) - target. Backward: no communication; the
    local block of (softmax - onehot) x dloss. The saved softmax is reused in place, so the graph
    cannot be backpropagated twice (as in Megatron)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start: int, comm: Comm, tag: str):
        # The logits are a temporary of the LM head: work on them in place (fp32), as Megatron does.
        x = logits.float() if logits.dtype != torch.float32 else logits.detach()
        row_max = x.max(dim=-1).values
        comm.all_reduce(row_max, op=dist.ReduceOp.MAX, tag=tag)
        x.sub_(row_max.unsqueeze(-1))
        local = labels - vocab_start
        hit = (local >= 0) & (local < x.shape[-1])
        safe = local.masked_fill(~hit, 0)
        target = x.gather(-1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(~hit, 0.0)
        comm.all_reduce(target, tag=tag)
        x.exp_()
        sum_exp = x.sum(dim=-1)
        comm.all_reduce(sum_exp, tag=tag)
        x.div_(sum_exp.unsqueeze(-1))                       # x is now the local softmax block
        ctx.save_for_backward(x, safe, hit)
        ctx.in_dtype = logits.dtype
        return torch.log(sum_exp) - target

    @staticmethod
    def backward(ctx, dloss):
        softmax, safe, hit = ctx.saved_tensors
        grad = softmax                                      # reused in place (see docstring)
        grad.scatter_add_(-1, safe.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_(dloss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, vocab_start: int,
                                 comm: Comm, tag: str = "head.ce") -> torch.Tensor:
    """Per-token cross-entropy [B, T] (fp32) of vocab-sharded logits; ignored labels (outside
    every shard, e.g. -100) get log(sum_exp): mask them in the caller."""
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, comm, tag)


class _TiledVocabParallelLoss(torch.autograd.Function):
    """Token losses of x [B, T, h] against the vocab shard w [V/D, h], the tokens taken `chunk` at a
    time so that no [B T, V/D] block exists (parallel/loss_chunks.py). Forward: per chunk the fp32
    logits [chunk, V/D], this shard's log-sum-exp and target logit; then the three all-reduces
    of _VocabParallelCrossEntropy, the same [B, T] fp32 tensors (the max of the shards' log-sum-exps,
    the sum of exp(lse_shard - max), the target), so tiling moves no extra bytes and issues no
    extra collective. Backward: no communication; per chunk the logits are recomputed and
    (softmax - onehot) x dloss gives that chunk's dX and is added to the fp32 weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, labels, vocab_start: int, comm: Comm, chunk: int, tag: str,
                vocab_size: int | None = None):
        flat = x.reshape(-1, x.shape[-1])                        # [B T, h]
        local, hit = in_vocab_shard(labels.reshape(-1), vocab_start, weight.shape[0])
        shard_lse = flat.new_empty(flat.shape[0], dtype=torch.float32)
        target = flat.new_zeros(flat.shape[0], dtype=torch.float32)
        for c in token_chunks(flat.shape[0], chunk):
            logits = mask_vocab_padding((flat[c] @ weight.T).float(), vocab_start, vocab_size)  # [chunk, V/D]
            target[c] = logits.gather(1, local[c, None]).squeeze(1).masked_fill_(~hit[c], 0.0)
            shard_lse[c] = torch.logsumexp(logits, dim=-1)
        top = shard_lse.clone()
        comm.all_reduce(top, op=dist.ReduceOp.MAX, tag=tag)
        comm.all_reduce(target, tag=tag)
        sum_exp = (shard_lse - top).exp_()
        comm.all_reduce(sum_exp, tag=tag)
        lse = top + torch.log(sum_exp)                           # [B T], over the whole vocabulary
        ctx.save_for_backward(x, weight, local, hit, lse)
        ctx.chunk, ctx.vocab_start, ctx.vocab_size = chunk, vocab_start, vocab_size
        return (lse - target).view(labels.shape)

    @staticmethod
    def backward(ctx, dloss):
        x, weight, local, hit, lse = ctx.saved_tensors
        flat, scale = x.reshape(-1, x.shape[-1]), dloss.reshape(-1)
        dx = torch.empty_like(flat)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for c in token_chunks(flat.shape[0], ctx.chunk):
            grad = mask_vocab_padding((flat[c] @ weight.T).float(), ctx.vocab_start, ctx.vocab_size)
            grad = grad.sub_(lse[c, None]).exp_()                              # softmax block
            grad.scatter_add_(1, local[c, None], -hit[c, None].float())        # - onehot
            grad = grad.mul_(scale[c, None]).to(weight.dtype)
            dx[c] = grad @ weight                                # each chunk's rows once: no sum
            dw.add_(grad.T @ flat[c])                            # summed over chunks in fp32
        return dx.view(x.shape), dw.to(weight.dtype), None, None, None, None, None, None


def tiled_vocab_parallel_loss(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                              vocab_start: int, comm: Comm, chunk: int,
                              tag: str = "head.ce", vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy [B, T] (fp32) of the LM head x @ weight.T with vocab-sharded weight
    [V/D, h], `chunk` tokens at a time; ignored labels get the log-sum-exp: mask them in the caller.
    vocab_size: rows at or past it are padding (-inf logits)."""
    return _TiledVocabParallelLoss.apply(x, weight, labels, vocab_start, comm, chunk, tag, vocab_size)


def vocab_parallel_argmax(logits: torch.Tensor, *, vocab_start: int, comm: Comm,
                          tag: str = "head.argmax") -> torch.Tensor:
    """The most likely token [B, T] (int64, whole-vocabulary index) from vocab-sharded logits
    [B, T, V/T], as torch.argmax of the full logits gives it: the largest value by an all-reduce
    max, then the smallest index among the shards that hold it by an all-reduce min (the first
    index on ties). Forward only (evaluation)."""
    local_max, local_idx = logits.float().max(dim=-1)
    best = local_max.clone()
    comm.all_reduce(best, op=dist.ReduceOp.MAX, tag=tag)
    none = torch.iinfo(torch.long).max                  # this shard does not hold the maximum
    index = torch.where(local_max == best, local_idx + vocab_start, torch.full_like(local_idx, none))
    comm.all_reduce(index, op=dist.ReduceOp.MIN, tag=tag)
    return index
