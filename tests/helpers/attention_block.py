"""One TSP attention block on a group of one rank, in process (a Comm of size one issues no
collective, so no process group is needed): the GPU twin of chunked attention
(tests/gpu/test_gpu_chunked_attention.py) and its CPU run (tests/unit/test_attention_chunk.py)."""

from __future__ import annotations

import torch

from tsp_trainer.model.documents import Documents
from tsp_trainer.model.rope import PositionRuns, Rotary
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger
from tsp_trainer.parallel.tsp.attention import TSPAttention


def attention_block_step(device, dtype, *, seq: int, chunk, hidden: int = 256, heads: int = 8,
                         kv_heads: int = 2, lengths: list[int] | None = None, seed: int = 0,
                         recompute: str = "full") -> dict:
    """Forward and backward of one TSP attention block (tsp_degree 1) over one sequence of `seq`
    tokens with parallel.attention_chunk_tokens=`chunk`; `lengths`: document lengths (document
    masking) or None. Returns the output, the gradients of x and of W_q, W_k, W_v, W_o, and the
    peak bytes the CUDA allocator reached above what was allocated before the step (0 on CPU)."""
    d = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(device=device, dtype=dtype)

    comm = Comm(None, [0], 0, CommLedger(), "tsp", device=device)
    block = TSPAttention(weight(heads * d, hidden), weight(kv_heads * d, hidden),
                         weight(kv_heads * d, hidden), weight(hidden, heads * d), head_dim=d, comm=comm,
                         recompute=recompute, attention_chunk_tokens=chunk)
    x = torch.randn(1, seq, hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    # the output's gradient at a mean loss's scale (1 / tokens), as the models' parity tests have it
    grad = (torch.randn(1, seq, hidden, generator=gen) / seq).to(device=device, dtype=dtype)
    documents = None if lengths is None else Documents.from_lengths([lengths])
    rope = Rotary.build(PositionRuns.contiguous(seq).with_documents(documents), d, 10000.0, device=device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    out = block(x, rope)
    params = [block.q_proj.weight, block.k_proj.weight, block.v_proj.weight, block.o_proj.weight]
    grads = torch.autograd.grad(out, [x, *params], grad)
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    return {"out": out.detach(), "grads": [g.detach() for g in grads], "peak": peak}
