"""Transient memory of the TSP blocks, measured (live tensor bytes allocated inside one forward +
backward of a block, minus its output, input gradient and parameter gradients).

Measured at h = 512, I = 2048, 64 tokens (weights dominate): attention 4.2-4.3 packed shards at
D = 4 and 8 (backward holds two weight buffers of a fixed pool, this rank's shard packed into one of
them when its turn comes, and two fp32 gradient buffers, the one filled and the one being reduced,
the gradients written into them by hand; the rest is the gathered K/V buckets and token-sized
temporaries); the MLP ~3.1 (its weight gradients go straight into the ring's fp32 accumulator and
the sent accumulator is the next receive buffer: the shard in use, the one arriving and two
accumulators), independent of D in units of a shard, so the
transient is a fixed number of shards (P/D), never the full layer once D >= 8."""

import pytest
import torch

from tests.helpers.dist import run_on_ranks

pytestmark = pytest.mark.distributed
SHARDS_BOUND = {"attn": 4.0, "mlp": 4.0}   # measured 4.3 (with K/V, temporaries) and 3.1; a full layer would be D


def _transient(rank, world, h, inter, seq):
    from tsp_trainer.tools.memory import LiveTensorMemory
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.model.layers import Rotary
    from tsp_trainer.parallel import zigzag
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize

    cfg = model_config("tiny", hidden_size=h, num_heads=8, num_kv_heads=8, intermediate_size=inter)
    mesh = build_mesh(world)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, "tsp", mesh, seq_len=seq, init_seed=0)
    pos = zigzag.zigzag_positions(seq, rank, world)
    rope = Rotary.build(pos, cfg.head_dim, cfg.rope_theta)
    out = {}
    for name, block in (("attn", model.layers[0].self_attn), ("mlp", model.layers[0].mlp)):
        x = torch.randn(1, seq // world, h, requires_grad=True)
        params = list(block.parameters())
        with LiveTensorMemory() as mem:
            mem.ignore(x, *params, rope.cos, rope.sin, pos)
            y = block(x, rope) if name == "attn" else block(x)
            y.sum().backward()
        kept = (y.numel() + x.grad.numel() + sum(p.numel() for p in params)) * 4
        out[name] = {"transient": mem.peak - kept, "shard": sum(p.numel() for p in params) * 4}
    return out


def test_transient_is_a_few_shards_never_a_full_layer_at_d8():
    h, inter, seq = 512, 2048, 64
    for o in run_on_ranks(_transient, 8, h, inter, seq):
        for name, m in o.items():
            kv_bucket = seq * 2 * h // 8 * 4 if name == "attn" else 0     # gathered K/V, one bucket
            activations = 16 * seq // 8 * max(h, inter // 8) * 4          # local [T, .] temporaries
            assert m["transient"] <= SHARDS_BOUND[name] * m["shard"] + 3 * kv_bucket + activations, (name, m)
            if name == "mlp":                  # the MLP's transient is at most 4 packed shards
                assert m["transient"] <= 4 * m["shard"], m
            assert m["transient"] < 8 * m["shard"], (name, m)           # a full layer is 8 shards


def _layer_transients(rank, world, h, inter, seq, chunk):
    """Transient peak (bytes alive beyond x, y, dX and the parameters) of layer 0's attention and
    MLP blocks over one forward + backward in bf16, in units of one bf16 [N/D, h] tensor."""
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.model.layers import Rotary
    from tsp_trainer.parallel import zigzag
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.tools.memory import LiveTensorMemory

    cfg = model_config("tiny", hidden_size=h, num_heads=8, num_kv_heads=2, intermediate_size=inter)
    mesh = build_mesh(world)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, "tsp", mesh, seq_len=seq, init_seed=0, mlp_chunk_tokens=chunk)
    model.to(torch.bfloat16)
    pos = zigzag.zigzag_positions(seq, rank, world)
    rope = Rotary.build(pos, cfg.head_dim, cfg.rope_theta)
    out = {}
    for name, block in (("attn", model.layers[0].self_attn), ("mlp", model.layers[0].mlp)):
        x = torch.randn(1, seq // world, h, dtype=torch.bfloat16, requires_grad=True)
        params = list(block.parameters())
        with LiveTensorMemory() as mem:
            mem.ignore(x, *params, rope.cos, rope.sin, pos)
            y = block(x, rope) if name == "attn" else block(x)
            y.sum().backward()
        kept = 2 * 2 * x.numel() + sum(p.numel() * p.element_size() for p in params)
        out[name] = (mem.peak - kept) / (2 * x.numel())
    return out


def test_a_tiled_layer_holds_a_few_bf16_activations_not_its_mlp_intermediates():
    """parallel.mlp_chunk_tokens: the MLP's intermediates [chunk, I/D] instead of [N/D, I/D], and
    the layer's output and dX accumulators in bf16 instead of fp32. An MLP-heavy layer (I = 8 h,
    2,048 local tokens, chunks of 128): measured, in bf16 [N/D, h] units, the MLP's transient 34.9
    untiled and 3.9 tiled, the attention's 7.4 and 6.4 (its fp32 accumulator was 2 units, now 1;
    the rest is gathered K/V, q/k/v of two items and the incoming gradient)."""
    untiled, tiled = (run_on_ranks(_layer_transients, 2, 64, 512, 4096, chunk)[0]
                      for chunk in (10**9, 128))
    assert tiled["mlp"] <= 4.5 and untiled["mlp"] >= 30, (tiled, untiled)
    assert untiled["attn"] - tiled["attn"] >= 0.9 and tiled["attn"] <= 7, (tiled, untiled)


def _saved_between_passes(rank, world, recompute, kv_heads, buckets, seq):
    """Bytes alive after one attention forward (its output excluded), before backward."""
    from tests.distributed.tsp_cases import tsp_attention_block
    from tsp_trainer.tools.memory import LiveTensorMemory

    _, block, rope, x = tsp_attention_block(rank, world, hidden=128, kv_heads=kv_heads, seq=seq,
                                            buckets=buckets, recompute=recompute)
    with LiveTensorMemory() as mem:
        mem.ignore(x, *block.parameters(), rope.cos, rope.sin, rope.positions)
        y = block(x, rope)
        saved = mem.live - y.numel() * 4
    y.sum().backward()                       # the kept activations are consumed
    return {"saved": saved, "h": x.shape[-1], "hkv": kv_heads * block.head_dim, "heads": 8}


@pytest.mark.parametrize("world,kv_heads,buckets", [(2, 8, 1), (4, 4, 1), (4, 8, 2)])
def test_selective_recompute_keeps_its_activations_not_the_gathered_kv(world, kv_heads, buckets):
    """parallel.tsp_recompute=selective keeps, per layer and rank, exactly q, the local k/v, the
    attention output, the kernel's saved output and its log-sum-exp of this rank's T tokens:
    4 T (3 h + 2 h_kv + n_heads) bytes in fp32, and never the gathered K/V (S = D T tokens, per
    item), which the saved-tensor hook drops and backward re-gathers. Full recompute keeps nothing
    beyond X_p."""
    seq = 64 * world
    full = run_on_ranks(_saved_between_passes, world, "full", kv_heads, buckets, seq)
    selective = run_on_ranks(_saved_between_passes, world, "selective", kv_heads, buckets, seq)
    for f, s in zip(full, selective):
        t = seq // world
        assert f["saved"] == 0, f
        expected = 4 * t * (3 * s["h"] + 2 * s["hkv"] + s["heads"])
        gathered_kv_bucket = 4 * seq * 2 * s["hkv"] // (world * buckets)
        assert expected <= s["saved"] <= expected + 64 * world * buckets, (s, expected)   # + 0-d anchors
        assert s["saved"] - expected < gathered_kv_bucket / 4, (s, expected, gathered_kv_bucket)


def _mlp_saved_between_passes(rank, world, keep_gate_up, inter, seq):
    """Bytes alive after one TSP MLP forward (its output excluded), before backward."""
    from tsp_trainer.tools.memory import LiveTensorMemory
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize

    cfg = model_config("tiny", hidden_size=64, num_heads=4, num_kv_heads=4, intermediate_size=inter)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, "tsp", build_mesh(world), seq_len=seq, init_seed=0,
                tsp_recompute="none" if keep_gate_up else "full")
    block = model.layers[0].mlp
    assert block.keep_gate_up == keep_gate_up
    x = torch.randn(2, seq // world, 64, requires_grad=True)
    with LiveTensorMemory() as mem:
        mem.ignore(x, *block.parameters())
        y = block(x)
        saved = mem.live - y.numel() * 4
    y.sum().backward()
    after = mem.live
    return {"saved": saved, "tokens": x.shape[0] * x.shape[1], "after_backward": after}


@pytest.mark.parametrize("world", [2, 4])
def test_no_recompute_keeps_the_mlp_gate_and_up_exactly(world):
    """parallel.tsp_recompute=none: the MLP keeps, per rank, the gate and up pre-activations of
    every ring step, 2 T I elements (T local tokens, I the full intermediate size: D steps of
    I/D) = 8 T I bytes in fp32, and nothing else; full keeps nothing beyond X_p."""
    inter, seq = 96, 16 * world
    full = run_on_ranks(_mlp_saved_between_passes, world, False, inter, seq)
    keep = run_on_ranks(_mlp_saved_between_passes, world, True, inter, seq)
    for f, k in zip(full, keep):
        assert f["saved"] == 0, f
        assert k["saved"] == 8 * k["tokens"] * inter, (k, 8 * k["tokens"] * inter)


def _slot_bytes(value) -> int | None:
    """Bytes of the tensors a replay put in a checkpoint slot: the MLP's {step: [(g, u) per
    chunk]} or the attention's items (q, stacked k/v, output a of each); None when the replay kept
    nothing."""
    if value is None:
        return None
    if isinstance(value, dict):
        return sum(t.numel() * t.element_size() for kept in value.values() for pair in kept
                   for t in pair)
    return sum(t.numel() * t.element_size() for item in value for t in (item.q, item.kv, item.a))


def _checkpointed_backward(rank, world, layers, mode, seq, keeps="all"):
    """A `layers`-layer TSP model under activation checkpointing, one forward + backward: the peak
    of live bytes over the blocks' backward (from the arrival of the top block's output gradient,
    past the LM head's and the loss's peak), the bytes alive at the end of the forward and at the
    end of each block's backward (when the gradient of its input arrives), besides the parameters
    and their preallocated gradients; and the bytes each replay put in its slots ("puts": (part,
    bytes or None), `_slot_bytes`) under parallel.checkpoint_replay_keeps=`keeps`."""
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.model.activation_checkpoint import CheckpointCall, checkpointed_block
    from tsp_trainer.parallel.tsp.attention import AttentionSettings
    from tsp_trainer.parallel import zigzag
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.tools.memory import LiveTensorMemory

    cfg = model_config("tiny", hidden_size=64, num_heads=8, num_kv_heads=8, intermediate_size=256,
                       num_layers=layers)
    mesh = build_mesh(world)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, "tsp", mesh, seq_len=seq, init_seed=0, tsp_recompute=mode,
                checkpoint_replay_keeps=keeps)
    params = list(model.parameters())
    puts, put = [], CheckpointCall.put

    def recording_put(call, key, value):
        puts.append(("attention" if isinstance(key, AttentionSettings) else "mlp", _slot_bytes(value)))
        put(call, key, value)
    for p in params:
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    local_ids, local_labels, pos = zigzag.shard_batch(ids[:, :-1], ids[:, 1:], mesh.tsp_rank, world)
    block_ends, top = [], []

    def from_here(g):                   # the top block's backward starts: its peak from now on
        if not top:
            top.append(mem.live)
            mem.peak = mem.live

    def wrapper(block, x, rope):
        x.register_hook(lambda g: block_ends.append(mem.live))
        y = checkpointed_block(block, x, rope)
        y.register_hook(from_here)
        return y

    model.block_wrapper = wrapper
    CheckpointCall.put = recording_put
    try:
        with LiveTensorMemory() as mem:
            mem.ignore(*params, *(p.grad for p in params), local_ids, local_labels)
            loss_sum, _ = model.loss_sum(local_ids, local_labels, pos)
            forward = mem.live
            loss_sum.backward()
    finally:
        CheckpointCall.put = put
    return {"peak": mem.peak, "forward": forward, "block_ends": block_ends, "top": top[0], "puts": puts,
            "tokens": seq // world,
            "h": cfg.hidden_size, "inter": cfg.intermediate_size, "heads": cfg.num_heads}


