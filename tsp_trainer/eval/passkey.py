"""Passkey retrieval under the training layout: for each (length, depth) cell, `samples` haystacks
(haystack.py) run through the parallel model's forward (TSP or a baseline, no backward) and are
scored teacher-forced on the key's tokens:

    accuracy        share of haystacks whose every key token is the argmax (exact retrieval)
    token_accuracy  share of key tokens that are the argmax
    key_nll         mean cross-entropy of the key tokens (nats/token): moves before accuracy does

No rank holds full-vocabulary logits of all tokens: the LM head reduces the vocabulary itself
(Parallelized.token_stats). Each rank then holds the argmax and loss of its own tokens (zigzag
under TSP and SP); the few positions of the key are put together over the groups that split a
replica's tokens (all-reduce max of the predictions, sum of the losses), and the per-cell counts
are summed over dp at the end (one all-reduce, on the compute device: NCCL serves no host
tensor). Sample s of every cell runs on DP replica s mod dp. With document masking a haystack goes
to `local_batch` with its documents as a training batch does (documents.py: one document, as it
holds no EOS).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tsp_trainer.eval.documents import DocumentMasking, batch_documents
from tsp_trainer.eval.haystack import HaystackBuilder, Sample
from tsp_trainer.model.rope import PositionRuns
from tsp_trainer.model.transformer import IGNORE_INDEX
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.schemes import Parallelized


@dataclass(frozen=True)
class PasskeyTask:
    """The cells (lengths x depths) and how many haystacks each has."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    samples: int
    builder: HaystackBuilder

    def __post_init__(self):
        need = self.builder.min_length(self.samples)
        short = [n for n in self.lengths if n < need]
        if short:
            raise ValueError(f"passkey length {short[0]} is shorter than the haystack's fixed text "
                             f"({need} tokens with {self.builder.digits}-digit keys and this "
                             f"tokenizer); use lengths >= {need}")

    def cells(self) -> list[tuple[int, float]]:
        return list(itertools.product(self.lengths, self.depths))


@dataclass(frozen=True)
class PasskeyCell:
    length: int
    depth: float
    samples: int
    exact: int                  # haystacks with every key token right
    tokens_right: int
    key_tokens: int
    nll_sum: float

    @property
    def accuracy(self) -> float:
        return self.exact / self.samples if self.samples else float("nan")

    @property
    def token_accuracy(self) -> float:
        return self.tokens_right / self.key_tokens if self.key_tokens else float("nan")

    @property
    def key_nll(self) -> float:
        return self.nll_sum / self.key_tokens if self.key_tokens else float("nan")


@dataclass
class PasskeyResult:
    cells: list[PasskeyCell]
    # (length, depth, sample) -> predicted key tokens, for the samples this DP replica ran
    predictions: dict[tuple[int, float, int], list[int]] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        """Mean over cells of the exact-retrieval accuracy."""
        return sum(c.accuracy for c in self.cells) / len(self.cells)

    def cell(self, length: int, depth: float) -> PasskeyCell:
        return next(c for c in self.cells if c.length == length and c.depth == depth)

    def rows(self) -> list[tuple]:
        """(length, depth, accuracy, token_accuracy, key_nll, samples) per cell."""
        return [(c.length, c.depth, c.accuracy, c.token_accuracy, c.key_nll, c.samples)
                for c in self.cells]


def replica_jobs(task: PasskeyTask, length: int, *, dp_rank: int, dp_size: int) -> list[tuple[int, float, int]]:
    """(cell index, depth, sample) of the haystacks of `length` that DP replica `dp_rank` runs."""
    return [(i, depth, s) for i, (n, depth) in enumerate(task.cells()) if n == length
            for s in range(task.samples) if s % dp_size == dp_rank]


def replica_haystacks(task: PasskeyTask, *, dp_rank: int, dp_size: int) -> int:
    """How many haystacks DP replica `dp_rank` runs (a progress bar's total)."""
    return sum(len(replica_jobs(task, n, dp_rank=dp_rank, dp_size=dp_size)) for n in task.lengths)


