"""Qwen3 (per-head q/k RMSNorm), an explicit head_dim (Llama, Mistral) and a prime vocabulary
(padded to a multiple of the degree inside, tied and untied), imported from tiny folders saved by
transformers, under TSP and every baseline at D = 2 and 4 (pairwise at D = 4: AT_D4), against transformers itself on the same
weights (fp32): the logits, the loss and every gradient; the ledger of a step against the closed
forms; the loss and gradients with document masking (each document alone in transformers); the
weights after 3 AdamW steps; those weights written as TSP's checkpoint shards and read back into a
fresh model of the same layout (the resume path) and of another (sp at D = 2, tp_x_sp at D = 4);
exported (save_hf_folder, the original vocabulary) and loaded by transformers. D = 1 is
tests/unit/test_hf_shapes.py. K/V heads fewer than D (MQA, GQA 8/2): each rank's copy of its K/V
head, the copies' gradients summed (the gathered gradients and trained weights are the copies'),
the checkpoint shards holding one copy per head, export writing the original K/V head count. One
fork per degree runs every case, so the test stays cheap.

Tolerances: rtol 1e-5 / atol 1e-6 for logits and gradients, rel 1e-6 for losses (the same math
summed in another order over ranks); weights after AdamW atol 3e-6 (eps 1e-3 bounds the
first-order effect of gradient rounding: 3 steps x lr 1e-2 x 1e-7 / 1e-3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import hf_shapes
from tests.helpers.dist import run_on_ranks
from tsp_trainer.checkpoint.hf import load_hf_state_dict, save_hf_folder
from tsp_trainer.checkpoint.shards import read_local_state_dict, shard_file_name, write_shard
from tsp_trainer.config.hf_model import model_config_from_hf
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import checkpointed_block
from tsp_trainer.model.documents import Documents
from tsp_trainer.parallel.baselines.comm_model import expected_ledger_bytes
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize
from tsp_trainer.parallel.tsp.comm_model import ledger_totals, tsp_step_comm
from tsp_trainer.plan.communication import model_parallel_comm
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import FP32

pytestmark = pytest.mark.distributed

TOL = dict(rtol=1e-5, atol=1e-6)
# (scheme, options) per degree: every scheme, and TSP's kept-items paths (selective, buckets)
SCHEMES = {
    2: [("tsp", {}), ("tsp", {"tsp_recompute": "selective", "head_buckets": 2}), ("tp", {}),
        ("tp_sp", {}), ("sp", {})],
    4: [("tsp", {}), ("tsp", {"tsp_recompute": "none"}), ("tp", {}), ("tp_sp", {}), ("sp", {}),
        ("tp_x_sp", {"tp_degree": 2, "sp_degree": 2})],
}

# Pairwise at D = 4: every scheme meets every shape at D = 2, and tsp and tp_x_sp (which needs 4
# ranks) every shape at D = 4 too; there each other case runs on the shapes named here, so every
# shape and every scheme meet D = 4 and each shape's features (q/k norms, biases, tying, head_dim
# above and below hidden / heads, a prime vocabulary) meet a Megatron baseline and sp at D = 4.
AT_D4 = {("tsp", "none"): ("qwen3", "qwen3_bias_tied", "mistral_head_dim"),
         ("tp", None): ("qwen3", "llama_vocab_prime_tied"),
         ("tp_sp", None): ("qwen3_bias_tied", "mistral_head_dim"),
         ("sp", None): ("llama_head_dim", "qwen3_vocab_prime")}

# K/V heads fewer than D (hf_shapes.FEW_KV_HEADS), where they are: MQA at D = 2 and 4 (one group of
# 2 and 4 sharers), GQA 8/2 at D = 4 (two groups of 2). One K/V head per shard cannot be bucketed;
# TSP's kept items (tsp_recompute=none keeps what selective keeps) reuse the shared gather, and so
# does activation checkpointing's replay ("checkpointing": every block checkpointed). Every Megatron baseline runs with
# copies at D = 4 (tp, tp_sp and tp_x_sp share the copies' code: each runs on one shape or two);
# sp (whole weights) is the same code as for the others, at D = 2 only (the reshard).
_X = ("tp_x_sp", {"tp_degree": 2, "sp_degree": 2})
FEW_KV_SCHEMES = {
    ("qwen2_mqa", 2): [("tsp", {}), ("tp", {}), ("sp", {})],
    ("qwen2_mqa", 4): [("tsp", {}), ("tsp", {"tsp_recompute": "none"}), ("tp_sp", {}), _X],
    ("qwen3_kv2", 4): [("tsp", {"checkpointing": True}), ("tp", {}), _X],
}

# TSP's checkpoint shards are read back into this scheme's layout too (another split of the rows)
RESHARD_TO = {2: "sp", 4: "tp_x_sp"}


def _schemes(shape: str, world: int) -> list:
    if shape in hf_shapes.FEW_KV_HEADS:
        return FEW_KV_SCHEMES.get((shape, world), [])
    if world == 2:
        return SCHEMES[2]
    return [(scheme, options) for scheme, options in SCHEMES[4]
            if shape in AT_D4.get((scheme, options.get("tsp_recompute")), (shape,))]


@pytest.fixture(scope="module")
def folders():
    """The root folder of every shape's saved folder (shared with the D = 1 test)."""
    return [hf_shapes.saved(shape) for shape in hf_shapes.SHAPES][0].parent


