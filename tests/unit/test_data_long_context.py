"""Long-context controls: a sequence-length schedule (shapes by step, the token
stream continuous across a stage boundary, resume across it exact, TSP's 2D | seq_len rule per
stage at config time), long-document upsampling, and BOS that follows the tokenizer."""

from __future__ import annotations

import json

import pytest

from tests.unit.data_helpers import (CORPUS, TOKENIZER, assert_same_batches, take, tiny_config,
                                     write_jsonl)
from tsp_trainer.config import validate_config
from tsp_trainer.config.schema import DataSection, LengthStageSection, UpsampleSection
from tsp_trainer.data import (LengthSchedule, LengthStage, PrefetchLoader, build_loader,
                              build_train_loader, load_tokenizer)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


def _stream(batches) -> list[int]:
    """The packed token stream, whatever the window length (windows overlap by one token)."""
    out = []
    for b in batches:
        for ids, labels in zip(b["input_ids"], b["labels"]):
            if out:
                assert out[-1] == int(ids[0])
            else:
                out.append(int(ids[0]))
            out += labels.tolist()
    return out


SCHEDULE = LengthSchedule([LengthStage(0, 32, 4), LengthStage(3, 64, 2), LengthStage(5, 128, 1)],
                          batches_per_step=2)


def test_schedule_shapes_by_step_and_a_continuous_stream(tok):
    assert [SCHEDULE.shape_of_batch(b) for b in range(12)] == \
        [(32, 4)] * 6 + [(64, 2)] * 4 + [(128, 1)] * 2
    assert SCHEDULE.seq_len_at(2) == 32 and SCHEDULE.seq_len_at(3) == 64 and SCHEDULE.max_seq_len == 128
    staged = take(build_loader(str(CORPUS), tokenizer=tok, seq_len=128, micro_batch_size=1,
                               schedule=SCHEDULE), 14)
    assert [tuple(b["input_ids"].shape) for b in staged] == \
        [(4, 32)] * 6 + [(2, 64)] * 4 + [(1, 128)] * 4
    plain = take(build_loader(str(CORPUS), tokenizer=tok, seq_len=32, micro_batch_size=1), 64)
    got = _stream(staged)
    assert got == _stream(plain)[:len(got)]            # nothing lost or repeated at a boundary


def test_resume_across_a_stage_boundary_with_prefetch_is_exact(tok):
    kw = dict(tokenizer=tok, seq_len=128, micro_batch_size=1, shuffle=True, shuffle_buffer=8,
              seed=2, schedule=SCHEDULE)
    reference = take(build_loader(str(CORPUS), **kw), 14)
    first = PrefetchLoader(build_loader(str(CORPUS), **kw), depth=2)
    got = take(first, 5)                                 # mid-stage 0; the queue crosses into 1
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    second = build_loader(str(CORPUS), **kw)
    second.load_state_dict(state)
    got += take(second, 9)
    assert_same_batches(got, reference)


def test_schedule_rules_checked_at_config_time():
    ok = tiny_config(["train.steps=10", "data.seq_len=64",
                      "data.seq_len_schedule=[{start_step: 0, seq_len: 16, micro_batch_size: 8}, "
                      "{start_step: 4, seq_len: 64}]"])
    validate_config(ok, 4)
    bad = tiny_config(["train.steps=10", "data.seq_len=64",
                       "data.seq_len_schedule=[{start_step: 0, seq_len: 18}, {start_step: 4, seq_len: 64}]"])
    with pytest.raises(ValueError) as err:
        validate_config(bad, 4)               # tsp_degree 2: zigzag needs 4 | seq_len
    assert str(err.value).startswith("data.seq_len_schedule[0].seq_len=18 is not divisible by "
                                      "2 x parallel.tsp_degree = 4")
    assert "\n" not in str(err.value)
    late = tiny_config(["train.steps=10", "data.seq_len=64",
                        "data.seq_len_schedule=[{start_step: 0, seq_len: 16}, {start_step: 12, seq_len: 64}]"])
    with pytest.raises(ValueError, match=r"start_step=12 is not before train.steps=10"):
        validate_config(late, 4)


