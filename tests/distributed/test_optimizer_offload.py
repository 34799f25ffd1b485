"""zero.offload_optimizer=cpu through the whole Trainer on CPU ranks (gloo, DS_ACCELERATOR=cpu):
DeepSpeed's ZeRO-Offload with its DeepSpeedCPUAdam, under ZeRO 1/2 (the dp axis) and ZeRO-3
(schemes sp and ulysses, every rank), against the single-process torch AdamW reference, and
resumes from checkpoints saved with the optimizer state on the host.

DeepSpeedCPUAdam is a C++ op that DeepSpeed builds with g++ on first use, into
TORCH_EXTENSIONS_DIR (tests/conftest.py: one folder per test session, unless the environment
names one already, which then keeps the build across sessions). The module fixture builds it once
in the pytest process, before any rank forks, so that no rank waits for a build inside its run's
time limit; the ranks inherit the loaded op."""

import time

import pytest
import torch

from tests.distributed.fault_cases import assert_nan_step_is_skipped
from tests.distributed.trainer_cases import (assert_matches_reference, assert_resume_as_matches_uninterrupted,
                                             reference_run, train_rank)
from tests.helpers.dist import run_on_ranks

# slow: the op's build alone (150-160 s of g++ CPU time) is beyond the default suite's budget; the
# timeout covers the build, which pytest counts in the first test's setup
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1200)]

OFFLOAD = ["zero.offload_optimizer=cpu"]
# A resume at step 5 updates at step 6 first: DeepSpeedCPUAdam's fp32 beta2^6 built by 6
# multiplications by 0.95 differs from pow(0.95, 6) (steps 1-5 agree), so only a resume that
# replays the step counter (engine/zero_state.py replay_cpu_adam_steps) continues bit for bit.
RESUME_AT = 5


@pytest.fixture(scope="module", autouse=True)
def cpu_adam_op():
    from tsp_trainer.engine.deepspeed import load_cpu_adam_op

    started = time.perf_counter()
    load_cpu_adam_op()
    print(f"cpu_adam op ready in {time.perf_counter() - started:.1f} s")


@pytest.mark.parametrize("world,layout", [
    (1, ["zero.stage=1", "parallel.tsp_degree=1"]),                    # one rank, the whole model
    (2, ["zero.stage=2", "parallel.tsp_degree=2"]),                    # TSP D=2, dp 1
    (2, ["zero.stage=2", "parallel.tsp_degree=1"]),                    # dp 2: a partition per rank
    (2, ["zero.stage=1", "parallel.tsp_degree=2", "parallel.scheme=tp"]),   # a baseline, D=2
])
def test_offloaded_adam_matches_single_process(world, layout):
    """4 steps with the optimizer on the host equal one process with torch AdamW on the same global
    batches. DeepSpeedCPUAdam is not bitwise torch AdamW: it keeps beta^t in fp32 and multiplies
    by 1 / sqrt(1 - beta2^t) where torch divides, so each update differs from torch's by a few
    fp32 ulps. Losses: rtol 1e-6, as on the device; clipped gradient norms: rtol 1e-5; weights:
    atol 1e-4 = lr / 30 (an element whose gradient sits at the fp32 noise floor moves by up to lr
    in a noise-set direction, tests/distributed/test_trainer.py), and 99.9% of the elements within
    1e-6, which a wrong partition, norm or learning rate would break."""
    overrides = ["train.steps=4", "checkpoint.enabled=false"] + layout + OFFLOAD
    dp = world // (2 if "parallel.tsp_degree=2" in layout else 1)
    reference = reference_run(overrides, dp_degree=dp)
    outs = run_on_ranks(train_rank, world, overrides)
    assert outs[0]["dp_world_size"] == dp
    assert_matches_reference(outs, reference)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scheme", ["ulysses", "sp"])
