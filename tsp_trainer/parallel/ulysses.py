"""Scheme `ulysses`: DeepSpeed-Ulysses sequence parallelism over the model-parallel axis (size D =
parallel.tsp_degree), the attention of the ALST stack.

Rank p holds the contiguous tokens p*S/D .. (p+1)*S/D - 1 of every sequence. Its weights are those
of `sp`: under DeepSpeed ZeRO-3 (the default, `sharded_weights`) sharded over the axis x dp, each
layer's gathered for its compute and its gradients reduce-scattered over the same set
(parallel/sharded_weights.py); under ZeRO 0-2 replicated over the axis, gradients summed over it
inside autograd, then over dp by ZeRO. Everything but attention is token-wise and runs on the local tokens; the
embedding, norms, MLP and LM head are the baseline blocks with T = 1 (parallel/baselines/layers.py).

| Step      | Forward op                                          | Backward op                          |
|-----------|-----------------------------------------------------|--------------------------------------|
| q, k, v   | all-to-all [B, S/D, H, d] -> [B, S, H/D, d]         | all-to-all of dq, dk, dv back        |
|           | (sequence gathered, heads scattered)                |                                      |
| attention | full causal attention of the local heads over the   | autograd through attention_core      |
|           | whole sequence (document mask of the full rows)     |                                      |
| output    | all-to-all [B, S, H/D, d] -> [B, S/D, H, d]         | all-to-all of d(output)              |

The all-to-alls are DeepSpeed's own `deepspeed.sequence.layer.DistributedAttention`, built in
tsp_trainer/engine/ulysses.py (the one package that imports DeepSpeed) and handed to the builder as
`distributed_attention(local_attention, process_group) -> attend(q, k, v, **kwargs)`. DeepSpeed
issues them on the axis' process group itself, so they are recorded in the ledger here, around the
call, by their closed form: each all-to-all moves the tensor it is given ("all_to_all" records, the
local tensor's bytes, the 1/D that stays on the rank included, as all_gather records its output).

Head chunks (parallel.ulysses_head_chunks = c, "UPipe"): the local q [B, S/D, Hq, d] and k, v are
split by heads into c groups (Hq / c query heads each, a multiple of D) and each group goes through
its own DistributedAttention call (q/k/v all-to-all, attention, output all-to-all) before the next
starts, so the full-sequence tensors [B, S, Hq / (c D), d] of one group are the only ones alive.
Under autograd a group keeps only its local inputs (`_HeadChunk`): its backward runs the group's
all-to-alls and attention forward again, then their backward, and frees them before the next
group's. Cost: that replay, one more forward's all-to-all bytes per step; without autograd
(checkpointed blocks' first forward, evaluation) the bytes are those of c = 1.

GQA: K/V heads fewer than D are repeated (each K/V head D / n_kv times, as DeepSpeed's Ulysses for
Hugging Face models does) so that every rank receives one; query head j then still meets its K/V
head j // (n_h / n_kv). With c head chunks a group of n_h / c query heads takes the n_kv / c K/V
heads they meet (or the one it shares with other groups when n_kv < c) and repeats them up to D
inside its own call: the all-to-alls then move c max(n_kv / c, D) K/V heads per layer against
max(n_kv, D) without chunks, more only when n_kv < c D.

The shape rules (config/validate.py) refuse n_h or the sequence length not divisible by D
(DistributedAttention returns wrong values there without an error), n_kv that neither divides nor
is divided by D, and chunk counts the heads do not split into (check_ulysses_head_chunks).
"""

from __future__ import annotations

from typing import Callable

import torch

from tsp_trainer.config.validate import check_ulysses_head_chunks
from tsp_trainer.model.documents import Documents
from tsp_trainer.model.layers import PositionRuns, attention_core
from tsp_trainer.model.transformer import Transformer
from tsp_trainer.parallel.baselines.apply import _check, apply_baseline, sp_groups
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.mesh import Mesh, axis_view
from tsp_trainer.parallel.parallelized import Parallelized

