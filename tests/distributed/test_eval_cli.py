"""`tsp-eval` on real model sources: an imported Hugging Face folder's loss by position equals what
transformers gives; passkey on a trained checkpoint gives the same predictions on 1 process and
under TSP D = 2 (resharded from the training layout); the report files; bad input fails with one
line before any process group; the CLI runs as a user runs it (subprocess, and torchrun)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist import run_on_ranks
from tsp_trainer.data import iterate_eval_batches, load_tokenizer
from tsp_trainer.eval import bucket_edges
from tsp_trainer.eval import cli as eval_cli

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOKENIZER = REPO / "data" / "tokenizer"
CORPUS = str(REPO / "data" / "corpus")


def _cli_rank(rank, world, argv):
    """prepare + run as tsp_trainer/cli.py does (the launcher helper owns the process group)."""
    args = eval_cli.build_parser().parse_args(argv)
    job = eval_cli.prepare(args, world_size=world, rank=rank)
    return eval_cli.run(job, rank=rank)


def _transformers_buckets(hf, tok, *, seq_len, batch, batches, dp):
    """The loss per position bucket from transformers' logits, on the batches tsp-eval reads."""
    edges = bucket_edges(seq_len)
    sums, tokens = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for r in range(dp):
        for b in iterate_eval_batches(CORPUS, tokenizer=tok, seq_len=seq_len, micro_batch_size=batch,
                                      num_batches=batches, split="validation", dp_rank=r, dp_degree=dp):
            with torch.no_grad():
                logits = hf(input_ids=b["input_ids"]).logits.float()
            loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none").view(b["labels"].shape)
            for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
                sums[i] += float(loss[:, lo:hi].double().sum())
                tokens[i] += loss[:, lo:hi].numel()
    return sums, tokens


