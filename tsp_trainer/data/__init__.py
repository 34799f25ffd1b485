"""Data pipeline: HF datasets streaming split by DP rank only, tokenisation, packing into fixed
seq_len windows with document boundaries, and per-DP-rank resumable loader state (DESIGN.md 8).

Imports torch, datasets, tokenizers/transformers (the last two lazily) and the standard library;
never torch.distributed: the caller passes dp_rank and dp_degree as plain integers.

    tok = load_tokenizer("data/tokenizer")
    check_tokenizer_fits(tok, model_cfg.vocab_size)
    loader = build_loader("data/corpus", tokenizer=tok, seq_len=256, micro_batch_size=4,
                          dp_rank=dp_rank, dp_degree=dp_degree, shuffle=True, seed=0)
    batch = next(loader)            # {"input_ids": (4, 256), "labels": (4, 256)} int64
    state = loader.state_dict()     # save per DP rank; loader.load_state_dict(state) resumes
"""

from tsp_trainer.data.loader import PackedLoader, build_loader, iterate_eval_batches
from tsp_trainer.data.packing import pack_documents
from tsp_trainer.data.streaming import open_text_stream
from tsp_trainer.data.tokenize import (TextTokenizer, check_same_tokenizer, check_tokenizer_fits,
                                       load_run_tokenizer, load_tokenizer)

__all__ = [
    "PackedLoader",
    "TextTokenizer",
    "build_loader",
    "check_same_tokenizer",
    "check_tokenizer_fits",
    "iterate_eval_batches",
    "load_run_tokenizer",
    "load_tokenizer",
    "open_text_stream",
    "pack_documents",
]
