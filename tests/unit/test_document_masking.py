"""Document masking on one process: the segment planner and varlen index (pure, host ints), the
packed model against each document run alone (loss and every gradient, fp32, with and without
activation checkpointing and reset_positions), and the CUDA varlen route's packing run on CPU
with a reference kernel (its CPU twin)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from tests.distributed.tsp_cases import init_model
from tsp_trainer.config import ModelConfig
from tsp_trainer.model import Transformer, attention_core
from tsp_trainer.model.attention_route import SdpaRoute, varlen_attention
from tsp_trainer.model.documents import Documents, Segment, plan_segments, rope_positions, varlen_plan
from tsp_trainer.model.rope import PositionRuns
from tsp_trainer.parallel import zigzag

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=64, family="qwen2", qkv_bias=True)
# Two rows of 30 tokens; documents of any length (1, odd, longer than a zigzag chunk).
LENGTHS = [[5, 11, 1, 13], [30]]


def test_plan_segments_tiles_queries_and_keeps_documents():
    starts = (0, 5, 16, 17)                                   # documents [0,5) [5,16) [16,17) [17,30)
    runs = zigzag_runs_of(30, rank=1, degree=3)               # chunks 1 and 4: positions 5..9, 20..24
    segs = plan_segments(runs, starts)
    assert segs == (Segment(0, 5, 5, 10), Segment(5, 10, 17, 25))
    square = plan_segments(((0, 30, 0),), starts)
    assert [s.q_stop - s.q_start for s in square] == [5, 11, 1, 13]
    assert all(s.n_prefix == 0 for s in square)               # each document a square causal block
    # a run that starts mid-document sees its document's earlier keys (the prefix), nothing before
    assert plan_segments(((0, 4, 7),), starts) == (Segment(0, 4, 5, 11),)


def zigzag_runs_of(seq_len, rank, degree):
    return zigzag.zigzag_runs(seq_len, rank, degree).query_runs()


def test_documents_from_ids_and_lengths():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3]])
    assert Documents.from_ids(ids).starts == ((0, 2, 5), (0,))
    assert Documents.from_lengths([[2, 3, 1], [6]]).starts == ((0, 2, 5), (0,))
    with pytest.raises(ValueError, match="must be positive"):
        Documents.from_lengths([[0, 6]])


def test_rope_positions_restart_per_document():
    docs = Documents.from_lengths([[3, 5], [8]], reset_positions=True)
    pos = rope_positions(((0, 2), (6, 2)), docs)              # tokens at positions 0, 1, 6, 7
    assert pos.tolist() == [[0, 1, 3, 4], [0, 1, 6, 7]]


def test_varlen_plan_offsets():
    segs = (Segment(0, 5, 5, 10), Segment(5, 10, 17, 25))
    plan = varlen_plan(segs)
    assert plan.cu_q == (0, 5, 10) and plan.cu_k == (0, 5, 13)
    assert (plan.max_q, plan.max_k) == (5, 8)
    assert plan.key_index().tolist() == list(range(5, 10)) + list(range(17, 25))


def _reference_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k):
    """What flash's varlen mode computes, on CPU: per segment, bottom-right causal attention of
    packed [total, heads, d] tensors (GQA: K/V heads repeated)."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]]
        vs = v[cu_k[i]:cu_k[i + 1]]
        assert qs.shape[0] <= max_q and ks.shape[0] <= max_k
        rep = q.shape[1] // k.shape[1]
        ks, vs = (t.repeat_interleave(rep, dim=1) for t in (ks, vs))
        n, n_k = qs.shape[0], ks.shape[0]
        mask = torch.ones(n, n_k, dtype=torch.bool).tril(diagonal=n_k - n)
        outs.append(F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                                   vs.transpose(0, 1), attn_mask=mask).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("rank,degree", [(0, 1), (0, 2), (1, 2), (3, 4)])
