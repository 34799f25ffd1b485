"""A data warning is a fact about the job's source, the same on every rank: a 4-rank job (dp 2 x
tsp 2) reading a one-file source prints the num_shards warning once (rank 0), not once per rank."""

from __future__ import annotations

import json
import warnings

import pytest

from tests.helpers.dist import run_on_ranks
from tsp_trainer.data import streaming
from tsp_trainer.data import open_text_stream

pytestmark = pytest.mark.distributed


def _open_and_count_warnings(rank, world, path):
    """This rank's DP share of `path` (dp 2 x tsp 2: dp rank = rank // 2), and the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        texts = [row["text"] for row in open_text_stream(path, dp_rank=rank // 2, dp_degree=2)]
    return {"texts": texts, "warnings": [str(w.message) for w in caught]}


def test_num_shards_warning_is_printed_once_per_job(tmp_path, monkeypatch):
    # as if the file were large (the forked ranks inherit it)
    monkeypatch.setattr(streaming, "SMALL_SOURCE_BYTES", 0)
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(6)))
    outs = run_on_ranks(_open_and_count_warnings, 4, str(path))
    assert [len(o["warnings"]) for o in outs] == [1, 0, 0, 0]
    assert "num_shards=1, not a multiple of dp_degree=2" in outs[0]["warnings"][0]
    # the split itself is unchanged on the ranks that stay quiet
    assert [o["texts"] for o in outs] == [["doc 0", "doc 2", "doc 4"]] * 2 + [["doc 1", "doc 3", "doc 5"]] * 2
