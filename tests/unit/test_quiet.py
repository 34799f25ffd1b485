"""Quiet launches: a warning is one line (no echoed source line); a setting the user chose is not
warned about; a small local source split by example (the bundled data, `tsp-eval
retrieval-corpus` output) streams without the shard warning."""

import json
import os
import warnings

from tsp_trainer import cli
from tsp_trainer.data import streaming
from tsp_trainer.data.streaming import open_text_stream


def test_warnings_are_one_line_naming_the_program(monkeypatch):
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)   # restored afterwards
    cli._quiet_known_warnings("tsp-launch")
    ours = warnings.formatwarning("data.x: do this", UserWarning,
                                  f"{os.sep}repo{os.sep}tsp_trainer{os.sep}data{os.sep}loader.py", 12,
                                  line="    warnings.warn(...)")
    assert ours == "tsp-launch: warning: data.x: do this\n"
    theirs = warnings.formatwarning("something", UserWarning, "/site-packages/torch/nn/x.py", 7,
                                    line="    warnings.warn(...)")
    assert theirs == "tsp-launch: warning: something (UserWarning, x.py:7)\n"


def test_a_small_one_file_source_streams_without_the_shard_warning(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(6)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        texts = [row["text"] for row in open_text_stream(path, dp_rank=1, dp_degree=2)]
    assert texts == ["doc 1", "doc 3", "doc 5"]                 # the same example split
    assert streaming._local_bytes(str(tmp_path)) == path.stat().st_size
    assert streaming._local_bytes("org/some-hub-dataset") == float("inf")
