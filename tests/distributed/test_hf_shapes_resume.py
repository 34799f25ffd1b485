"""A Qwen3 folder (q/k norms, head_dim 16 != hidden / heads) with a prime vocabulary (1,031 rows,
padded inside to a multiple of D) and one K/V head (MQA: a copy on every rank) through the
Trainer: `model.init_from` at D = 2, a checkpoint at step 2, resumed at D = 4 (the padded
vocabulary rows, the K/V head's copies and the AdamW moments resharded): steps 3 and 4 give the
losses of the uninterrupted D = 2 run (rel 1e-6: only fp32 summation order differs), and
tsp-export writes the 1,031-row, one-K/V-head Qwen3 that transformers loads with our logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.distributed.trainer_cases import REPO, train_rank
from tests.helpers import hf_shapes
from tests.helpers.dist import run_on_ranks
from tsp_trainer.checkpoint.export_cli import main as export_main
from tsp_trainer.checkpoint.shards import read_full_state_dict
from tsp_trainer.config.model import ModelConfig
from tsp_trainer.model import Transformer

pytestmark = pytest.mark.distributed


def test_qwen3_prime_vocabulary_mqa_resumes_under_another_degree_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "hf"
    hf_shapes.save_tiny(folder, "qwen3_vocab_prime", num_key_value_heads=1)
    for f in (REPO / "data" / "tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    common = ["model.size=null", "data.tokenizer=null", f"model.init_from={folder}", "train.steps=4",
              "data.seq_len=64", "model.max_seq_len=128"]
    whole = run_on_ranks(train_rank, 2, common + ["parallel.tsp_degree=2", "checkpoint.every=2",
                                                  "checkpoint.keep_last=4",
                                                  f"train.output_dir={tmp_path / 'd2'}"], False)[0]
    step2 = tmp_path / "d2" / "checkpoints" / "step_00000002"
    resumed = run_on_ranks(train_rank, 4, common + ["parallel.tsp_degree=4", f"train.resume={step2}",
                                                    f"train.output_dir={tmp_path / 'd4'}"], False)[0]
    assert resumed["step"] == 4
    print(f"\nqwen3 vocab 1031, 1 K/V head: D=2 losses {whole['losses']}, resumed at D=4 {resumed['losses']}")
    assert resumed["losses"] == pytest.approx(whole["losses"][2:], rel=1e-6)

    ckpt = tmp_path / "d4" / "checkpoints" / "step_00000004"
    export_main([str(ckpt), str(tmp_path / "out")])
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out["model_type"], out["vocab_size"], out["head_dim"], out["num_key_value_heads"]) == \
        ("qwen3", 1031, 16, 1)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ours = Transformer(ModelConfig.from_dict(json.loads((ckpt / "meta.json").read_text())["model"]))
    ours.load_state_dict(read_full_state_dict(ckpt / "model"))
    ids = torch.randint(0, 1031, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), rtol=1e-5, atol=1e-6)
