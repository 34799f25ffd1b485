"""The analytic model against the real code on real gloo ranks (CPU, fp32): tsp-bench's measuring
rank (`bench.run.scheme_rank`: one forward + backward + AdamW step, ledger reset before the step,
peak activations from its live-tensor tracker) on 2 and 4 processes.

(a) per-rank communication: the ledger equals `communication.model_parallel_comm` exactly, every
    op and tag, with and without activation checkpointing;
(b) per-rank memory: parameters + gradients + AdamW state + peak activations within 10% of what
    the benchmark measures, and the peak activations alone within 10% too.
"""

from __future__ import annotations

import pytest

from tests.helpers.dist import ForkedCases
from tsp_trainer.bench.run import scheme_rank
from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.activations import activation_memory
from tsp_trainer.plan.communication import model_parallel_comm
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import FP32
from tsp_trainer.plan.state import state_bytes

pytestmark = pytest.mark.distributed

CFG = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                  intermediate_size=256, max_seq_len=4096)
SEQ = 2048


CASES = [
    ("tsp", 2, {"head_buckets": 2}, False),
    ("tsp", 2, {"head_buckets": 1}, True),
    ("tsp", 4, {"head_buckets": 1}, False),
    ("tsp", 2, {"head_buckets": 2, "tsp_recompute": "selective"}, False),
    ("tsp", 4, {"head_buckets": 1, "tsp_recompute": "selective"}, False),
    ("tsp", 2, {"head_buckets": 2, "tsp_recompute": "none"}, False),
    ("tsp", 4, {"head_buckets": 1, "tsp_recompute": "none"}, False),
    ("tp", 2, {}, False),
    ("tp_sp", 2, {}, True),
    ("sp", 2, {}, False),
    ("tp_x_sp", 4, {"tp_degree": 2, "sp_degree": 2, "tp_sequence_parallel": True}, False),
]


def _job(scheme, options, ac) -> dict:
    return {"scheme": scheme, "options": options, "model": CFG, "seq_len": SEQ, "micro_batch": 1,
            "steps": 0, "warmup": 1, "seed": 0, "backend": "gloo", "activation_checkpointing": ac}


# Every case's ranks run in a fork shared with the next cases of its degree (ForkedCases); the
# live-tensor tracker measures each case's own step.
RUNS = ForkedCases()
for _s, _d, _o, _ac in CASES:
    RUNS.add(_d, (_s, tuple(sorted(_o.items())), _ac), scheme_rank, _job(_s, _o, _ac))


@pytest.mark.parametrize("scheme,degree,options,ac", CASES, ids=lambda v: str(v))
def test_ledger_and_memory_of_the_real_code(scheme, degree, options, ac):
    ranks = RUNS.result(degree, (scheme, tuple(sorted(options.items())), ac))
    axes = ({"tp": options["tp_degree"], "sp": options["sp_degree"],
             "tp_sequence_parallel": options["tp_sequence_parallel"]} if scheme == "tp_x_sp" else {})
    layout = Layout(scheme, degree, zero_stage=0, activation_checkpointing=ac,
                    head_buckets=options.get("head_buckets", 1),
                    tsp_recompute=options.get("tsp_recompute", "full"), **axes)
    comm = {k: {"count": v["count"], "bytes": v["bytes"]}
            for k, v in model_parallel_comm(CFG, layout, SEQ, FP32).items()}
    state = state_bytes(CFG, layout, FP32)
    act = activation_memory(CFG, layout, SEQ, FP32, device="cpu")
    model_total = state["params"] + state["grads"] + state["optimizer"] + act.peak
    for rank, r in enumerate(ranks):
        assert r["comm"] == comm, f"rank {rank}"
        measured_state = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        # AdamW's per-parameter `step` counters are the only state the model leaves out
        assert measured_state == pytest.approx(state["params"] + state["grads"] + state["optimizer"],
                                               abs=8 * 64)
        assert act.peak == pytest.approx(r["peak_act_bytes"], rel=0.10), f"rank {rank}"
        assert model_total == pytest.approx(measured_state + r["peak_act_bytes"], rel=0.10)
