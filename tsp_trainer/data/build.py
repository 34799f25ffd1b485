"""From the `data` config section to loaders: the training loader (one source or a token-weighted
mixture, long-document upsampling, the length schedule, the prefetch worker) and the evaluation
batches (built once). Receives only `DataSection` and plain integers (no process group, no config
tree).
"""

from __future__ import annotations

from dataclasses import dataclass

from tsp_trainer.config.schema import DataSection
from tsp_trainer.data.eval import EvalBatches
from tsp_trainer.data.loader import PackedLoader, open_documents
from tsp_trainer.data.mixture import MixtureDocuments
from tsp_trainer.data.prefetch import PrefetchLoader
from tsp_trainer.data.schedule import LengthSchedule, LengthStage
from tsp_trainer.data.tokenize import TextTokenizer
from tsp_trainer.data.upsample import LongDocUpsampler


@dataclass(frozen=True)
class SourceSpec:
    """One training source with every default filled in from `data.*`."""

    source: str
    name: str
    weight: float
    format: str
    split: str
    text_field: str
    token_field: str | None


def train_sources(data: DataSection) -> list[SourceSpec]:
    """`data.sources` (a mixture) or the single `data.source`, defaults resolved."""
    if not data.sources:
        return [SourceSpec(str(data.source), str(data.source), 1.0, data.format, data.train_split,
                           data.text_field, data.token_field)]
    return [SourceSpec(s.source, s.name or s.source, float(s.weight), s.format,
                       s.split or data.train_split, s.text_field or data.text_field,
                       s.token_field if s.token_field is not None else data.token_field)
            for s in data.sources]


def length_schedule(data: DataSection, *, grad_accum: int) -> LengthSchedule:
    """`data.seq_len_schedule`, or data.seq_len and data.micro_batch_size for the whole run."""
    stages = [LengthStage(s.start_step, s.seq_len, s.micro_batch_size or data.micro_batch_size)
              for s in data.seq_len_schedule] or [LengthStage(0, data.seq_len, data.micro_batch_size)]
    return LengthSchedule(stages, batches_per_step=grad_accum)


def build_train_loader(data: DataSection, *, tokenizer: TextTokenizer, dp_rank: int,
                       dp_degree: int, seed: int, grad_accum: int,
                       pin_memory: bool = False) -> PackedLoader | PrefetchLoader:
    """This DP rank's training loader, with the prefetch worker when data.prefetch > 0 (which
    pins the batches when `pin_memory`: a CUDA run, data/prefetch.py `pins_batches`)."""
    specs = train_sources(data)
    docs = [open_documents(s.source, tokenizer=tokenizer, split=s.split, text_field=s.text_field,
                           token_field=s.token_field, data_format=s.format, dp_rank=dp_rank,
                           dp_degree=dp_degree, seed=seed, shuffle=data.shuffle,
                           shuffle_buffer=data.shuffle_buffer,
                           max_example_split_dp=data.max_example_split_dp, name=s.name)
            for s in specs]
    documents = docs[0]
    if data.sources:
        documents = MixtureDocuments(docs, [s.weight for s in specs], seed=seed, dp_rank=dp_rank,
                                     estimate_docs=data.mixture_estimate_docs,
                                     specials_per_doc=1 + (tokenizer.bos_id is not None))
    if data.upsample.min_tokens > 0 and data.upsample.factor > 1:
        documents = LongDocUpsampler(documents, min_tokens=data.upsample.min_tokens,
                                     factor=data.upsample.factor, gap_docs=data.upsample.gap_docs,
                                     seed=seed, dp_rank=dp_rank)
    loader = PackedLoader(documents, tokenizer=tokenizer, seq_len=data.seq_len,
                          micro_batch_size=data.micro_batch_size, dp_rank=dp_rank,
                          dp_degree=dp_degree, shuffle=data.shuffle, seed=seed,
                          shuffle_buffer=data.shuffle_buffer,
                          source=",".join(s.name for s in specs), split=specs[0].split,
                          schedule=length_schedule(data, grad_accum=grad_accum),
                          document_ids=data.document_masking)
    if data.prefetch == 0:
        return loader
    return PrefetchLoader(loader, depth=data.prefetch, pin_memory=pin_memory)


def eval_source(data: DataSection) -> tuple[str, str] | None:
    """(source, split) of the held-out data, or None when there is none configured."""
    if data.eval_split is None:
        return None
    if data.eval_source is not None:
        return data.eval_source, data.eval_split
    if data.source is None:          # a mixture names its held-out data with data.eval_source
        return None
    return data.source, data.eval_split


def build_eval_batches(data: DataSection, *, tokenizer: TextTokenizer, dp_rank: int,
                       dp_degree: int, num_batches: int, replicate: bool) -> EvalBatches:
    """This DP rank's evaluation batches; `replicate` (fewer documents than DP ranks, decided by
    checks.check_data_config) gives every rank the whole split."""
    located = eval_source(data)
    if located is None:
        raise ValueError("evaluation needs held-out data: set data.eval_source (and "
                         "data.eval_split), or train.eval_every=0")
    source, split = located
    rank, degree = (0, 1) if replicate else (dp_rank, dp_degree)
    fmt = data.format if data.eval_source is None else "auto"
    documents = open_documents(source, tokenizer=tokenizer, split=split,
                               text_field=data.text_field, token_field=data.token_field,
                               data_format=fmt, dp_rank=rank, dp_degree=degree, mode="eval")
    loader = PackedLoader(documents, tokenizer=tokenizer, seq_len=data.seq_len,
                          micro_batch_size=data.micro_batch_size, dp_rank=rank, dp_degree=degree,
                          source=source, split=split, document_ids=data.document_masking)
    return EvalBatches(loader, num_batches=num_batches)
