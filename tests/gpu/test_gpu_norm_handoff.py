"""The GPU twin of the norm handoff (parallel/tsp/norm.py; CPU runs: the norm_handed cases of
tests/distributed/test_tsp_parity.py and tests/distributed/test_tsp_memory.py): one whole TSP
block (norms, attention, MLP) on one GPU, bf16, with its tokens tiled (each norm's work handed to
its consumer) against the same block untiled (the norms run themselves).

* the same output and gradients, the norm weights' included, to bf16 rounding;
* between forward and backward the tiled block keeps exactly two [n, h] fewer: the norms' outputs.

Run with `python -m pytest -m gpu`; without a CUDA device every test here is skipped."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is False)")]

SEQ, HIDDEN = 32768, 1024
REL_ERR = 2e-2                                  # bf16 rounding, as tests/gpu/test_gpu_paths.py


def block_step(device, dtype, chunk, *, seq: int = SEQ, hidden: int = HIDDEN) -> dict:
    """One TSP block (tsp_degree 1, in process) of a Llama-shaped model with GQA over `seq` tokens,
    parallel.mlp_chunk_tokens=`chunk`: output, gradients of x and of every parameter, and the
    bytes the CUDA allocator holds between forward and backward beyond x and the output (0 on CPU)."""
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.model.rope import PositionRuns, Rotary
    from tsp_trainer.parallel.apply import apply_tsp
    from tsp_trainer.parallel.comm import Comm
    from tsp_trainer.parallel.ledger import CommLedger

    cfg = model_config("tiny", hidden_size=hidden, num_heads=16, num_kv_heads=4,
                       intermediate_size=hidden * 11 // 4, num_layers=1, max_seq_len=seq)
    model = Transformer(cfg)
    model.init_weights(0)
    with torch.no_grad():                       # norm weights away from one: their gradients matter
        for block in model.layers:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    comm = Comm(None, [0], 0, CommLedger(), "tsp", device=device)
    apply_tsp(model, comm, seq_len=seq, mlp_chunk_tokens=chunk)
    model.to(device=device, dtype=dtype)
    block = model.layers[0]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, seq, hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad = (torch.randn(1, seq, hidden, generator=gen) / seq).to(device=device, dtype=dtype)
    rope = Rotary.build(PositionRuns.contiguous(seq), cfg.head_dim, cfg.rope_theta, device=device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    out = block(x, rope)
    kept = torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size() if cuda else 0
    params = list(block.parameters())
    grads = torch.autograd.grad(out, [x, *params], grad)
    names = ["x"] + [n for n, _ in block.named_parameters()]
    return {"out": out.detach(), "grads": dict(zip(names, (g.detach() for g in grads))), "kept": kept,
            "tokens": seq}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def test_tiled_block_equals_the_untiled_block_and_keeps_two_tensors_fewer():
    block_step("cuda", torch.bfloat16, 512, seq=2048)    # warm-up: libraries' lasting buffers
    tiled, untiled = (block_step("cuda", torch.bfloat16, c) for c in (4096, 10**9))
    assert _rel_err(tiled["out"], untiled["out"]) < REL_ERR
    assert any("layernorm" in name for name in tiled["grads"])
    for name, g in tiled["grads"].items():
        assert torch.isfinite(g).all() and _rel_err(g, untiled["grads"][name]) < REL_ERR, name
    norm_output = SEQ * HIDDEN * 2                              # one [n, h] bf16
    assert untiled["kept"] - tiled["kept"] == 2 * norm_output, (untiled["kept"], tiled["kept"])
