"""Precision of the bf16 path, on CPU: the TSP embedding sums repeated rows in fp32 (as
F.embedding's backward does), the LM head's backward multiplies in the weights' dtype, every
gradient accumulator and reduction is fp32, DeepSpeed is configured to accumulate and reduce in
fp32, and what DeepSpeed cannot accumulate in fp32 (bf16 without ZeRO) is refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tsp_trainer.config import load_config, validate_config
from tsp_trainer.engine.deepspeed import ds_config
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger
from tsp_trainer.parallel.tsp.vocab import TSPEmbedding, TSPLMHead


def _single_rank() -> Comm:
    return Comm(None, [0], 0, CommLedger(), "tsp")


class _AccumulationDtypes(TorchDispatchMode):
    """dtype of every scatter-style accumulation (index_add, index_put with accumulate,
    scatter_add, embedding_dense_backward)."""

    OPS = ("index_add", "index_put", "_index_put_impl", "scatter_add", "embedding_dense_backward")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.rstrip("_") in self.OPS:
            self.seen.append((func.overloadpacket.__name__, out.dtype))
        return out


def test_embedding_backward_sums_a_repeated_token_in_fp32():
    """One row seen 4,096 times with gradient 0.002 each sums to 8.19. On CUDA, atomic adds
    into a bf16 accumulator round at every occurrence and stall near 2 (each addend falls below
    half a bf16 ulp); CPU kernels hide that, so the accumulation's dtype is asserted too."""
    emb = TSPEmbedding(torch.zeros(16, 4, dtype=torch.bfloat16), comm=_single_rank(), vocab_size=16)
    ids = torch.zeros(1, 8192, dtype=torch.long)
    ids[0, ::2] = 3                                     # two rows, each seen 4,096 times
    out = emb(ids)
    with _AccumulationDtypes() as acc:
        out.backward(torch.full(out.shape, 0.002, dtype=torch.bfloat16))
    assert acc.seen and all(dtype == torch.float32 for _, dtype in acc.seen), acc.seen
    grad = emb.weight.grad
    assert grad.dtype == torch.bfloat16
    expected = 4096 * torch.tensor(0.002, dtype=torch.bfloat16).float()
    torch.testing.assert_close(grad[[0, 3]].float(), torch.full((2, 4), expected.item()), rtol=4e-3, atol=0)
    assert grad[[1, 2, 4]].abs().max() == 0


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def test_lm_head_backward_multiplies_in_the_weights_dtype():
    """No fp32 matmul of bf16 data (on CUDA, fp32 without TF32 runs on CUDA cores, ~15x slower)."""
    torch.manual_seed(0)
    head = TSPLMHead(torch.randn(32, 16, dtype=torch.bfloat16), comm=_single_rank(), vocab_size=32)
    hidden = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32, (2, 8))
    labels[0, 0] = -100
    loss, _ = head.loss_sum(hidden, labels)
    with _MatmulDtypes() as mm:
        loss.backward()
    assert mm.seen and all(set(dtypes) == {torch.bfloat16} for dtypes in mm.seen), mm.seen
    assert hidden.grad.dtype == head.weight.grad.dtype == torch.bfloat16
    # the same gradients as fp32 autograd through the full logits, to bf16 accuracy
    h32, w32 = hidden.detach().float().requires_grad_(), head.weight.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy((h32 @ w32.T).flatten(0, 1), labels.flatten(),
                                            reduction="sum", ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(hidden.grad.float(), h32.grad, rtol=0.02, atol=0.02)
    torch.testing.assert_close(head.weight.grad.float(), w32.grad, rtol=0.02, atol=0.02)


def test_deepspeed_accumulates_and_reduces_gradients_in_fp32():
    for bf16 in (True, False):
        cfg = ds_config(micro_batch=1, grad_accum=4, dp_degree=2, zero_stage=1, max_grad_norm=1.0, bf16=bf16)
        assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}
        assert cfg["communication_data_type"] == "fp32"


def test_optimizer_offload_config_is_deepspeeds_zero_offload():
    common = dict(micro_batch=1, grad_accum=1, dp_degree=1, zero_stage=2, max_grad_norm=1.0, bf16=True)
    assert "offload_optimizer" not in ds_config(**common)["zero_optimization"]
    assert "zero_force_ds_cpu_optimizer" not in ds_config(**common)
    cfg = ds_config(**common, offload_optimizer=True)
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg["zero_optimization"]["stage"] == 2
    # else Accelerate swaps our DeepSpeedCPUAdam for one in Adam (L2) mode (engine/deepspeed.py)
    assert cfg["zero_force_ds_cpu_optimizer"] is False
    # ZeRO-3 (sp, ulysses): the same offload beside its partitioning settings
    zero3 = ds_config(**{**common, "zero_stage": 3}, offload_optimizer=True)
    assert zero3["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero3["zero_optimization"]["stage"] == 3
    assert zero3["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert zero3["zero_force_ds_cpu_optimizer"] is False


def test_bf16_without_zero_is_refused():
    cfg = load_config("recipes/tiny_cpu.yaml", ["train.dtype=bf16", "zero.stage=0", "train.nonfinite=stop"])
    with pytest.raises(ValueError, match=r"zero.stage=0 with bf16 .*use zero.stage 1 or 2"):
        validate_config(cfg)
    validate_config(load_config("recipes/tiny_cpu.yaml", ["train.dtype=bf16", "zero.stage=1"]))