def _parallel(cfg, folder, scheme, options, mesh, seq_len):
    model = Transformer(cfg)
    model.load_state_dict(dict(load_hf_state_dict(folder, cfg)))
    options = dict(options)
    checkpointing = options.pop("checkpointing", False)
    par = parallelize(model, scheme, mesh, seq_len=seq_len, **options)
    if checkpointing:
        model.block_wrapper = checkpointed_block
    return par


def _step(par, ids, labels, documents=None):
    local_ids, local_labels, pos = par.local_batch(ids, labels, documents)
    loss_sum, count = par.loss_sum(local_ids, local_labels, pos)
    total = global_count(count, par.token_comms)
    (loss_sum / total).backward()
    return reduce_loss_value(loss_sum, total, par.token_comms)


def _cases_rank(rank, world, root, ckpt_root):
    """Every shape x scheme of this degree on this rank; rank 0 returns the gathered results."""
    mesh = build_mesh(world)
    results = {}
    for shape in hf_shapes.SHAPES:
        folder = f"{root}/{shape}"
        cfg = model_config_from_hf(folder)
        ids, labels = hf_shapes.batch(cfg.vocab_size)
        for i, (scheme, options) in enumerate(_schemes(shape, world)):
            par = _parallel(cfg, folder, scheme, options, mesh, ids.shape[1])
            mesh.ledger.reset()
            out = {"loss": _step(par, ids, labels)}
            out["ledger"] = _ledger(mesh, cfg, scheme, options, world, ids)
            out["grads"] = par.gather_full_grads()
            local_ids, local_labels, pos = par.local_batch(ids, labels)
            out["logits"] = par.model(local_ids, pos).detach()
            # evaluation: per-token loss and argmax (padded vocabulary rows never win), and where
            # this rank's tokens sit in the batch
            stats = par.token_stats(local_ids, local_labels, pos)
            where = torch.arange(ids.numel()).view(ids.shape)
            out["stats"] = (stats.loss, stats.argmax, par.local_batch(where, where)[0])
            par.model.zero_grad()
            docs = Documents.from_lengths(hf_shapes.DOC_LENGTHS, reset_positions=True)
            out["doc_loss"] = _step(par, ids, labels, docs)
            out["doc_grads"] = par.gather_full_grads()
            par.model.zero_grad()
            opt = torch.optim.AdamW(par.model.parameters(), lr=hf_shapes.LR, eps=hf_shapes.EPS)
            for _ in range(hf_shapes.STEPS):
                _step(par, ids, labels)
                opt.step()
                opt.zero_grad()
            out["weights"] = par.gather_full_state_dict()
            if i == 0:                   # resume: TSP's shards written, read back into a fresh model
                ckpt = Path(f"{ckpt_root}/d{world}_{shape}")
                if rank == 0:
                    ckpt.mkdir()
                dist.barrier()
                write_shard(ckpt / shard_file_name(mesh.tsp.rank, world), par.model.state_dict(),
                            par.specs, {c.axis: c.rank for c in par.axis_comms.values()})
                dist.barrier()
                out["resumed"] = _read_back(ckpt, cfg, folder, scheme, options, mesh, ids)
                written = (ckpt, out["weights"])
            elif scheme == RESHARD_TO[world]:  # the same shards read into another layout
                resharded = _read_back(written[0], cfg, folder, scheme, options, mesh, ids)
                out["resharded"] = all(torch.equal(resharded[n], w) for n, w in written[1].items())
            results[(shape, scheme, i)] = out if rank == 0 else {"loss": out["loss"]}
    return results


