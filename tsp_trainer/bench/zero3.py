"""One rank of `sp` or `ulysses` as the trainer runs them (zero.stage auto = 3): weights, gradients
and AdamW state sharded by DeepSpeed ZeRO-3 over the D ranks (engine/deepspeed.py
sharded_weights_engine), gathered for each use and reduce-scattered (parallel/sharded_weights.py).

The step is the bench's (run.py): forward, the loss summed over the local tokens scaled by W over
the global count (DeepSpeed averages the gradients over its W ranks), engine.backward, engine.step
(ZeRO-3's AdamW). Per step the ledger gets the scheme's own ops as it runs them and ZeRO-3's by
their closed form (`Zero3Traffic`); `zero3_measured` holds the bytes DeepSpeed handed to
torch.distributed in the same forward + backward (engine/zero3_bytes.py), which report.py sets
beside the closed form.

The memory step is three applied steps: the first gives the loss (before any update, as every
scheme's); the second is tracked, after DeepSpeed's first-use allocations, with ZeRO-3's standing
state (partitions, fp32 masters, gradient partitions, moments) ignored, so the layers' gathered
weights count as transients (as for the ALST reference, bench/alst.py); the third is counted for
FLOPs (ZeRO-3 keeps no gradient the bench could drop between steps, as StepRunner does).
"""

from __future__ import annotations

import torch

from tsp_trainer.bench.run import LR, _now, _tracked, executed_flops, runner_result
from tsp_trainer.engine.alst_reference import zero3_reduce_buckets, zero3_state, zero3_state_bytes
from tsp_trainer.tools.memory import tensor_bytes
from tsp_trainer.engine.deepspeed import sharded_weights_engine
from tsp_trainer.engine.zero3_bytes import process_counter
from tsp_trainer.parallel.loss import global_count
from tsp_trainer.parallel.sharded_weights import Zero3Traffic


def install_counter() -> None:
    """Before any DeepSpeed comm start-up in this rank (engine/zero3_bytes.py)."""
    process_counter()


class Zero3StepRunner:
    """StepRunner's interface (run.py) over a DeepSpeed ZeRO-3 engine."""

    def __init__(self, par, mesh, batch, device: torch.device, job: dict):
        model = par.model
        self.traffic = Zero3Traffic(model, mesh.world)             # from the whole parameters
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.engine = sharded_weights_engine(model, optimizer, mesh, micro_batch=job["micro_batch"],
                                             bf16=job.get("dtype") == "bf16")
        self.counter, self.ledger = process_counter(), mesh.ledger
        self.batch, self.device, self.times = batch, device, []
        self.checkpointed = bool(job["activation_checkpointing"])
        world = mesh.world.size

        def fwd_bwd():
            loss_sum, count = par.loss_sum(*batch)
            total = global_count(count, par.token_comms)
            self.engine.backward(loss_sum * world / total)
            return loss_sum, total

        self.fwd_bwd = fwd_bwd

    def _recorded_fwd_bwd(self):
        """One forward + backward: the ledger and the byte counter start from zero, the
        counter sees DeepSpeed's collectives, the ledger gets their closed form."""
        self.ledger.reset()
        self.counter.reset()
        with self.counter.counting():
            out = self.fwd_bwd()
        self.measured = dict(self.counter.bytes)
        self.traffic.record(checkpointed=self.checkpointed)
        return out

    def memory_step(self) -> None:
        self.loss_sum, self.total = self._recorded_fwd_bwd()
        self.engine.step()
        standing = [t for ts in zero3_state(self.engine).values() for t in ts]
        self.peak, _ = _tracked(self._recorded_fwd_bwd, standing, self.batch, self.device)
        self.engine.step()
        with executed_flops() as flops:
            self._recorded_fwd_bwd()
        self.engine.step()
        self.flops = flops.get_total_flops()

    def step(self) -> float:
        t0 = _now(self.device)
        self._recorded_fwd_bwd()
        self.engine.step()
        return _now(self.device) - t0

    def result(self) -> dict:
        return {**runner_result(self, zero3_state_bytes(self.engine)), "zero3_measured": self.measured,
                # of grad_bytes: the buckets the trainer's reduce_bucket_size allocates, whatever the model
                "reduce_bucket_bytes": tensor_bytes(zero3_reduce_buckets(self.engine))}
