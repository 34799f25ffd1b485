"""Start-up checks of the data, before any process group, Accelerate or DeepSpeed exists.

`check_data_config(cfg, dp_degree)` opens what the run will read (DP rank 0's view, no batches)
and raises ValueError in one line for what would otherwise fail later:
  - a missing source, split, column or file; `data.format` contradicting the files; a jsonl line
    that is not one UTF-8 JSON object among the first and last SAMPLE_BYTES of each file (named by
    file, line and byte offset);
  - a source with fewer shards than DP ranks above `data.max_example_split_dp` (every rank would
    read everything), or fewer documents than DP ranks;
  - evaluation (train.eval_every > 0) without held-out data: a missing eval split, a single-file
    source (it has no other split; it would evaluate on its training data unless
    `data.eval_source` names it on purpose), a mixture without `data.eval_source`, an empty
    split, or fewer documents than DP ranks with `data.eval_replicate=false`.
It returns a DataPlan: how evaluation feeds the DP ranks (split, or the whole split replicated on
every rank), and the run's token budget against each source's size (exact for token files and
tsp-tokenize output, estimated from a sample for text files, `data.dataset_tokens` when given),
with a warning when the run will read its data more than `data.max_epochs_warning` times.
Imports our data modules, datasets (lazily), pyarrow (lazily); never torch.distributed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tsp_trainer.config.schema import TrainConfig
from tsp_trainer.data.build import SourceSpec, eval_source, length_schedule, train_sources
from tsp_trainer.data.pretokenized import read_metadata, resolve_token_field
from tsp_trainer.data.read_errors import LINE_FORMATS, check_jsonl_ends
from tsp_trainer.data.streaming import (check_column, is_single_file_source, load_streaming,
                                        refuse_example_split, reshard_for, resolve_local_files)
from tsp_trainer.data.tokenfile import count_tokens
from tsp_trainer.data.tokenize import TextTokenizer, load_run_tokenizer

SAMPLE_BYTES = 1 << 18      # text read to estimate tokens per byte (jsonl, txt, arrow)
SAMPLE_ROWS = 64            # rows read to estimate tokens per row (parquet)


@dataclass
class DataPlan:
    """What the start-up checks found; the Trainer logs `notes` and `warnings` on rank 0."""

    eval_replicate: bool = False
    eval_docs: int | None = None                 # documents counted in the eval split (up to dp)
    tokens_per_epoch: dict[str, int | None] = field(default_factory=dict)   # per source name
    how_counted: dict[str, str] = field(default_factory=dict)              # exact/estimated/...
    shares: dict[str, float] = field(default_factory=dict)                 # token share per source
    planned_tokens: int = 0                      # tokens the whole run trains on
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def epoch_metric(self, stream_epoch: int, tokens_seen: int) -> float:
        """data/epoch: passes over the most repeated source from the tokens seen when every
        source's size is known, else the pass this rank's stream is in (an integer)."""
        epochs = self.epochs_at(tokens_seen)
        return float(stream_epoch) if epochs is None else epochs

    def epochs_at(self, tokens_seen: int) -> float | None:
        """Passes over the most repeated source after `tokens_seen` trained tokens (None when a
        source's size is unknown)."""
        if not self.tokens_per_epoch or any(v is None for v in self.tokens_per_epoch.values()):
            return None
        return max(tokens_seen * self.shares[n] / max(t, 1) for n, t in self.tokens_per_epoch.items())


def check_data_config(cfg: TrainConfig, dp_degree: int, *, tokenizer: TextTokenizer | None = None,
                      estimate_epochs: bool = True) -> DataPlan:
    """Raise ValueError (one line) for data the run cannot use; see the module docstring."""
    tok = tokenizer or load_run_tokenizer(cfg.data.tokenizer, cfg.model)
    plan = DataPlan()
    specs = train_sources(cfg.data)
    total_weight = sum(s.weight for s in specs)
    for spec in specs:
        check_train_source(spec, cfg, dp_degree, tok)
        plan.shares[spec.name] = spec.weight / total_weight
        if estimate_epochs:
            tokens, how = epoch_tokens(spec, cfg, tok)
            plan.tokens_per_epoch[spec.name], plan.how_counted[spec.name] = tokens, how
    if cfg.train.eval_every:
        check_eval_source(cfg, dp_degree, tok, plan)
    plan.planned_tokens = planned_tokens(cfg, dp_degree)
    if estimate_epochs:
        _budget_lines(cfg, plan)
    return plan


# -- training data ----------------------------------------------------------------------------
def check_train_source(spec: SourceSpec, cfg: TrainConfig, dp_degree: int,
                       tok: TextTokenizer) -> None:
    d = cfg.data
    check_file_ends(spec.source, split=spec.split, data_format=spec.format)
    token_field = resolve_token_field(spec.source, token_field=spec.token_field,
                                      data_format=spec.format, split=spec.split, tokenizer=tok)
    column = token_field or spec.text_field
    dataset = load_streaming(spec.source, split=spec.split, data_format=spec.format,
                             dp_degree=dp_degree)
    check_column(dataset, column, source=spec.source, split=spec.split,
                 key="token_field" if token_field else "text_field")
    shards = reshard_for(dataset, dp_degree).num_shards if dp_degree > 1 else 1
    if shards >= dp_degree:
        return
    refuse_example_split(num_shards=shards, dp_degree=dp_degree, source=spec.source,
                         max_example_split_dp=d.max_example_split_dp)
    docs = count_documents(dataset, column, limit=dp_degree)
    if docs < dp_degree:
        raise ValueError(f"data source {spec.source!r} split {spec.split!r} has {docs} non-empty "
                         f"document(s) for dp_degree={dp_degree} DP ranks: some ranks would get "
                         "no data; use more documents or fewer DP ranks")


def check_file_ends(source: str, *, split: str, data_format: str) -> None:
    """Every line in the first and the last SAMPLE_BYTES of each jsonl file is a JSON object (a bad
    line elsewhere is named when training reaches it: data/read_errors.py)."""
    local = resolve_local_files(source, split=split, data_format=data_format)
    if local is not None and local[0] in LINE_FORMATS:
        check_jsonl_ends(local[1], sample_bytes=SAMPLE_BYTES)


def rows_known(dataset, source: str, *, split: str, data_format: str) -> int | None:
    """Rows of the split without reading them, when the metadata says (a Hub dataset's split
    info, local parquet footers, token-file indexes); None otherwise."""
    splits = getattr(dataset.info, "splits", None)
    if splits and split in splits and splits[split].num_examples:
        return int(splits[split].num_examples)
    local = resolve_local_files(source, split=split, data_format=data_format)
    if local is None:
        return None
    fmt, files = local
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    if fmt == "tokens":
        return count_tokens(files)[0]
    return None


def count_documents(dataset, column: str, *, limit: int) -> int:
    """Non-empty documents (text or token ids) among the rows, counting up to `limit`."""
    count = 0
    for row in dataset:
        value = row.get(column)
        count += value is not None and len(value) > 0
        if count >= limit:
            break
    return count


# -- evaluation data --------------------------------------------------------------------------
def check_eval_source(cfg: TrainConfig, dp_degree: int, tok: TextTokenizer, plan: DataPlan) -> None:
    d = cfg.data
    located = eval_source(d)
    if located is None:
        raise ValueError(f"train.eval_every={cfg.train.eval_every} with a mixture (data.sources) "
                         "needs held-out data: set data.eval_source, or train.eval_every=0")
    source, split = located
    fmt = d.format if d.eval_source is None else "auto"
    if d.eval_source is None and is_single_file_source(source, fmt):
        raise ValueError(f"data.source={source!r} is a single file (or a glob): it has no "
                         f"{split!r} split, so train.eval_every={cfg.train.eval_every} would "
                         "evaluate on the training data; set data.eval_source to held-out data "
                         "(or to the same path to evaluate on training data on purpose), or "
                         "train.eval_every=0")
    try:
        token_field = resolve_token_field(source, token_field=d.token_field, data_format=fmt,
                                          split=split, tokenizer=tok)
        check_file_ends(source, split=split, data_format=fmt)
        dataset = load_streaming(source, split=split, data_format=fmt, dp_degree=dp_degree)
    except ValueError as err:
        raise ValueError(f"train.eval_every={cfg.train.eval_every} needs the eval split "
                         f"data.eval_split={split!r} of {source!r}: {err}") from None
    column = token_field or d.text_field
    check_column(dataset, column, source=source, split=split,
                 key="token_field" if token_field else "text_field")
    docs = rows_known(dataset, source, split=split, data_format=fmt)
    if docs is None:                 # read at most dp documents (at 1,024 ranks, each rank does)
        docs = count_documents(dataset, column, limit=dp_degree)
    plan.eval_docs = docs
    if docs == 0:
        raise ValueError(f"eval split {split!r} of {source!r} has no non-empty documents; "
                         "nothing to evaluate on")
    if docs >= dp_degree:
        return
    if not d.eval_replicate:
        raise ValueError(f"eval split {split!r} of {source!r} has {docs} document(s) for "
                         f"dp_degree={dp_degree} DP ranks and data.eval_replicate=false: ranks "
                         f"{docs}-{dp_degree - 1} would have nothing to evaluate; set "
                         "data.eval_replicate=true or use a larger eval split")
    plan.eval_replicate = True
    plan.notes.append(f"data: eval split {split!r} of {source!r} has {docs} document(s) for "
                      f"{dp_degree} DP ranks: every rank evaluates the whole split "
                      "(data.eval_replicate)")


# -- token budget -----------------------------------------------------------------------------
def planned_tokens(cfg: TrainConfig, dp_degree: int) -> int:
    """Tokens the whole run trains on: steps x grad_accum x dp x micro x seq_len, per stage."""
    schedule = length_schedule(cfg.data, grad_accum=cfg.train.grad_accum)
    starts = [s.start_step for s in schedule.stages] + [cfg.train.steps]
    total = 0
    for stage, start, end in zip(schedule.stages, starts, starts[1:]):
        steps = max(0, min(end, cfg.train.steps) - start)
        total += steps * cfg.train.grad_accum * dp_degree * stage.micro_batch_size * stage.seq_len
    return total


def epoch_tokens(spec: SourceSpec, cfg: TrainConfig, tok: TextTokenizer) -> tuple[int | None, str]:
    """(tokens in one pass over the source, BOS/EOS included; how they were counted)."""
    specials = 1 + (tok.bos_id is not None)
    if cfg.data.dataset_tokens is not None and not cfg.data.sources:
        return int(cfg.data.dataset_tokens), "given by data.dataset_tokens"
    meta = read_metadata(spec.source) if spec.format != "hub" else None
    if meta is not None and spec.split in meta.get("splits", {}):
        counts = meta["splits"][spec.split]
        return counts["tokens"] + specials * counts["nonempty_docs"], "exact (tokenized.json)"
    local = resolve_local_files(spec.source, split=spec.split, data_format=spec.format)
    if local is None:
        return None, "unknown (a Hub dataset; set data.dataset_tokens)"
    fmt, files = local
    if fmt == "tokens":
        docs, tokens = count_tokens(files)
        return tokens + specials * docs, "exact (token file indexes)"
    token_field = resolve_token_field(spec.source, token_field=spec.token_field, data_format=fmt,
                                      split=spec.split, tokenizer=tok)
    if fmt == "parquet":
        return _parquet_tokens(files, token_field or spec.text_field, token_field is not None,
                               tok, specials), f"estimated from the first {SAMPLE_ROWS} rows"
    if token_field is not None:
        return None, "unknown (token ids in a non-parquet file; set data.dataset_tokens)"
    return _text_tokens(files, fmt, spec.text_field, tok, specials), \
        f"estimated from the first {SAMPLE_BYTES >> 10} KiB"


def _text_tokens(files: list[str], fmt: str, field_name: str, tok: TextTokenizer,
                 specials: int) -> int:
    """Tokens per byte of the first file's first MiB, times the bytes of all files."""
    total_bytes = sum(os.path.getsize(f) for f in files)
    if fmt == "arrow":
        texts, sample_bytes = _arrow_sample(files[0], field_name)
    else:
        with open(files[0], "rb") as f:
            raw = f.read(SAMPLE_BYTES)
        lines = raw.split(b"\n")
        if len(raw) == SAMPLE_BYTES and len(lines) > 1:
            lines = lines[:-1]                     # a cut last line
        sample_bytes = sum(len(line) + 1 for line in lines)
        rows = [line.decode("utf-8", errors="replace") for line in lines]
        texts = [json.loads(r).get(field_name, "") if r.strip() else "" for r in rows] \
            if fmt == "jsonl" else rows
    texts = [t for t in texts if isinstance(t, str) and t]
    tokens = sum(len(ids) + specials for ids in tok.encode_batch(texts)) if texts else 0
    return int(tokens * total_bytes / max(sample_bytes, 1))


def _arrow_sample(path: str, field_name: str) -> tuple[list[str], int]:
    import pyarrow as pa

    with open(path, "rb") as f:
        try:
            reader = pa.ipc.open_stream(f)
            batch = next(iter(reader))
        except (OSError, pa.lib.ArrowInvalid):
            reader = pa.ipc.open_file(f)
            batch = reader.get_batch(0)
    return batch.column(field_name).to_pylist(), batch.nbytes


def _parquet_tokens(files: list[str], column: str, is_tokens: bool, tok: TextTokenizer,
                    specials: int) -> int:
    """Rows (from the files' metadata) times the mean tokens of the first rows."""
    import pyarrow.parquet as pq

    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    first = pq.ParquetFile(files[0])
    batch = next(first.iter_batches(batch_size=SAMPLE_ROWS, columns=[column]), None)
    values = batch.column(0).to_pylist() if batch is not None else []
    if is_tokens:
        lengths = [len(v) + specials for v in values if v]
    else:
        texts = [v for v in values if isinstance(v, str) and v]
        lengths = [len(ids) + specials for ids in tok.encode_batch(texts)] if texts else []
    return int(rows * sum(lengths) / max(len(values), 1))


def _budget_lines(cfg: TrainConfig, plan: DataPlan) -> None:
    """The token budget against each source's size; a warning past data.max_epochs_warning."""
    for name, tokens in plan.tokens_per_epoch.items():
        reads = plan.planned_tokens * plan.shares[name]
        if tokens is None:
            plan.notes.append(f"data: the run trains on {reads:,.0f} tokens of {name!r}, whose "
                              f"size is {plan.how_counted[name]}")
            continue
        epochs = reads / max(tokens, 1)
        line = (f"data: the run trains on {reads:,.0f} tokens of {name!r} = {epochs:.2f} epochs "
                f"of {tokens:,} tokens ({plan.how_counted[name]})")
        if epochs > cfg.data.max_epochs_warning:
            plan.warnings.append(f"{line}: more than data.max_epochs_warning="
                                 f"{cfg.data.max_epochs_warning:g}; the model will see the same "
                                 "data repeatedly (use more data, fewer steps, or raise the limit)")
        else:
            plan.notes.append(line)