def _assert_one_block_input_per_block_end(c: dict, block_input: int) -> None:
    """Each block's backward ends exactly one block input below the previous block's end, and the
    first end one block input below the backward's top: the norms' partial gradients go into the
    pass's fixed flat buffer as they arrive (parallel/grad_sync.py), and no collective runs inside a
    block's backward to hold them."""
    ends = c["block_ends"]
    steps = [a - b for a, b in zip([c["top"], *ends], ends)]
    assert steps == [block_input] * len(ends), (steps, block_input, c)


@pytest.mark.parametrize("mode", ["full", "none"])
def test_checkpointed_replay_keeps_one_block_and_frees_it_with_its_backward(mode):
    """Under activation checkpointing each block's replay keeps its attention items and gate/up
    pre-activations for that block's backward, in every tsp_recompute mode (the dry run counts
    the attention calls: tests/unit/test_plan_cuda_path.py), and they are gone when the gradient
    of the block's input arrives: the forward keeps only the block inputs, each block's end holds
    exactly one block input less than the previous one, and the backward's peak grows by just the
    two extra blocks' inputs (and their norms' slots of the replicated-gradient buffer) from one
    layer to three (one block's items at a time)."""
    world, seq = 2, 64
    one, three = (run_on_ranks(_checkpointed_backward, world, layers, mode, seq) for layers in (1, 3))
    for a, c in zip(one, three):
        block_input = 4 * a["tokens"] * a["h"]                    # fp32 [1, T, h]
        kept = 4 * a["tokens"] * (5 * a["h"] + a["heads"]) + 8 * a["tokens"] * a["inter"]
        assert c["forward"] - a["forward"] == 2 * block_input, (a, c)
        # and, in backward, the buffer of replicated gradients: two fp32 [h] norm weights per layer
        replicated = 2 * 4 * a["h"]
        assert c["peak"] - a["peak"] == 2 * (block_input + replicated), (a, c, block_input)
        assert c["peak"] - c["top"] > kept, (c, kept)             # the backward holds one block's items
        _assert_one_block_input_per_block_end(c, block_input)


