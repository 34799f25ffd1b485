"""The peers' planner layouts (plan/peers.py): ulysses (the ALST stack), upipe (head-chunked
Ulysses), sp_zero3 (FSDP + context parallelism), the peers' own stacks as the planner models them
(the trainer runs them on its model code as ulysses, head chunks and sp under ZeRO-3)."""

from __future__ import annotations

import pytest

from tsp_trainer.config.model import model_config
from tsp_trainer.plan import cli
from tsp_trainer.plan.hardware import get_profile
from tsp_trainer.plan.longest import longest_seq_len
from tsp_trainer.plan.peers import (ALST_TABLE, PEER_STACK, PeerLayout, alst_ablation,
                                    peer_comm_seconds, peer_longest, peer_memory, peer_ranking,
                                    peer_shapes_ok, predict_peer)
from tsp_trainer.plan.precision import BF16
from tsp_trainer.plan.predict import Assumptions

LLAMA = model_config("llama3_8b")
H100 = get_profile("h100")

# ALST's rows the planner cannot bring within 15%, with the gap it does find (planner / ALST - 1):
# row 4 (tiled MLP, block inputs in HBM): the planner frees the untiled MLP's three [n, I]
# intermediates in full, ALST gained 9% over row 3 (docs/planner.md, "The peers")
ALST_BOUND = 0.15
ALST_KNOWN_GAPS = {4: (0.15, 0.20)}


@pytest.fixture(scope="module")
def alst_rows():
    return alst_ablation()


def test_alst_table_within_15_percent_or_the_documented_gap(alst_rows):
    for row, longest in alst_rows:
        gap = longest.seq_len / row.published - 1
        low, high = ALST_KNOWN_GAPS.get(row.row, (-ALST_BOUND, ALST_BOUND))
        assert low <= gap <= high, (row.row, row.configuration, longest.seq_len, f"{gap:+.1%}")
        assert longest.best.layout.degree == row.degree
        assert longest.best.layout.offload_optimizer
        assert longest.bound == "HBM"


def test_alst_rows_grow_as_alst_adds_techniques(alst_rows):
    n = {row.row: longest.seq_len for row, longest in alst_rows}
    assert n[1] < n[2] < n[3] < n[4] < n[6] and n[3] < n[5] < n[6]
    assert [r.row for r in ALST_TABLE] == [1, 2, 3, 4, 5, 6]