@torch.no_grad()
def run_passkey(par: Parallelized, task: PasskeyTask, *, dp: Comm, micro_batch_size: int = 1,
                device: torch.device | str = "cpu", masking: DocumentMasking | None = None,
                progress=None) -> PasskeyResult:
    """Score every cell on this replica's share of the samples, then sum over `dp`. `device`: the
    model's; `progress.update(n)` after each forward of n haystacks when given. Collective over
    the model-parallel groups (every forward) and dp (once at the end): every rank calls it."""
    cells = task.cells()
    counts = [[0.0] * 5 for _ in cells]             # per cell: samples, exact, right, tokens, nll
    predictions = {}
    for length in task.lengths:
        jobs = replica_jobs(task, length, dp_rank=dp.rank, dp_size=dp.size)
        for start in range(0, len(jobs), micro_batch_size):
            batch = jobs[start:start + micro_batch_size]
            samples = [task.builder.build(length, depth, s) for _, depth, s in batch]
            preds, scores = _score(par, samples, device, masking)
            for (i, depth, s), pred, score in zip(batch, preds, scores):
                counts[i] = [a + b for a, b in zip(counts[i], (1.0, *score))]
                predictions[(length, depth, s)] = pred
            if progress is not None:
                progress.update(len(batch))
    total = torch.tensor(counts, dtype=torch.float64, device=device)    # [cells, 5], for NCCL
    dp.all_reduce(total, tag="eval.passkey")
    return PasskeyResult([PasskeyCell(n, depth, int(c[0]), int(c[1]), int(c[2]), int(c[3]), float(c[4]))
                          for (n, depth), c in zip(cells, total.tolist())], predictions)


def _window(runs: PositionRuns | torch.Tensor, start: int, stop: int) -> tuple[list[int], list[int]]:
    """(indices among this rank's tokens, offsets from `start`) of the tokens at global positions
    start .. stop - 1 that this rank holds, from the layout's runs of positions."""
    runs = runs if isinstance(runs, PositionRuns) else PositionRuns.of(runs)
    local, cols = [], []
    for begin, end, first in runs.query_runs():      # tokens begin..end-1 hold first, first+1, ...
        for p in range(max(first, start), min(first + end - begin, stop)):
            local.append(begin + p - first)
            cols.append(p - start)
    return local, cols


def _score(par: Parallelized, samples: list[Sample], device,
           masking: DocumentMasking | None = None) -> tuple[list[list[int]], list[tuple]]:
    """One forward of equal-length haystacks [b, L]: (predicted key tokens, (exact, right, key
    tokens, nll sum)) per sample."""
    host = {"input_ids": torch.stack([s.input_ids for s in samples]),
            "labels": torch.stack([s.labels for s in samples])}
    ids, labels = host["input_ids"].to(device), host["labels"].to(device)
    local_ids, local_labels, runs = par.local_batch(ids, labels, batch_documents(masking, host))
    stats = par.token_stats(local_ids, local_labels, runs)
    # The key's positions are the last k of every haystack; put them together from whichever
    # ranks hold them (zigzag: the end of the sequence lives on tsp rank 0).
    length, k = ids.shape[1], max(len(s.key_ids) for s in samples)
    local, cols = _window(runs, length - k, length)          # host ints: no device read
    pred = torch.full((len(samples), k), -1, dtype=torch.long, device=ids.device)
    nll = torch.zeros(len(samples), k, dtype=torch.float64, device=ids.device)
    if local:
        local_t, cols_t = (torch.tensor(v, device=ids.device) for v in (local, cols))
        pred[:, cols_t] = stats.argmax[:, local_t]
        nll[:, cols_t] = stats.loss[:, local_t].double()
    for comm in par.token_comms:
        comm.all_reduce(pred, tag="eval.passkey.argmax", op=dist.ReduceOp.MAX)
        comm.all_reduce(nll, tag="eval.passkey.nll")
    want = labels[:, length - k:]
    valid = want != IGNORE_INDEX
    right = (pred == want) & valid
    exact = (right | ~valid).all(dim=-1)
    out_preds = [p[v].tolist() for p, v in zip(pred.cpu(), valid.cpu())]
    scores = list(zip(exact.tolist(), right.sum(-1).tolist(), valid.sum(-1).tolist(),
                      (nll * valid).sum(-1).tolist()))
    return out_preds, scores