def test_offloaded_zero3_matches_single_process(scheme, world):
    """sp / ulysses with zero.stage left to auto (ZeRO-3 over every rank: D 2, and dp 2 on 4 ranks)
    and the optimizer on the host: DeepSpeed's ZeRO-3 steps DeepSpeedCPUAdam on host fp32
    partitions, and 4 steps equal one process with torch AdamW on the same global batches, with
    the tolerances of test_offloaded_adam_matches_single_process (same CPU Adam arithmetic)."""
    overrides = ["train.steps=4", "checkpoint.enabled=false", f"parallel.scheme={scheme}",
                 "parallel.tsp_degree=2"] + OFFLOAD
    reference = reference_run(overrides, dp_degree=world // 2)
    outs = run_on_ranks(train_rank, world, overrides, timeout=600)
    assert outs[0]["dp_world_size"] == world                       # ZeRO-3: partitions over all ranks
    assert outs[0]["zero_optimizer"] == {"wrapper": "DeepSpeedZeroOptimizer_Stage3",
                                         "optimizer": "DeepSpeedCPUAdam", "offloaded": True}
    assert_matches_reference(outs, reference)


@pytest.mark.parametrize("scheme,world", [("ulysses", 2), ("sp", 4)])
def test_offloaded_zero3_resume_equals_uninterrupted(scheme, world, tmp_path):
    """ZeRO-3 with the optimizer on the host: a 7-step run saving at step 5, and a resume of that
    checkpoint, give the same steps 6-7 bit for bit (losses and weights): the host fp32 master and
    moments partitions come back from the layout-free state, and DeepSpeedCPUAdam's beta^t
    products are rebuilt (RESUME_AT: where fp32 0.95^6 by products differs from pow's, so the
    resume is exact only with the replay)."""
    def run(out, resume="none", every=0):
        return run_on_ranks(train_rank, world, [
            f"train.steps={RESUME_AT + 2}", f"checkpoint.every={every}", f"train.resume={resume}",
            f"train.output_dir={tmp_path / out}", f"parallel.scheme={scheme}",
            "parallel.tsp_degree=2"] + OFFLOAD, timeout=600)[0]

    full = run("a", every=RESUME_AT)
    resumed = run("b", resume=tmp_path / "a" / "checkpoints" / f"step_{RESUME_AT:08d}")
    assert resumed["zero_optimizer"]["offloaded"]
    assert resumed["losses"] == full["losses"][RESUME_AT:]
    for name, w in full["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


@pytest.mark.parametrize("first,first_overrides,then,then_overrides",
                         [("tsp", [], "ulysses", OFFLOAD), ("ulysses", OFFLOAD, "tsp", [])])
def test_resume_across_schemes_into_and_out_of_offloaded_zero3(first, first_overrides, then,
                                                              then_overrides, tmp_path):
    """A tsp checkpoint (ZeRO-1, torch AdamW on the device) resumed as ulysses under ZeRO-3 with
    the optimizer on the host, and the other way round, trains steps 4 and 5 like the
    uninterrupted run (DP 2 x D 2; losses rtol 1e-6, weights with the tolerances of
    test_trainer.py: the CPU Adam update differs from torch's by a few fp32 ulps)."""
    assert_resume_as_matches_uninterrupted(first, then, tmp_path, first_overrides=first_overrides,
                                           then_overrides=then_overrides)


def test_offloaded_resume_equals_uninterrupted(tmp_path):
    """TSP D=2, ZeRO-2, optimizer on the host: a 7-step run saving at step 5, and a resume of that
    checkpoint, give the same steps 6-7 bit for bit (losses and weights): the moments and fp32
    master come back from the layout-free state into the host partition, and DeepSpeedCPUAdam's
    beta^t products are rebuilt (engine/zero_state.py replay_cpu_adam_steps; RESUME_AT)."""
    def run(out, resume="none", every=0):
        return run_on_ranks(train_rank, 2, [f"train.steps={RESUME_AT + 2}", f"checkpoint.every={every}",
                                            f"train.resume={resume}", f"train.output_dir={tmp_path / out}",
                                            "zero.stage=2"] + OFFLOAD)[0]

    full = run("a", every=RESUME_AT)
    resumed = run("b", resume=tmp_path / "a" / "checkpoints" / f"step_{RESUME_AT:08d}")
    assert resumed["losses"] == full["losses"][RESUME_AT:]
    for name, w in full["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


def test_nan_on_one_rank_skips_the_offloaded_update(tmp_path):
    """TSP D=2, ZeRO-1, optimizer on the host: step 3's loss is NaN on rank 1 only. DeepSpeed's
    offload path flags the overflow while copying the gradients to the host and agrees it over dp
    and tsp, so both ranks skip the CPU update (counted); with a constant learning rate the weights
    after 3 steps equal those after 2 clean steps."""
    assert_nan_step_is_skipped(2, ["optim.warmup_steps=0", "optim.min_lr=3e-3", "zero.stage=1"] + OFFLOAD,
                               tmp_path)


def test_nan_on_one_rank_skips_the_offloaded_zero3_update(tmp_path):
    """ulysses D=2 under ZeRO-3, optimizer on the host: step 3's loss is NaN on rank 1 only; every
    rank skips the CPU update (counted), and with a constant learning rate the weights after 3
    steps equal those after 2 clean steps."""
    assert_nan_step_is_skipped(2, ["optim.warmup_steps=0", "optim.min_lr=3e-3", "parallel.scheme=ulysses",
                                   "parallel.tsp_degree=2"] + OFFLOAD, tmp_path)


def test_cpu_adam_step_counter_replay_makes_a_restored_optimizer_bitwise():
    """DeepSpeedCPUAdam's op multiplies beta^t by beta once per step in fp32; an optimizer restored
    at step t would recompute them with pow() (one rounding instead of t) and update differently
    in the last bits. 12 steps (where fp32 beta1^t and beta2^t both differ from pow's, for 0.9 and
    0.95), then one more from a copy of the state: bitwise equal after replay_cpu_adam_steps, and
    not without it (so the replay is what makes resumes exact)."""
    from tsp_trainer.config import OptimSection
    from tsp_trainer.engine.deepspeed import build_offload_optimizer
    from tsp_trainer.engine.zero_state import fresh_adam_step, replay_cpu_adam_steps

    STEPS = 12
    torch.manual_seed(0)
    grads = [torch.randn(64, 32) for _ in range(STEPS + 1)]
    cfg = OptimSection(weight_decay=0.0)

    def model_with(weight):
        m = torch.nn.Linear(32, 64, bias=False)
        with torch.no_grad():
            m.weight.copy_(weight)
        return m

    live = model_with(torch.zeros(64, 32))
    opt = build_offload_optimizer(live, cfg)
    for g in grads[:STEPS]:
        live.weight.grad = g.clone()
        opt.step()
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[live.weight].items()}
    saved_weight = live.weight.detach().clone()

    def restored(replay: bool) -> torch.Tensor:
        m = model_with(saved_weight)
        o = build_offload_optimizer(m, cfg)
        o.state[m.weight] = {"step": fresh_adam_step(o, STEPS), "exp_avg": saved["exp_avg"].clone(),
                             "exp_avg_sq": saved["exp_avg_sq"].clone()}
        if replay:
            replay_cpu_adam_steps(o, STEPS)
        m.weight.grad = grads[STEPS].clone()
        o.step()
        return m.weight.detach()

    live.weight.grad = grads[STEPS].clone()
    opt.step()
    assert torch.equal(restored(replay=True), live.weight.detach())
    assert not torch.equal(restored(replay=False), live.weight.detach())
