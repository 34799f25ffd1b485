"""The Trainer: checks its inputs (run/inputs.py), then builds, in order, mesh -> model with its
parallel scheme -> DeepSpeed engine under Accelerate -> data -> checkpoints -> run folder and
logging; then fit() runs train_step() / evaluate() under the run's lifecycle guards (run/: the
preemption agreement at step boundaries and the hang watchdog).

One optimizer step = grad_accum micro-batches per DP rank. Every rank of a TSP group reads the same
micro-batch (the loader is split by dp rank only) and takes its zigzag slice. The loss backpropagated
on each rank is local_sum * dp / global_count: DeepSpeed averages gradients over dp and divides by
grad_accum, so the update follows the mean over all tokens of the global batch.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from tsp_trainer.checkpoint import reshard
from tsp_trainer.checkpoint.manager import CheckpointManager
from tsp_trainer.config import TrainConfig, config_to_yaml, hang_dump_after_s, save_resolved_config
from tsp_trainer.config.model_source import describe_source
from tsp_trainer.data import build_loader, iterate_eval_batches
from tsp_trainer.engine import deepspeed as ds_engine
from tsp_trainer.model import Transformer
from tsp_trainer.observability import (ProgressBar, StepMetrics, get_logger, make_sinks,
                                       model_and_hardware_flops_per_token, peak_memory_bytes)
from tsp_trainer.optim import build_optimizer, build_scheduler
from tsp_trainer.parallel.loss import global_count, reduce_loss_value
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.mpu import TSPMpu
from tsp_trainer.parallel.schemes import Parallelized, parallelize
from tsp_trainer.run import CheckedInputs, HangWatchdog, StopAgreement, check_inputs, check_same_model
from tsp_trainer.run.session import open_run_folder

_LAYOUT_POLICY = {"refuse": "error", "restart": "restart", "resplit": "resplit"}


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient with train.nonfinite=stop (raised before the update)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous complete one stays `latest`."""


@dataclass
class TrainState:
    step: int = 0                # optimizer steps taken
    tokens_seen: int = 0         # global tokens consumed
    skipped_steps: int = 0       # non-finite steps skipped


