"""The Trainer: checks its inputs (run/inputs.py), then builds, in order, mesh -> model with its
parallel scheme -> DeepSpeed engine under Accelerate -> data -> checkpoints -> run folder and
logging; then fit() runs train_step() and, when due, self.evaluator.run(step) (tsp_trainer/eval:
eval loss, loss by position, passkey) under the run's lifecycle guards (run/: the preemption
agreement at step boundaries and the hang watchdog).

One optimizer step = grad_accum micro-batches per DP rank. Every rank of a TSP group reads the same
micro-batch (the loader is split by dp rank only) and takes its zigzag slice. The loss backpropagated
on each rank is local_sum * W / global_count: DeepSpeed averages gradients over its W data-parallel
ranks (dp, or all under ZeRO-3) and divides by grad_accum: the update follows the global batch's mean.
"""

from __future__ import annotations

import contextlib
import time

import torch

from tsp_trainer.checkpoint.train_state import NonFiniteError
from tsp_trainer.checkpoint.training import TrainingCheckpoints
# CheckpointSaveError is re-exported: callers and tests import it from the trainer.
from tsp_trainer.checkpoint.writer import CheckpointSaveError  # noqa: F401
from tsp_trainer.config import TrainConfig, hang_dump_after_s, run_facts, save_resolved_config
from tsp_trainer.config.model_source import describe_source
from tsp_trainer.data import build_eval_batches, build_train_loader
from tsp_trainer.data.prefetch import batch_to_device, pins_batches
from tsp_trainer.engine import deepspeed as ds_engine, ulysses as ulysses_engine, zero_state
from tsp_trainer.engine.device_support import check_device_support, device_refusal
from tsp_trainer.eval.evaluator import Evaluator, build_passkey_task
from tsp_trainer.model import Transformer
from tsp_trainer.model.activation_checkpoint import wrap_blocks
from tsp_trainer.model.attention_kernel import run_attention_kernel
from tsp_trainer.model.attention_route import use_attention_kernel
from tsp_trainer.model.documents import Documents
from tsp_trainer.observability import (ProgressBar, StepRecorder, detect_peak_flops, get_logger,
                                       make_sinks)
from tsp_trainer.observability.wandb_sink import check_wandb_credentials
from tsp_trainer.optim import build_optimizer, build_scheduler
from tsp_trainer.parallel.loss import global_count, reduce_loss_sum
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.mpu import ShardedWeightsMpu, TSPMpu
from tsp_trainer.parallel.nonfinite import NonFiniteFlags
from tsp_trainer.parallel.schemes import Parallelized, parallelize
from tsp_trainer.parallel.sharded_weights import Zero3Traffic
from tsp_trainer.plan.resolve import Resolved
from tsp_trainer.run import CheckedInputs, HangWatchdog, StopAgreement
from tsp_trainer.run.placement import place_ranks
from tsp_trainer.run.preemption import agree_on_batches
from tsp_trainer.run.session import open_run_folder
from tsp_trainer.run.startup import prepare_run


