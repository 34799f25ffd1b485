"""tsp_trainer.data: packing, DP split, exact resume, layout-change policies, local formats, errors.

Runs offline on the bundled corpus (data/corpus, 2 train shards) and small files written to tmp.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from tsp_trainer.data import streaming
from tsp_trainer.config import model_config
from tsp_trainer.data import (PackedLoader, build_loader, check_tokenizer_fits,
                              iterate_eval_batches, load_tokenizer, open_text_stream,
                              pack_documents)
from tsp_trainer.data.packing import DocumentTokenizer, TokenPacker

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus"
TOKENIZER = REPO / "data" / "tokenizer"
TRAIN_SHARDS = sorted(CORPUS.glob("train-*.jsonl"))


@pytest.fixture(scope="module", autouse=True)
def offline_hf(tmp_path_factory):
    """No network, a private HF cache, and no 5 s parquet shutdown sleep at exit.

    datasets reads the environment when first imported (our package imports it lazily), and its
    config values are patched too in case another test imported it earlier.
    """
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                           ("HF_HOME", str(home))):
            mp.setenv(key, value)
        import datasets

        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
        mp.setattr(datasets.config, "HF_MODULES_CACHE", home / "modules")
        mp.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
        yield


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


def read_jsonl(*paths) -> list[str]:
    return [json.loads(line)["text"] for p in paths for line in Path(p).read_text().splitlines()]


def write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def token_stream(batches) -> list[int]:
    """Rebuild the packed token stream: windows overlap by one token, so it is the first input
    followed by every label, in order."""
    out = [int(batches[0]["input_ids"][0, 0])]
    for batch in batches:
        out += batch["labels"].reshape(-1).tolist()
    return out


def take(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])


# ---------------------------------------------------------------- tokenizer


def test_bundled_tokenizer_loads_offline_and_round_trips(tok):
    assert (tok.eos_id, tok.vocab_size) == (0, 1024)
    text = "Return the Python representation of ``s``.\n\tcafé naïve 日本語 -> {x: 1}"
    ids = tok.encode(text)
    assert 0 < len(ids) < len(text.encode()) and max(ids) < 1024
    assert tok.decode(ids) == text
    # The file path and the folder load the same tokenizer.
    assert load_tokenizer(TOKENIZER / "tokenizer.json").encode(text) == ids
    check_tokenizer_fits(tok, model_config("tiny").vocab_size)


def test_bundled_tokenizer_folder_loads_with_transformers(tok):
    from transformers import PreTrainedTokenizerFast

    from tsp_trainer.data.tokenize import _from_transformers

    text = "Shutdown and close event loop.\n    x = {'a': 1}"
    hf = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER))
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token, hf.pad_token_id) == \
        ("<|endoftext|>", 0, "<|pad|>", 1)
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    # The AutoTokenizer route (used for Hub names) agrees with the tokenizers route.
    auto = _from_transformers(str(TOKENIZER))
    assert (auto.eos_id, auto.vocab_size, auto.encode(text)) == (0, 1024, tok.encode(text))


def test_hub_names_fail_clearly_when_offline():
    with pytest.raises(ValueError, match="could not open 'no-org/no-dataset'.*Hub"):
        open_text_stream("no-org/no-dataset")
    with pytest.raises(ValueError, match="could not load tokenizer 'no-org/no-tokenizer'"):
        load_tokenizer("no-org/no-tokenizer")


def test_tokenizer_larger_than_model_vocab_is_refused(tok):
    with pytest.raises(ValueError, match=r"vocab_size=1024.*model\.vocab_size=512"):
        check_tokenizer_fits(tok, 512)


def test_missing_tokenizer_path_is_named(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ValueError, match="does not exist") as err:
        load_tokenizer(missing)
    assert str(missing) in str(err.value)


# ---------------------------------------------------------------- packing


def test_pack_documents_exact_windows_eos_and_long_document_split():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13]]   # doc 1 is longer than seq_len
    batches = list(pack_documents(docs, seq_len=4, micro_batch_size=1, eos_id=0))
    # Stream: 1 2 3 E 4 5 6 7 8 9 10 11 12 E 13 E -> windows of 5 tokens starting every 4.
    windows = [[1, 2, 3, 0, 4], [4, 5, 6, 7, 8], [8, 9, 10, 11, 12]]
    assert len(batches) == 3
    for batch, window in zip(batches, windows):
        assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (1, 4)
        assert batch["input_ids"][0].tolist() == window[:-1]
        assert batch["labels"][0].tolist() == window[1:]
    # The long document spans windows 0..2: none of its tokens is lost.
    assert set(range(4, 13)) <= set(token_stream(batches))


def test_token_packer_keeps_pending_tokens_for_resume():
    packer = TokenPacker(seq_len=3, eos_id=0)
    packer.add_document([5, 6, 7, 8, 9])
    assert packer.num_ready() == 1 and packer.pop_window().tolist() == [5, 6, 7, 8]
    assert packer.pending() == [8, 9, 0] and packer.num_ready() == 0
    resumed = TokenPacker(seq_len=3, eos_id=0, pending=packer.pending())
    resumed.add_document([1])
    assert resumed.pop_window().tolist() == [8, 9, 0, 1]


def test_loader_labels_are_next_tokens_with_eos_between_documents(tok):
    loader = build_loader(str(CORPUS), tokenizer=tok, seq_len=32, micro_batch_size=3)
    batches = take(loader, 40)
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == (3, 32)
        assert torch.equal(b["labels"][:, :-1], b["input_ids"][:, 1:])
        # Row r's last label is row r+1's first input (windows overlap by one token).
        assert torch.equal(b["labels"][:-1, -1], b["input_ids"][1:, 0])
    stream = token_stream(batches)
    expected = []
    for text in read_jsonl(TRAIN_SHARDS[0], TRAIN_SHARDS[1]):
        expected += tok.encode(text) + [tok.eos_id]
        if len(expected) >= len(stream):
            break
    assert stream == expected[:len(stream)]
    assert loader.stats["docs_consumed"] >= 2 and loader.stats["docs_empty"] == 0


def test_empty_documents_skipped_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ["alpha beta", "", "gamma delta", ""] * 3)
    loader = build_loader(str(path), tokenizer=tok, seq_len=8, micro_batch_size=1)
    batches = take(loader, 3)
    doc = lambda t: tok.encode(t) + [tok.eos_id]
    expected = (doc("alpha beta") + doc("gamma delta")) * 6
    stream = token_stream(batches)
    assert stream == expected[:len(stream)]          # no EOS pair from an empty document
    assert loader.stats["docs_empty"] == loader.stats["docs_consumed"] // 2 >= 1


def test_all_empty_documents_raise_instead_of_looping(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ["", "", ""])
    loader = build_loader(str(path), tokenizer=tok, seq_len=8, micro_batch_size=1)
    with pytest.raises(ValueError, match="every document .* is empty"):
        next(loader)


def test_invalid_unicode_is_repaired_and_counted(tok):
    docs = DocumentTokenizer(tok, text_field="text")
    ids = docs({"text": "bad \udc80 char"}, where="row 0")
    assert tok.decode(ids) == "bad ? char" and docs.num_repaired == 1


def test_non_utf8_jsonl_is_a_clear_error(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "ok \xff bad"}\n')
    loader = build_loader(str(path), tokenizer=tok, seq_len=64, micro_batch_size=1)
    with pytest.raises(ValueError) as err:
        next(loader)
    assert str(err.value).startswith(f"data file {path} line 2 (byte offset 17): byte 13 of the "
                                     "line (0xff) is not UTF-8")


# ---------------------------------------------------------------- streaming and DP split


def test_dp_split_is_disjoint_and_covers_the_bundled_corpus():
    all_docs = read_jsonl(*TRAIN_SHARDS)
    per_rank = [[row["text"] for row in open_text_stream(CORPUS, split="train", dp_rank=r,
                                                         dp_degree=2)] for r in range(2)]
    assert per_rank[0] == read_jsonl(TRAIN_SHARDS[0])   # 2 shards, 2 ranks: one shard each
    assert per_rank[1] == read_jsonl(TRAIN_SHARDS[1])
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(all_docs)


def test_dp_split_of_one_file_warns_and_interleaves(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SMALL_SOURCE_BYTES", 0)     # as if the file were large
    path = write_jsonl(tmp_path / "one.jsonl", [f"doc {i}" for i in range(7)])
    with pytest.warns(UserWarning, match=r"num_shards=1, not a multiple of dp_degree=2"):
        rank1 = [r["text"] for r in open_text_stream(path, dp_rank=1, dp_degree=2)]
    assert rank1 == ["doc 1", "doc 3", "doc 5"]


def test_local_jsonl_parquet_txt_folder_and_glob(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first document", "second one", "third, with unicode: é"]
    write_jsonl(tmp_path / "a.jsonl", texts)
    pq.write_table(pa.table({"text": texts, "id": [1, 2, 3]}), tmp_path / "a.parquet")
    (tmp_path / "a.txt").write_text("\n".join(texts) + "\n")
    for name in ("a.jsonl", "a.parquet", "a.txt"):
        assert [r["text"] for r in open_text_stream(tmp_path / name)] == texts, name
    # Undecodable bytes in a txt file become U+FFFD instead of stopping the run.
    (tmp_path / "bad.txt").write_bytes(b"ok \xff bytes\n")
    assert [r["text"] for r in open_text_stream(tmp_path / "bad.txt")] == ["ok \ufffd bytes"]
    # A folder picks the split by file name; a glob is taken as the requested split.
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train-00000-of-00001.jsonl", texts[:2])
    write_jsonl(folder / "validation.jsonl", texts[2:])
    assert [r["text"] for r in open_text_stream(folder, split="validation")] == texts[2:]
    assert [r["text"] for r in open_text_stream(f"{folder}/train-*.jsonl")] == texts[:2]
    with pytest.raises(ValueError, match="no files for split 'test'.*validation"):
        open_text_stream(folder, split="test")


def test_missing_path_and_empty_dataset_errors(tmp_path, tok):
    missing = tmp_path / "no_such_dir" / "train.jsonl"
    with pytest.raises(ValueError, match="does not exist") as err:
        build_loader(str(missing), tokenizer=tok, seq_len=8, micro_batch_size=1)
    assert str(missing) in str(err.value)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        open_text_stream(tmp_path / "empty.jsonl")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="contains no data files"):
        open_text_stream(tmp_path / "empty_dir")
    # One document, two ranks: rank 1's stream is empty; the loader names the source.
    one = write_jsonl(tmp_path / "one.jsonl", ["only document"])
    loader = build_loader(str(one), tokenizer=tok, seq_len=8, micro_batch_size=1,   # small: no warning
                          dp_rank=1, dp_degree=2)
    with pytest.raises(ValueError, match="yielded no documents") as err:
        next(loader)
    assert str(one) in str(err.value)


def test_missing_or_non_string_text_field_is_named(tmp_path, tok):
    path = tmp_path / "c.jsonl"
    path.write_text('{"content": "a"}\n')
    with pytest.raises(ValueError, match=r"no column text_field='text'.*\['content'\]"):
        open_text_stream(path)
    path = tmp_path / "n.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": null}\n')
    loader = build_loader(str(path), tokenizer=tok, seq_len=64, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"text_field='text' is of type NoneType in document 2"):
        next(loader)


# ---------------------------------------------------------------- resume


def _loader(source, tok, **kw):
    args = dict(tokenizer=tok, seq_len=16, micro_batch_size=2) | kw
    return build_loader(str(source), **args)


@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_resume_once_and_twice_in_a_row(tok, shuffle):
    kw = dict(dp_rank=1, dp_degree=2, shuffle=shuffle, seed=3, shuffle_buffer=64, seq_len=128,
              micro_batch_size=4)
    reference = take(_loader(CORPUS, tok, **kw), 30)
    first = _loader(CORPUS, tok, **kw)
    got = take(first, 10)
    # States are plain Python (JSON round-trip) so any checkpoint format can hold them.
    state1 = json.loads(json.dumps(first.state_dict()))
    second = _loader(CORPUS, tok, **kw)
    second.load_state_dict(state1)
    got += take(second, 10)
    state2 = second.state_dict()
    third = _loader(CORPUS, tok, **kw)
    third.load_state_dict(state2)
    got += take(third, 10)
    assert_same_batches(got, reference)
    # The first segment crossed document boundaries; both saves carried a partial document.
    assert 2 <= state1["docs_consumed"] <= state2["docs_consumed"]
    assert state1["token_buffer"] and state2["token_buffer"]


def test_resume_across_epochs_and_partial_shuffle_blocks(tmp_path, tok):
    # 7 documents, blocks of 3: epochs wrap several times and blocks end early.
    path = write_jsonl(tmp_path / "d.jsonl", [f"document number {i} " * (1 + i % 3)
                                              for i in range(7)])
    kw = dict(shuffle=True, seed=1, shuffle_buffer=3, seq_len=8, micro_batch_size=2)
    reference = take(_loader(path, tok, **kw), 24)
    got, state = [], None
    for _ in range(4):
        loader = _loader(path, tok, **kw)
        if state is not None:
            loader.load_state_dict(state)
        got += take(loader, 6)
        state = loader.state_dict()
    assert_same_batches(got, reference)
    assert state["documents"]["stream"]["epoch"] >= 2


def test_shuffle_permutes_each_epoch_differently(tmp_path, tok):
    texts = [f"d{i}" for i in range(7)]
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    loader = _loader(path, tok, shuffle=True, seed=1, shuffle_buffer=4, seq_len=4,
                     micro_batch_size=1)
    stream = token_stream(take(loader, 12))
    docs = tok.decode(stream).split("<|endoftext|>")
    epoch0, epoch1 = docs[:7], docs[7:14]
    assert sorted(epoch0) == sorted(epoch1) == texts
    assert epoch0 != texts and epoch1 != epoch0
    # Blocks of 4: a document never leaves its block (a local, resumable shuffle).
    assert sorted(epoch0[:4]) == texts[:4] and sorted(epoch1[4:]) == texts[4:]


def test_loading_a_start_state_rewinds_a_used_loader(tok):
    fresh = _loader(CORPUS, tok)
    start_state = fresh.state_dict()
    reference = take(fresh, 3)
    used = _loader(CORPUS, tok)
    take(used, 100)
    mid_state = used.state_dict()
    assert mid_state["docs_consumed"] > 1
    used.load_state_dict(mid_state)
    used.load_state_dict(start_state)
    assert_same_batches(take(used, 3), reference)


def test_shuffle_is_seeded_and_changes_order(tok):
    first_doc = lambda **kw: token_stream(take(_loader(CORPUS, tok, shuffle_buffer=32, **kw),
                                               1))[:16]
    plain = first_doc()
    assert first_doc(shuffle=True, seed=0) == first_doc(shuffle=True, seed=0)
    assert first_doc(shuffle=True, seed=0) != plain
    assert first_doc(shuffle=True, seed=0) != first_doc(shuffle=True, seed=1)


def test_changed_dp_degree_is_refused_unless_asked(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(streaming, "SMALL_SOURCE_BYTES", 0)     # as if the file were large
    texts = [f"document {i:03d} body text" for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    with pytest.warns(UserWarning, match="num_shards"):
        old = _loader(path, tok, dp_rank=0, dp_degree=2)
    take(old, 5)
    state = old.state_dict()

    new = _loader(path, tok)
    with pytest.raises(ValueError, match=r"dp_degree=2.*dp_degree=1"):
        new.load_state_dict(state)

    with warnings.catch_warnings():          # the user chose restart: no warning (the resume logs it)
        warnings.simplefilter("error")
        new.load_state_dict(state, on_layout_change="restart")
    assert_same_batches(take(new, 3), take(_loader(path, tok), 3))

    # The approximate re-split is gone; asking for it names why.
    with pytest.raises(ValueError, match="'resplit' was removed: it only approximated"):
        _loader(path, tok).load_state_dict(state, on_layout_change="resplit")

    with pytest.warns(UserWarning, match="num_shards"):
        other_rank = _loader(path, tok, dp_rank=1, dp_degree=2)
    with pytest.raises(ValueError, match="dp_rank=0 loaded on dp_rank=1"):
        other_rank.load_state_dict(state)


def test_changed_shuffle_settings_are_refused(tok):
    loader = _loader(CORPUS, tok, shuffle=True, seed=0)
    next(loader)
    other = _loader(CORPUS, tok, shuffle=True, seed=1)
    with pytest.raises(ValueError, match="shuffle, seed, shuffle_buffer"):
        other.load_state_dict(loader.state_dict())


# ---------------------------------------------------------------- eval


def test_eval_batches_are_fixed_and_counted(tok):
    run = lambda: list(iterate_eval_batches(str(CORPUS), tokenizer=tok, seq_len=64,
                                            micro_batch_size=2, num_batches=4))
    first = run()
    assert len(first) == 4 and first[0]["input_ids"].shape == (2, 64)
    assert_same_batches(first, run())
    expected = tok.encode(read_jsonl(CORPUS / "validation.jsonl")[0])
    assert token_stream(first)[:50] == expected[:50]


def test_packed_loader_validates_its_arguments(tok):
    with pytest.raises(ValueError, match="dp_rank=2 must be an integer in \\[0, dp_degree=2\\)"):
        open_text_stream(CORPUS, dp_rank=2, dp_degree=2)
    with pytest.raises(ValueError, match="seq_len=0"):
        PackedLoader(open_text_stream(CORPUS), tokenizer=tok, seq_len=0, micro_batch_size=1)
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_version_1_loader_state_resumes_exactly(tok):
    """Checkpoints written before the loader's state version 2 (one source, the stream's fields at
    the top level, unshuffled blocks of one document) resume to the same batches."""
    saved = json.loads((REPO / "tests" / "assets" / "loader_state_v1.json").read_text())
    for name in ("shuffled", "unshuffled"):
        case = saved[name]
        assert case["state"]["version"] == 1
        loader = build_loader(str(CORPUS), tokenizer=tok, **case["kwargs"])
        with pytest.warns(UserWarning, match="source='data/corpus'"):    # saved as a relative path
            loader.load_state_dict(case["state"])
        got = [next(loader)["input_ids"].tolist() for _ in range(3)]
        assert got == case["next_input_ids"], name
