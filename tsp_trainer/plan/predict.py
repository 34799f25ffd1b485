"""Predicted memory, communication and time of one optimizer step of a layout on a hardware profile:
the step time, tokens/s, MFU and HFU under an explicit overlap model (docs/planner.md section 4).

Everything is per rank, bytes and seconds unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from tsp_trainer.config import ModelConfig
from tsp_trainer.plan.activations import ActivationEstimate, activation_memory
from tsp_trainer.plan.communication import WIRE_FACTOR, data_parallel_comm, model_parallel_comm
from tsp_trainer.plan.efficiency import KernelEfficiency, gqa_native_slowdown_at, kernel_efficiency
from tsp_trainer.plan.flops import executed_by_family, hardware_flops_per_token
from tsp_trainer.plan.hardware import HardwareProfile
from tsp_trainer.plan.layout import Layout
from tsp_trainer.plan.precision import BF16, Precision
from tsp_trainer.plan.reserved import reserved_memory
from tsp_trainer.plan.state import FP32_BYTES, state_bytes
from tsp_trainer.plan.transients import native_gqa


@dataclass(frozen=True)
class Assumptions:
    """The planner's free parameters (docs/planner.md section 4 explains each)."""

    # achieved fraction of peak per kernel family (plan/efficiency.py); None = the GPU's published row
    kernel_efficiency: KernelEfficiency | None = None
    # one fraction of peak for every FLOP family instead (GEMMs and attention alike); None = the table
    compute_efficiency: float | None = None
    comm_efficiency: float = 0.75          # achieved fraction of link bandwidth (bus bandwidth)
    hbm_usable: float = 0.92               # of HBM, for tensors and the reserve (allocator slack)
    op_latency_s: float = 15e-6            # fixed cost of one collective / P2P op (launch + sync)
    # optimizer offload: achieved fraction of the node's host DRAM bandwidth (HardwareProfile.
    # host_mem_bw, shared by its GPUs) in DeepSpeedCPUAdam's streaming update (AVX-512, OpenMP)
    cpu_adam_efficiency: float = 0.5


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, int]              # params, grads, optimizer, activations_peak, total
    fits: bool
    capacity: float
    activation: ActivationEstimate
    comm_mp: dict
    comm_dp: dict
    times: dict[str, float]             # seconds: compute, exposed comm, ... per optimizer step
    step_time: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    exceeds: tuple[str, ...] = ()       # the limits the layout is over: "HBM", "host" (none: fits)
    host_capacity: float = 0.0          # host memory of one node, bytes

    def as_dict(self) -> dict:
        a = self.activation
        return {"layout": self.layout.as_dict(), "label": self.layout.label(), "memory": self.memory,
                "fits": self.fits, "capacity_bytes": self.capacity, "exceeds": list(self.exceeds),
                "host_capacity_bytes_per_node": self.host_capacity,
                "activation": {"stored_per_layer": a.stored_per_layer, "stored_outside": a.stored_outside,
                               "stored": a.stored, "phases": a.phases, "peak": a.peak,
                               "peak_phase": a.peak_phase, "terms": a.terms},
                "comm_mp_per_micro_step": self.comm_mp, "comm_dp_per_step": self.comm_dp,
                "times_s": self.times, "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu, "hfu": self.hfu}


# Overlap model (docs/planner.md section 4): which ledger tags the code issues asynchronously and
# waits for later (they can hide behind compute), and which it issues synchronously (exposed).
# TSP's K/V all-gathers and dK/dV reduce-scatters are issued one item ahead: all but one item per
# layer and pass hide behind compute (`_model_parallel_seconds`).
OVERLAPPABLE_TAGS = ("attn.weights", "attn.wgrad", "mlp.weights", "mlp.weights.grad", "embed.weights",
                     "embed.weights.grad", "head.weights", "head.weights.grad")


def predict(cfg: ModelConfig, layout: Layout, seq_len: int, hw: HardwareProfile, *,
            global_batch: int | None = None, prec: Precision = BF16,
            assumptions: Assumptions = Assumptions(), device: str = "cuda") -> Prediction:
    """Memory, communication and time of one optimizer step of `layout` on `hw`. device: the
    attention path whose activations are counted ("cuda", or "cpu" for a CPU run's memory)."""
    st = state_bytes(cfg, layout, prec)
    act = activation_memory(cfg, layout, seq_len, prec, device=device, **layout.chunks)
    # the libraries' reserve (NCCL, cuBLAS, flash buffers, CUDA context) exists only on a GPU
    reserved = reserved_memory(cfg, layout, seq_len, prec, gpu=hw.name) if device == "cuda" else {"total": 0}
    memory = _memory(st, act, reserved)
    gpus_on_node = min(layout.world, hw.gpus_per_node)
    memory["host_optimizer_per_node"] = st["host_optimizer"] * gpus_on_node
    memory["host_per_node"] = host_bytes_per_node(memory, gpus_on_node)
    capacity = hw.hbm_bytes * assumptions.hbm_usable
    limits = exceeded_limits(memory, capacity, hw.host_memory_bytes)

    mp = model_parallel_comm(cfg, layout, seq_len, prec)
    dp = data_parallel_comm(cfg, layout, prec)
    eff_n = assumptions.comm_efficiency
    flops = hardware_flops_per_token(cfg, layout, seq_len, prec.act, chunks=layout.chunks)
    tokens_micro = layout.micro_batch * seq_len                    # per replica
    t_compute = compute_seconds_per_token(cfg, layout, seq_len, hw, assumptions, prec, device=device) \
        * tokens_micro / layout.degree
    overlappable, exposed = _model_parallel_seconds(mp, layout, hw, assumptions)
    # activation offload: every block's saved tensors go to the host in forward and come back in
    # backward on a side stream, overlapped with compute (model/offload.py); without prefetch a
    # block's come back when its backward asks for them, those copies exposed
    t_offload = act.host_traffic / (hw.host_bw * eff_n)
    t_fetch = act.host_fetch_exposed / (hw.host_bw * eff_n)
    # ZeRO-3 (sp, ulysses): each layer's weights gathered and its gradients reduce-scattered over
    # all ranks every micro-step, prefetched and bucketed beside compute (as the peers' model)
    t_zero3 = _zero3_seconds(dp, layout, hw, eff_n)
    t_micro = max(t_compute, overlappable, t_offload, t_zero3) + exposed + t_fetch
    # DP: gradients reduced while the last micro-step's backward runs (2/3 of its compute);
    # ZeRO-1/2 all-gather the updated parameters after the step (exposed)
    t_dp_grad, t_dp_params = _data_parallel_seconds(dp, layout, hw, eff_n)
    t_dp_exposed = max(0.0, t_dp_grad - 2 / 3 * t_compute) + t_dp_params
    t_opt = _optimizer_seconds(st["param_count"], layout, prec, hw)
    t_pcie = 0.0
    if layout.offload_optimizer:
        t_opt = _cpu_adam_seconds(st["param_count"], layout, prec, hw, assumptions)
        t_pcie = _optimizer_pcie_seconds(st["param_count"], layout, prec, hw, eff_n)
    step = layout.grad_accum * t_micro + t_dp_exposed + t_opt + t_pcie
    batch = global_batch if global_batch is not None else layout.micro_batch * layout.grad_accum * layout.dp
    tps = batch * seq_len / step
    per_gpu = tps / layout.world
    times = {"compute_per_micro": t_compute, "overlappable_comm_per_micro": overlappable,
             "exposed_comm_per_micro": exposed, "offload_per_micro": t_offload,
             "offload_fetch_exposed_per_micro": t_fetch, "micro_step": t_micro,
             "dp_grad_comm": t_dp_grad, "dp_param_allgather": t_dp_params, "dp_exposed": t_dp_exposed,
             "optimizer": t_opt, "optimizer_pcie": t_pcie}
    return Prediction(layout=layout, memory=memory, fits=not limits, capacity=capacity, exceeds=limits,
                      host_capacity=hw.host_memory_bytes,
                      activation=act, comm_mp=mp, comm_dp=dp, times=times, step_time=step,
                      tokens_per_s=tps, tokens_per_s_per_gpu=per_gpu,
                      mfu=flops["model"] * per_gpu / hw.peak_flops,
                      hfu=flops["hardware"] * per_gpu / hw.peak_flops)


def efficiencies(hw: HardwareProfile, assumptions: Assumptions = Assumptions()) -> KernelEfficiency:
    """The kernel efficiencies a prediction uses: the assumptions' table row (or the GPU's published
    one), with every FLOP family set to `compute_efficiency` when that is given."""
    eff = assumptions.kernel_efficiency or kernel_efficiency(hw.name)
    return eff if assumptions.compute_efficiency is None else eff.with_single(assumptions.compute_efficiency)


def compute_seconds_per_token(cfg: ModelConfig, layout: Layout, seq_len: int, hw: HardwareProfile,
                              assumptions: Assumptions = Assumptions(), prec: Precision = BF16, *,
                              device: str = "cuda") -> float:
    """Seconds of compute per training token on one GPU's worth of work (divide by D for a rank):
    each kernel family's work at its achieved rate (plan/efficiency.py), the attention's slower by
    `gqa_native_slowdown` where the layout runs the GQA-native path."""
    eff = efficiencies(hw, assumptions)
    work = executed_by_family(cfg, layout, seq_len, bytes_per_element=prec.act, chunks=layout.chunks)
    slow = gqa_native_slowdown(cfg, layout, seq_len, prec, device)
    return (work["gemm"] / (hw.peak_flops * eff.gemm)
            + slow * work["attention_forward"] / (hw.peak_flops * eff.attention_forward)
            + slow * work["attention_backward"] / (hw.peak_flops * eff.attention_backward)
            + work["elementwise_bytes"] / (hw.hbm_bw * eff.elementwise))


def gqa_native_slowdown(cfg: ModelConfig, layout: Layout, seq_len: int, prec: Precision,
                        device: str = "cuda") -> float:
    """The attention time of `layout` at seq_len over that of SDPA's fused GQA call: the measured
    GQA_NATIVE_SLOWDOWN (plan/efficiency.py) of its calls' shape where it runs the GQA-native path
    (train.attention_gqa=native on CUDA's flash route under GQA, transients.native_gqa), else 1."""
    t, s_p, _ = layout.axes
    kv_heads = cfg.kv_shard_hidden(t) // cfg.head_dim          # per weight shard (a copy if fewer)
    gqa = cfg.num_heads // t != kv_heads
    if not native_gqa(prec.act, device, gqa, cfg.head_dim, layout.attention_gqa):
        return 1.0
    return gqa_native_slowdown_at("prefix" if s_p > 1 else "square", seq_len)


def host_bytes_per_node(memory: dict[str, int], gpus_on_node: int) -> int:
    """Host bytes one node pins for its GPUs' ranks: each rank's offloaded activations
    (train.offload_activations), ZeRO-Offload's optimizer partition and the async checkpoint's
    staging of its weights and optimizer state (counted so that checkpoint.async_save may stay on;
    plan/reserved.py::pinned_host_per_node)."""
    per_rank = memory["host_offloaded"] + memory["host_optimizer"] + memory["checkpoint_staging"]
    return gpus_on_node * per_rank


def exceeded_limits(memory: dict[str, int], capacity: float, host_capacity: float) -> tuple[str, ...]:
    """Which memories a layout overflows: "HBM" (its per-GPU peak over `capacity` usable bytes),
    "host" (its node's pinned host bytes over `host_capacity`)."""
    over = []
    if memory["total"] > capacity:
        over.append("HBM")
    if memory["host_per_node"] > host_capacity:
        over.append("host")
    return tuple(over)


def _memory(st: dict[str, int], act: ActivationEstimate, reserved: dict[str, int]) -> dict[str, int]:
    """Per-rank memory: model state, saved and peak activations, the libraries' reserve
    (plan/reserved.py: flash buffers, NCCL, cuBLAS, CUDA context), their total on the GPU, and
    what activation offload and optimizer offload hold in host memory (pinned)."""
    gathered = st.get("zero3_gathered", 0)          # ZeRO-3: the layers' weights gathered for use
    total = st["params"] + st["grads"] + st["optimizer"] + gathered + act.peak + reserved["total"]
    return {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"],
            **({"zero3_gathered": gathered} if gathered else {}),
            "activations_stored": act.stored, "activations_peak": act.peak,
            "reserved": reserved["total"], "reserved_terms": {k: v for k, v in reserved.items() if k != "total"},
            "total": total, "host_offloaded": act.host, "host_optimizer": st["host_optimizer"],
            # what an async checkpoint stages on the host: this rank's weights and optimizer state
            "checkpoint_staging": st["params"] + st["optimizer"]}


def _link_bw(group_span: int, hw: HardwareProfile, *, p2p: bool) -> float:
    """Bandwidth of a group of `group_span` consecutive ranks: inside one node -> the node fabric
    (one peer for P2P rings), across nodes -> the NIC."""
    if group_span <= hw.gpus_per_node:
        return hw.p2p_bw if p2p else hw.intra_node_bw
    return hw.inter_node_bw


def _model_parallel_seconds(mp: dict[str, dict[str, int]], layout: Layout, hw: HardwareProfile,
                            assumptions: Assumptions) -> tuple[float, float]:
    """(overlappable, exposed) seconds of one micro-step's model-parallel ops: bytes on the wire
    over the link's achieved bandwidth, plus a fixed latency per op."""
    eff_n = assumptions.comm_efficiency
    overlappable = exposed = 0.0
    for key, v in mp.items():
        op, tag = key.split("/", 1)
        g = v["group"]
        if g <= 1:
            continue
        span = g if tag not in ("attn.kv", "attn.dkv", "wgrad", "loss.count") or layout.scheme == "tsp" \
            else layout.degree                                     # the sp sub-axis strides over tp
        bw = _link_bw(span, hw, p2p=op in ("send", "recv")) * eff_n
        seconds = v["bytes"] * WIRE_FACTOR[op](g) / bw + v["count"] * assumptions.op_latency_s
        if layout.scheme == "tsp" and tag in OVERLAPPABLE_TAGS:
            overlappable += seconds
        elif layout.scheme == "tsp" and tag in ("attn.kv", "attn.dkv"):
            # issued one item ahead (parallel/tsp/attention.py): only each pass's first item of a
            # layer waits for its K/V (forward, backward; the AC replay) and the last item's dK/dV
            # reduce-scatter is waited for before the layer's backward ends
            first = 1 / (layout.degree * layout.head_buckets)
            exposed += seconds * first
            overlappable += seconds * (1 - first)
        else:
            exposed += seconds
    return overlappable, exposed


def _data_parallel_seconds(dp: dict[str, dict[str, int]], layout: Layout, hw: HardwareProfile,
                           eff_n: float) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) seconds of one optimizer step's DP ops, over the
    whole world's links."""
    t_dp_grad = t_dp_params = 0.0
    for key, v in dp.items():
        if _ZERO3 in key:                   # per micro-step: _zero3_seconds
            continue
        op = key.split("/")[0]
        bw = _link_bw(layout.world, hw, p2p=False) * eff_n
        seconds = v["bytes"] * WIRE_FACTOR[op](v["group"]) / bw
        if key.endswith("dp.params"):
            t_dp_params += seconds
        else:
            t_dp_grad += seconds
    return t_dp_grad, t_dp_params