class Trainer:
    def __init__(self, cfg: TrainConfig, *, world_size: int, global_rank: int, cuda: bool = False,
                 inputs: CheckedInputs | None = None, resolved: Resolved | None = None):
        """resolved: the settings every rank runs (run/startup.py agree_on_settings: no `auto`
        left); tsp-train passes it with its checked inputs. Built directly, the Trainer runs that
        check and agreement itself (run/startup.py prepare_run)."""
        self.log = get_logger(__name__, rank=global_rank)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        with self._startup("config checked and resolved"):
            # Bad input (config, tokenizer, data, resume path, output folder) fails before any group exists.
            if inputs is None or resolved is None:   # built directly; tsp-train did both before
                check_wandb_credentials(cfg.logging.wandb_mode)   # before check_inputs makes the run folder
                inputs, resolved = prepare_run(cfg, world_size=world_size, rank=global_rank, cuda=cuda,
                                               device=self.device, refuses=device_refusal(self.device))
            for line in inputs.resume_warnings:        # rank 0's: which checkpoints failed, and why
                self.log.warning(line)
            for line in inputs.resume_notes:
                self.log.info(line)
            cfg = self.cfg = resolved.cfg                 # what runs is what is logged
            self.resolved, self.model_cfg = resolved, cfg.model.to_model_config()   # named size or HF folder
            self.tokenizer, self.data_plan = inputs.tokenizer, inputs.data_plan
            passkey = build_passkey_task(cfg, self.tokenizer, self.model_cfg)   # reads its filler text
            self.log.info(f"model: {describe_source(cfg.model)}; tokenizer: {self.tokenizer.name}")
            self.bf16 = cfg.train.dtype == "bf16"          # resolve_config turned "auto" into a dtype
            self.attention = run_attention_kernel(cfg, self.model_cfg, device=self.device)
            use_attention_kernel(self.attention)           # torch's flash implementation (FA3 / FA4)
            self.log.info(f"attention kernel: {self.attention.kernel} ({self.attention.reason})")
            if resolved.line():                            # the auto settings, decided by rank 0
                self.log.info(resolved.line())
            check_device_support(cfg, self.model_cfg, device=self.device,   # still before any group
                                 attention_kernel=self.attention.kernel)
        tsp, dp = cfg.parallel.tsp_degree, world_size // cfg.parallel.tsp_degree
        with self._startup(f"process groups: {world_size} ranks = dp {dp} x tsp {tsp}"):
            self.accelerator = ds_engine.make_accelerator(self._ds_config(world_size, dp), cpu=not cuda,
                                                          timeout_s=cfg.train.collective_timeout_s)
            self.mesh = build_mesh(tsp, timeout_s=cfg.train.collective_timeout_s, device=self.device)
            self.placement = place_ranks(self.mesh.world, self.mesh.dims, self.log)
        with self._startup(f"model: {self.model_cfg.num_layers} layers, parallel.scheme={cfg.parallel.scheme}"):
            self.par = self._build_model()
            self.zero3 = Zero3Traffic(self.par.model, self.mesh.world, enabled=cfg.zero.stage == 3)
            self._loss_comms = self.par.token_comms + [self.mesh.dp]   # groups sharing a global batch
            offload = cfg.zero.offload_optimizer == "cpu"      # DeepSpeed's ZeRO-Offload wants its CPU Adam
            self.optimizer = (ds_engine.build_offload_optimizer if offload else build_optimizer)(
                self.par.model, cfg.optim)
            self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        with self._startup(f"engine: DeepSpeed ZeRO-{cfg.zero.stage} over "
                           + (f"all {world_size} ranks" if cfg.zero.stage == 3 else f"dp {dp}")
                           + (", optimizer offloaded to the host" if offload else "")):
            self.engine, _ = ds_engine.prepare(self.accelerator, self.par.model, self.optimizer,
                                               (ShardedWeightsMpu if cfg.zero.stage == 3 else TSPMpu)(self.mesh))
        with self._startup("data: training loader" + (" and eval batches" if cfg.train.eval_every else "")):
            self.loader, self.eval_batches = self._build_loaders()
            self.evaluator = Evaluator(cfg, par=self.par, mesh=self.mesh, device=self.device, log=self.log,
                                       eval_batches=self.eval_batches, passkey=passkey,
                                       whole_weights=lambda: zero_state.whole_parameters(self.par.model))
        self.checkpoints = TrainingCheckpoints(cfg, mesh=self.mesh, par=self.par, optimizer=self.optimizer,
                                               scheduler=self.scheduler, loader=self.loader,
                                               device=self.device, log=self.log)
        self.nonfinite = NonFiniteFlags(self.mesh.world)     # device flag, agreed once per step
        self.nonfinite.watch(self.par.model.parameters())
        self._poisoned, self._consecutive_skips = False, 0
        self.state = self.checkpoints.load(inputs.resume_path)
        self._open_run(inputs, world_size=world_size, global_rank=global_rank)

    # -- building ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _startup(self, phase: str):
        """Rank 0 logs each start-up phase with its seconds: the first tens of seconds of a run
        say what they are doing."""
        started = time.perf_counter()
        yield
        self.log.info(f"start-up: {phase} ({time.perf_counter() - started:.1f} s)")

    def _open_run(self, inputs: CheckedInputs, *, world_size: int, global_rank: int) -> None:
        """The run folder and its identity, metrics and sinks, data notes, lifecycle guards."""
        cfg = self.cfg
        self.session = open_run_folder(cfg, world=self.mesh.world, resume_path=inputs.resume_path,
                                       resume_meta=inputs.resume_meta, resumed_step=self.state.step,
                                       layout=self.checkpoints.layout, device=self.device.type)
        for note in self.session.notes:
            self.log.info(note)
        if self.mesh.rank == 0:
            save_resolved_config(cfg, f"{cfg.train.output_dir}/config.yaml")
        peak = cfg.logging.peak_tflops * 1e12 if cfg.logging.peak_tflops else detect_peak_flops(self.device)
        self.metrics = StepRecorder(world=self.mesh.world, peak_flops=peak, device=self.device,
                                    rank_stats_every=cfg.logging.rank_stats_every,
                                    flops=self.resolved.flops_at(cfg.data.seq_len))
        facts = run_facts(cfg, world_size=world_size, device=str(self.device),
                          peak_tflops=None if peak is None else peak / 1e12)
        auto = self.resolved.facts()
        self.sinks = self._build_sinks(config={**cfg.to_dict(), "run": {
            **facts, "attention_kernel": self.attention.kernel, "nodes": list(self.placement.nodes), **auto}})
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
        self._slowest_step_s = 0.0            # train.max_runtime_min leaves room for one more

    def _ds_config(self, world_size: int, dp: int) -> dict:
        c = self.cfg                                     # DeepSpeed's data parallelism: ZeRO-3's is every rank
        return ds_engine.ds_config(micro_batch=c.data.micro_batch_size, grad_accum=c.train.grad_accum,
                                   dp_degree=world_size if c.zero.stage == 3 else dp, zero_stage=c.zero.stage,
                                   max_grad_norm=c.optim.max_grad_norm, bf16=self.bf16,
                                   offload_optimizer=c.zero.offload_optimizer == "cpu")

    def _build_model(self) -> Parallelized:
        c, p = self.cfg, self.cfg.parallel
        with torch.device("meta"):                       # no rank ever holds the full model
            model = Transformer(self.model_cfg, **self.attention.model_kwargs())
        # the baselines refuse options they do not know: the recompute settings go to TSP only
        tsp_only = ({"tsp_recompute": p.tsp_recompute, "checkpoint_replay_keeps": p.checkpoint_replay_keeps,
                     "attention_chunk_tokens": p.attention_chunk_tokens} if p.scheme == "tsp"
                    else ulysses_engine.scheme_options(p.scheme, c.zero.stage, p.ulysses_head_chunks))
        par = parallelize(model, c.parallel.scheme, self.mesh, seq_len=c.data.seq_len,
                          head_buckets=c.parallel.head_buckets, init_seed=c.model.seed,
                          tp_degree=c.parallel.tp_degree, sp_degree=c.parallel.sp_degree,
                          loss_chunk_tokens=c.parallel.loss_chunk_tokens,
                          mlp_chunk_tokens=c.parallel.mlp_chunk_tokens, **tsp_only)
        if c.model.init_from:
            from tsp_trainer.checkpoint.hf import load_hf_state_dict
            par.load_full_state_dict(load_hf_state_dict(c.model.init_from, self.model_cfg))
        wrap_blocks(model, checkpointing=c.train.activation_checkpointing, offload=c.train.offload_activations,
                    segment_blocks=c.train.checkpoint_segment_blocks, prefetch=c.train.offload_prefetch)
        return par

    def _build_loaders(self):
        """The training loader (prefetching) and the eval batches, each built once."""
        c, dp_rank, dp = self.cfg, self.mesh.dp_rank, self.mesh.dims.dp
        train = build_train_loader(c.data, tokenizer=self.tokenizer, dp_rank=dp_rank, dp_degree=dp,
                                   seed=c.train.seed, grad_accum=c.train.grad_accum,
                                   pin_memory=pins_batches(self.device))
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
        self.checkpoints.poll()                            # publish a finished background save
        self.metrics.begin_step()
        lr = self.optimizer.param_groups[0]["lr"]          # the rate this step's update uses
        self.nonfinite.reset()
        skipped_before = self.engine.skipped_steps
        # Loss and token sums stay on the device until the step ends: no host sync per micro-step.
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)   # [mean loss, tokens]
        # Bad data on any rank stops every rank here, before the step's first collective.
        for batch in agree_on_batches(mesh.world, self._read_step_batches, device=self.device):
            seq_len = batch["input_ids"].shape[1]           # follows data.seq_len_schedule
            loss_sum, total = self._batch_loss(batch)
            # A non-finite loss poisons every gradient (NaN scale), so DeepSpeed's overflow check,
            # agreed over dp and tsp, skips the update.
            loss = self.nonfinite.poison_if_nonfinite(loss_sum, loss_sum * self.engine.dp_world_size / total)
            with mesh.dp.foreign_ops("DeepSpeed ZeRO gradient reduction (engine.backward)", also=[mesh.world]):
                self.engine.backward(loss)
            self.zero3.record(checkpointed=c.train.activation_checkpointing)   # ZeRO-3's ops in the ledger
            if self.engine.is_gradient_accumulation_boundary():
                self._check_finite()
            self.checkpoints.before_update()               # an async snapshot has been copied
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
            checkpoint_stall_s=self.checkpoints.take_stall_s(),
            flops=self.resolved.flops_at(seq_len))
        return {**metrics, **self._data_metrics(seq_len)}

    def _read_step_batches(self) -> list[dict]:
        with self.metrics.waiting_for_data():
            return [next(self.loader) for _ in range(self.cfg.train.grad_accum)]

    def _batch_loss(self, batch: dict):
        """(this rank's loss sum, valid tokens of the global micro-batch) for one micro-batch."""
        # a non-blocking host-to-device copy from the prefetch worker's pinned batch (no sync)
        ids, labels, pos = self.par.local_batch(*batch_to_device(batch, self.device), self._documents(batch))
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
                f"the run is not recovering; the latest checkpoint is {self.checkpoints.latest()}; resume from "
                "it with a lower optim.lr and optim.on_resume_change=recipe, or look at these steps' data")
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
                self._slowest_step_s = max(self._slowest_step_s, time.perf_counter() - t0)
                if step % c.logging.log_every == 0 or step == c.train.steps or evaluated:
                    self.sinks.log(step, metrics)
                bar.update(loss=metrics["train/loss"], tokens_per_s=metrics["perf/tokens_per_s"])
                history.append(metrics)
                if c.checkpoint.enabled and c.checkpoint.every and step % c.checkpoint.every == 0:
                    self.save()
                if step < c.train.steps:          # collective: all ranks stop after the same step
                    self.stop_reason = self.stopper.agree(step_s=self._slowest_step_s,
                                                          save_s=self.checkpoints.slowest_save_s)
            # Still under the signal handlers: a second SIGTERM (the scheduler's own, after the
            # launcher's) must not kill the final save.
            if c.checkpoint.enabled and self.state.step != self.checkpoints.saved_step:
                self.save()      # the final state, unless that exact checkpoint already exists
            self.checkpoints.wait()                         # publish the save in flight, if any
        if self.stop_reason:
            self.log.info(f"stopped after step {self.state.step} of {c.train.steps}: "
                             f"{self.stop_reason}; continue with train.resume=auto")
            self.sinks.mark_preempting()
        self.sinks.close()
        return history

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self) -> None:
        """Collective: checkpoint the current state (checkpoint/training.py)."""
        self.checkpoints.save(self.state, self.session.identity.as_dict())