@pytest.mark.parametrize("keeps", ["all", "attention", "nothing"])
def test_checkpoint_replay_keeps_what_the_setting_allows(keeps):
    """parallel.checkpoint_replay_keeps: each block's replay puts in its slots the attention items
    (q, stacked k/v and output a of every item: 4 h fp32 per token with as many K/V heads as query
    heads) under all and attention, and the gate/up pre-activations (8 T I bytes in fp32) under all
    only; a part it does not keep gets None (its backward recomputes). Still one block at a time:
    the forward keeps only the block inputs and each block's backward ends one block input lower."""
    world, seq, layers = 2, 64, 3
    for c in run_on_ranks(_checkpointed_backward, world, layers, "full", seq, keeps):
        tokens, block_input = c["tokens"], 4 * c["tokens"] * c["h"]
        items = 4 * tokens * 4 * c["h"] if keeps in ("all", "attention") else None
        gate_up = 8 * tokens * c["inter"] if keeps == "all" else None
        assert c["puts"] == [("attention", items), ("mlp", gate_up)] * layers, (c["puts"], items, gate_up)
        _assert_one_block_input_per_block_end(c, block_input)


def _block_saved(rank, world, h, seq, chunk):
    """Bytes one whole block (norms, attention, MLP) keeps between its forward and its backward,
    its input, output, parameters and RoPE tables excluded; and the block's token count."""
    from tsp_trainer.config import model_config
    from tsp_trainer.model import Transformer
    from tsp_trainer.model.layers import Rotary
    from tsp_trainer.parallel import zigzag
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.tools.memory import LiveTensorMemory

    cfg = model_config("tiny", hidden_size=h, num_heads=8, num_kv_heads=4, intermediate_size=2 * h)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, "tsp", build_mesh(world), seq_len=seq, init_seed=0, mlp_chunk_tokens=chunk)
    pos = zigzag.zigzag_positions(seq, rank, world)
    rope = Rotary.build(pos, cfg.head_dim, cfg.rope_theta)
    block = model.layers[0]
    x = torch.randn(1, seq // world, h, requires_grad=True)
    with LiveTensorMemory() as mem:
        mem.ignore(x, *block.parameters(), rope.cos, rope.sin, pos)
        y = block(x, rope)
        saved = mem.live - y.numel() * 4
    y.sum().backward()
    return {"saved": saved, "tokens": seq // world}


@pytest.mark.parametrize("world", [2, 4])
def test_tiled_block_keeps_its_norms_inputs_not_their_outputs(world):
    """Untiled, a block keeps three [n, h] tensors besides its input: the attention's input (the
    first norm's output), the second norm's input x + attn and the MLP's input (its output), and
    the norms' rstd [n, 1]. Tiled, each norm hands its work to its consumer (parallel/tsp/norm.py):
    the block keeps x + attn and the two rstd only (exactly, in fp32), two [n, h] fewer."""
    h, seq = 64, 256
    untiled, tiled = (run_on_ranks(_block_saved, world, h, seq, chunk)[0] for chunk in (10**9, 16))
    n = tiled["tokens"]
    assert tiled["saved"] == 4 * n * h + 2 * 4 * n, tiled
    assert untiled["saved"] == 3 * 4 * n * h + 2 * 4 * n, untiled
