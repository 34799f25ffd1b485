"""experiments/tiling_cost.py (the measured side of docs/long_context/longest_context.md's 128K cost table) runs
end to end at a tiny size, so it cannot rot: every variant gives the untiled loss (tiling changes
the order of sums only) and a ratio per variant over its interleaved steps."""

import pytest

from tests.helpers.experiments import load_experiment

pytestmark = pytest.mark.distributed


def test_tiling_cost_reports_each_variant_against_the_untiled_step():
    script = load_experiment("tiling_cost")
    out = script.main(["--degree", "2", "--seq-len", "64", "--chunks", "4", "--steps", "2"])
    variants = out["variants"]
    assert list(variants) == ["untiled", "tiled loss", "tiled MLP", "tiled loss + MLP"]
    assert variants["tiled MLP"]["mlp_chunk_tokens"] == 8          # 32 local tokens in 4 chunks
    base = variants["untiled"]["first_loss"]
    assert all(v["first_loss"] == pytest.approx(base, rel=1e-6) for v in variants.values())
    for spread in out["ratios"].values():
        assert spread["repeats"] == 2 and 0 < spread["min"] <= spread["median"] <= spread["max"]
