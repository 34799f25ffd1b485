"""Data pipeline: HF datasets streaming split by DP rank only (by shards), tokenisation in a
background worker, packing into fixed seq_len windows with document boundaries, token-weighted
mixtures, pre-tokenized inputs, long-context controls, and per-DP-rank resumable loader state
(docs/data.md).

Imports torch, datasets, numpy, tokenizers/transformers (the last two lazily) and the standard
library; never torch.distributed: the caller passes dp_rank and dp_degree as plain integers.

    tok = load_tokenizer("data/tokenizer")
    check_tokenizer_fits(tok, model_cfg.vocab_size)
    plan = check_data_config(cfg, dp_degree)          # before any process group: one-line errors
    loader = build_train_loader(cfg.data, tokenizer=tok, dp_rank=dp_rank, dp_degree=dp_degree,
                                seed=0, grad_accum=1)
    batch = next(loader)            # {"input_ids": (B, S), "labels": (B, S)} int64
    state = loader.state_dict()     # save per DP rank; loader.load_state_dict(state) resumes
"""

from tsp_trainer.data.build import build_eval_batches, build_train_loader, length_schedule
from tsp_trainer.data.checks import DataPlan, check_data_config
from tsp_trainer.data.eval import EvalBatches
from tsp_trainer.data.loader import PackedLoader, build_loader, iterate_eval_batches
from tsp_trainer.data.packing import pack_documents
from tsp_trainer.data.prefetch import PrefetchLoader
from tsp_trainer.data.schedule import LengthSchedule, LengthStage
from tsp_trainer.data.streaming import open_text_stream
from tsp_trainer.data.tokenize import (TextTokenizer, check_same_tokenizer, check_tokenizer_fits,
                                       load_run_tokenizer, load_tokenizer)

__all__ = [
    "DataPlan",
    "EvalBatches",
    "LengthSchedule",
    "LengthStage",
    "PackedLoader",
    "PrefetchLoader",
    "TextTokenizer",
    "build_eval_batches",
    "build_loader",
    "build_train_loader",
    "check_data_config",
    "check_same_tokenizer",
    "check_tokenizer_fits",
    "iterate_eval_batches",
    "length_schedule",
    "load_run_tokenizer",
    "load_tokenizer",
    "open_text_stream",
    "pack_documents",
]