def test_long_documents_are_upsampled_with_a_gap(tmp_path, tok):
    texts = [("long " * 40 if i % 5 == 0 else "short") + f" doc{i}" for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    data = DataSection(source=str(path), tokenizer=str(TOKENIZER), seq_len=16, micro_batch_size=1,
                       prefetch=0, upsample=UpsampleSection(min_tokens=30, factor=3.0, gap_docs=4))
    loader = build_train_loader(data, tokenizer=tok, dp_rank=0, dp_degree=1, seed=0, grad_accum=1)
    docs = tok.decode(_stream(take(loader, 60))).split("<|endoftext|>")[:-1]
    assert docs[:5] == [texts[0], texts[1], texts[2], texts[3], texts[0]]   # copy 4 docs later
    seen = {t: docs.count(t) for t in texts if t in docs[:30]}
    assert seen[texts[0]] == 3 and seen[texts[5]] == 3 and seen[texts[1]] == 1
    stats = loader.stats
    assert stats["long_docs"] >= 2 and stats["long_doc_copies"] >= 4
    assert "trained on 3x on average" in loader.describe()[0]
    # Resume with copies pending is exact.
    reference = take(build_train_loader(data, tokenizer=tok, dp_rank=0, dp_degree=1, seed=0,
                                        grad_accum=1), 30)
    first = build_train_loader(data, tokenizer=tok, dp_rank=0, dp_degree=1, seed=0, grad_accum=1)
    got = take(first, 11)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["documents"]["pending"]
    second = build_train_loader(data, tokenizer=tok, dp_rank=0, dp_degree=1, seed=0, grad_accum=1)
    second.load_state_dict(state)
    assert_same_batches(got + take(second, 19), reference)


def test_fractional_upsampling_factor(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [("long " * 40) + f"doc{i}" for i in range(400)])
    data = DataSection(source=str(path), tokenizer=str(TOKENIZER), seq_len=64, micro_batch_size=4,
                       prefetch=0, upsample=UpsampleSection(min_tokens=30, factor=1.5, gap_docs=8))
    loader = build_train_loader(data, tokenizer=tok, dp_rank=0, dp_degree=1, seed=0, grad_accum=1)
    take(loader, 150)
    stats = loader.stats
    assert stats["long_doc_copies"] / stats["long_docs"] == pytest.approx(0.5, abs=0.1)


def _bos_tokenizer(folder, *, post_processor: bool, add_bos_token=None):
    """The bundled BPE plus a "<s>" token, added to texts by the post-processor (Llama-style) or
    named only in tokenizer_config.json."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    folder.mkdir()
    t = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    t.add_special_tokens(["<s>"])
    bos = t.token_to_id("<s>")
    if post_processor:
        t.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    t.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": "<s>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return bos


def test_bos_follows_the_tokenizer(tmp_path, tok):
    bos = _bos_tokenizer(tmp_path / "llama_like", post_processor=True)
    llama = load_tokenizer(tmp_path / "llama_like")
    assert llama.bos_id == bos and tok.bos_id is None          # the bundled GPT-2-style BPE: none
    path = write_jsonl(tmp_path / "d.jsonl", ["first doc", "second doc"])
    stream = _stream(take(build_loader(str(path), tokenizer=llama, seq_len=8, micro_batch_size=1), 2))
    first, second = llama.encode("first doc"), llama.encode("second doc")
    assert stream[:len(first) + len(second) + 4] == [bos, *first, 0, bos, *second, 0]
    # add_bos_token in tokenizer_config.json decides both ways.
    assert load_tokenizer(_dir(tmp_path, "off", post_processor=True, add_bos_token=False)).bos_id is None
    assert load_tokenizer(_dir(tmp_path, "on", post_processor=False, add_bos_token=True)).bos_id == bos


def _dir(tmp_path, name, **kw):
    _bos_tokenizer(tmp_path / name, **kw)
    return tmp_path / name


def test_length_stage_section_defaults_micro_batch(tok):
    from tsp_trainer.data import length_schedule

    data = DataSection(seq_len=64, micro_batch_size=3,
                       seq_len_schedule=[LengthStageSection(0, 32, 6), LengthStageSection(2, 64)])
    assert length_schedule(data, grad_accum=1).to_list() == [[0, 32, 6], [2, 64, 3]]
