"""Rank functions and single-process references for the evaluation parity tests (module level, so
forked ranks can run them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.tsp_cases import init_model
from tsp_trainer.eval import PasskeyTask, PositionLossAccumulator, run_passkey
from tsp_trainer.model import Transformer
from tsp_trainer.model.transformer import IGNORE_INDEX
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

SEED = 7


class LargestTensor(TorchDispatchMode):
    """Records the shapes of every tensor an op produces (to check which logits ever exist)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def reference_stats(cfg, ids, labels):
    """One process: per-token loss (0 at ignored labels) and argmax of the plain model's logits."""
    model = Transformer(cfg)
    init_model(model, SEED)
    with torch.no_grad():
        logits = model(ids).float()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                           ignore_index=IGNORE_INDEX).view(labels.shape)
    return loss, logits.argmax(-1)


def reference_passkey(cfg, task: PasskeyTask):
    """(length, depth, sample) -> argmax of the plain model at the key positions."""
    model = Transformer(cfg)
    init_model(model, SEED)
    out = {}
    with torch.no_grad():
        for length, depth in task.cells():
            for s in range(task.samples):
                sample = task.builder.build(length, depth, s)
                logits = model(sample.input_ids[None])[0]
                out[(length, depth, s)] = [int(logits[p].argmax()) for p in sample.key_positions]
    return out


def eval_rank(rank, world, cfg, scheme, options, ids, labels, task: PasskeyTask, dp_degree=1):
    """This rank's token stats (in its layout, with positions), the reduced loss buckets, the
    passkey result, and the shapes of every tensor token_stats produced."""
    mesh = build_mesh(world // dp_degree)
    model = Transformer(cfg)
    init_model(model, SEED)
    par = parallelize(model, scheme, mesh, seq_len=ids.shape[1], **options)
    # DP replica r evaluates rows r, r + dp, ... of the batch (as a DP eval loader would)
    rows = slice(mesh.dp_rank, None, dp_degree)
    local_ids, local_labels, positions = par.local_batch(ids[rows], labels[rows])
    with LargestTensor() as shapes:
        stats = par.token_stats(local_ids, local_labels, positions)
    acc = PositionLossAccumulator(ids.shape[1])
    acc.add(stats, local_labels, positions)
    buckets = acc.reduce(par.token_comms + [mesh.dp])
    passkey = run_passkey(par, task, dp=mesh.dp, micro_batch_size=2)
    return {"loss": stats.loss, "argmax": stats.argmax, "positions": positions.tensor(),
            "dp_rank": mesh.dp_rank, "buckets": buckets, "passkey": passkey, "shapes": shapes.shapes}


def masked_eval_rank(rank, world, cfg, scheme, batches, reset_positions, task: PasskeyTask, dp_degree=1):
    """The Trainer's Evaluator with data.document_masking on this rank's share of `batches`
    (host dicts with input_ids, labels, document_ids; DP replica r takes rows r, r + dp, ...):
    its loss by position, the passkey result under the same masking, and the documents every
    local_batch call of the passkey received."""
    from tsp_trainer.config import DataSection, TrainConfig
    from tsp_trainer.eval.evaluator import Evaluator

    mesh = build_mesh(world // dp_degree)
    model = Transformer(cfg)
    init_model(model, SEED)
    seq_len = batches[0]["input_ids"].shape[1]
    par = parallelize(model, scheme, mesh, seq_len=seq_len)
    train_cfg = TrainConfig(data=DataSection(seq_len=seq_len, document_masking=True,
                                             reset_positions=reset_positions))
    rows = slice(mesh.dp_rank, None, dp_degree)
    mine = [{k: v[rows] for k, v in b.items()} for b in batches]
    evaluator = Evaluator(train_cfg, par=par, mesh=mesh, device=torch.device("cpu"),
                          eval_batches=mine, passkey=task)
    buckets = evaluator.loss_by_position()
    seen, local_batch = [], par.local_batch
    par.local_batch = lambda ids, labels, documents=None: (seen.append(documents),
                                                            local_batch(ids, labels, documents))[1]
    passkey = run_passkey(par, task, dp=mesh.dp, micro_batch_size=2, masking=evaluator.masking)
    return {"buckets": buckets, "passkey": passkey, "documents": seen}


def per_document_buckets(cfg, ids, labels, lengths, *, reset_positions: bool, seq_len: int):
    """One process, each document alone (the plain model, at positions 0.. of the document under
    reset_positions, else at its positions in the row): per bucket (loss sum, valid tokens), the
    bucket being the document position under reset_positions, else the row position."""
    from tsp_trainer.eval import bucket_edges
    from tsp_trainer.model.rope import PositionRuns

    model = Transformer(cfg)
    init_model(model, SEED)
    edges = bucket_edges(seq_len)
    sums, tokens = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    with torch.no_grad():
        for row, row_lengths in enumerate(lengths):
            start = 0
            for n in row_lengths:
                first = 0 if reset_positions else start
                doc_labels = labels[row:row + 1, start:start + n]
                stats = model.token_stats(ids[row:row + 1, start:start + n], doc_labels,
                                          PositionRuns.contiguous(n, first=first))
                for t in range(n):
                    if int(doc_labels[0, t]) == IGNORE_INDEX:
                        continue
                    b = next(i for i in range(len(edges) - 1) if edges[i] <= first + t < edges[i + 1])
                    sums[b] += float(stats.loss[0, t])
                    tokens[b] += 1
                start += n
    return sums, tokens