def test_varlen_route_cpu_twin(rank, degree):
    """The CUDA route's packing (query order, key gather, cu_seqlens) with a reference kernel
    equals the CPU route per segment, forward and backward (GQA)."""
    torch.manual_seed(0)
    s, docs = 24, (0, 7, 8, 19)
    runs = zigzag_runs_of(s, rank, degree)
    tq = sum(b - a for a, b, _ in runs)
    q = torch.randn(1, 4, tq, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, s, 8, requires_grad=True) for _ in range(2))
    segs = plan_segments(runs, docs)
    cpu = SdpaRoute("cpu_blocked_mask", query_block=3).documents(q, k, v, segs, gqa=True)
    twin = varlen_attention(q, k, v, varlen_plan(segs), _reference_varlen_kernel)
    torch.testing.assert_close(twin, cpu, **TOL)
    g = torch.randn_like(cpu)
    grads_cpu = torch.autograd.grad(cpu, (q, k, v), g)
    grads_twin = torch.autograd.grad(twin, (q, k, v), g)
    for a, b in zip(grads_twin, grads_cpu):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_forward_agrees_on_cpu():
    """FlexAttention (the other block-sparse choice) with a document block mask gives the CPU
    route's forward: the mask_mod below is the rule of model/documents.py."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(1)
    s, lengths = 32, [5, 11, 1, 15]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    q, k, v = (torch.randn(1, 2, s, 8) for _ in range(3))
    mask = create_block_mask(same_document_causal, None, None, s, s, device="cpu", BLOCK_SIZE=8)
    flex = flex_attention(q, k, v, block_mask=mask)
    docs = Documents.from_lengths([lengths])
    ours = attention_core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ((0, s, 0),),
                          documents=docs)
    torch.testing.assert_close(ours, flex.transpose(1, 2).reshape(1, s, -1), **TOL)


def _model():
    torch.manual_seed(0)
    model = Transformer(CFG)
    init_model(model, 5)
    return model


def _batch(seq_len=30):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), seq_len + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, 2] = -100
    return tokens[:, :-1].contiguous(), labels


def per_document_reference(model, ids, labels, lengths, *, reset_positions: bool):
    """Sum over documents, each run alone through `model` (one process): the loss sum, the token
    count and every gradient of (sum of losses) / count."""
    model.zero_grad()
    total, count = 0.0, 0
    sums = []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            pos = PositionRuns.contiguous(n, first=0 if reset_positions else start)
            s, c = model.loss_sum(ids[row:row + 1, start:start + n], labels[row:row + 1, start:start + n], pos)
            sums.append(s)
            count += int(c)
            start += n
    total = torch.stack(sums).sum()
    (total / count).backward()
    return total.item(), count, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reset_positions", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_batch_equals_documents_alone(reset_positions, checkpointing):
    model = _model()
    ids, labels = _batch()
    ref_loss, ref_count, ref_grads = per_document_reference(model, ids, labels, LENGTHS,
                                                            reset_positions=reset_positions)
    model.zero_grad()
    if checkpointing:
        model.block_wrapper = lambda block, x, rope: torch.utils.checkpoint.checkpoint(
            block, x, rope, use_reentrant=False)
    docs = Documents.from_lengths(LENGTHS, reset_positions=reset_positions)
    s, c = model.loss_sum(ids, labels, PositionRuns.contiguous(ids.shape[1]).with_documents(docs))
    (s / c).backward()
    assert int(c) == ref_count
    assert s.item() == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, **TOL, msg=lambda m: f"{name}: {m}")


class _Counted:
    """Wraps a function of tsp_trainer.model.documents and counts its calls."""

    def __init__(self, monkeypatch, name):
        import tsp_trainer.model.documents as documents

        self.calls, real = 0, getattr(documents, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(documents, name, counted)


@pytest.mark.parametrize("reset_positions", [False, True])
def test_segment_plan_is_built_once_per_batch_and_query_layout(monkeypatch, reset_positions):
    """A forward and backward of a 4-layer model (with activation checkpointing: each block's
    attention runs again in backward) over 2 rows cuts each row into segments once: 2 builds, not
    layers x calls x rows = 16 (plus 2 for the RoPE positions with reset_positions). A second
    query layout (a zigzag rank's runs, as a head bucket calls it twice) adds one build per row."""
    segments = _Counted(monkeypatch, "plan_segments")
    model = Transformer(CFG.__class__(**{**CFG.__dict__, "num_layers": 4}))
    init_model(model, 5)
    model.block_wrapper = lambda block, x, rope: torch.utils.checkpoint.checkpoint(
        block, x, rope, use_reentrant=False)
    ids, labels = _batch()
    docs = Documents.from_lengths(LENGTHS, reset_positions=reset_positions)
    s, c = model.loss_sum(ids, labels, PositionRuns.contiguous(ids.shape[1]).with_documents(docs))
    (s / c).backward()
    assert segments.calls == len(LENGTHS)
    runs = zigzag_runs_of(30, rank=1, degree=3)
    q = torch.randn(2, sum(b - a for a, b, _ in runs), 4, 8)
    k, v = torch.randn(2, 30, 2, 8), torch.randn(2, 30, 2, 8)
    first, second = (attention_core(q, k, v, runs, documents=docs) for _ in range(2))
    assert segments.calls == 2 * len(LENGTHS) and torch.equal(first, second)
    assert docs.plan(runs) is docs.plan(list(runs))                # the same plan objects


def test_varlen_tensors_are_made_once_per_row_and_device(monkeypatch):
    """The varlen call's key index and int32 offsets (CUDA) come from the row plan, made at its
    first use on a device and reused by every later call (CPU twin: the CPU device)."""
    made = _Counted(monkeypatch, "varlen_plan")
    docs = Documents.from_lengths(LENGTHS)
    rows = docs.plan(zigzag_runs_of(30, rank=1, degree=3))
    cpu = torch.device("cpu")
    first = [row.varlen(cpu) for row in rows]
    again = [row.varlen(cpu) for row in rows]
    assert made.calls == len(LENGTHS) and all(a is b for a, b in zip(first, again))
    assert first[0].cu_q.dtype == torch.int32 and first[0].cu_q.tolist() == list(first[0].plan.cu_q)
    assert first[0].key_index.tolist() == first[0].plan.key_index().tolist()


def test_masking_changes_the_loss():
    """The test above can fail: without masking the packed loss differs from the documents'."""
    model = _model()
    ids, labels = _batch()
    ref_loss, _, _ = per_document_reference(model, ids, labels, LENGTHS, reset_positions=False)
    with torch.no_grad():
        s, _ = model.loss_sum(ids, labels)
    assert abs(s.item() - ref_loss) > 1e-3


# -- the data side: the loader carries document ids, cut after every EOS -------------------------
def test_document_ids_start_after_each_eos():
    from tsp_trainer.data.packing import document_ids, windows_to_batch

    eos = 2
    ids = torch.tensor([[5, 2, 7, 8, 2, 9], [2, 2, 4, 4, 4, 4]])
    assert document_ids(ids, eos).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    batch = windows_to_batch([[5, 2, 7, 8, 2, 9, 1]], eos_id=eos)
    assert Documents.from_ids(batch["document_ids"]).starts == ((0, 2, 5),)
    assert "document_ids" not in windows_to_batch([[5, 2, 7, 8, 2, 9, 1]])


@pytest.mark.parametrize("prefetch", [False, True])
def test_loader_batches_carry_document_ids(prefetch):
    from tests.unit.data_helpers import CORPUS, TOKENIZER
    from tsp_trainer.data import PrefetchLoader, build_loader, load_tokenizer
    from tsp_trainer.data.packing import document_ids

    tok = load_tokenizer(TOKENIZER)
    loader = build_loader(str(CORPUS), tokenizer=tok, seq_len=512, micro_batch_size=2, document_ids=True)
    loader = PrefetchLoader(loader, depth=2) if prefetch else loader
    with loader:
        batches = [next(loader) for _ in range(3)]
    assert any(int(b["document_ids"].max()) > 0 for b in batches)      # boundaries inside windows
    for b in batches:
        assert b["document_ids"].shape == b["input_ids"].shape
        torch.testing.assert_close(b["document_ids"], document_ids(b["input_ids"], tok.eos_id))
        for row, starts in enumerate(Documents.from_ids(b["document_ids"]).starts):
            assert all(int(b["input_ids"][row, s - 1]) == tok.eos_id for s in starts[1:])


def test_config_keys_and_their_rule():
    from tsp_trainer.config.load import load_config
    from tsp_trainer.config.validate import validate_config

    cfg = load_config(None, ["parallel.tsp_degree=2", "data.document_masking=true", "data.reset_positions=true"])
    assert cfg.data.document_masking and cfg.data.reset_positions
    validate_config(cfg, world_size=4)
    bad = load_config(None, ["parallel.tsp_degree=2", "data.reset_positions=true"])
    with pytest.raises(ValueError, match=r"^data.reset_positions=true needs data.document_masking=true"):
        validate_config(bad, world_size=4)
