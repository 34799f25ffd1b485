"""The loss phase's transient memory is bounded by the chunk (parallel.loss_chunk_tokens), measured
with LiveTensorMemory over one LM head loss + backward on 2 gloo ranks, for TSP's vocab ring and
the TP baseline's tiled cross-entropy.

Shape: V = 16,384 (8,192 rows per rank), h = 32, 1,024 local tokens: the fp32 logits of all local
tokens are 32 MiB, a weight shard 1 MiB, a chunk of 64 tokens 2 MiB. Whole, the peak holds the full
block; tiled, at most two chunk blocks (the logits and their softmax gradient's product), six
shard-sized buffers (the shard in use and the one arriving, fp32 gradient accumulators: the one
being filled, the one sent, the one arriving, and the weight gradient) and fp32 token-sized
vectors and dX. Measured: TSP 9.1 MiB tiled against 37.1 MiB whole, TP 5.1 against 33.1."""

import pytest
import torch

from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed
V, H, TOKENS, CHUNK = 16_384, 32, 1_024, 64


def _loss_transients(rank, world):
    from tsp_trainer.config import ModelConfig
    from tsp_trainer.model import Transformer
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.tools.memory import LiveTensorMemory

    cfg = ModelConfig(vocab_size=V, hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=4,
                      intermediate_size=64, max_seq_len=2 * TOKENS)
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for scheme in ("tsp", "tp"):
        for chunk in (CHUNK, "auto"):                         # auto: one chunk at this size
            mesh = build_mesh(world)
            with torch.device("meta"):
                model = Transformer(cfg)
            parallelize(model, scheme, mesh, seq_len=TOKENS * (world if scheme == "tsp" else 1),
                        init_seed=0, loss_chunk_tokens=chunk)
            head = model.lm_head
            hidden = torch.randn(1, TOKENS, H, generator=gen, requires_grad=True)
            labels = torch.randint(0, V, (1, TOKENS), generator=gen)
            with LiveTensorMemory() as mem:
                mem.ignore(hidden, labels, head.weight)
                loss, _ = head.loss_sum(hidden, labels)
                loss.backward()
            out[scheme, chunk] = {"peak": mem.peak, "chunk": head.chunk_tokens(TOKENS),
                                  "rows": head.weight.shape[0]}
    return out


def test_the_loss_transient_is_bounded_by_the_chunk_not_the_tokens():
    for o in run_on_ranks(_loss_transients, 2):
        for scheme in ("tsp", "tp"):
            tiled, whole = o[scheme, CHUNK], o[scheme, "auto"]
            rows = tiled["rows"]
            assert (tiled["chunk"], whole["chunk"], rows) == (CHUNK, TOKENS, V // 2)
            block, chunk_block, shard = 4 * TOKENS * rows, 4 * CHUNK * rows, 4 * rows * H
            tokens_fp32 = 4 * TOKENS * (H + 8)                   # dX and per-token vectors
            assert whole["peak"] >= block, (scheme, whole, block)
            assert tiled["peak"] <= 2 * chunk_block + 6 * shard + 2 * tokens_fp32, (scheme, tiled)
            assert tiled["peak"] < block / 3, (scheme, tiled, block)