def _ledger(mesh, cfg, scheme, options, world, ids) -> bool:
    """The step's ledger equals the closed form of the scheme (q/k norm all-reduces included)."""
    batch, seq = ids.shape
    records = [r for r in mesh.ledger.records if r.tag != "loss.value"]    # the logged loss value
    if options.get("checkpointing"):       # the replay's forward traffic too: the planner's model
        got = {f"{op}/{tag}": v for (op, tag), v in ledger_totals(records).items()}
        want = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in model_parallel_comm(
            cfg, Layout(scheme, world, micro_batch=batch, activation_checkpointing=True), seq, FP32).items()}
        assert got == want, f"{scheme} {options}: ledger {got} != closed form {want}"
        return True
    if scheme == "tsp":
        got = ledger_totals(records)
        want = tsp_step_comm(cfg, degree=world, batch=batch, seq_len=seq,
                             head_buckets=options.get("head_buckets", 1))
    else:
        got = {k: v["bytes"] for k, v in mesh.ledger.summary().items() if not k.endswith("/loss.value")}
        want = expected_ledger_bytes(cfg, scheme, degree=world, batch=batch, seq_len=seq,
                                     **{k: v for k, v in options.items() if k.endswith("degree")})
    assert got == want, f"{scheme} {options}: ledger {got} != closed form {want}"
    return True


def _read_back(ckpt: Path, cfg, folder, scheme, options, mesh, ids) -> dict:
    """A fresh `scheme` model loaded from the shards in `ckpt` (read_local_state_dict: this rank's
    slices only, padded vocabulary rows included), gathered back to full tensors."""
    fresh = _parallel(cfg, folder, scheme, options, mesh, ids.shape[1])
    names = [n for n, _ in fresh.model.named_parameters()]
    local = read_local_state_dict(ckpt, fresh.specs, {c.axis: c.rank for c in fresh.axis_comms.values()},
                                  names)
    with torch.no_grad():
        for n, p in fresh.model.named_parameters():
            p.copy_(local[n])
    return fresh.gather_full_state_dict()


def _max_diff(ours: dict, theirs: dict) -> float:
    return max((ours[n] - t).abs().max().item() for n, t in theirs.items())


