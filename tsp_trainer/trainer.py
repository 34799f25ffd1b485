"""The Trainer: checks its inputs (run/inputs.py), then builds, in order, mesh -> model with its
parallel scheme -> DeepSpeed engine under Accelerate -> data -> checkpoints -> run folder and
logging; then fit() runs train_step() and, when due, self.evaluator.run(step) (tsp_trainer/eval:
eval loss, loss by position, passkey) under the run's lifecycle guards (run/: the preemption
agreement at step boundaries and the hang watchdog).

One optimizer step = grad_accum micro-batches per DP rank. Every rank of a TSP group reads the same
micro-batch (the loader is split by dp rank only) and takes its zigzag slice. The loss backpropagated
on each rank is local_sum * dp / global_count: DeepSpeed averages gradients over dp and divides by
grad_accum, so the update follows the mean over all tokens of the global batch.
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from tsp_trainer.checkpoint import reshard
# CheckpointSaveError is re-exported: callers and tests import it from the trainer.
from tsp_trainer.checkpoint.async_writer import CheckpointSaveError, Checkpointer, Snapshot  # noqa: F401
from tsp_trainer.checkpoint.manager import CheckpointManager
from tsp_trainer.config import (TrainConfig, config_to_yaml, hang_dump_after_s, resolve_config, run_facts,
                                save_resolved_config)
from tsp_trainer.config.model_source import describe_source
from tsp_trainer.config.validate import check_precision
from tsp_trainer.data import build_eval_batches, build_train_loader
from tsp_trainer.engine import deepspeed as ds_engine
from tsp_trainer.eval.evaluator import Evaluator, build_passkey_task
from tsp_trainer.model import Transformer
from tsp_trainer.model.offload import ActivationOffload
from tsp_trainer.model.attention_route import check_cuda_attention
from tsp_trainer.model.documents import Documents
from tsp_trainer.observability import (ProgressBar, StepRecorder, detect_peak_flops, get_logger,
                                       make_sinks, model_and_hardware_flops_per_token)
from tsp_trainer.optim import build_optimizer, build_scheduler
from tsp_trainer.parallel.loss import global_count, reduce_loss_sum
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.mpu import TSPMpu
from tsp_trainer.parallel.nonfinite import NonFiniteFlags
from tsp_trainer.parallel.schemes import Parallelized, parallelize
from tsp_trainer.parallel.tsp.recompute_rules import check_selective_route
from tsp_trainer.run import CheckedInputs, HangWatchdog, StopAgreement, check_inputs, check_same_model
from tsp_trainer.run.session import open_run_folder

_LAYOUT_POLICY = {"refuse": "error", "restart": "restart"}


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient with train.nonfinite=stop (raised before the update)."""


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
        cfg = resolve_config(cfg, world_size=world_size, cuda=cuda)   # what runs is what is logged
        self.cfg, self.model_cfg = cfg, cfg.model.to_model_config()   # named size or HF folder
        self.tokenizer, self.data_plan = inputs.tokenizer, inputs.data_plan
        dp = world_size // cfg.parallel.tsp_degree
        passkey = build_passkey_task(cfg, self.tokenizer, self.model_cfg)   # reads its filler text
        self.log = get_logger(__name__, rank=global_rank)
        self.log.info(f"model: {describe_source(cfg.model)}; tokenizer: {self.tokenizer.name}")
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.bf16 = cfg.train.dtype == "bf16"          # resolve_config turned "auto" into a dtype
        self._check_device_support()                     # still before any process group
        self.accelerator = ds_engine.make_accelerator(self._ds_config(dp), cpu=not cuda,
                                                      timeout_s=cfg.train.collective_timeout_s)
        self.mesh = build_mesh(cfg.parallel.tsp_degree, timeout_s=cfg.train.collective_timeout_s,
                               device=self.device)
        self.par = self._build_model()
        self._loss_comms = self.par.token_comms + [self.mesh.dp]   # groups sharing a global batch
        self.optimizer = build_optimizer(self.par.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.engine, _ = ds_engine.prepare(self.accelerator, self.par.model, self.optimizer,
                                           TSPMpu(self.mesh))
        self.loader, self.eval_batches = self._build_loaders()
        self.evaluator = Evaluator(cfg, par=self.par, mesh=self.mesh, device=self.device,
                                   eval_batches=self.eval_batches, passkey=passkey, log=self.log)
        self.ckpt = CheckpointManager(f"{cfg.train.output_dir}/checkpoints", world=self.mesh.world,
                                      keep_last=cfg.checkpoint.keep_last)
        self.checkpointer = Checkpointer(self.ckpt, world=self.mesh.world, device=self.device,
                                         async_save=cfg.checkpoint.async_save)
        self.state = TrainState()
        self.nonfinite = NonFiniteFlags(self.mesh.world)     # device flag, agreed once per step
        self.nonfinite.watch(self.par.model.parameters())
        self._poisoned = False
        self._saved_step = -1                # step of the newest checkpoint this run wrote or loaded
        self._consecutive_skips = 0
        self._resume(inputs.resume_path)
        self.session = open_run_folder(cfg, world=self.mesh.world, resume_path=inputs.resume_path,
                                       resume_meta=inputs.resume_meta, resumed_step=self.state.step)
        for note in self.session.notes:
            self.log.info(note)
        if self.mesh.rank == 0:
            save_resolved_config(cfg, f"{cfg.train.output_dir}/config.yaml")
        peak = cfg.logging.peak_tflops * 1e12 if cfg.logging.peak_tflops else detect_peak_flops(self.device)
        self.metrics = StepRecorder(world=self.mesh.world, peak_flops=peak, device=self.device,
                                    rank_stats_every=cfg.logging.rank_stats_every,
                                    flops=model_and_hardware_flops_per_token(
                                        self.model_cfg, cfg.data.seq_len,
                                        recompute=cfg.train.activation_checkpointing))
        facts = run_facts(cfg, world_size=world_size, device=str(self.device),
                          peak_tflops=None if peak is None else peak / 1e12)
        self.sinks = self._build_sinks(config={**cfg.to_dict(), "run": facts})
        self._data_epoch = 0                                  # last training-data pass logged
        for line in self.data_plan.notes + self.loader.describe():
            self.log.info(line)
        if self.mesh.rank == 0:              # warnings pass on every rank; say these once
            for line in self.data_plan.warnings:
                self.log.warning(line)
        self.stopper = StopAgreement(self.mesh.world, signals=cfg.train.preempt_signals,
                                     max_runtime_s=cfg.train.max_runtime_min * 60, device=self.device)
        self.watchdog = HangWatchdog(dump_after_s=hang_dump_after_s(cfg.train), rank=global_rank,
                                     in_flight=self.mesh.ledger.in_flight.describe,
                                     dump_dir=f"{cfg.train.output_dir}/hang_dumps")
        self.stop_reason: str | None = None   # set when a signal or max_runtime_min ended fit() early
        self._slowest = {"step": 0.0, "save": 0.0}   # seconds, for the max-runtime margin
        self._save_started: float | None = None      # an async save in flight since then

    # -- building ---------------------------------------------------------------------------------
    def _check_device_support(self) -> None:
        """What this device and dtype cannot run is refused here, naming shape and dtype."""
        check_precision(zero_stage=self.cfg.zero.stage, bf16=self.bf16)
        if self.device.type == "cuda":
            m = self.model_cfg
            route = check_cuda_attention(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                         dtype=torch.bfloat16 if self.bf16 else torch.float32)
            # selective and none keep the attention kernel's graph alike (none adds the MLP's)
            if self.cfg.parallel.tsp_recompute != "full":
                check_selective_route(route, dtype=self.cfg.train.dtype, num_heads=m.num_heads,
                                      num_kv_heads=m.num_kv_heads,
                                      document_masking=self.cfg.data.document_masking,
                                      mode=self.cfg.parallel.tsp_recompute)

    def _ds_config(self, dp: int) -> dict:
        c = self.cfg
        return ds_engine.ds_config(micro_batch=c.data.micro_batch_size, grad_accum=c.train.grad_accum,
                                   dp_degree=dp, zero_stage=c.zero.stage,
                                   max_grad_norm=c.optim.max_grad_norm, bf16=self.bf16)

    def _build_model(self) -> Parallelized:
        c = self.cfg
        with torch.device("meta"):                       # no rank ever holds the full model
            model = Transformer(self.model_cfg)
        # the baselines refuse options they do not know: tsp_recompute goes to TSP only
        tsp_only = {"tsp_recompute": c.parallel.tsp_recompute} if c.parallel.scheme == "tsp" else {}
        par = parallelize(model, c.parallel.scheme, self.mesh, seq_len=c.data.seq_len,
                          head_buckets=c.parallel.head_buckets, init_seed=c.model.seed,
                          tp_degree=c.parallel.tp_degree, sp_degree=c.parallel.sp_degree, **tsp_only)
        if c.model.init_from:
            from tsp_trainer.checkpoint.hf import load_hf_state_dict
            par.load_full_state_dict(load_hf_state_dict(c.model.init_from, self.model_cfg))
        if c.train.activation_checkpointing:
            model.block_wrapper = _checkpointed_block
        if c.train.offload_activations:                  # around the checkpoint, if any
            model.block_wrapper = ActivationOffload(model.block_wrapper)
        return par

    def _build_loaders(self):
        """The training loader (prefetching) and the eval batches, each built once."""
        c, dp_rank, dp = self.cfg, self.mesh.dp_rank, self.mesh.dims.dp
        train = build_train_loader(c.data, tokenizer=self.tokenizer, dp_rank=dp_rank, dp_degree=dp,
                                   seed=c.train.seed, grad_accum=c.train.grad_accum)
        evals = build_eval_batches(c.data, tokenizer=self.tokenizer, dp_rank=dp_rank, dp_degree=dp,
                                   num_batches=c.train.eval_batches,
                                   replicate=self.data_plan.eval_replicate) if c.train.eval_every else None
        return train, evals

    def _build_sinks(self, config: dict):
        """metrics.jsonl, console, W&B (rank 0), under the run's identity (run/session.py)."""
        c, s = self.cfg.logging, self.session
        wandb_options = dict(entity=c.wandb_entity, group=c.wandb_group, tags=c.wandb_tags,
                             continues=s.wandb.continues, skip_through_step=s.wandb.skip_through_step,
                             rewind_to_step=s.wandb.rewind_to_step)
        return make_sinks(global_rank=self.mesh.rank, wandb_mode=c.wandb_mode, project=c.wandb_project,
                          run_name=s.identity.name, config=config, output_dir=self.cfg.train.output_dir,
                          jsonl=c.jsonl, wandb_run_id=s.identity.wandb_run_id, wandb_options=wandb_options)

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict:
        c, mesh = self.cfg, self.mesh
        self.checkpointer.poll()                           # publish a finished background save
        self.metrics.begin_step()
        lr = self.optimizer.param_groups[0]["lr"]          # the rate this step's update uses
        self.nonfinite.reset()
        skipped_before = self.engine.skipped_steps
        # Loss and token sums stay on the device until the step ends: no host sync per micro-step.
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)   # [mean loss, tokens]
        for _ in range(c.train.grad_accum):
            with self.metrics.waiting_for_data():
                batch = next(self.loader)
            seq_len = batch["input_ids"].shape[1]           # follows data.seq_len_schedule
            loss_sum, total = self._batch_loss(batch)
            # A non-finite loss poisons every gradient (NaN scale), so DeepSpeed's overflow check,
            # agreed over dp and tsp, skips the update.
            loss = self.nonfinite.poison_if_nonfinite(loss_sum, loss_sum * mesh.dims.dp / total)
            with mesh.dp.foreign_ops("DeepSpeed ZeRO gradient reduction (engine.backward)"):
                self.engine.backward(loss)
            if self.engine.is_gradient_accumulation_boundary():
                self._check_finite()
            self.checkpointer.before_update()              # an async snapshot has been copied
            with mesh.dp.foreign_ops("DeepSpeed ZeRO step (engine.step: norm and overflow "
                                     "all-reduces, parameter all-gather)", also=[mesh.tsp]):
                self.engine.step()
            sums[0] += reduce_loss_sum(loss_sum, self._loss_comms) / total.clamp(min=1) / c.train.grad_accum
            sums[1] += total
        loss_value, tokens = sums.tolist()                  # the step's one read of its sums
        tokens = int(tokens)
        skipped = self._after_update(skipped_before)
        self.state.tokens_seen += tokens
        grad_norm = self.engine.get_global_grad_norm()
        metrics = self.metrics.end_step(
            self.state.step, loss=loss_value, lr=lr, tokens=tokens, skipped=skipped,
            grad_norm=None if grad_norm is None else float(grad_norm),
            skipped_steps=self.state.skipped_steps, tokens_seen=self.state.tokens_seen,
            checkpoint_stall_s=self.checkpointer.take_stall_s(),
            flops=_flops_per_token(self.model_cfg, seq_len, self.cfg.train.activation_checkpointing))
        return {**metrics, **self._data_metrics(seq_len)}

    def _batch_loss(self, batch: dict):
        """(this rank's loss sum, valid tokens of the global micro-batch) for one micro-batch."""
        # non_blocking: a host-to-device copy that does not wait for the GPU's queue (no sync)
        ids, labels, pos = self.par.local_batch(batch["input_ids"].to(self.device, non_blocking=True),
                                                batch["labels"].to(self.device, non_blocking=True),
                                                self._documents(batch))
        loss_sum, count = self.engine.module.loss_sum(ids, labels, pos)
        return loss_sum, global_count(count, self._loss_comms)

    def _documents(self, batch: dict) -> Documents | None:
        """data.document_masking: the batch's document starts, read from its host tensor (host
        ints: attention never reads boundaries back from the device)."""
        if not self.cfg.data.document_masking:
            return None
        return Documents.from_ids(batch["document_ids"], reset_positions=self.cfg.data.reset_positions)

    def _check_finite(self) -> None:
        """All ranks agree, before the update, whether this step is poisoned."""
        self._poisoned = self.nonfinite.agree()
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

    def _data_metrics(self, seq_len: int) -> dict:
        """data/epoch and data/seq_len (the length schedule's stage); logs each new data pass."""
        epoch = self.loader.stats["epoch"]
        if epoch > self._data_epoch:
            self._data_epoch = epoch
            self.log.info(f"data: epoch {epoch} of the training data began at step {self.state.step}")
        return {"data/epoch": self.data_plan.epoch_metric(epoch, self.state.tokens_seen),
                "data/seq_len": seq_len}

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
                evaluated = self.evaluator.run(step)        # {} unless an evaluation is due
                metrics.update(evaluated)
                self.watchdog.step_finished()
                self._time_step_and_save(t0)
                if step % c.logging.log_every == 0 or step == c.train.steps or evaluated:
                    self.sinks.log(step, metrics)
                bar.update(loss=metrics["train/loss"], tokens_per_s=metrics["perf/tokens_per_s"])
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
            self.checkpointer.wait()                        # publish the save in flight, if any
        if self.stop_reason:
            self.log.warning(f"stopped after step {self.state.step} of {c.train.steps}: "
                             f"{self.stop_reason}; continue with train.resume=auto")
            self.sinks.mark_preempting()
        self.sinks.close()
        return history

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self) -> None:
        """Collective: checkpoint the current state (published at once, or with
        checkpoint.async_save when the background write completes; see checkpoint/async_writer.py).
        Never with non-finite weights."""
        t0 = time.perf_counter()
        self._refuse_nonfinite_weights(self.state.step)
        self.checkpointer.save(self.state.step, self._snapshot)
        self._saved_step = self.state.step
        if self.checkpointer.in_flight:
            self._save_started = t0                    # timed when the background write is done
        else:
            self._slowest["save"] = max(self._slowest["save"], time.perf_counter() - t0)

    def _time_step_and_save(self, step_started: float) -> None:
        """The slowest step and the slowest complete save so far: train.max_runtime_min leaves
        room for one more of each."""
        now = time.perf_counter()
        self._slowest["step"] = max(self._slowest["step"], now - step_started)
        if self._save_started is not None and not self.checkpointer.in_flight:
            self._slowest["save"] = max(self._slowest["save"], now - self._save_started)
            self._save_started = None

    def _snapshot(self, host_copy) -> Snapshot:
        return Snapshot(reshard.snapshot_layout_free_state(self.par, self.optimizer, host_copy=host_copy),
                        self._rank_state(), self._meta())

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
                        # this process's device only: a resume may see fewer GPUs (one per task)
                        "cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}}

    def _resume(self, path) -> None:
        if path is None:
            return
        meta = self.ckpt.verify(path)
        saved = meta["layout"]
        same_layout = self._check_compatible(meta, path)
        # One copy of the state serves both cases: values are copied, so the same layout resumes
        # bit for bit, and another layout reads the slices it now owns.
        reshard.load_layout_free_state(path, self.par, self.optimizer)
        rank_state = self.ckpt.read_rank_state(
            path, reshard.source_rank(saved, self.mesh.dp_rank, self.mesh.tsp_rank))
        if not same_layout:
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
        saved one."""
        check_same_model(meta, self.model_cfg, path)
        reshard.check_layout_change(meta["layout"], self._layout(),
                                    policy=self.cfg.data.on_layout_change, path=path)
        return not reshard.layout_changed(meta["layout"], self._layout())


@functools.lru_cache(maxsize=None)
def _flops_per_token(model_cfg, seq_len: int, recompute: bool) -> tuple[float, float]:
    """(model, hardware) FLOPs per token at `seq_len`: MFU follows a length schedule's stage."""
    return model_and_hardware_flops_per_token(model_cfg, seq_len, recompute=recompute)


def _checkpointed_block(block, x, rope):
    # Non-reentrant checkpointing re-runs the block's forward (and its collectives, in the same
    # order on every rank) during backward.
    return torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False)


def _set_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    cuda = cuda_rng_state_for_this_device(rng.get("cuda"), torch.cuda.current_device()
                                          if torch.cuda.is_available() else None)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def cuda_rng_state_for_this_device(saved, device_index: int | None):
    """The saved CUDA generator state this process restores into its current device: the single
    state a checkpoint holds, or (checkpoints that saved every visible GPU) this device's entry.
    None when there is nothing to restore or no CUDA device here."""
    if saved is None or device_index is None:
        return None
    if isinstance(saved, (list, tuple)):
        return saved[device_index] if device_index < len(saved) else None
    return saved

