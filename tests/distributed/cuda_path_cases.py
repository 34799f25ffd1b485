"""Rank functions for tests/distributed/test_cuda_path.py."""

from __future__ import annotations

import torch

from tests.distributed.trainer_cases import config
from tests.helpers.devices import HostDefaultElsewhere


def train_steps_with_host_default_elsewhere(rank, world, overrides):
    """Build the Trainer normally, then run its steps while factories in the compute packages
    that name no device create meta tensors (tests/helpers/devices.py)."""
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    losses = []
    with HostDefaultElsewhere() as mode:
        for _ in range(trainer.cfg.train.steps):
            losses.append(trainer.train_step()["train/loss"])
    return {"losses": losses, "redirected": mode.redirected,
            "flag_device": str(trainer.nonfinite.flag.device), "device": str(trainer.device)}


def count_host_syncs(rank, world, overrides):
    """Host syncs of the Trainer's second optimizer step (the first warms up), by source."""
    import os

    import tsp_trainer
    from tsp_trainer.tools.host_sync import HostSyncCounter
    from tsp_trainer.trainer import Trainer

    trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
    trainer.train_step()
    with HostSyncCounter(trainer.device) as counter:
        trainer.train_step()
    ours = os.path.dirname(tsp_trainer.__file__)
    return {"total": counter.total, "ours": counter.count_from(ours),
            "by_site": dict(counter.by_site), "micro_steps": trainer.cfg.train.grad_accum}


def train_and_describe_precision(rank, world, runs):
    """Train each config of `runs` in turn (same processes); per run: the losses and how
    DeepSpeed accumulates and reduces gradients."""
    from tsp_trainer.trainer import Trainer

    out = []
    for overrides in runs:
        trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
        opt = trainer.engine.optimizer
        accum = getattr(opt, "grad_acc_dtype", None) or getattr(opt, "gradient_accumulation_dtype", None)
        history = trainer.fit()
        out.append({"losses": [h["train/loss"] for h in history], "optimizer": type(opt).__name__,
                    "grad_accum_dtype": str(accum), "param_dtype": str(next(trainer.par.model.parameters()).dtype),
                    "communication_dtype": str(trainer.engine.communication_data_type)})
    return out


def bf16_step_ledger(rank, world, scheme, options, biases=False):
    """One forward + backward of a bf16 model under `scheme`: the ledger (op, tag) totals and the
    dtypes each tag's payloads had, and the dtype of every parameter's gradient."""
    from tsp_trainer.config import ModelConfig
    from tsp_trainer.model import Transformer
    from tsp_trainer.parallel.loss import global_count
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.parallel.tsp.comm_model import ledger_totals

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_seq_len=64, qkv_bias=biases, o_bias=biases,
                      mlp_bias=biases)
    mesh = build_mesh(world)
    model = Transformer(cfg)
    model.init_weights(0)
    model.to(torch.bfloat16)
    par = parallelize(model, scheme, mesh, seq_len=32, **options)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=gen)
    batch = par.local_batch(tokens[:, :-1], tokens[:, 1:])
    mesh.ledger.reset()
    loss_sum, count = par.loss_sum(*batch)
    (loss_sum / global_count(count, par.token_comms)).backward()
    return {"dtypes": {tag: sorted(d) for tag, d in mesh.ledger.dtypes_by_tag().items()},
            "ledger": {f"{op}/{tag}": v for (op, tag), v in ledger_totals(mesh.ledger.records).items()},
            "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}), "cfg": cfg}


def evaluate_with_host_default_elsewhere(rank, world, batches):
    """The Trainer's Evaluator (loss by position with document masking, then the passkey, whose
    per-cell counts are all-reduced over dp), once plainly and once while factories in the
    compute packages and tsp_trainer/eval that name no device create meta tensors."""
    from tsp_trainer.config import ModelConfig
    from tsp_trainer.data import load_tokenizer
    from tsp_trainer.eval import HaystackBuilder, PasskeyTask
    from tsp_trainer.eval.evaluator import EVAL_LOSS, PASSKEY_ACCURACY, Evaluator
    from tsp_trainer.model import Transformer
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize

    cfg = ModelConfig(vocab_size=1024, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_seq_len=256)
    seq_len = batches[0]["input_ids"].shape[1]
    train_cfg = config(["train.eval_every=1", "eval.passkey_every=1", "data.document_masking=true",
                        "data.reset_positions=true", f"data.seq_len={seq_len}"])
    mesh = build_mesh(1)                                 # dp 2: the passkey counts cross ranks
    model = Transformer(cfg)
    model.init_weights(0)
    par = parallelize(model, "tsp", mesh, seq_len=seq_len)
    builder = HaystackBuilder(load_tokenizer("data/tokenizer"), list(range(100, 900)), digits=3)
    task = PasskeyTask((96, 128), (0.0, 1.0), 2, builder)
    mine = [{k: v[mesh.dp_rank::2] for k, v in b.items()} for b in batches]
    evaluator = Evaluator(train_cfg, par=par, mesh=mesh, device=torch.device("cpu"),
                          eval_batches=mine, passkey=task)
    plain = evaluator.run(1)
    with HostDefaultElsewhere() as mode:
        guarded = evaluator.run(1)
    return {"redirected": mode.redirected,
            "plain": (plain[EVAL_LOSS], plain[PASSKEY_ACCURACY]),
            "guarded": (guarded[EVAL_LOSS], guarded[PASSKEY_ACCURACY])}


def whole_run_with_host_default_elsewhere(rank, world, overrides, cli_runs=(), export_to=None):
    """A whole Trainer run (construction, fit with its evaluations and checkpoint saves, the
    resume that `overrides` may ask for), then each `tsp-eval` argv of `cli_runs` in the same
    process group, then (rank 0) `tsp-export` to `export_to`: all while factories in the compute
    packages that name no device create meta tensors."""
    from tsp_trainer.checkpoint.export_cli import main as export_main
    from tsp_trainer.eval import cli as eval_cli
    from tsp_trainer.trainer import Trainer

    with HostDefaultElsewhere() as mode, mode.named_on_failure():
        trainer = Trainer(config(overrides), world_size=world, global_rank=rank)
        resumed_from = trainer.state.step
        history = trainer.fit()
        evaluations = []
        for argv in cli_runs:
            args = eval_cli.build_parser().parse_args(argv)
            evaluations.append(eval_cli.run(eval_cli.prepare(args, world_size=world, rank=rank), rank=rank))
        if export_to is not None and rank == 0:
            export_main([trainer.cfg.train.output_dir, str(export_to)])
    weights = trainer.par.gather_full_state_dict()
    return {"redirected": mode.redirected, "resumed_from": resumed_from,
            "metrics": [{k: v for k, v in h.items() if k.startswith(("train/loss", "eval/"))} for h in history],
            "evaluations": evaluations, "weights": weights if rank == 0 else None,
            "device": str(trainer.device)}
