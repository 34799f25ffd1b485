"""TrainingCheckpoints: the Trainer's one checkpoint object. It saves the training state (the
layout-free model and optimizer shards, checkpoint/reshard.py, plus meta.json and each rank's
loader / scheduler / RNG state, checkpoint/train_state.py), resumes it under the same or another
layout, and keeps the last checkpoint.keep_last of them (pruned at each publish,
checkpoint/store.py).

    checkpoints = TrainingCheckpoints(cfg, mesh=mesh, par=par, ...)
    state = checkpoints.load(path)          # TrainState(); or the saved one, every piece restored
    checkpoints.poll()                      # each step: publish a finished background save
    checkpoints.before_update()             # right before each optimizer step
    checkpoints.save(state, run_identity)   # collective; never with non-finite weights
    checkpoints.wait()                      # end of fit: publish the save in flight

Rank 0 logs one line per checkpoint written: step, folder, size on disk, seconds from save() to
publish, sync or async.
"""

from __future__ import annotations

import collections
import functools
import time
from pathlib import Path

import torch

from tsp_trainer.checkpoint import reshard
from tsp_trainer.checkpoint.disk_format import folder_bytes
from tsp_trainer.checkpoint.store import CheckpointStore
from tsp_trainer.checkpoint.train_state import (NonFiniteError, TrainState, check_compatible,
                                                checkpoint_layout, checkpoint_meta, rank_state,
                                                restore_rank_state, saved_config)
from tsp_trainer.checkpoint.writer import CheckpointWriter, Snapshot
from tsp_trainer.config import TrainConfig
from tsp_trainer.engine.zero_state import local_weight
from tsp_trainer.optim import resume_settings_applied


