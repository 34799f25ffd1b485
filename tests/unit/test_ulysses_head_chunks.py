"""parallel.ulysses_head_chunks: counts the rule refuses exit 2 with one line naming the key, the
value and the rule before start-up; `auto` (plan/auto.py) takes 1 when the run fits whole, else the
fewest chunks whose predicted peak fits (the peers' model of ulysses against upipe, plan/peers.py),
and resolves to 1 for any other scheme. The runs themselves: tests/distributed/test_ulysses_parity.py."""

from __future__ import annotations

import pytest

from tsp_trainer import cli
from tsp_trainer.config import load_config
from tsp_trainer.config.model import model_config
from tsp_trainer.config.validate import ulysses_head_chunk_counts
from tsp_trainer.plan.auto import GIB, AutoSettingsError, Budget, choose_memory_settings
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.resolve import resolve_run

TINY = ["recipes/tiny_cpu.yaml", "parallel.scheme=ulysses", "parallel.head_buckets=1"]   # 4 heads, 2 KV


@pytest.mark.parametrize("overrides,rule", [
    (["parallel.ulysses_head_chunks=4"], "does not divide the model.num_heads / parallel.tsp_degree = 4 / 2 = 2 "
                                         "query heads per rank"),
    (["parallel.ulysses_head_chunks=3"], "does not divide the model.num_heads / parallel.tsp_degree"),
    (["parallel.scheme=tsp", "parallel.ulysses_head_chunks=2"], "is only used by parallel.scheme='ulysses' "
                                                                "(got 'tsp'); set it to 1 or auto"),
    (["parallel.ulysses_head_chunks=0"], "must be an integer >= 1"),
])
def test_bad_head_chunks_exit_2_with_one_line(overrides, rule, capsys, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        cli.check_main(["--world-size", "4", *TINY, *overrides, f"train.output_dir={out}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    value = overrides[-1].split("=")[1]
    assert len(err) == 1 and f"parallel.ulysses_head_chunks={value}" in err[0] and rule in err[0], err
    assert not out.exists()


def test_the_counts_keep_each_chunk_a_multiple_of_d_and_its_kv_heads_whole():
    llama = model_config("llama3_8b")                            # 32 heads, 8 K/V heads
    assert ulysses_head_chunk_counts(llama, 8) == [1, 2, 4]
    assert ulysses_head_chunk_counts(llama, 4) == [1, 2, 4, 8]
    gqa = llama.replace(num_kv_heads=2)                          # K/V heads fewer than D
    assert ulysses_head_chunk_counts(gqa, 4) == [1, 2, 4, 8]     # repeated up to D in each chunk
    odd = llama.replace(num_heads=24, num_kv_heads=6, hidden_size=24 * 128)
    assert ulysses_head_chunk_counts(odd, 3) == [1, 2]           # 4 chunks would cut K/V head groups


def test_auto_takes_one_when_it_fits_else_the_fewest_chunks_that_fit():
    """Llama-3.1-8B, ulysses over D = 8 at 1M tokens with checkpointing (CUDA's route, bf16):
    the predicted peak falls with the chunks; a budget above the whole peak gives 1, one between
    the peaks of c and the next fewer count gives c, one below every peak is refused naming the
    most chunks."""
    cfg = load_config(None, ["model.size=llama3_8b", "parallel.scheme=ulysses", "parallel.tsp_degree=8",
                             "parallel.head_buckets=1", "data.seq_len=1048576", "data.micro_batch_size=1",
                             "train.grad_accum=1", "train.dtype=bf16", "train.activation_checkpointing=true"])
    hw = get_profile("h100")

    def choose(budget: float, chunks: str = "auto"):
        run = load_config(None, [*_overrides(cfg), f"parallel.ulysses_head_chunks={chunks}"])
        return choose_memory_settings(run, world_size=8, budget=Budget(budget, "train.memory_budget_gib"),
                                      cuda=True, hw=hw)

    roomy = 10_000 * GIB
    peak = {c: choose(roomy, str(c)).peak for c in (1, 2, 4)}
    assert peak[1] > peak[2] > peak[4]                           # the premise
    assert choose(roomy).ulysses_head_chunks == 1
    assert choose(peak[1]).ulysses_head_chunks == 1
    assert choose((peak[1] + peak[2]) / 2).ulysses_head_chunks == 2
    chosen = choose((peak[2] + peak[4]) / 2)
    assert chosen.ulysses_head_chunks == 4 and "ulysses_head_chunks=4 (predicted peak" in chosen.line()
    assert chosen.apply(cfg).parallel.ulysses_head_chunks == 4
    with pytest.raises(AutoSettingsError, match="ulysses_head_chunks=4\\)"):
        choose(peak[4] * 0.99)


def _overrides(cfg) -> list[str]:
    return ["model.size=llama3_8b", "parallel.scheme=ulysses", "parallel.tsp_degree=8", "parallel.head_buckets=1",
            f"data.seq_len={cfg.data.seq_len}", "data.micro_batch_size=1", "train.grad_accum=1", "train.dtype=bf16",
            "train.activation_checkpointing=true", "train.attention_gqa=fused"]


@pytest.mark.parametrize("scheme,degree", [("tsp", 2), ("ulysses", 1)])
def test_auto_is_one_where_nothing_is_split(scheme, degree):
    cfg = load_config("recipes/tiny_cpu.yaml", [f"parallel.scheme={scheme}", f"parallel.tsp_degree={degree}"])
    assert cfg.parallel.ulysses_head_chunks == "auto"
    assert resolve_run(cfg, world_size=2, cuda=False).cfg.parallel.ulysses_head_chunks == 1