@pytest.mark.parametrize("model_type,extra,world,degree", [
    ("llama", dict(attention_bias=True, mlp_bias=True, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), 2, 2),
    ("qwen2", dict(rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 16}), 2, 1),
], ids=["llama3_bias_tsp2", "qwen2_yarn_dp2"])
def test_imported_model_loss_by_position_equals_transformers(tmp_path, model_type, extra, world, degree):
    """A tiny random transformers model saved to a folder: `tsp-eval loss` (TSP D=2, or DP=2) gives
    per-bucket losses equal to transformers' own per-token losses bucketed the same way (fp32,
    rtol 1e-5), token counts exactly."""
    from tests.helpers.hf_models import tiny_hf

    folder = tmp_path / model_type
    hf = tiny_hf(folder, model_type, vocab_size=1024, max_position_embeddings=128, **extra)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    argv = ["loss", str(folder), "--seq-len", "128", "--batches", "2", "--micro-batch-size", "2",
            "--tsp-degree", str(degree), "--text", CORPUS, "--split", "validation",
            "--out", str(tmp_path / "out")]
    results = run_on_ranks(_cli_rank, world, argv)
    sums, tokens = _transformers_buckets(hf, load_tokenizer(folder), seq_len=128, batch=2, batches=2,
                                         dp=world // degree)
    for got in results:
        assert list(got.tokens) == tokens
        torch.testing.assert_close(torch.tensor(got.loss_sums, dtype=torch.float64),
                                   torch.tensor(sums, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    results = tmp_path / "out" / model_type                  # --out/<the folder's name>
    record = json.loads((results / "loss_by_position.json").read_text())
    assert record["kind"] == "hf" and record["layout"]["tsp_degree"] == degree
    assert record["trained_layout"] is None and record["document_masking"] is None
    assert [b["tokens"] for b in record["buckets"]] == tokens
    assert (results / "loss_by_position.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def checkpoint(evaluated_run):
    """A tiny model trained 2 steps under DP=2 x TSP=2 (4 ranks): the session's evaluated run."""
    return evaluated_run


def test_passkey_on_a_checkpoint_is_the_same_on_one_process_and_tsp2(tmp_path, checkpoint):
    """The run folder resolves to its latest checkpoint, trained under DP=2 x TSP=2; evaluated on
    one process and under TSP D=2 (its shards read into the new layout), the passkey predictions
    and cells are identical, and rank 0 writes the JSON and the heatmap."""
    argv = ["passkey", str(checkpoint), "--lengths", "128,192", "--depths", "0,1", "--samples", "3",
            "--digits", "3", "--micro-batch-size", "2"]
    one = run_on_ranks(_cli_rank, 1, argv + ["--out", str(tmp_path / "one")])[0]
    two = run_on_ranks(_cli_rank, 2, argv + ["--out", str(tmp_path / "two"), "--tsp-degree", "2"])
    dp = run_on_ranks(_cli_rank, 2, argv + ["--out", str(tmp_path / "dp"), "--tsp-degree", "1"])
    assert len(one.predictions) == 2 * 2 * 3
    for result in two + dp:
        _same_cells(result.cells, one.cells)               # dp: samples split, counts summed
    for result in two:
        assert result.predictions == one.predictions
    assert {**dp[0].predictions, **dp[1].predictions} == one.predictions
    results = tmp_path / "two" / checkpoint.name / "step_00000002"     # --out/<run>/<step>
    record = json.loads((results / "passkey.json").read_text())
    assert record["kind"] == "checkpoint" and record["model"].endswith("step_00000002")
    assert record["trained_layout"] == {"scheme": "tsp", "tsp_degree": 2, "dp_degree": 2,
                                        "world_size": 4, "zero_stage": record["trained_layout"]["zero_stage"]}
    assert record["layout"]["tsp_degree"] == 2 and record["layout"]["dp_degree"] == 1
    assert record["text"]["source"].endswith("data/corpus") and record["text"]["split"] == "validation"
    assert [(c["length"], c["depth"]) for c in record["cells"]] == [(128, 0.0), (128, 1.0), (192, 0.0), (192, 1.0)]
    assert (results / "passkey.png").stat().st_size > 10_000


def _same_cells(got, want):
    """Counts exactly; the key loss to fp32 summation order."""
    for a, b in zip(got, want, strict=True):
        assert (a.length, a.depth, a.samples, a.exact, a.tokens_right, a.key_tokens) == \
            (b.length, b.depth, b.samples, b.exact, b.tokens_right, b.key_tokens)
        assert a.nll_sum == pytest.approx(b.nll_sum, rel=1e-5)


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.mark.slow           # tsp-eval as subprocesses, one and two (~8 s); the in-process cases stay
def test_cli_as_a_user_runs_it(tmp_path, checkpoint):
    """`tsp-eval` on one process and under torchrun (2 processes, TSP D=2): the table on stdout,
    exit 0; bad input: exit 2 and one line naming the flag, before any process group."""
    out = tmp_path / "out"
    # the bad input beside the good run (it stops before anything is read or written)
    bad = subprocess.Popen([str(BIN / "tsp-eval"), "passkey", str(checkpoint), "--lengths", "129"],
                           cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ok = subprocess.run([str(BIN / "tsp-eval"), "passkey", str(checkpoint), "--lengths", "128",
                         "--depths", "0,0.5,1", "--samples", "2", "--out", str(out)],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    _, bad_err = bad.communicate(timeout=120)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "tsp-eval passkey: 100%" in ok.stderr and "6/6" in ok.stderr    # the progress bar
    results = out / checkpoint.name / "step_00000002"
    assert "mean accuracy" in ok.stdout and f"wrote {results / 'passkey.json'}" in ok.stdout
    lines = ok.stdout.splitlines()
    assert lines[1] == "trained at seq_len 64 under tsp D=2 x dp 2"
    assert lines[2] == f"evaluated under tsp D=1 x dp 1 on 1 process(es), fp32; text {CORPUS} [validation]"
    assert lines[3].split() == ["length", "depth", "accuracy", "token", "acc", "key", "nll"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", "-m",
                          "tsp_trainer", "eval", "passkey", str(checkpoint), "--lengths", "128",
                          "--depths", "0,0.5,1", "--samples", "2", "--out", str(tmp_path / "tr")],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "evaluated under tsp D=2 x dp 1 on 2 process(es)" in run.stdout
    same = json.loads((results / "passkey.json").read_text())["cells"]
    torchrun = tmp_path / "tr" / checkpoint.name / "step_00000002" / "passkey.json"
    for a, b in zip(json.loads(torchrun.read_text())["cells"], same, strict=True):
        assert a == {**b, "key_nll": pytest.approx(b["key_nll"], rel=1e-5)}
    assert bad.returncode == 2
    assert bad_err == ("tsp-eval: error: --lengths=129 is not divisible by 2 x --tsp-degree = 2 "
                          "(zigzag cuts each sequence into 2D chunks); use a multiple of 2, e.g. 128 "
                          "or 130\n")


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "130", "--tsp-degree", "2"], "--lengths=130 is not divisible by 2 x --tsp-degree = 4"),
    (["--lengths", "128", "--depths", "0,2", "--tsp-degree", "2"], "--depths 2.0: each depth must be in [0, 1]"),
    (["--lengths", "16", "--tsp-degree", "2"], "passkey length 16 is shorter than the haystack's fixed text"),
    (["--lengths", "128", "--tsp-degree", "3"], "world size 4 is not divisible by --tsp-degree=3"),
    (["--lengths", "128", "--scheme", "tp_sp", "--tsp-degree", "4", "--tp-degree", "2"],
     "--tp-degree=2 is only used by --scheme='tp_x_sp'"),
    (["--lengths", "128", "--samples", "0"], "--samples=0 must be >= 1"),
])
def test_bad_input_is_one_line_before_any_process_group(checkpoint, capsys, monkeypatch, argv, message):
    """In process, as a 4-process launch would see it: exit 2, one line, no process group."""
    import torch.distributed as dist

    from tsp_trainer.cli import eval_main

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        eval_main(["passkey", str(checkpoint), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not dist.is_initialized()


def test_a_missing_or_foreign_folder_is_named(tmp_path, capsys):
    from tsp_trainer.cli import eval_main

    (tmp_path / "empty").mkdir()
    for path, message in [(tmp_path / "nope", "does not exist"),
                          (tmp_path / "empty", "is neither a tsp_trainer checkpoint")]:
        with pytest.raises(SystemExit):
            eval_main(["passkey", str(path), "--lengths", "128"])
        assert message in capsys.readouterr().err


def test_an_earlier_result_is_refused_unless_overwrite(tmp_path, checkpoint, capsys):
    """An earlier passkey.json in the model's folder: one line naming it, exit 2, before any
    process group; --overwrite goes on (prepare passes)."""
    from tsp_trainer.cli import eval_main

    results = tmp_path / checkpoint.name / "step_00000002"
    results.mkdir(parents=True)
    (results / "passkey.json").write_text("{}")
    argv = ["passkey", str(checkpoint), "--lengths", "128", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        eval_main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"tsp-eval: error: {results / 'passkey.json'} exists (an earlier tsp-eval passkey of this "
        "model); pass --overwrite to replace it, or another --out\n")
    job = eval_cli.prepare(eval_cli.build_parser().parse_args(argv + ["--overwrite"]), world_size=1, rank=0)
    assert job.out == results
    loss = eval_cli.prepare(eval_cli.build_parser().parse_args(["loss", *argv[1:2], "--out", str(tmp_path)]),
                            world_size=1, rank=0)
    assert loss.out == results                        # another command's files are not in the way


def test_longer_than_max_seq_len_warns_once_naming_both(tmp_path, checkpoint, capfd):
    """The tiny model's max_seq_len is 1024: --seq-len 2048 runs (RoPE is computed for any
    position) and rank 0 prints one warning line naming both numbers; 1024 prints none."""
    argv = ["loss", str(checkpoint), "--seq-len", "2048", "--batches", "1", "--out", str(tmp_path)]
    run_on_ranks(_cli_rank, 2, argv + ["--tsp-degree", "2"])
    warnings = [line for line in capfd.readouterr().err.splitlines() if "tsp-eval: warning" in line]
    assert warnings == ["tsp-eval: warning: --seq-len 2048 is longer than the model's max_seq_len "
                        "1024: positions from 1024 on run (RoPE is computed for any position) but "
                        "the model was set up for fewer; this measures extrapolation"]
    job = eval_cli.prepare(eval_cli.build_parser().parse_args(
        ["loss", str(checkpoint), "--seq-len", "1024", "--out", str(tmp_path / "b")]), world_size=1, rank=0)
    assert job.warnings == []


def test_hf_folder_without_tokenizer_names_the_flag(tmp_path, capsys):
    from tests.helpers.hf_models import tiny_hf
    from tsp_trainer.cli import eval_main

    tiny_hf(tmp_path / "llama", "llama", vocab_size=1024, max_position_embeddings=128)
    capsys.readouterr()                               # transformers' own output while saving
    with pytest.raises(SystemExit) as exit_:
        eval_main(["loss", str(tmp_path / "llama"), "--seq-len", "128"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tsp-eval: error: Hugging Face folder {tmp_path / 'llama'} holds no tokenizer")
    assert err.endswith("pass --tokenizer with the tokenizer this model was trained with\n")
    assert "data.tokenizer" not in err and len(err.splitlines()) == 1
