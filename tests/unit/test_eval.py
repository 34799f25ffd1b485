"""Evaluation pieces on one process: position buckets, haystacks, the passkey task's checks, the
config keys and their one-line errors, tables in metrics.jsonl and W&B, the plots."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from tsp_trainer.config import load_config, validate_config
from tsp_trainer.data import load_tokenizer
from tsp_trainer.eval import HaystackBuilder, PasskeyTask, PositionLossAccumulator, bucket_edges
from tsp_trainer.eval.haystack import QUESTION
from tsp_trainer.model.transformer import TokenStats
from tsp_trainer.observability import JsonlSink, LineChart, MetricTable
from tsp_trainer.observability.wandb_sink import _loggable


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("data/tokenizer")


def test_bucket_edges_are_powers_of_two_up_to_seq_len():
    assert bucket_edges(1) == [0, 1]
    assert bucket_edges(2) == [0, 1, 2]
    assert bucket_edges(256) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket_edges(100) == [0, 1, 2, 4, 8, 16, 32, 64, 100]
    assert bucket_edges(131072)[-2:] == [65536, 131072] and len(bucket_edges(131072)) == 19
    with pytest.raises(ValueError, match="seq_len=0"):
        bucket_edges(0)


def test_accumulator_buckets_by_global_position_and_skips_ignored_labels():
    acc = PositionLossAccumulator(8)
    positions = torch.tensor([0, 1, 6, 7])                     # a zigzag rank's tokens
    labels = torch.tensor([[5, -100, 5, 5], [5, 5, 5, 5]])
    loss = torch.tensor([[1.0, 100.0, 3.0, 5.0], [2.0, 4.0, 6.0, 8.0]])
    acc.add(TokenStats(loss, torch.zeros_like(labels)), labels, positions)
    result = acc.reduce([])
    assert result.edges == (0, 1, 2, 4, 8)
    assert result.tokens == (2.0, 1.0, 0.0, 4.0)
    assert result.loss_sums == (3.0, 4.0, 0.0, 22.0)
    assert result.rows() == [(0, 0, 1.5, 2), (1, 1, 4.0, 1), (2, 3, None, 0), (4, 7, 5.5, 4)]
    assert result.mean_loss == pytest.approx(29.0 / 7)
    with pytest.raises(ValueError, match="position 9 is beyond"):
        acc.add(TokenStats(loss, labels), labels, torch.tensor([0, 1, 2, 9]))


def test_haystack_layout_key_and_labels(tok):
    filler = list(range(300, 700))
    builder = HaystackBuilder(tok, filler, digits=5, seed=0)
    for depth in (0.0, 0.5, 1.0):
        s = builder.build(200, depth, 3)
        assert s.input_ids.shape == s.labels.shape == (200,)
        k = len(s.key_ids)
        # labels: the key's tokens at the last k positions, ignored elsewhere
        assert s.labels[-k:].tolist() == list(s.key_ids)
        assert (s.labels[:-k] == -100).all()
        assert list(s.key_positions) == list(range(200 - k, 200))
        ids = s.input_ids.tolist() + [s.key_ids[-1]]
        assert ids[-k:] == list(s.key_ids)                          # the answer
        assert ids[s.needle_at + 4:s.needle_at + 4 + k] == list(s.key_ids)   # the needle holds it
        question = tok.encode(QUESTION)
        assert ids[-k - len(question):-k] == question
        assert s.key == builder.key_for(3)[0] and len(s.key) == 5
    # depth moves the needle through the filler: 0 right after the intro, 1 right before the question
    starts = [builder.build(200, d, 3).needle_at for d in (0.0, 0.5, 1.0)]
    assert starts[0] == len(builder.prefix) and starts[0] < starts[1] < starts[2]
    end = builder.build(200, 1.0, 3)
    needle_len = sum(len(p) for p in builder.needle_parts) + 2 * len(end.key_ids)
    assert end.needle_at + needle_len == 201 - len(question) - len(end.key_ids)
    # the same sample has the same key in every cell; other samples have other keys
    assert builder.build(120, 0.25, 3).key == s.key != builder.build(200, 0.0, 4).key
    # deterministic: a second builder gives the same haystack
    again = HaystackBuilder(tok, filler, digits=5, seed=0).build(200, 0.5, 3)
    assert torch.equal(again.input_ids, builder.build(200, 0.5, 3).input_ids)


def test_haystack_wraps_a_short_filler_and_refuses_a_too_short_length(tok):
    builder = HaystackBuilder(tok, [400, 401, 402], digits=3, seed=1, bos_id=1)
    s = builder.build(300, 0.5, 0)
    assert s.input_ids[0] == 1                                   # bos first
    assert set(s.input_ids.tolist()) >= {400, 401, 402}
    need = builder.min_length(4)
    with pytest.raises(ValueError, match=f"passkey length {need - 1} is shorter .* use lengths >= {need}"):
        PasskeyTask((300, need - 1), (0.0,), 4, builder)
    PasskeyTask((need,), (0.0, 1.0), 4, builder).builder.build(need, 1.0, 3)   # fits exactly
    with pytest.raises(ValueError, match="filler text gave no tokens"):
        HaystackBuilder(tok, [], digits=3).build(300, 0.5, 0)


def _cfg(*overrides):
    return load_config("recipes/tiny_cpu.yaml", list(overrides))


@pytest.mark.parametrize("overrides,match", [
    (["eval.passkey_every=10", "eval.passkey_lengths=[256,250]"],
     r"eval.passkey_lengths\[1\]=250 is not divisible by 2 x parallel.tsp_degree = 4 .*use a multiple "
     r"of 4, e.g. 248 or 252"),
    (["eval.passkey_every=10", "parallel.scheme=tp_sp", "eval.passkey_lengths=[129]"],
     r"eval.passkey_lengths\[0\]=129 is not divisible by parallel.tsp_degree=2"),
    (["eval.passkey_every=10", "eval.passkey_depths=[0.5,1.5]"],
     r"eval.passkey_depths\[1\]=1.5 must be a number in \[0, 1\]"),
    (["eval.passkey_every=10", "eval.passkey_depths=[]"], r"needs at least one depth"),
    (["eval.passkey_lengths=[256,256]"], r"eval.passkey_lengths=\[256, 256\] lists 256 more than once"),
    (["eval.passkey_every=-1"], r"eval.passkey_every=-1 must be an integer >= 0"),
    (["eval.passkey_samples=0"], r"eval.passkey_samples=0 must be an integer >= 1"),
    (["eval.passkey_every=10", "eval.passkey_lengths=[0]"], r"eval.passkey_lengths\[0\]=0 must be an integer >= 1"),
    (["eval.passkey_every=10", "data.seq_len=250", "data.micro_batch_size=1"], r"data.seq_len=250 is not divisible"),
])
def test_eval_config_errors_name_the_key_the_value_and_the_rule(overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        validate_config(_cfg(*overrides), 4)
    assert "\n" not in str(err.value)


def test_eval_config_loads_lists_and_refuses_wrong_types():
    cfg = _cfg("eval.passkey_every=20", "eval.passkey_lengths=[256,512]", "eval.passkey_depths=[0,1]")
    validate_config(cfg, 4)
    assert cfg.eval.passkey_lengths == [256, 512] and cfg.eval.passkey_depths == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"'eval.passkey_lengths'=\['a'\] must be a list of ints"):
        _cfg("eval.passkey_lengths=[a]")
    with pytest.raises(ValueError, match="did you mean 'eval.passkey_every'"):
        _cfg("eval.passkey_evry=3")


def _table():
    return MetricTable(("position_start", "position_end", "loss", "tokens"),
                       ((0, 0, 6.5, 8), (1, 1, float("nan"), 0), (2, 3, 5.25, 16)),
                       LineChart("position_end", "loss", "eval loss by position"))


def test_metric_table_in_metrics_jsonl(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(5, {"eval/loss": 5.5, "eval/loss_by_position": _table()})
    sink.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["eval/loss_by_position"] == {
        "columns": ["position_start", "position_end", "loss", "tokens"],
        "rows": [[0, 0, 6.5, 8], [1, 1, None, 0], [2, 3, 5.25, 16]]}
    with pytest.raises(ValueError, match="has 2 values"):
        MetricTable(("a", "b", "c"), ((1, 2),))
    with pytest.raises(ValueError, match=r"line chart column\(s\) \['z'\]"):
        MetricTable(("a",), ((1,),), LineChart("a", "z", "t"))


def test_metric_table_becomes_a_wandb_table_and_line_chart():
    """The sink's conversion, against a stand-in of wandb's API (Table, plot.line)."""
    calls = []
    fake = types.SimpleNamespace(
        Table=lambda columns, data: ("Table", tuple(columns), tuple(map(tuple, data))),
        plot=types.SimpleNamespace(line=lambda table, x, y, title: calls.append((table, x, y, title)) or "chart"))
    out = _loggable({"eval/loss": 5.5, "eval/loss_by_position": _table(), "mfu": None}, fake)
    assert out["eval/loss"] == 5.5 and "mfu" not in out
    assert out["eval/loss_by_position"] == ("Table", ("position_start", "position_end", "loss", "tokens"),
                                            ((0, 0, 6.5, 8), (1, 1, None, 0), (2, 3, 5.25, 16)))
    assert out["eval/loss_by_position_chart"] == "chart"
    # the chart's own table drops the empty bucket (W&B cannot draw a null)
    assert calls == [(("Table", ("position_end", "loss"), ((0, 6.5), (3, 5.25))), "position_end", "loss",
                      "eval loss by position")]


def test_real_wandb_takes_the_table_offline(tmp_path, monkeypatch):
    """wandb 0.31 itself accepts the table and the chart (offline run, no network)."""
    from tsp_trainer.observability import make_sinks

    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = make_sinks(global_rank=0, wandb_mode="offline", project="tsp-test", run_name="tables",
                      config={}, output_dir=tmp_path, console=False)
    sink.log(1, {"eval/loss": 5.5, "eval/loss_by_position": _table()})
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert "wandb" in sys.modules



def test_passkey_filler_defaults_to_the_held_out_text_and_a_mixture_must_name_one():
    from tsp_trainer.eval.evaluator import filler_source

    on = "eval.passkey_every=10"
    assert filler_source(_cfg(on)) == ("data/corpus", "validation")
    assert filler_source(_cfg(on, "data.eval_source=held/out")) == ("held/out", "validation")
    assert filler_source(_cfg(on, "data.eval_split=null")) == ("data/corpus", "train")
    assert filler_source(_cfg(on, "eval.passkey_filler=books", "eval.passkey_filler_split=test")) == \
        ("books", "test")
    mixture = _cfg(on, "data.source=null", "data.sources=[{source: a, weight: 1}]")
    with pytest.raises(ValueError, match=r"eval.passkey_every=10 needs haystack text: set "
                                         r"eval.passkey_filler"):
        filler_source(mixture)