class Trainer:
    def __init__(self, cfg: TrainConfig, *, world_size: int, global_rank: int, cuda: bool = False,
                 inputs: CheckedInputs | None = None):
        # Bad input (config, tokenizer, data, resume path, output folder) fails before any group exists.
        inputs = inputs if inputs is not None else check_inputs(cfg, world_size=world_size)
        self.cfg, self.model_cfg = cfg, cfg.model.to_model_config()   # named size or HF folder
        self.tokenizer = inputs.tokenizer
        self.log = get_logger(__name__, rank=global_rank)
        self.log.info(f"model: {describe_source(cfg.model)}; tokenizer: {self.tokenizer.name}")
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and cuda)
        dp = world_size // cfg.parallel.tsp_degree
        self.accelerator = ds_engine.make_accelerator(self._ds_config(dp), cpu=not cuda,
                                                      timeout_s=cfg.train.collective_timeout_s)
        self.mesh = build_mesh(cfg.parallel.tsp_degree, timeout_s=cfg.train.collective_timeout_s)
        self.par = self._build_model()
        self._loss_comms = self.par.token_comms + [self.mesh.dp]   # groups sharing a global batch
        self.optimizer = build_optimizer(self.par.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.engine, _ = ds_engine.prepare(self.accelerator, self.par.model, self.optimizer,
                                           TSPMpu(self.mesh))
        self.loader = self._build_loader()
        self.ckpt = CheckpointManager(f"{cfg.train.output_dir}/checkpoints", world=self.mesh.world,
                                      keep_last=cfg.checkpoint.keep_last)
        self.state = TrainState()
        self._nonfinite_grad = torch.zeros((), dtype=torch.bool)
        self._poisoned = False
        self._saved_step = -1                # step of the newest checkpoint this run wrote or loaded
        self._consecutive_skips = 0
        self._watch_gradients()
        self._resume(inputs.resume_path)
        self.session = open_run_folder(cfg, world=self.mesh.world, resume_path=inputs.resume_path,
                                       resume_meta=inputs.resume_meta, resumed_step=self.state.step)
        for note in self.session.notes:
            self.log.info(note)
        if self.mesh.rank == 0:
            save_resolved_config(cfg, f"{cfg.train.output_dir}/config.yaml")
        self.sinks = self._build_sinks()
        self.flops = model_and_hardware_flops_per_token(
            self.model_cfg, cfg.data.seq_len, recompute=cfg.train.activation_checkpointing)
        self.stopper = StopAgreement(self.mesh.world, signals=cfg.train.preempt_signals,
                                     max_runtime_s=cfg.train.max_runtime_min * 60, device=self.device)
        self.watchdog = HangWatchdog(dump_after_s=hang_dump_after_s(cfg.train), rank=global_rank,
                                     in_flight=self.mesh.ledger.in_flight.describe,
                                     dump_dir=f"{cfg.train.output_dir}/hang_dumps")
        self.stop_reason: str | None = None   # set when a signal or max_runtime_min ended fit() early
        self._slowest = {"step": 0.0, "save": 0.0}   # seconds, for the max-runtime margin

    # -- building ---------------------------------------------------------------------------------
    def _ds_config(self, dp: int) -> dict:
        c = self.cfg
        return ds_engine.ds_config(micro_batch=c.data.micro_batch_size, grad_accum=c.train.grad_accum,
                                   dp_degree=dp, zero_stage=c.zero.stage,
                                   max_grad_norm=c.optim.max_grad_norm, bf16=self.bf16)

    def _build_model(self) -> Parallelized:
        c = self.cfg
        with torch.device("meta"):                       # no rank ever holds the full model
            model = Transformer(self.model_cfg)
        par = parallelize(model, c.parallel.scheme, self.mesh, seq_len=c.data.seq_len,
                          head_buckets=c.parallel.head_buckets, init_seed=c.model.seed,
                          tp_degree=c.parallel.tp_degree, sp_degree=c.parallel.sp_degree)
        if c.model.init_from:
            from tsp_trainer.checkpoint.hf import load_hf_state_dict
            par.load_full_state_dict(load_hf_state_dict(c.model.init_from, self.model_cfg))
        if c.train.activation_checkpointing:
            model.block_wrapper = _checkpointed_block
        return par

    def _build_loader(self):
        c = self.cfg.data
        return build_loader(c.source, tokenizer=self.tokenizer, seq_len=c.seq_len,
                            micro_batch_size=c.micro_batch_size, split=c.train_split,
                            text_field=c.text_field, dp_rank=self.mesh.dp_rank,
                            dp_degree=self.mesh.dims.dp, seed=self.cfg.train.seed,
                            shuffle=c.shuffle, shuffle_buffer=c.shuffle_buffer)

    def _build_sinks(self):
        c, s = self.cfg.logging, self.session
        wandb_options = dict(entity=c.wandb_entity, group=c.wandb_group, tags=c.wandb_tags,
                             continues=s.wandb.continues, skip_through_step=s.wandb.skip_through_step,
                             rewind_to_step=s.wandb.rewind_to_step)
        return make_sinks(global_rank=self.mesh.rank, wandb_mode=c.wandb_mode, project=c.wandb_project,
                          run_name=s.identity.name, config=self.cfg.to_dict(),
                          output_dir=self.cfg.train.output_dir, jsonl=c.jsonl,
                          wandb_run_id=s.identity.wandb_run_id, wandb_options=wandb_options)

    def _watch_gradients(self) -> None:
        """Flag non-finite raw gradients as autograd produces them (before DeepSpeed reduces)."""
        def hook(grad):
            if not torch.isfinite(grad).all():
                self._nonfinite_grad.fill_(True)
            return grad
        for p in self.par.model.parameters():
            p.register_hook(hook)

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict:
        c, mesh = self.cfg, self.mesh
        t0, data_wait, loss_value, tokens = time.perf_counter(), 0.0, 0.0, 0
        lr = self.optimizer.param_groups[0]["lr"]          # the rate this step's update uses
        mesh.ledger.reset()
        self._nonfinite_grad.fill_(False)
        local_bad, skipped_before = False, self.engine.skipped_steps
        for _ in range(c.train.grad_accum):
            t = time.perf_counter()
            batch = next(self.loader)
            data_wait += time.perf_counter() - t
            loss_sum, total = self._batch_loss(batch)
            loss = loss_sum * mesh.dims.dp / total
            if not bool(torch.isfinite(loss_sum)):
                # A non-finite loss must poison every gradient it touches (an additive NaN would
                # not), so DeepSpeed's overflow check, agreed over dp and tsp, skips the update.
                local_bad, loss = True, loss * float("nan")
            with mesh.dp.foreign_ops("DeepSpeed ZeRO gradient reduction (engine.backward)"):
                self.engine.backward(loss)
            if self.engine.is_gradient_accumulation_boundary():
                self._check_finite(local_bad)
            with mesh.dp.foreign_ops("DeepSpeed ZeRO step (engine.step: norm and overflow "
                                     "all-reduces, parameter all-gather)", also=[mesh.tsp]):
                self.engine.step()
            loss_value += reduce_loss_value(loss_sum, total, self._loss_comms) / c.train.grad_accum
            tokens += int(total)
        skipped = self._after_update(skipped_before)
        metrics = self._step_metrics(loss_value, tokens, time.perf_counter() - t0, data_wait, skipped)
        return {**metrics, "lr": lr}

    def _batch_loss(self, batch: dict):
        """(this rank's loss sum, valid tokens of the global micro-batch) for one micro-batch."""
        ids, labels, pos = self.par.local_batch(batch["input_ids"].to(self.device),
                                                batch["labels"].to(self.device))
        loss_sum, count = self.engine.module.loss_sum(ids, labels, pos)
        return loss_sum, global_count(count, self._loss_comms)

    def _check_finite(self, local_bad: bool) -> None:
        """All ranks agree, before the update, whether this step is poisoned."""
        flag = torch.tensor(float(local_bad or bool(self._nonfinite_grad)))
        self.mesh.world.all_reduce(flag, tag="nonfinite.flag", op=torch.distributed.ReduceOp.MAX)
        self._poisoned = bool(flag)
        if self._poisoned and self.cfg.train.nonfinite == "stop":
            raise NonFiniteError(f"non-finite loss or gradient at step {self.state.step + 1} "
                                 "(train.nonfinite=stop): stopped before the optimizer update")

    def _after_update(self, skipped_before: int) -> bool:
        skipped = self._poisoned
        if skipped and self.engine.skipped_steps == skipped_before:
            raise RuntimeError(f"step {self.state.step + 1} had non-finite values but DeepSpeed "
                               "applied the update; refusing to continue from a poisoned state")
        if skipped:
            self.state.skipped_steps += 1
            self._consecutive_skips += 1
            self.log.warning(f"step {self.state.step + 1}: non-finite loss or gradient, update skipped "
                             f"({self.state.skipped_steps} skipped so far)")
        else:
            self.scheduler.step()
            self._consecutive_skips = 0
        self.state.step += 1
        limit = self.cfg.train.max_consecutive_skips
        if self._consecutive_skips >= limit:
            raise NonFiniteError(
                f"{limit} steps in a row (steps {self.state.step - limit + 1}-{self.state.step}) had a "
                f"non-finite loss or gradient and were skipped (train.max_consecutive_skips={limit}): "
                f"the run is not recovering; the latest checkpoint is {self.ckpt.latest()}; resume "
                "from it with a lower optim.lr, or look at the data of these steps")
        return skipped

    def _step_metrics(self, loss: float, tokens: int, dt: float, data_wait: float, skipped: bool) -> dict:
        m = StepMetrics.compute(tokens=tokens, step_time_s=dt, world_size=self.mesh.dims.world_size,
                                model_flops_per_token=self.flops[0], hardware_flops_per_token=self.flops[1])
        self.state.tokens_seen += tokens
        grad_norm = self.engine.get_global_grad_norm()
        return {"loss": loss, "grad_norm": None if grad_norm is None else float(grad_norm),
                **m.as_dict(), "peak_mem_bytes": peak_memory_bytes(),
                "comm_bytes_model_parallel": self.mesh.ledger.total_bytes(),
                "data_wait_s": data_wait, "skipped": int(skipped),
                "skipped_steps": self.state.skipped_steps, "tokens_seen": self.state.tokens_seen}

    # -- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        c = self.cfg
        total_loss, total_tokens = 0.0, 0.0
        for batch in iterate_eval_batches(c.data.source, tokenizer=self.tokenizer, seq_len=c.data.seq_len,
                                          micro_batch_size=c.data.micro_batch_size,
                                          num_batches=c.train.eval_batches, split=c.data.eval_split,
                                          text_field=c.data.text_field, dp_rank=self.mesh.dp_rank,
                                          dp_degree=self.mesh.dims.dp):
            s, total = self._batch_loss(batch)
            total_loss += reduce_loss_value(s, total, self._loss_comms) * float(total)
            total_tokens += float(total)
        return total_loss / max(total_tokens, 1.0)

    # -- loop -------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        """Train to train.steps, or until a preemption signal / train.max_runtime_min stops every
        rank after the same step (self.stop_reason says which); either way the state is saved."""
        c, history = self.cfg, []
        bar = ProgressBar(c.train.steps, initial=self.state.step, rank=self.mesh.rank,
                          enabled=None if c.logging.progress_bar else False)
        with bar, self.watchdog, self.stopper:
            while self.state.step < c.train.steps and self.stop_reason is None:
                t0 = time.perf_counter()
                self.watchdog.step_started(self.state.step + 1)
                metrics = self.train_step()
                step = self.state.step
                if c.train.eval_every and step % c.train.eval_every == 0:
                    metrics["eval_loss"] = self.evaluate()
                self.watchdog.step_finished()
                self._slowest["step"] = max(self._slowest["step"], time.perf_counter() - t0)
                if step % c.logging.log_every == 0 or step == c.train.steps:
                    self.sinks.log(step, metrics)
                bar.update(loss=metrics["loss"], tokens_per_s=metrics.get("tokens_per_s"))
                history.append(metrics)
                if c.checkpoint.enabled and c.checkpoint.every and step % c.checkpoint.every == 0:
                    self.save()
                if step < c.train.steps:          # collective: all ranks stop after the same step
                    self.stop_reason = self.stopper.agree(step_s=self._slowest["step"],
                                                          save_s=self._slowest["save"])
            # Still under the signal handlers: a second SIGTERM (the scheduler's own, after the
            # launcher's) must not kill the final save.
            if c.checkpoint.enabled and self.state.step != self._saved_step:
                self.save()      # the final state, unless that exact checkpoint already exists
        if self.stop_reason:
            self.log.warning(f"stopped after step {self.state.step} of {c.train.steps}: "
                             f"{self.stop_reason}; continue with train.resume=auto")
            self.sinks.mark_preempting()
        self.sinks.close()
        return history

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self):
        step, t0 = self.state.step, time.perf_counter()
        self._refuse_nonfinite_weights(step)
        tmp = self.ckpt.begin(step)
        try:
            self.engine.save_checkpoint(str(tmp), tag="deepspeed", save_latest=False)
            reshard.write_layout_free_state(tmp, self.par, self.optimizer)     # model/ + optim/
            self.ckpt.write_rank_state(tmp, self._rank_state())
        except OSError as err:        # disk full, quota, I/O error: never publish a partial save
            self.ckpt.abort(tmp)
            raise CheckpointSaveError(f"saving the step-{step} checkpoint failed on rank "
                                      f"{self.mesh.rank}: {err}; {self.ckpt.latest()} is still the "
                                      "latest complete checkpoint") from err
        path = self.ckpt.publish(tmp, step, self._meta())
        self._saved_step = step
        self._slowest["save"] = max(self._slowest["save"], time.perf_counter() - t0)
        return path

    def _refuse_nonfinite_weights(self, step: int) -> None:
        """Collective: a checkpoint is never published with NaN/inf weights (every rank checks its
        shards; one host sync). The previous checkpoint stays `latest`."""
        finite = [torch.isfinite(p).all() for p in self.par.model.parameters()]
        bad = torch.stack(finite).logical_not().any().float().reshape(1).to(self.device)
        self.mesh.world.all_reduce(bad, tag="nonfinite.weights", op=torch.distributed.ReduceOp.MAX)
        if bool(bad.item()):
            raise NonFiniteError(f"refusing to checkpoint step {step}: the weights hold NaN or inf; "
                                 f"{self.ckpt.latest()} stays the latest checkpoint")

    def _meta(self) -> dict:
        c = self.cfg
        return {"step": self.state.step, "tokens_seen": self.state.tokens_seen,
                "skipped_steps": self.state.skipped_steps,
                "layout": self._layout(), "run": self.session.identity.as_dict(),
                "model": self.model_cfg.to_dict(), "config_yaml": config_to_yaml(c)}

    def _rank_state(self) -> dict:
        return {"loader": self.loader.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                        "numpy": np.random.get_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}

    def _resume(self, path) -> None:
        if path is None:
            return
        meta = self.ckpt.verify(path)
        saved = meta["layout"]
        if self._check_compatible(meta, path):
            self.engine.load_checkpoint(str(path), tag="deepspeed", load_lr_scheduler_states=False)
            rank_state = self.ckpt.read_rank_state(path)
        else:       # another layout: DeepSpeed's files don't fit, read the layout-free shards
            reshard.load_layout_free_state(path, self.par, self.optimizer)
            rank_state = self.ckpt.read_rank_state(
                path, reshard.source_rank(saved, self.mesh.dp_rank, self.mesh.tsp_rank))
            self.log.info(f"resharded {path}: {saved} -> {self._layout()}")
        self.loader.load_state_dict(rank_state["loader"],
                                    on_layout_change=_LAYOUT_POLICY[self.cfg.data.on_layout_change])
        self.scheduler.load_state_dict(rank_state["scheduler"])
        reshard.apply_scheduler_lr(self.optimizer, self.scheduler)
        _set_rng(rank_state["rng"])
        self.state = TrainState(meta["step"], meta["tokens_seen"], meta.get("skipped_steps", 0))
        self._saved_step = meta["step"]
        self.log.info(f"resumed from {path} at step {self.state.step}")

    def _layout(self) -> dict:
        c, dims = self.cfg, self.mesh.dims
        return {"scheme": c.parallel.scheme, "tsp_degree": dims.tsp, "dp_degree": dims.dp,
                "world_size": dims.world_size, "zero_stage": c.zero.stage}

    def _check_compatible(self, meta: dict, path) -> bool:
        """Raises for another model shape or a refused layout change; True if the layout is the
        saved one (DeepSpeed's own files load as they are)."""
        check_same_model(meta, self.model_cfg, path)
        reshard.check_layout_change(meta["layout"], self._layout(),
                                    policy=self.cfg.data.on_layout_change, path=path)
        return not reshard.layout_changed(meta["layout"], self._layout())


def _checkpointed_block(block, x, rope):
    # Non-reentrant checkpointing re-runs the block's forward (and its collectives, in the same
    # order on every rank) during backward.
    return torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False)


def _set_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])