class TrainingCheckpoints:
    """Save, load and prune the checkpoints of one training run.

    Args:
        cfg: the resolved config (checkpoint.*, train.output_dir, data.on_layout_change).
        mesh: the run's mesh (every collective goes over mesh.world; the layout is its dims).
        par, optimizer, scheduler, loader: the pieces whose state a checkpoint holds.
        log: the trainer's rank-aware logger.
    """

    def __init__(self, cfg: TrainConfig, *, mesh, par, optimizer, scheduler, loader,
                 device: torch.device, log):
        self.cfg, self.mesh, self.par, self.log = cfg, mesh, par, log
        self.optimizer, self.scheduler, self.loader, self.device = optimizer, scheduler, loader, device
        self.layout = checkpoint_layout(cfg, mesh.dims)
        self.store = CheckpointStore(f"{cfg.train.output_dir}/checkpoints", world=mesh.world,
                                     keep_last=cfg.checkpoint.keep_last)
        self.writer = CheckpointWriter(self.store, world=mesh.world, device=device,
                                       async_save=cfg.checkpoint.async_save,
                                       pinned_staging=cfg.checkpoint.pinned_staging,
                                       on_publish=self._published)
        self.saved_step = -1            # step of the newest checkpoint this run wrote or loaded
        self.slowest_save_s = 0.0       # save() to publish: train.max_runtime_min leaves room for one
        self._save_started: collections.deque[float] = collections.deque()   # one per unpublished save

    # -- save -------------------------------------------------------------------------------------
    def save(self, state: TrainState, run_identity: dict) -> None:
        """Collective: checkpoint `state` (published at once, or with checkpoint.async_save when
        the background write completes). Never with non-finite weights."""
        started = time.perf_counter()
        self._refuse_nonfinite_weights(state.step)
        self._save_started.append(started)
        self.writer.save(state.step, functools.partial(self._snapshot, state, run_identity))
        self.saved_step = state.step

    def poll(self) -> None:
        """Collective, once per step: publish the save in flight if every rank has written it."""
        self.writer.poll()

    def before_update(self) -> None:
        """Right before each optimizer step: the save in flight has copied what the update changes."""
        self.writer.before_update()

    def wait(self) -> None:
        """Collective: publish (or raise for) the save in flight, if any."""
        self.writer.wait()

    def take_stall_s(self) -> float:
        """Seconds the training thread spent checkpointing since the last call."""
        return self.writer.take_stall_s()

    def latest(self) -> Path | None:
        return self.store.latest()

    def _snapshot(self, state: TrainState, run_identity: dict, host_copy) -> Snapshot:
        files = reshard.snapshot_layout_free_state(self.par, self.optimizer, host_copy=host_copy)
        mine = rank_state(loader=self.loader, scheduler=self.scheduler, device=self.device)
        meta = checkpoint_meta(state, cfg=self.cfg, model_cfg=self.par.model.cfg, layout=self.layout,
                               run_identity=run_identity)
        return Snapshot(files, mine, meta)

    def _refuse_nonfinite_weights(self, step: int) -> None:
        """Collective: a checkpoint is never published with NaN/inf weights (every rank checks its
        shards, or ZeRO-3 partitions; one host sync). The previous checkpoint stays `latest`."""
        finite = [torch.isfinite(local_weight(p)).all() for p in self.par.model.parameters()]
        bad = torch.stack(finite).logical_not().any().float().reshape(1).to(self.device)
        self.mesh.world.all_reduce(bad, tag="nonfinite.weights", op=torch.distributed.ReduceOp.MAX)
        if bool(bad.item()):
            raise NonFiniteError(f"refusing to checkpoint step {step}: the weights hold NaN or inf; "
                                 f"{self.latest()} stays the latest checkpoint")

    def _published(self, step: int, folder: Path) -> None:
        seconds = time.perf_counter() - self._save_started.popleft()
        self.slowest_save_s = max(self.slowest_save_s, seconds)
        if self.mesh.rank == 0:
            how = "async" if self.writer.async_save else "sync"
            self.log.info(f"checkpoint: step {step} written to {folder} "
                          f"({_size(folder_bytes(folder))}, {seconds:.1f} s, {how})")

    # -- load -------------------------------------------------------------------------------------
    def load(self, path: Path | None) -> TrainState:
        """Collective: the state saved in rank 0's `path`, restored into the model, optimizer,
        scheduler, loader and RNG (under this run's layout: each rank reads the slices it now
        owns); a fresh TrainState when it is None. Rank 0 verified `path` before the process
        groups existed (run/inputs.py), so nothing is hashed here, and the other ranks take rank
        0's path (under train.resume=auto they have none of their own)."""
        chosen = self.mesh.world.broadcast_object(None if path is None else str(path))
        if chosen is None:
            return TrainState()
        path = Path(chosen)
        meta = self.store.read_meta(path)
        saved = meta["layout"]
        same_layout = check_compatible(meta, path, model_cfg=self.par.model.cfg, layout=self.layout,
                                       on_layout_change=self.cfg.data.on_layout_change)
        # One copy of the state serves both cases: values are copied, so the same layout resumes
        # bit for bit, and another layout reads the slices it now owns.
        reshard.load_layout_free_state(path, self.par, self.optimizer)
        mine = self.store.read_rank_state(
            path, reshard.source_rank(saved, self.mesh.dp_rank, self.mesh.tsp_rank))
        if not same_layout:
            self.log.info(f"resharded {path}: {saved} -> {self.layout}")
        if saved["dp_degree"] != self.layout["dp_degree"]:
            self.log.info(f"data.on_layout_change=restart: dp {saved['dp_degree']} -> "
                          f"{self.layout['dp_degree']}, so each DP rank's data stream starts over")
        restore_rank_state(mine, loader=self.loader, scheduler=self.scheduler, optimizer=self.optimizer,
                           on_layout_change=self.cfg.data.on_layout_change)
        # optim.on_resume_change: the rate, betas and weight decay of the side that wins
        changed = resume_settings_applied(self.optimizer, self.scheduler, saved_config(meta),
                                          self.cfg.to_dict(), policy=self.cfg.optim.on_resume_change)
        if changed:
            self.log.info(changed)
        self.saved_step = meta["step"]
        state = TrainState.from_meta(meta)
        self.log.info(f"resumed from {path} at step {state.step}")
        return state


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
