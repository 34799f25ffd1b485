"""Start-up data checks: evaluation that cannot kill the
run, single-file sources never evaluating on their training data, a missing eval split failing
before training, data.format honoured, eval batches built once, and the token budget against the
data's size. Every error is one line, raised before any process group exists."""

from __future__ import annotations

import pytest

from tests.unit.data_helpers import CORPUS, TOKENIZER, tiny_config, write_jsonl
from tsp_trainer.data import build_eval_batches, check_data_config, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def pg19_like_validation(tmp_path_factory):
    """50 held-out books in one file, like PG19's validation split."""
    path = tmp_path_factory.mktemp("val") / "validation.jsonl"
    return write_jsonl(path, [f"Book {i}. " + "It was a dark and stormy night. " * 20 for i in range(50)])


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_50_eval_documents_over_128_ranks_are_replicated(pg19_like_validation, tok):
    cfg = tiny_config(["train.eval_every=5", f"data.eval_source={pg19_like_validation}",
                       "data.max_example_split_dp=128"])
    plan = check_data_config(cfg, 128, tokenizer=tok)
    assert plan.eval_replicate and plan.eval_docs == 50
    assert any("50 document(s) for 128 DP ranks" in n for n in plan.notes)
    # Ranks 50 and 127 (which got nothing and crashed at step 200 before) evaluate like rank 0.
    got = {}
    for rank in (0, 50, 127):
        evals = build_eval_batches(cfg.data, tokenizer=tok, dp_rank=rank, dp_degree=128,
                                   num_batches=3, replicate=plan.eval_replicate)
        got[rank] = [b["input_ids"] for b in evals]
        assert len(got[rank]) == 3
    assert all(all(x.equal(y) for x, y in zip(got[0], got[r])) for r in (50, 127))


def test_50_eval_documents_over_128_ranks_refused_without_replication(pg19_like_validation, tok):
    cfg = tiny_config(["train.eval_every=5", f"data.eval_source={pg19_like_validation}",
                       "data.max_example_split_dp=128", "data.eval_replicate=false"])
    with pytest.raises(ValueError) as err:
        check_data_config(cfg, 128, tokenizer=tok)
    message = _one_line(err)
    assert "50 document(s) for dp_degree=128" in message and "ranks 50-127" in message
    assert "data.eval_replicate=true" in message


def test_50_eval_documents_over_16_ranks_are_split(pg19_like_validation, tok):
    cfg = tiny_config(["train.eval_every=5", f"data.eval_source={pg19_like_validation}",
                       "data.max_example_split_dp=16", "data.eval_replicate=false"])
    plan = check_data_config(cfg, 16, tokenizer=tok)
    assert not plan.eval_replicate and plan.eval_docs == 16          # counted up to dp
    firsts = []
    for rank in (0, 15):
        evals = build_eval_batches(cfg.data, tokenizer=tok, dp_rank=rank, dp_degree=16,
                                   num_batches=2, replicate=False)
        firsts.append(tok.decode(next(iter(evals))["input_ids"][0, :16].tolist()))
    assert firsts[0].startswith("Book 0. It") and firsts[1].startswith("Book 15. It")


def test_eval_batches_are_built_once_and_read_once(tok):
    cfg = tiny_config(["train.eval_every=5"])
    evals = build_eval_batches(cfg.data, tokenizer=tok, dp_rank=1, dp_degree=2, num_batches=3,
                               replicate=False)
    runs = [[b["input_ids"] for b in evals] for _ in range(3)]
    assert evals.reads == 1                                # cached after the first evaluation
    assert all(len(r) == 3 and all(x.equal(y) for x, y in zip(runs[0], r)) for r in runs)


def test_single_file_source_never_evaluates_on_its_training_data(tmp_path, tok):
    path = write_jsonl(tmp_path / "all.jsonl", [f"document {i}" for i in range(20)])
    cfg = tiny_config([f"data.source={path}", "train.eval_every=3"])
    with pytest.raises(ValueError) as err:
        check_data_config(cfg, 2, tokenizer=tok)
    message = _one_line(err)
    assert "single file" in message and "data.eval_source" in message and str(path) in message
    # Asked for explicitly, it is allowed; a held-out file is the usual answer.
    check_data_config(tiny_config([f"data.source={path}", "train.eval_every=3",
                                   f"data.eval_source={path}"]), 2, tokenizer=tok)
    check_data_config(tiny_config([f"data.source={path}", "train.eval_every=0"]), 2, tokenizer=tok)


