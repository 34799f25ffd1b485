"""What the Trainer runs at its evaluation steps, under the training layout:

* every `train.eval_every` steps: the eval loss on `train.eval_batches` held-out micro-batches per
  DP rank, and (`eval.loss_by_position`) the same loss per position bucket;
* every `eval.passkey_every` steps: passkey retrieval over eval.passkey_lengths x passkey_depths.

Both attend as training does: with `data.document_masking` every batch goes to `local_batch` with
its documents (documents.py; `data.reset_positions` restarts RoPE per document), and the loss by
position then buckets by the position inside the document under reset_positions.

`Evaluator.run(step)` returns the metrics due at that step ({} otherwise) for the Trainer's sinks:
scalars, and MetricTables that metrics.jsonl and W&B render (observability/tables.py). The passkey
task (tokenizer, filler text, lengths) is built by `build_passkey_task` before any process group
exists, so a bad filler source or a length too short for the prompt fails at start-up.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable

import torch

from tsp_trainer.config import ModelConfig, TrainConfig
from tsp_trainer.config.validate import passkey_lengths
from tsp_trainer.data import TextTokenizer, open_text_stream
from tsp_trainer.data.build import eval_source
from tsp_trainer.eval.documents import DocumentMasking, batch_documents
from tsp_trainer.eval.haystack import HaystackBuilder, filler_tokens
from tsp_trainer.eval.passkey import PasskeyResult, PasskeyTask, run_passkey
from tsp_trainer.eval.position_loss import PositionLoss, PositionLossAccumulator
from tsp_trainer.observability.tables import LineChart, MetricTable
from tsp_trainer.parallel.mesh import Mesh
from tsp_trainer.parallel.schemes import Parallelized

# Metric names (metrics.jsonl and W&B keys), rows of observability/metric_names.py's table.
EVAL_LOSS = "eval/loss"
LOSS_BY_POSITION = "eval/loss_by_position"
PASSKEY_ACCURACY = "eval/passkey_accuracy"
PASSKEY = "eval/passkey"

# Filler tokens read beyond the longest haystack, so the samples' random offsets differ in text.
FILLER_MARGIN = 4096


def read_filler(source: str, *, split: str, text_field: str, tokenizer: TextTokenizer,
                min_tokens: int) -> list[int]:
    """Tokens of `source`'s `split` (every rank reads the same: no DP split), at least `min_tokens`
    unless the split is shorter."""
    rows = open_text_stream(source, split=split, text_field=text_field)
    return filler_tokens((row[text_field] for row in rows), tokenizer, min_tokens=min_tokens)


def build_passkey_task(cfg: TrainConfig, tokenizer: TextTokenizer, model_cfg: ModelConfig) -> PasskeyTask | None:
    """The passkey task of `cfg.eval` (None when eval.passkey_every = 0); a bos token first when
    the model has one (an imported Llama does). Its filler text: see `filler_source`."""
    e, d = cfg.eval, cfg.data
    if not e.passkey_every:
        return None
    lengths = passkey_lengths(cfg)
    source, split = filler_source(cfg)
    filler = read_filler(source, split=split, text_field=d.text_field,
                         tokenizer=tokenizer, min_tokens=max(lengths) + FILLER_MARGIN)
    builder = HaystackBuilder(tokenizer, filler, digits=e.passkey_digits, seed=e.passkey_seed,
                              bos_id=model_cfg.bos_token_id)
    return PasskeyTask(tuple(lengths), tuple(float(x) for x in e.passkey_depths), e.passkey_samples,
                       builder)


def filler_source(cfg: TrainConfig) -> tuple[str, str]:
    """(source, split) of the haystack filler: eval.passkey_filler if set, else the held-out data
    (data.eval_source or data.source, data.eval_split), else data.source's train split; the split
    eval.passkey_filler_split when set. A mixture without eval_source must name its filler."""
    e, d = cfg.eval, cfg.data
    held_out = eval_source(d)
    if e.passkey_filler is not None:
        source, split = e.passkey_filler, d.eval_split or d.train_split
    elif held_out is not None:
        source, split = held_out
    elif d.source is not None:
        source, split = d.source, d.train_split
    else:
        raise ValueError(f"eval.passkey_every={e.passkey_every} needs haystack text: set "
                         "eval.passkey_filler (e.g. data/corpus) or data.eval_source for the mixture "
                         "in data.sources")
    return source, e.passkey_filler_split or split


def loss_table(result: PositionLoss) -> MetricTable:
    return MetricTable(("position_start", "position_end", "loss", "tokens"), tuple(result.rows()),
                       LineChart("position_end", "loss", "eval loss by position"))


def passkey_table(result: PasskeyResult) -> MetricTable:
    return MetricTable(("length", "depth", "accuracy", "token_accuracy", "key_nll", "samples"),
                       tuple(result.rows()))


def describe_positions(result: PositionLoss) -> str:
    """'loss 5.1234; by position 0: 6.90, 1: 6.12, 2-3: 5.80, ..., 128-255: 4.95'."""
    parts = [f"{a}: {loss:.2f}" if a == b else f"{a}-{b}: {loss:.2f}"
             for a, b, loss, _ in result.rows() if loss is not None]
    return f"loss {result.mean_loss:.4f}; by position " + ", ".join(parts)


def describe_passkey(result: PasskeyResult) -> str:
    """'accuracy 0.75 (length 128: 1.00, 256: 0.50)'."""
    lengths = sorted({c.length for c in result.cells})
    per = [sum(c.accuracy for c in result.cells if c.length == n) /
           sum(1 for c in result.cells if c.length == n) for n in lengths]
    return f"accuracy {result.accuracy:.2f} (length " + ", ".join(
        f"{n}: {a:.2f}" for n, a in zip(lengths, per)) + ")"


class Evaluator:
    """Runs the evaluations due at a step on this rank's part of the sharded model."""

    def __init__(self, cfg: TrainConfig, *, par: Parallelized, mesh: Mesh, device: torch.device,
                 eval_batches: Iterable[dict] | None, passkey: PasskeyTask | None, log=None,
                 whole_weights: Callable[[], ContextManager] = contextlib.nullcontext):
        """eval_batches: this DP rank's held-out micro-batches, the same at every iteration
        (data/eval.py's EvalBatches); None when train.eval_every = 0. whole_weights: a context
        inside which the model's weights are whole on every rank without further communication
        (ZeRO-3: the dp replicas run different numbers of forward passes), entered (collectively)
        around each evaluation that is due."""
        self.cfg, self.par, self.mesh, self.device = cfg, par, mesh, device
        self.whole_weights = whole_weights
        self.eval_batches, self.passkey, self.log = eval_batches, passkey, log
        self._comms = par.token_comms + [mesh.dp]        # each token of the global batch once
        # held-out batches carry the loader's document_ids; haystacks are cut at the tokenizer's EOS
        eos_id = passkey.builder.tokenizer.eos_id if passkey is not None else None
        self.masking = DocumentMasking.of(cfg.data, eos_id)

    def run(self, step: int) -> dict:
        metrics = {}
        loss = self.eval_batches is not None and _due(self.cfg.train.eval_every, step)
        passkey = self.passkey is not None and _due(self.cfg.eval.passkey_every, step)
        if not (loss or passkey):
            return metrics
        with self.whole_weights():
            if loss:
                metrics.update(self.loss_metrics(step))
            if passkey:
                metrics.update(self.passkey_metrics(step))
        return metrics

    @torch.no_grad()
    def loss_by_position(self) -> PositionLoss:
        """eval/loss and eval/loss_by_position: the held-out tokens' loss per position bucket, a
        token's position being the one RoPE sees (inside its document under data.reset_positions,
        else inside its row)."""
        return position_loss(self.par, self.eval_batches, seq_len=self.cfg.data.seq_len,
                             comms=self._comms, device=self.device, masking=self.masking)

    def loss_metrics(self, step: int) -> dict:
        result = self.loss_by_position()
        metrics = {EVAL_LOSS: result.mean_loss}
        if self.cfg.eval.loss_by_position:
            metrics[LOSS_BY_POSITION] = loss_table(result)
            self._info(f"eval at step {step}: {describe_positions(result)}")
        return metrics

    def passkey_metrics(self, step: int) -> dict:
        result = run_passkey(self.par, self.passkey, dp=self.mesh.dp,
                             micro_batch_size=self.cfg.data.micro_batch_size, device=self.device,
                             masking=self.masking)
        self._info(f"passkey at step {step}: {describe_passkey(result)}")
        return {PASSKEY_ACCURACY: result.accuracy, PASSKEY: passkey_table(result)}

    def _info(self, line: str) -> None:
        if self.log is not None:
            self.log.info(line)


@torch.no_grad()
def position_loss(par: Parallelized, batches: Iterable[dict], *, seq_len: int, comms: list,
                  device: torch.device | str, masking: DocumentMasking | None = None,
                  progress=None) -> PositionLoss:
    """The loss by position of `batches` (host tensors, this DP rank's), each run through
    `local_batch` with its documents as in training, reduced over `comms`; `progress.update(1)`
    after each batch when given. Collective: every rank of `comms` calls it."""
    acc = PositionLossAccumulator(seq_len, device)
    for batch in batches:
        ids, labels, positions = par.local_batch(batch["input_ids"].to(device),
                                                 batch["labels"].to(device),
                                                 batch_documents(masking, batch))
        acc.add(par.token_stats(ids, labels, positions), labels, positions)
        if progress is not None:
            progress.update(1)
    return acc.reduce(comms)


def _due(every: int, step: int) -> bool:
    return bool(every) and step % every == 0
