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