def test_missing_eval_split_fails_before_training(tmp_path, tok):
    folder = tmp_path / "train_only"
    folder.mkdir()
    write_jsonl(folder / "train-00000-of-00001.jsonl", [f"document {i}" for i in range(20)])
    cfg = tiny_config([f"data.source={folder}", "train.eval_every=3"])
    with pytest.raises(ValueError) as err:
        check_data_config(cfg, 2, tokenizer=tok)
    message = _one_line(err)
    assert "train.eval_every=3 needs the eval split data.eval_split='validation'" in message
    assert "no files for split 'validation'" in message


def test_data_errors_come_before_any_process_group(tmp_path):
    """The Trainer runs the data checks before Accelerate starts: no process group exists here,
    and the error still arrives as a ValueError (not a failure inside torch.distributed)."""
    import torch.distributed as dist

    from tsp_trainer.trainer import Trainer

    path = write_jsonl(tmp_path / "all.jsonl", [f"document {i}" for i in range(20)])
    with pytest.raises(ValueError, match="single file"):
        Trainer(tiny_config([f"data.source={path}", "train.eval_every=3"]), world_size=4,
                global_rank=0)
    assert not dist.is_initialized()


def test_data_format_is_honoured(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ["a", "b"])
    with pytest.raises(ValueError) as err:
        check_data_config(tiny_config([f"data.source={path}", "data.format=parquet"]), 1,
                          tokenizer=tok)
    assert "data.format='parquet'" in _one_line(err) and "jsonl file" in str(err.value)
    # A format given for an unknown extension is used to read it.
    odd = tmp_path / "d.data"
    odd.write_text((tmp_path / "d.jsonl").read_text())
    check_data_config(tiny_config([f"data.source={odd}", "data.format=jsonl"]), 1, tokenizer=tok)
    with pytest.raises(ValueError, match="extension '.data'.*set data.format"):
        check_data_config(tiny_config([f"data.source={odd}"]), 1, tokenizer=tok)
    with pytest.raises(ValueError, match="data.format='hub' but .* is a local path"):
        check_data_config(tiny_config([f"data.source={path}", "data.format=hub"]), 1,
                          tokenizer=tok)


def test_token_budget_against_the_data_and_the_repeat_warning(tok):
    plan = check_data_config(tiny_config(["train.steps=60"]), 2, tokenizer=tok)
    # 60 steps x dp 2 x micro 2 x 64 tokens = 15,360 tokens of a ~700K-token corpus.
    assert plan.planned_tokens == 60 * 2 * 2 * 64
    estimate = plan.tokens_per_epoch[str(CORPUS)]
    exact = 342_285 + 356_882 + 382            # data/README.md, plus one EOS per document
    assert abs(estimate - exact) / exact < 0.15, estimate
    assert not plan.warnings and "epochs" in plan.notes[-1]
    long_run = check_data_config(tiny_config(["train.steps=2000", "data.seq_len=256"]), 2,
                                 tokenizer=tok)
    assert len(long_run.warnings) == 1 and "data.max_epochs_warning=1" in long_run.warnings[0]
    assert long_run.epochs_at(long_run.planned_tokens) == pytest.approx(
        long_run.planned_tokens / estimate)
    given = check_data_config(tiny_config(["data.dataset_tokens=1000000"]), 2, tokenizer=tok)
    assert given.tokens_per_epoch[str(CORPUS)] == 1_000_000


def test_eval_rows_from_parquet_footers(tmp_path, tok):
    """A parquet eval split is counted from its footers (no document is read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "validation.parquet"
    pq.write_table(pa.table({"text": [f"book {i} text" for i in range(50)]}), path)
    cfg = tiny_config(["train.eval_every=5", f"data.eval_source={path}",
                       "data.max_example_split_dp=128"])
    from tsp_trainer.data import checks

    calls = []
    real = checks.count_documents
    checks.count_documents = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        plan = check_data_config(cfg, 128, tokenizer=tok)
    finally:
        checks.count_documents = real
    assert plan.eval_replicate and plan.eval_docs == 50
    assert len(calls) == 1            # the training data's count (2 files < 128 ranks), not eval's
