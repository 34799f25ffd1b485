"""Replicated weights under TSP (every norm, the o_proj / down_proj biases) train on gradients
summed over the tsp group in ONE flattened fp32 all-reduce per backward, after the rest of the
backward; the summed gradients equal one process's (rtol 1e-5 / atol 1e-6)."""

import pytest
import torch

from tests.distributed.tsp_cases import make_batch, reference, tsp_rank
from tests.helpers.dist import run_on_ranks
from tsp_trainer.config import model_config

pytestmark = pytest.mark.distributed


def _replicated(name: str) -> bool:
    return name.endswith(("norm.weight", "o_proj.bias", "down_proj.bias"))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_replicated_gradients_are_summed_in_one_all_reduce(checkpointing):
    cfg = model_config("tiny", num_layers=2, num_heads=8, num_kv_heads=4, qkv_bias=True, o_bias=True,
                       mlp_bias=True)
    layers, h = cfg.num_layers, cfg.hidden_size
    ids, labels = make_batch(cfg, 2, 16)
    ref = reference(cfg, 3, ids, labels)
    names = [n for n in ref["grads"] if _replicated(n)]
    assert len(names) == (2 * layers + 1) + 2 * layers      # one all-reduce each, summed one at a time
    outs = run_on_ranks(tsp_rank, 2, cfg, 3, ids, labels, 1, 0, 1e-2, False, "adamw", "full", "auto",
                        checkpointing)
    for o in outs:
        reduces = [(r.tag, r.nbytes, r.dtype) for r in o["ledger"]
                   if r.op == "all_reduce" and r.tag != "loss.count"]
        assert reduces == [("replicated.grad", len(names) * h * 4, "float32")]
        for name in names:
            torch.testing.assert_close(o["grads"][name], ref["grads"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