def test_zero3_state_is_sharded_over_the_world_and_cpu_adam_moves_it_to_host():
    lay = PeerLayout("ulysses", 8, dp=2)
    m, _ = peer_memory(LLAMA, lay, 65536)
    n = LLAMA.num_params()
    assert m["params"] == -(-2 * n // 16) and m["grads"] == -(-4 * n // 16)
    assert m["optimizer"] == -(-12 * n // 16) and m["host_optimizer"] == 0
    off, _ = peer_memory(LLAMA, PeerLayout("ulysses", 8, dp=2, offload_optimizer=True), 65536)
    assert off["grads"] == off["optimizer"] == 0
    # fp32 master, two fp32 moments, the fp32 gradient partition, the bf16 copy sent back
    assert off["host_optimizer"] == -(-n * 18 // 16)


def test_offloaded_block_inputs_live_in_host_memory():
    seq = 1 << 20
    on, act_on = peer_memory(LLAMA, PeerLayout("ulysses", 8), seq)
    off, act_off = peer_memory(LLAMA, PeerLayout("ulysses", 8, offload_block_inputs=True), seq)
    block = 2 * (seq // 8) * LLAMA.hidden_size
    assert act_off.host == LLAMA.num_layers * block and act_on.host == 0
    assert act_on.peak - act_off.peak == (LLAMA.num_layers - 1) * block
    p = predict_peer(LLAMA.replace(max_seq_len=seq), PeerLayout("ulysses", 8, offload_block_inputs=True),
                     seq, H100)
    assert p.memory["host_per_node"] >= 8 * act_off.host


def test_head_chunks_divide_attention_memory_and_replay_one_forward():
    """upipe (parallel.ulysses_head_chunks > 1): the post-all-to-all tensors alive in backward are
    one chunk's, a chunk keeps only its local q, k, v, and backward replays each chunk's forward
    all-to-alls (the checkpointed layout: 4 passes of bytes against 3)."""
    seq = 1 << 20
    _, whole = peer_memory(LLAMA, PeerLayout("ulysses", 8, tiled_mlp=True), seq)
    e, n, hq, hkv = 2, seq // 8, LLAMA.q_hidden_size, LLAMA.kv_hidden_size
    b = peer_comm_seconds(LLAMA, PeerLayout("ulysses", 8), seq, H100, Assumptions())
    for chunks in (2, 4):
        lay = PeerLayout("upipe", 8, head_chunks=chunks)
        _, act = peer_memory(LLAMA, lay, seq)
        # everything after the all-to-all is per chunk; the o_proj input [n, hq] stays whole
        assert act.terms["flash_backward"] < whole.terms["flash_backward"]
        assert act.terms["attention_saved"] == e * n * (2 * hq + 2 * hkv)
        assert act.terms["attention_backward"] < whole.terms["attention_backward"]
        assert act.terms["block_input"] == whole.terms["block_input"]
        a = peer_comm_seconds(LLAMA, lay, seq, H100, Assumptions())
        assert a["sp_bytes"] == pytest.approx(b["sp_bytes"] * 4 / 3)
    slow = predict_peer(LLAMA.replace(max_seq_len=seq), PeerLayout("upipe", 8, head_chunks=4), seq, H100)
    fast = predict_peer(LLAMA.replace(max_seq_len=seq), PeerLayout("ulysses", 8), seq, H100)
    assert slow.times["compute_per_micro"] > fast.times["compute_per_micro"]


def test_ulysses_all_to_all_bytes():
    """4 all-to-alls of q, k, v, o per layer and pass (forward, backward, checkpoint replay),
    (D - 1) / D of each on the wire; K/V heads fewer than D replicated up to D."""
    seq, d = 65536, 8
    c = peer_comm_seconds(LLAMA, PeerLayout("ulysses", d), seq, H100, Assumptions())
    kv = 2 * max(LLAMA.num_kv_heads, d) * LLAMA.head_dim
    expected = 3 * LLAMA.num_layers * 2 * (seq // d) * (2 * LLAMA.q_hidden_size + kv) * (d - 1) / d
    assert c["sp_bytes"] == pytest.approx(expected)


def test_refusals_name_the_rule():
    with pytest.raises(ValueError, match="head_chunks"):
        PeerLayout("upipe", 8, head_chunks=1)
    with pytest.raises(ValueError, match="head_chunks"):
        PeerLayout("ulysses", 8, head_chunks=2)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        PeerLayout("ulysses", 8, activation_checkpointing=False, offload_block_inputs=True)
    with pytest.raises(ValueError, match="not a peer"):
        PeerLayout("tsp", 8)
    assert "q heads 32 not divisible by D=3" in peer_shapes_ok(LLAMA, "ulysses", 3, 3 * 1024)
    assert "not divisible by 16" in peer_shapes_ok(LLAMA, "sp_zero3", 8, 8 * 1001)
    assert PEER_STACK in PeerLayout("ulysses", 8).label()


def test_sp_with_zero3_goes_longer_than_replicated_sp():
    sp = longest_seq_len(LLAMA, "sp", hw=H100, nodes=1, prec=BF16)
    z3 = peer_longest(LLAMA, "sp_zero3", hw=H100, nodes=1, prec=BF16)
    assert z3.seq_len > max(sp.seq_len, 1 << 18)


def test_ranking_at_one_node_and_at_1024_gpus_lists_every_peer():
    for nodes, batch in ((1, 8), (128, 128)):
        best = peer_ranking(LLAMA, seq_len=131072, global_batch=batch, hw=H100, nodes=nodes)
        assert set(best) == {"ulysses", "upipe", "sp_zero3"}
        for p in best.values():
            assert p.fits and p.layout.world == 8 * nodes and 0 < p.mfu < 1


def test_cli_lists_tsp_beside_the_peers(capsys):
    assert cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", "--max-seq-len",
                     "--schemes", "tsp,ulysses,upipe,sp_zero3"]) == 0
    out = capsys.readouterr().out
    for name in ("| tsp |", "| ulysses |", "| upipe |", "| sp_zero3 |"):
        assert name in out
    assert cli.main(["--model", "llama3_8b", "--gpu", "h100", "--nodes", "1", "--seq-len", "131072",
                     "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "TSP beside the peers" in out and f"ulysses ({PEER_STACK})" in out


def test_cli_dry_run_refuses_a_peer(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--dry-run", "--schemes", "ulysses"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--schemes='ulysses'" in err and "peer stacks the dry run does not model" in err