# D = 4 (4 ranks on the CI's 2 cores, ~30 s) in the slow tier; D = 2 runs every scheme x shape
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hf_shapes_match_transformers(folders, tmp_path, world, capsys):
    results = run_on_ranks(_cases_rank, world, str(folders), str(tmp_path), timeout=600)
    figures = []
    for (shape, scheme, i), out in results[0].items():
        ref = hf_shapes.shared_reference(shape)
        cfg = model_config_from_hf(folders / shape)
        where = f"D={world} {shape} {scheme} {_schemes(shape, world)[i][1]}"
        for rank in range(world):
            assert results[rank][(shape, scheme, i)]["loss"] == pytest.approx(ref["loss"], rel=1e-6), where
        par_ref = ref["logits"]            # for rank 0's logits of its own tokens
        assert out["grads"].keys() == ref["grads"].keys(), where
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], grad, **TOL, msg=lambda m: f"{where} {name}: {m}")
        assert out["doc_loss"] == pytest.approx(ref["doc_loss"], rel=1e-6), where
        for name, grad in ref["doc_grads"].items():
            torch.testing.assert_close(out["doc_grads"][name], grad, **TOL,
                                       msg=lambda m: f"{where} documents {name}: {m}")
        for name, w in ref["weights"].items():
            torch.testing.assert_close(out["weights"][name], w, rtol=0, atol=3e-6,
                                       msg=lambda m: f"{where} AdamW {name}: {m}")
        token_loss, argmax, where_ = out["stats"]
        ref_logits = ref["logits"].flatten(0, 1)[where_.flatten()]
        labels = hf_shapes.batch(cfg.vocab_size)[1].flatten()[where_.flatten()]
        ref_loss = torch.nn.functional.cross_entropy(ref_logits, labels, reduction="none", ignore_index=-100)
        torch.testing.assert_close(token_loss.flatten(), ref_loss, **TOL, msg=lambda m: f"{where} token loss: {m}")
        assert torch.equal(argmax.flatten(), ref_logits.argmax(-1)), f"{where} argmax"
        if "resumed" in out:
            for name, w in out["weights"].items():
                assert torch.equal(out["resumed"][name], w), f"{where} resumed {name}"
        if "resharded" in out:
            assert out["resharded"], f"{where}: TSP's D={world} shards read into {scheme} differ"
        # the trained weights load into a model of the shape (strict: every name and shape), and
        # exported and loaded by transformers, give transformers' logits equal to ours. The export
        # once per shape and degree (the first scheme's): every scheme's trained weights equal
        # transformers' to atol 3e-6 above, and the export reads nothing but those weights.
        Transformer(cfg).load_state_dict(out["weights"])
        export = _export_diff(out["weights"], cfg, tmp_path / f"export_{world}_{shape}", where) if i == 0 else None
        figures.append(f"{where}: loss {abs(out['loss'] - ref['loss']):.1e} grads "
                       f"{_max_diff(out['grads'], ref['grads']):.1e} documents "
                       f"{_max_diff(out['doc_grads'], ref['doc_grads']):.1e} adamw "
                       f"{_max_diff(out['weights'], ref['weights']):.1e} logits(rank 0) "
                       f"{_local_logits_diff(out['logits'], par_ref, world, scheme):.1e}"
                       + (f" export logits {export:.1e}" if export is not None else ""))
    with capsys.disabled():
        print("\n" + "\n".join(figures))


def _export_diff(weights: dict, cfg, folder, where: str) -> float:
    """save_hf_folder of `weights`, loaded by transformers: its logits against ours on the same
    weights (the largest difference); the folder's config reads back as `cfg`."""
    from transformers import AutoModelForCausalLM

    model = Transformer(cfg)
    model.load_state_dict(weights)
    ids, _ = hf_shapes.batch(cfg.vocab_size)
    exported = save_hf_folder(weights, cfg, folder)
    back = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    with torch.no_grad():
        ours_logits, their_logits = model(ids), back(ids).logits
    torch.testing.assert_close(their_logits, ours_logits, **TOL, msg=lambda m: f"{where} export: {m}")
    assert model_config_from_hf(exported) == cfg
    return (their_logits - ours_logits).abs().max().item()


def _local_logits_diff(local: torch.Tensor, full: torch.Tensor, world: int, scheme: str) -> float:
    """Rank 0's logits against the same tokens of transformers' logits: zigzag chunks 0 and 2D-1
    (tsp, sp), all tokens (tp), or for tp_x_sp the sp rank 0's chunks (sp = 2)."""
    s = full.shape[1]
    if scheme in ("tp", "tp_sp"):
        want = full
    else:
        parts = 2 * (2 if scheme == "tp_x_sp" else world)
        c = s // parts
        want = torch.cat([full[:, :c], full[:, s - c:]], dim=1)
    diff = (local - want).abs().max().item()
    assert diff <= 1e-5, f"rank 0 logits differ by {diff}"
    return diff