_ZERO3 = "/zero3."


def _zero3_seconds(dp: dict[str, dict[str, int]], layout: Layout, hw: HardwareProfile, eff_n: float) -> float:
    """Seconds per micro-step of ZeRO-3's gathers and reduce-scatters over all ranks (0 without)."""
    total = sum(v["bytes"] * WIRE_FACTOR[key.split("/")[0]](v["group"]) for key, v in dp.items() if _ZERO3 in key)
    return total / layout.grad_accum / (_link_bw(layout.world, hw, p2p=False) * eff_n)


def _optimizer_shard(param_count: int, layout: Layout) -> float:
    """Parameters this rank's optimizer steps: ZeRO-3 partitions over all ranks, ZeRO 1-2 over dp."""
    if layout.zero_stage == 3:
        return param_count / layout.world
    return param_count / (layout.dp if layout.zero_stage >= 1 else 1)


def _optimizer_seconds(param_count: int, layout: Layout, prec: Precision, hw: HardwareProfile) -> float:
    """AdamW over this rank's shard, bound by HBM bandwidth: it reads and writes the fp32 master and
    2 moments, reads the gradient, writes the bf16 weight."""
    shard = _optimizer_shard(param_count, layout)
    return shard * (2 * prec.optimizer + (prec.grad_accum or prec.grad) + prec.weight) / hw.hbm_bw