# (local_attention, process group) -> attend(q, k, v, **kwargs for local_attention): the engine's
# adapter around DeepSpeed's DistributedAttention (engine/ulysses.py).
DistributedAttentionFactory = Callable[[Callable, object], Callable]


class _LedgerMark(torch.autograd.Function):
    """Identity that records the all-to-all its input goes through (forward) and the one its
    gradient goes through (backward), for the ops DeepSpeed issues where Comm cannot see them."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str, grad_tag: str):
        _record(comm, tag, x)
        ctx.comm, ctx.grad_tag = comm, grad_tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        _record(ctx.comm, ctx.grad_tag, dx)
        return dx, None, None, None


def _record(comm: Comm, tag: str, x: torch.Tensor) -> None:
    comm.ledger.record("all_to_all", axis=comm.axis, tag=tag, group_size=comm.size,
                       nbytes=x.numel() * x.element_size(), dtype=str(x.dtype).removeprefix("torch."))


class _HeadChunk(torch.autograd.Function):
    """One head group's attention, `run(q, k, v)` (its all-to-alls and attention), keeping for
    backward only its local inputs q [B, S/D, Hq/c, d], k, v [B, S/D, Hkv'/c, d]: forward runs the
    group without autograd (its full-sequence tensors are freed on return); backward runs it again
    with autograd, then its backward, and the group's tensors are freed before the next group's
    backward starts."""

    @staticmethod
    def forward(ctx, run: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        ctx.save_for_backward(q, k, v)
        return run(q, k, v)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.run(*inputs)
        dq, dk, dv = torch.autograd.grad(out, inputs, dout)
        return None, dq, dk, dv


class UlyssesAttention:
    """Callable with the signature of context_attention (parallel/baselines/context.py):
    (q [B, T, Hq, d], k, v [B, T, Hkv, d] of the local contiguous tokens, q_runs, comm, documents)
    -> [B, T, Hq * d]. The local attention sees the whole sequence in order, so q_runs is not
    needed after the all-to-all and the document mask is the full rows' own. `head_chunks` c:
    the heads go through the all-to-alls and attention in c groups, one at a time (module
    docstring)."""

    def __init__(self, factory: DistributedAttentionFactory, comm: Comm, *, head_chunks: int = 1):
        self.comm = comm
        self.head_chunks = head_chunks
        self.attend = factory(self._local, comm.group)

    @staticmethod
    def _local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Documents | None = None, kernel: str = "fa2", gqa_path: str = "native") -> torch.Tensor:
        """q [B, S, Hq/D, d], k, v [B, S, Hkv', d] of every token -> [B, S, Hq/D, d] (the layout
        DistributedAttention's second all-to-all takes)."""
        out = attention_core(q, k, v, None, documents=documents, kernel=kernel, gqa_path=gqa_path)   # [B, S, Hq/D * d]
        return out.view(q.shape)

    def _group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Documents | None, kernel: str, gqa_path: str) -> torch.Tensor:
        """One group's all-to-alls and attention: local q [B, T, hq, d], k, v [B, T, hkv, d] ->
        local output [B, T, hq, d], the all-to-alls recorded in the ledger. K/V heads fewer than D
        are repeated (each D / hkv times) so that every rank receives one."""
        c = self.comm
        repeat = max(1, c.size // k.shape[2])
        if repeat > 1:                                 # [B, T, hkv, d] -> [B, T, D, d]
            k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
        q, k, v = (_LedgerMark.apply(t.contiguous(), c, f"attn.a2a.{n}", f"attn.a2a.d{n}")
                   for t, n in ((q, "q"), (k, "k"), (v, "v")))
        with c.foreign_ops("DeepSpeed DistributedAttention all-to-all"):
            out = self.attend(q, k, v, documents=documents, kernel=kernel, gqa_path=gqa_path)   # [B, T, hq, d]
        return _LedgerMark.apply(out, c, "attn.a2a.o", "attn.a2a.do")

    def _groups(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(q, k, v) of each head group: group i's Hq/c query heads i Hq/c .. and the K/V heads they
        meet (query head j meets K/V head j // (Hq / Hkv)): Hkv/c of them, or, with Hkv fewer than
        c, the one K/V head it shares with c / Hkv - 1 other groups (views of q, k, v)."""
        chunks, n_kv = self.head_chunks, k.shape[2]
        per_group = max(n_kv // chunks, 1)
        for i, qc in enumerate(q.split(q.shape[2] // chunks, dim=2)):
            first = i * n_kv // chunks
            yield qc, k.narrow(2, first, per_group), v.narrow(2, first, per_group)

    def __call__(self, q, k, v, q_runs, comm: Comm, documents: Documents | None = None,
                 kernel: str = "fa2", gqa_path: str = "native") -> torch.Tensor:
        del q_runs                                     # contiguous slices: the all-to-all orders them
        if self.head_chunks == 1:
            out = self._group(q, k, v, documents, kernel, gqa_path)                          # [B, T, Hq, d]
        else:
            def run(qc, kc, vc):
                return self._group(qc, kc, vc, documents, kernel, gqa_path)
            # under autograd each group keeps its local inputs only (_HeadChunk)
            keep_local = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            out = torch.cat([_HeadChunk.apply(run, *g) if keep_local else run(*g) for g in self._groups(q, k, v)],
                            dim=2)                                                           # [B, T, Hq, d]
        return out.reshape(out.shape[0], out.shape[1], -1)


def contiguous_layout(rank: int, degree: int):
    """(input_ids [B, S], labels [B, S]) -> rank's contiguous slice [B, S/D] of each, positions."""
    def layout(ids: torch.Tensor, labels: torch.Tensor):
        t = ids.shape[1] // degree
        part = slice(rank * t, (rank + 1) * t)
        return ids[:, part], labels[:, part], PositionRuns.contiguous(t, rank * t)
    return layout


def build_ulysses(model: Transformer, mesh: Mesh, *,
                  distributed_attention: DistributedAttentionFactory | None = None,
                  ulysses_head_chunks: int = 1, sharded_weights: bool = False,
                  **kw) -> Parallelized:
    """Ulysses over the D ranks: contiguous tokens, q/k/v/o all-to-alls by DeepSpeed's
    DistributedAttention (`distributed_attention`, engine/ulysses.py; not needed when D = 1), the
    heads in `ulysses_head_chunks` groups (parallel.ulysses_head_chunks).
    sharded_weights: DeepSpeed ZeRO-3 shards the weights over the axis x dp and reduces their
    gradients over that set, as ALST runs it; otherwise they are replicated over the axis and their
    gradients summed over it inside autograd."""
    _check(model, "ulysses", mesh, kw)
    check_ulysses_head_chunks(model.cfg, scheme="ulysses", degree=mesh.tsp.size, head_chunks=ulysses_head_chunks)
    sp = axis_view(mesh.tsp, "sp")
    attend = {}
    if sp.size > 1:
        if distributed_attention is None:
            raise ValueError(f"parallel.scheme='ulysses' with parallel.tsp_degree={sp.size} needs "
                             "DeepSpeed's DistributedAttention, which the trainer builds "
                             "(tsp_trainer/engine/ulysses.py: parallelize(..., "
                             "distributed_attention=...)); run it with tsp-train")
        attend = {"attend": UlyssesAttention(distributed_attention, sp, head_chunks=ulysses_head_chunks)}
    groups = sp_groups(mesh, sp, sharded_weights=sharded_weights, **attend)
    specs = apply_baseline(model, groups, init_seed=kw.get("init_seed"),
                           loss_chunk_tokens=kw.get("loss_chunk_tokens", "auto"),
                           mlp_chunk_tokens=kw.get("mlp_chunk_tokens", "auto"))
    axis_comms = {"sp": sp} if sp.size > 1 else {"tp": groups.tp}
    token_comms = [sp] if sp.size > 1 else []
    info = {"tp_degree": 1, "sp_degree": sp.size, "sequence_parallel": False}
    return Parallelized(model, specs, "ulysses", mesh, token_comms, axis_comms,
                        contiguous_layout(sp.rank, sp.size), info)
