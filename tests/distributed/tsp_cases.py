"""Rank functions shared by the TSP parity tests (module level, so forked ranks can run them)."""

from __future__ import annotations

import torch

from tsp_trainer.config import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.model.offload import ActivationOffload
from tsp_trainer.parallel import zigzag
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize


def make_batch(cfg, batch: int, seq_len: int, seed: int = 123):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, :3] = -100             # some ignored labels: the count must be global, not local
    return tokens[:, :-1].contiguous(), labels


def init_model(model, seed: int) -> None:
    """init_weights, then random biases (init_weights gives zeros, as transformers does, which
    would leave the bias paths untested): N(0, 0.1) from a generator seeded by (seed, name)."""
    model.init_weights(seed)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith(".bias"):
                gen = torch.Generator().manual_seed(seed * 1000 + i)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


# AdamW's update m / (sqrt(v) + eps) is scale-free for |g| >> eps: a gradient element at the fp32
# rounding floor, where the one-process and TSP sums differ in the last bits, would move by up to lr
# in a direction set by that noise. An eps far above the noise (gradient differences measured
# <= 1e-7) bounds the weight difference after n steps by n * lr * 1e-7 / eps, first order.
ADAMW_EPS = 1e-3


def make_optimizer(name: str, params, lr: float):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=lr, eps=ADAMW_EPS)


def reference(cfg, seed, ids, labels, steps: int = 0, lr: float = 1e-2, optim: str = "adamw"):
    """One process: logits, loss, grads of the plain model; optionally `steps` AdamW steps."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_model(model, seed)
    logits = model(ids).detach()
    loss = model.loss(ids, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = {"logits": logits, "loss": loss.item(), "grads": grads}
    if steps:
        model.zero_grad()
        opt = make_optimizer(optim, model.parameters(), lr)
        for _ in range(steps):
            model.loss(ids, labels).backward()
            opt.step()
            opt.zero_grad()
        out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def tsp_rank(rank, world, cfg, seed, ids, labels, head_buckets=1, steps=0, lr=1e-2, meta=False,
             optim="adamw", recompute="full", loss_chunk="auto", checkpointing=False,
             mlp_chunk="auto", offload=False, replay_keeps="all", attention_chunk="auto"):
    """One TSP rank: loss, gathered gradients, ledger and local logits (`loss_chunk`: the LM
    head's parallel.loss_chunk_tokens; `checkpointing`: every block under activation
    checkpointing; `mlp_chunk`: parallel.mlp_chunk_tokens; `offload`: the blocks' saved tensors
    in host memory, around the checkpoint if any; `replay_keeps`: parallel.checkpoint_replay_keeps;
    `attention_chunk`: parallel.attention_chunk_tokens)."""
    mesh = build_mesh(world)
    if meta:
        with torch.device("meta"):
            model = Transformer(cfg)
    else:
        model = Transformer(cfg)
        init_model(model, seed)
    par = parallelize(model, "tsp", mesh, head_buckets=head_buckets, seq_len=ids.shape[1],
                      init_seed=seed if meta else None, tsp_recompute=recompute,
                      loss_chunk_tokens=loss_chunk, mlp_chunk_tokens=mlp_chunk,
                      checkpoint_replay_keeps=replay_keeps, attention_chunk_tokens=attention_chunk)
    if checkpointing:
        model.block_wrapper = checkpointed_block
    if offload:
        model.block_wrapper = ActivationOffload(model.block_wrapper)
    local_ids, local_labels, pos = zigzag.shard_batch(ids, labels, mesh.tsp_rank, mesh.dims.tsp)

    mesh.ledger.reset()
    loss_sum, count = model.loss_sum(local_ids, local_labels, pos)
    total = global_count(count, [mesh.tsp])
    (loss_sum / total).backward()
    ledger = list(mesh.ledger.records)
    loss = reduce_loss_value(loss_sum, total, [mesh.tsp])
    grads = par.gather_full_grads()
    out = {"loss": loss, "grads": grads, "ledger": ledger,
           "loss_chunk": model.lm_head.chunk_tokens(local_labels.numel()),
           "mlp_chunk": model.layers[0].mlp.tiling.chunk(local_labels.numel(), 4),
           "logits_local": model(local_ids, pos).detach(),
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    if steps:
        model.zero_grad()
        opt = make_optimizer(optim, model.parameters(), lr)
        for _ in range(steps):
            s, c = model.loss_sum(local_ids, local_labels, pos)
            (s / global_count(c, [mesh.tsp])).backward()
            opt.step()
            opt.zero_grad()
        out["weights"] = par.gather_full_state_dict()
    return out


def tsp_attention_block(rank, world, *, hidden, kv_heads, seq, buckets=1, recompute="full"):
    """Layer 0's TSP attention block on this rank (meta-initialised, seed 0) with its RoPE for
    the rank's zigzag chunks and a random local input x [1, seq / world, hidden] needing grad:
    (mesh, block, rope, x)."""
    from tsp_trainer.model.layers import Rotary

    cfg = model_config("tiny", hidden_size=hidden, num_heads=8, num_kv_heads=kv_heads)
    mesh = build_mesh(world)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, "tsp", mesh, seq_len=seq, init_seed=0, head_buckets=buckets,
                tsp_recompute=recompute)
    rope = Rotary.build(zigzag.zigzag_runs(seq, rank, world), cfg.head_dim, cfg.rope_theta)
    x = torch.randn(1, seq // world, hidden, requires_grad=True)
    return mesh, model.layers[0].self_attn, rope, x


def largest_gathered_kv(rank, world, seq, chunk, kv_heads=4):
    """Layer 0's TSP attention block (tsp_attention_block, hidden 64, d 8) with
    parallel.attention_chunk_tokens=`chunk`, forward and backward: the shape of the largest K/V- or
    dK/dV-shaped tensor (last dims [kv_heads / world, d]) any op created, the rank's own tokens'
    K/V and dK/dV [1, seq / world, ...] aside."""
    import dataclasses

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    mesh, block, rope, x = tsp_attention_block(rank, world, hidden=64, kv_heads=kv_heads, seq=seq)
    block.settings = dataclasses.replace(block.settings, chunk_tokens=chunk)
    heads, local = kv_heads // world, seq // world

    class Largest(TorchDispatchMode):
        shape, numel = None, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                own = t.dim() in (4, 5) and t.shape[:2] == (1, local) if isinstance(t, torch.Tensor) else True
                if (isinstance(t, torch.Tensor) and t.dim() >= 3 and tuple(t.shape[-2:]) == (heads, 8)
                        and not own and t.numel() > self.numel):
                    self.shape, self.numel = tuple(t.shape), t.numel()
            return out

    with Largest() as largest:
        block(x, rope).sum().backward()
    return largest.shape