# bytes DeepSpeedCPUAdam moves per parameter: the fp32 master and both fp32 moments read and
# written (24), the fp32 gradient read (4); plus the updated partition written in the weights' dtype
CPU_ADAM_BYTES = 2 * (FP32_BYTES + 8) + FP32_BYTES


def _cpu_adam_seconds(param_count: int, layout: Layout, prec: Precision, hw: HardwareProfile,
                      assumptions: Assumptions) -> float:
    """DeepSpeedCPUAdam over this rank's partition, bound by host DRAM bandwidth: the node's
    bandwidth is shared by its GPUs' ranks, which all step at once."""
    shard = _optimizer_shard(param_count, layout)
    per_gpu_bw = hw.host_mem_bw / hw.gpus_per_node * assumptions.cpu_adam_efficiency
    return shard * (CPU_ADAM_BYTES + prec.weight) / per_gpu_bw


def _optimizer_pcie_seconds(param_count: int, layout: Layout, prec: Precision, hw: HardwareProfile,
                            eff_n: float) -> float:
    """ZeRO-Offload's PCIe traffic per step, exposed (DeepSpeed copies on the compute stream): the
    reduced fp32 gradient partition down to the host, then the updated partition in the weights'
    dtype back up (host_bw per direction)."""
    shard = _optimizer_shard(param_count, layout)
    return shard * (FP32_BYTES + prec.weight) / (hw.host_bw * eff_n)


__all__ = ["CPU_ADAM_BYTES", "OVERLAPPABLE_TAGS", "Assumptions", "Prediction", "compute_seconds_per_token",
           "efficiencies", "exceeded_limits", "gqa_native_slowdown", "host_bytes_per_node", "predict"]
