"""Dry run of the real code at full scale in one CPU process: FakeTensorMode (no real weights or
activations) + the fake process group (`torch.testing._internal.distributed.fake_pg`, backend
"fake") at any world size, e.g. the 7B 128K recipe at world 1,024 (D = 8, DP = 128).

What runs is the project's own code, unchanged: `Transformer`, `build_mesh`, `parallelize` (TSP and
the baselines), the TSP broadcast / ring / K-V schedules, the loss of `parallel/loss.py`. One
training micro-step (forward + backward of the summed token loss over the global token count) is
executed on fake tensors for one chosen rank. Out come, for that rank:

* the per-rank parameter shapes (after sharding) and their bytes;
* the communication ledger (every collective and P2P op the rank issues), which for TSP must equal
  `tsp_step_comm` exactly, and for the baselines `expected_ledger_bytes`;
* the activation memory: bytes alive at the end of the forward (what autograd keeps for the
  backward) and the peak of live bytes over forward + backward (saved activations + transient
  buffers), measured by `LiveTensorMemory` (tsp_trainer/tools/memory.py), a TorchDispatchMode that tracks
  the storages ops create.
* the executed FLOPs: every matmul and attention kernel of the micro-step, counted by
  `ExecutedFlops` (tsp_trainer/tools/flop_count.py: torch's FLOP counter with causal-aware attention
  formulas; the CUDA route's fused calls report theirs from the footprint), set beside the
  planner's `hardware_flops_per_token` (plan/flops.py).

Two local adjustments make the real code run on fake tensors; none changes the parallel package:

1. Real inputs. A fake tensor has no values, so the batch (ids, labels, a few hundred KB) is built
   as *real* tensors outside fake mode (positions are host integers, PositionRuns), and
   `RealPassthrough` runs every op whose tensor inputs are all real for real (labels, masks), and
   replaces a real boolean index of a fake tensor by the equivalent integer indices
   (`mask.nonzero().unbind(1)`, same semantics; the training path has no boolean indexing left,
   the host-sync count below would show it). Ops that create tensors from nothing (zeros,
   empty, ones) stay fake.
2. Layers. A forward + backward of one 7B layer at 128K on fake tensors dispatches ~10^4 ops
   (~15 s on a loaded 2-core machine for TSP, D = 8, 4 head buckets). `simulate(..., layers=None)`
   runs the model with 1 and with 2 layers and extrapolates linearly to L layers:
   X(L) = X(1) + (L - 1) * (X(2) - X(1)). This is exact for the ledger (every layer issues the same
   ops) and for the bytes alive after the forward (every layer saves the same tensors); for the
   peak it holds as long as the peak falls in the same phase (the last layer's backward or the
   loss), which tests check against full-depth runs of small models. Under activation offload
   the device holds at most two blocks' saved tensors (the one in use and the one prefetched in
   backward), a bound a 2-layer run reaches but a 1-layer run does not, so there the runs have 2
   and 3 layers: X(L) = X(2) + (L - 2) * (X(3) - X(2)).

The fake tensors live on the CPU device, so `attention_core` takes its CPU route (each zigzag run's
key prefix without a mask and its diagonal block with `is_causal`, merged by log-sum-exp:
model/attention_lse.py; no mask tensor) and the run is compared with the analytic model's
device="cpu" variant. With attention="cuda" (`tsp-plan --dry-run --attention cuda`) it takes the
route it takes on a GPU instead (`cuda_attention_path`: the fused kernel torch would pick, K/V
heads expanded where that kernel needs it, no mask; each fused call allocates its output and
log-sum-exp, its backward dq, dk, dv; under GQA on the flash route the per-group-member calls of
model/attention_gqa.py run as they are, their kernels on the fake tensors) and is compared with
device="cuda", the variant the planner
predicts with. Fake CUDA tensors cannot stand in for this: torch's CPU build refuses autograd and
SDPA on them.

Host syncs: the step runs under `HostSyncCounter` (tsp_trainer/tools/host_sync.py), so the report says
how many times the real code would make the host wait for a GPU per micro-step (0 for every scheme).

Not modelled by fake tensors: allocator rounding / fragmentation, communication-library scratch
buffers, kernel workspaces that are not tensors (e.g. FlashAttention's tiles).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tsp_trainer.config import ModelConfig
from tsp_trainer.model.activation_checkpoint import wrap_blocks
from tsp_trainer.tools.flop_count import ExecutedFlops, record_attention
from tsp_trainer.tools.host_sync import HostSyncCounter
from tsp_trainer.tools.memory import LiveTensorMemory

_INDEX_OPS = None   # filled lazily (torch.ops lookups)


# ---------------------------------------------------------------------------------------------
# fake-mode helpers


class RealPassthrough(TorchDispatchMode):
    """Under FakeTensorMode: run ops whose tensor inputs are all real for real, and turn a real
    boolean index of a fake tensor into integer indices. See the module docstring, item 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _index_ops():
            indices = []
            for index in args[1]:
                if (index is not None and not isinstance(index, FakeTensor)
                        and index.dtype == torch.bool):
                    with unset_fake_temporarily():
                        indices.extend(index.nonzero().unbind(1))
                else:
                    indices.append(index)
            args = (args[0], indices) + tuple(args[2:])
        return func(*args, **kwargs)


def _index_ops():
    global _INDEX_OPS
    if _INDEX_OPS is None:
        aten = torch.ops.aten
        _INDEX_OPS = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                      aten._index_put_impl_.default)
    return _INDEX_OPS


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """The fake process group of `world_size` ranks seen from `rank`, torn down on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers backend "fake"

    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a default process group "
                           "(it creates a fake one of the requested world size)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the CUDA attention path on fake CPU tensors


class _FusedFootprint(torch.autograd.Function):
    """What one fused SDPA call (FlashAttention, memory-efficient) allocates, without values:
    forward the output [B, H, n, d] and an fp32 log-sum-exp [B, H, n], both saved for backward
    with q, k, v; backward dq, dk, dv. No [n, n_k] score or mask tensor exists. `calls` counts
    the kernel launches ("forward", "backward")."""

    @staticmethod
    def forward(ctx, q, k, v, calls: dict[str, int]):
        calls["forward"] += 1
        # FLOPs of the flash call it stands for (bottom-right causal: the prefix, or the square)
        record_attention(q.shape, k.shape, v.shape, causal="bottom_right", backward=False)
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls = calls
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _ = ctx.saved_tensors
        ctx.calls["backward"] += 1
        record_attention(q.shape, k.shape, v.shape, causal="bottom_right", backward=True)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _footprint_route(route, calls: dict[str, int]):
    """`route` (a CUDA route: its kernel and K/V expansion) with each SDPA call replaced by the
    fused kernel's footprint, counted in `calls`."""
    from tsp_trainer.model.attention_route import SdpaRoute

    class FusedFootprintRoute(SdpaRoute):
        def kernels(self, device_type: str):
            return contextlib.nullcontext()

        def causal(self, q, k, v, *, gqa):
            return _FusedFootprint.apply(q, k, v, calls)

        def prefix(self, q, k, v, first, *, gqa):
            n_k = first + q.shape[2]
            return _FusedFootprint.apply(q, k[:, :, :n_k], v[:, :, :n_k], calls)

        def segment(self, q, k, v, *, gqa):          # document masking: one document's keys
            return _FusedFootprint.apply(q, k, v, calls)

    # gqa_native: the real per-group-member calls (model/attention_gqa.py), whose kernels run on
    # the fake tensors (CPU flash: flash's outputs, out and lse, dq, dk, dv), counted in `calls`
    # by `_counted_block_kernels`
    return FusedFootprintRoute(route.kernel, expand_kv=route.expand_kv, gqa_native=route.gqa_native)


@contextlib.contextmanager
def _counted_block_kernels(calls: dict[str, int]):
    """Inside: every kernel call of model/attention_chunk.py's blocks (the GQA-native path and
    sequence-chunked attention) is counted in `calls` ("forward", "backward")."""
    from tsp_trainer.model import attention_chunk

    forward, backward = attention_chunk._kernel_forward, attention_chunk._kernel_backward

    def counted(fn, key):
        def call(*args):
            calls[key] += 1
            return fn(*args)
        return call

    attention_chunk._kernel_forward = counted(forward, "forward")
    attention_chunk._kernel_backward = counted(backward, "backward")
    try:
        yield
    finally:
        attention_chunk._kernel_forward, attention_chunk._kernel_backward = forward, backward


@contextlib.contextmanager
def cuda_attention_path():
    """Inside: `attention_core` takes the route it would take on CUDA (`sdpa_route("cuda", ...)`:
    the kernel and the K/V expansion it decides) on the dry run's CPU fake tensors, and each fused
    SDPA call allocates what the kernel allocates (`_FusedFootprint`). Fake CUDA tensors cannot
    stand in: torch's CPU build runs no autograd or SDPA on them ("PyTorch is not linked with
    support for cuda devices"). The route decision is looked up by `attention_core` at call time
    from model.layers, where it is swapped for the duration of the block. Yields the count of
    fused kernel calls, {"forward": n, "backward": m}, filled as they run."""
    from tsp_trainer.model import attention_route, layers

    original = layers.sdpa_route
    calls = {"forward": 0, "backward": 0}

    def cuda_route(device_type, dtype, *, gqa, head_dim, kernel="fa2", gqa_path="native"):
        return _footprint_route(attention_route.sdpa_route("cuda", dtype, gqa=gqa, head_dim=head_dim,
                                                           kernel=kernel, gqa_path=gqa_path), calls)

    layers.sdpa_route = cuda_route
    try:
        with _counted_block_kernels(calls):
            yield calls
    finally:
        layers.sdpa_route = original


# ---------------------------------------------------------------------------------------------
# activation offload on fake tensors


class DeviceMemory(LiveTensorMemory):
    """`LiveTensorMemory` of the device alone: storages allocated while `on_host()` is entered
    (activation offload's host copies: on the dry run's CPU fake tensors both sides are the same
    device) are counted in `host_live` / `host_peak` instead of `live` / `peak`."""

    def __init__(self) -> None:
        super().__init__()
        self.host_live = 0
        self.host_peak = 0
        self._host_depth = 0

    @contextlib.contextmanager
    def on_host(self):
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def _track(self, storage: torch.UntypedStorage) -> None:
        if not self._host_depth or storage in self._seen:
            return super()._track(storage)
        device_peak = self.peak
        super()._track(storage)
        # moved to the host counters: the entry's new weakref replaces the device one (whose
        # callback then never runs)
        nbytes = self._seen[storage][0]
        self.live, self.peak = self.live - nbytes, device_peak
        self._seen[storage] = (nbytes, weakref.ref(storage, partial(self._free_host, nbytes)))
        self.host_live += nbytes
        self.host_peak = max(self.host_peak, self.host_live)

    def _free_host(self, nbytes: int, _ref) -> None:
        self.host_live -= nbytes


@contextlib.contextmanager
def host_copies_on_host(tracker: DeviceMemory):
    """Inside: activation offload (model/offload.py) makes its host copies under
    `tracker.on_host()`, so the device peak holds what offload leaves on the GPU (the block whose
    copy drains in forward, the block in use and the one prefetched in backward) and the host
    peak what it moved. The store class is looked up by `ActivationOffload` at call time from
    model.offload, where it is swapped for the duration of the block."""
    from tsp_trainer.model import offload

    original = offload._BlockStore

    class HostCountedStore(original):
        def pack(self, t):
            with tracker.on_host():
                return super().pack(t)

    offload._BlockStore = HostCountedStore
    try:
        yield
    finally:
        offload._BlockStore = original


# ---------------------------------------------------------------------------------------------
# one simulated step


@dataclass
class StepResult:
    """What one fake-mode step of one rank shows (bytes per rank; see the module docstring)."""

    scheme: str
    layers_run: int
    param_shapes: dict[str, list[int]]            # name -> local shape (layers.0 stands for all)
    param_bytes: int                              # this rank's parameters (all layers)
    param_count: int
    comm: dict[str, dict[str, int]]               # "op/tag" -> {"count", "bytes"}
    stored_bytes: int                             # alive at the end of the forward
    peak_bytes: int                               # peak alive over forward + backward
    seconds: float
    host_bytes: int = 0                           # activation offload: peak held in host memory
    info: dict = field(default_factory=dict)
    host_syncs: dict[str, int] = field(default_factory=dict)   # kind -> count (tsp_trainer/tools/host_sync.py)
    flops: int = 0                                # executed FLOPs of the micro-step (tools/flop_count.py)
    flops_by_op: dict[str, int] = field(default_factory=dict)  # "aten.mm" -> FLOPs

    def as_dict(self) -> dict:
        return asdict(self)


def _scheme_options(scheme: str, head_buckets: int, tp_degree, sp_degree, tp_sequence_parallel,
                    tsp_recompute: str = "full") -> dict:
    if scheme == "tsp":
        return {"head_buckets": head_buckets, "tsp_recompute": tsp_recompute}
    if scheme == "tp_x_sp":
        return {"tp_degree": tp_degree, "sp_degree": sp_degree,
                "tp_sequence_parallel": tp_sequence_parallel}
    return {}


def run_step(cfg: ModelConfig, scheme: str, *, world_size: int, degree: int, seq_len: int,
             micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16, head_buckets: int = 1,
             activation_checkpointing: bool = False, rank: int = 0, tp_degree: int | None = None,
             sp_degree: int | None = None, tp_sequence_parallel: bool = False,
             seed: int = 0, attention: str = "cpu", tsp_recompute: str = "full",
             loss_chunk_tokens: int | str = "auto", mlp_chunk_tokens: int | str = "auto",
             offload_activations: bool = False, checkpoint_replay_keeps: str = "all",
             attention_chunk_tokens: int | str = "auto", checkpoint_segment_blocks: int = 1,
             offload_prefetch: bool = True) -> StepResult:
    """One forward + backward of `cfg` (as many layers as it has) for global rank `rank`.
    attention: "cpu" (the fake tensors' own path) or "cuda" (`cuda_attention_path`);
    tsp_recompute: TSP's `parallel.tsp_recompute` ("full", "selective" or "none");
    loss_chunk_tokens: `parallel.loss_chunk_tokens` (the LM head's token chunks);
    mlp_chunk_tokens: `parallel.mlp_chunk_tokens` (the MLP's);
    offload_activations: `train.offload_activations` (model/offload.py around the blocks, its host
    copies counted apart: `host_copies_on_host`);
    checkpoint_replay_keeps: TSP's `parallel.checkpoint_replay_keeps` (under checkpointing);
    attention_chunk_tokens: TSP's `parallel.attention_chunk_tokens` (K/V in chunks);
    checkpoint_segment_blocks: `train.checkpoint_segment_blocks` (nested checkpointing);
    offload_prefetch: `train.offload_prefetch` (with offload_activations)."""
    if attention not in ("cpu", "cuda"):
        raise ValueError(f"attention={attention!r} must be 'cpu' or 'cuda'")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tsp_trainer.model import Transformer
    from tsp_trainer.parallel.loss import global_count
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.parallel.tsp.comm_model import ledger_totals

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    options = _scheme_options(scheme, head_buckets, tp_degree, sp_degree, tp_sequence_parallel,
                              tsp_recompute)
    if scheme == "tsp":
        options["checkpoint_replay_keeps"] = checkpoint_replay_keeps
        options["attention_chunk_tokens"] = attention_chunk_tokens
    with fake_world(world_size, rank):
        mesh = build_mesh(degree)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        default = torch.get_default_dtype()
        with mode:
            torch.set_default_dtype(dtype)
            try:
                model = Transformer(cfg)
            finally:
                torch.set_default_dtype(default)
            par = parallelize(model, scheme, mesh, seq_len=seq_len, loss_chunk_tokens=loss_chunk_tokens,
                              mlp_chunk_tokens=mlp_chunk_tokens, **options)
            params = list(model.parameters())
            for p in params:
                p.grad = torch.zeros_like(p)      # preallocated, as the benchmark does
        wrap_blocks(model, checkpointing=activation_checkpointing, offload=offload_activations,
                    segment_blocks=checkpoint_segment_blocks, prefetch=offload_prefetch)   # as the trainer
        batch = par.local_batch(ids, labels)      # real tensors (see the module docstring)
        mesh.ledger.reset()
        tracker = DeviceMemory()
        tracker.ignore(*params, *(p.grad for p in params), *batch)
        syncs = HostSyncCounter(mesh.device)
        path = cuda_attention_path() if attention == "cuda" else contextlib.nullcontext({})
        offload = host_copies_on_host(tracker) if offload_activations else contextlib.nullcontext()
        with path as fused_calls, offload, mode, RealPassthrough(), tracker, syncs, \
                ExecutedFlops() as counted:
            loss_sum, count = par.loss_sum(*batch)
            tracker.mark("forward")
            total = global_count(count, par.token_comms)
            (loss_sum / total).backward()
        comm = {f"{op}/{tag}": v for (op, tag), v in ledger_totals(mesh.ledger.records).items()}
        shapes = {}
        for name, p in model.named_parameters():
            if name.startswith("layers.") and not name.startswith("layers.0."):
                continue
            shapes[name] = list(p.shape)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        param_count = sum(p.numel() for p in params)
        info = dict(par.info, world_size=world_size, degree=degree, dp=world_size // degree,
                    rank=rank, tsp_rank=mesh.tsp_rank, dp_rank=mesh.dp_rank, dtype=str(dtype),
                    activation_checkpointing=activation_checkpointing, attention=attention,
                    offload_activations=offload_activations, offload_prefetch=offload_prefetch,
                    checkpoint_segment_blocks=checkpoint_segment_blocks)
        if fused_calls:
            info["fused_attention_calls"] = dict(fused_calls)     # the step's kernel launches
        del model, par, params
    return StepResult(scheme=scheme, layers_run=cfg.num_layers, param_shapes=shapes,
                      param_bytes=param_bytes, param_count=param_count,
                      comm=comm, stored_bytes=tracker.marks["forward"], peak_bytes=tracker.peak,
                      seconds=time.perf_counter() - start, host_bytes=tracker.host_peak, info=info,
                      host_syncs=dict(syncs.by_kind),
                      flops=counted.total, flops_by_op=counted.by_op)


def simulate(cfg: ModelConfig, scheme: str, *, layers: int | None = None, **kwargs) -> StepResult:
    """`run_step` at full depth (layers = cfg.num_layers), or extrapolated from runs with 1 and 2
    layers (layers=None, the default; module docstring item 2). Parameter counts and bytes are
    extrapolated the same way; the shapes are those of the run. With offload_activations the runs
    have 2 and 3 layers (module docstring item 2); under nested checkpointing
    (checkpoint_segment_blocks k > 1) whole segments: k and 2 k layers (2 k and 3 k with offload),
    plus the L mod k blocks of the model's last, shorter segment, extrapolated per segment to the
    model's ceil(L / k) of them."""
    if layers is not None and layers >= cfg.num_layers:
        return run_step(cfg, scheme, **kwargs)
    if layers is not None:
        raise ValueError(f"layers={layers}: run the full model (None or >= {cfg.num_layers}) or "
                         "let simulate extrapolate from 1 and 2 layers (layers=None)")
    k = kwargs.get("checkpoint_segment_blocks", 1)
    first = _first_run_layers(cfg.num_layers, bool(kwargs.get("offload_activations")), k)
    if cfg.num_layers <= first + k:
        return run_step(cfg, scheme, **kwargs)
    one = run_step(cfg.replace(num_layers=first), scheme, **kwargs)
    two = run_step(cfg.replace(num_layers=first + k), scheme, **kwargs)
    extra = (cfg.num_layers - first) // k

    def lin(a: int, b: int) -> int:
        return a + extra * (b - a)

    comm = {}
    for key in sorted(set(one.comm) | set(two.comm)):
        a = one.comm.get(key, {"count": 0, "bytes": 0})
        b = two.comm.get(key, {"count": 0, "bytes": 0})
        comm[key] = {"count": lin(a["count"], b["count"]), "bytes": lin(a["bytes"], b["bytes"])}
    info = dict(two.info, extrapolated_from_layers=[first, first + k])
    if "fused_attention_calls" in two.info:
        info["fused_attention_calls"] = {k: lin(one.info["fused_attention_calls"][k], n)
                                         for k, n in two.info["fused_attention_calls"].items()}
    syncs = {k: lin(one.host_syncs.get(k, 0), two.host_syncs.get(k, 0))
             for k in sorted(set(one.host_syncs) | set(two.host_syncs))}
    return StepResult(scheme=scheme, layers_run=first + k, param_shapes=two.param_shapes,
                      param_bytes=lin(one.param_bytes, two.param_bytes),
                      param_count=lin(one.param_count, two.param_count), comm=comm,
                      stored_bytes=lin(one.stored_bytes, two.stored_bytes),
                      peak_bytes=lin(one.peak_bytes, two.peak_bytes),
                      seconds=one.seconds + two.seconds,
                      host_bytes=lin(one.host_bytes, two.host_bytes), info=info,
                      host_syncs={k: v for k, v in syncs.items() if v},
                      flops=lin(one.flops, two.flops),
                      flops_by_op={k: lin(one.flops_by_op.get(k, 0), two.flops_by_op.get(k, 0))
                                   for k in sorted(set(one.flops_by_op) | set(two.flops_by_op))})


# ---------------------------------------------------------------------------------------------
# the full-scale dry run (tsp-plan --dry-run)


def _first_run_layers(num_layers: int, offload: bool, k: int) -> int:
    """Layers of `simulate`'s first run: one segment of k blocks (two with offload), plus the
    L mod k blocks of the model's last, shorter segment, so both runs end as the model does."""
    first = (2 if offload else 1) * k
    return first + (num_layers - first) % k


def _extrapolation(num_layers: int, offload: bool, k: int) -> str:
    first = _first_run_layers(num_layers, offload, k)
    return f"extrapolated from {first} and {first + k} layers"


def dry_run(cfg: ModelConfig, *, seq_len: int, world_size: int, degree: int,
            schemes=("tsp", "tp", "tp_sp"), head_buckets: int = 1, micro_batch: int = 1,
            activation_checkpointing: bool = True, zero_stage: int = 1, rank: int = 0,
            full_depth: bool = False, attention: str = "cpu", tsp_recompute: str = "full",
            offload_activations: bool = False, offload_optimizer: bool = False,
            checkpoint_replay_keeps: str = "all", gpu: str | None = None, log=None,
            attention_chunk_tokens: int | str = "auto", checkpoint_segment_blocks: int = 1,
            offload_prefetch: bool = True) -> dict:
    """Run every scheme's training step on fake tensors at full scale and set the results beside
    the analytic model (plan/communication.py, plan/activations.py, plan/state.py): the ledger must
    equal it exactly; memory within a few %.
    attention="cuda" runs attention_core's CUDA route (`cuda_attention_path`) and compares with the
    analytic model's device="cuda" variant, the one the planner predicts with.
    offload_activations: train.offload_activations (the device peak without the host copies, which
    are reported as `host_activations`); offload_optimizer: zero.offload_optimizer=cpu (AdamW's
    state counted in host memory, as the planner does: the fake step runs no optimizer);
    checkpoint_replay_keeps: TSP's parallel.checkpoint_replay_keeps (under checkpointing);
    attention_chunk_tokens: TSP's parallel.attention_chunk_tokens (K/V in chunks);
    checkpoint_segment_blocks: train.checkpoint_segment_blocks (nested checkpointing);
    offload_prefetch: train.offload_prefetch (with offload_activations);
    gpu: a hardware profile name ("h100"): the planner's reserve for it (plan/reserved.py: buffers
    the libraries allocate beside the tensors, which fake tensors do not show) is reported and
    `device_total` = the measured tensors + that reserve, comparable with the planner's total.
    Returns a JSON-friendly report."""
    from tsp_trainer.plan.activations import activation_memory
    from tsp_trainer.plan.communication import model_parallel_comm
    from tsp_trainer.plan.flops import hardware_flops_per_token
    from tsp_trainer.plan.layout import Layout
    from tsp_trainer.plan.precision import BF16
    from tsp_trainer.plan.reserved import reserved_memory
    from tsp_trainer.plan.state import state_bytes

    prec = BF16
    dp = world_size // degree
    report = {"model": asdict(cfg), "seq_len": seq_len, "world_size": world_size, "degree": degree,
              "dp": dp, "rank": rank, "micro_batch": micro_batch, "zero_stage": zero_stage,
              "activation_checkpointing": activation_checkpointing, "dtype": "bf16",
              "attention": attention, "tsp_recompute": tsp_recompute,
              "offload_activations": offload_activations, "offload_optimizer": offload_optimizer,
              "checkpoint_replay_keeps": checkpoint_replay_keeps, "gpu": gpu,
              "attention_chunk_tokens": attention_chunk_tokens,
              "checkpoint_segment_blocks": checkpoint_segment_blocks, "offload_prefetch": offload_prefetch,
              "layers": "all" if full_depth else _extrapolation(cfg.num_layers, offload_activations,
                                                                      checkpoint_segment_blocks),
              "schemes": {}}
    for scheme in schemes:
        if log:
            log(f"[dry-run] {scheme}: world {world_size} (D={degree}, DP={dp}), rank {rank}, "
                f"seq {seq_len} ...")
        nb = head_buckets if scheme == "tsp" else 1
        mode = tsp_recompute if scheme == "tsp" else "full"
        keeps = checkpoint_replay_keeps if scheme == "tsp" else "all"
        chunking = {"attention_chunk_tokens": attention_chunk_tokens} if scheme == "tsp" else {}
        res = simulate(cfg, scheme, layers=cfg.num_layers if full_depth else None,
                       world_size=world_size, degree=degree, seq_len=seq_len,
                       micro_batch=micro_batch, dtype=torch.bfloat16, head_buckets=nb,
                       activation_checkpointing=activation_checkpointing, rank=rank,
                       attention=attention, tsp_recompute=mode,
                       offload_activations=offload_activations, checkpoint_replay_keeps=keeps,
                       checkpoint_segment_blocks=checkpoint_segment_blocks,
                       offload_prefetch=offload_prefetch, **chunking)
        layout = Layout(scheme, degree, dp=dp, zero_stage=zero_stage,
                        checkpoint_segment_blocks=checkpoint_segment_blocks, offload_prefetch=offload_prefetch,
                        activation_checkpointing=activation_checkpointing, head_buckets=nb,
                        micro_batch=micro_batch, tsp_recompute=mode, replay_keeps=keeps,
                        offload_activations=offload_activations, offload_optimizer=offload_optimizer,
                        **chunking)
        act = activation_memory(cfg, layout, seq_len, prec, device=attention, **chunking)
        model_comm = {k: {"count": v["count"], "bytes": v["bytes"]}
                      for k, v in model_parallel_comm(cfg, layout, seq_len, prec).items()}
        st = state_bytes(cfg, layout, prec)
        flops = hardware_flops_per_token(cfg, layout, seq_len, prec.act)
        # this rank's executed FLOPs are its 1/D share of the replica's micro_batch * seq_len tokens
        counted = res.flops * degree / (micro_batch * seq_len)
        measured_state = _measured_state(res, layout, prec)
        reserve = reserved_memory(cfg, layout, seq_len, prec, gpu=gpu)["total"] if gpu else 0
        tensors = sum(measured_state.values()) + res.peak_bytes
        report["schemes"][scheme] = {
            "param_shapes": res.param_shapes, "param_count": res.param_count,
            "param_count_model": st["param_count"],
            "state_bytes": measured_state,
            "comm": res.comm, "comm_total_bytes": sum(v["bytes"] for k, v in res.comm.items()
                                                      if not k.startswith("send/")),
            "comm_equals_model": res.comm == model_comm,
            "comm_diff": {k: {"ledger": res.comm.get(k), "model": model_comm.get(k)}
                          for k in sorted(set(res.comm) | set(model_comm))
                          if res.comm.get(k) != model_comm.get(k)},
            "activations_stored": res.stored_bytes, "activations_stored_model": act.stored,
            "activations_peak": res.peak_bytes, "activations_peak_model": act.peak,
            "peak_phase_model": act.peak_phase,
            "total_peak": tensors, "reserved_model": reserve, "device_total": tensors + reserve,
            "host_activations": res.host_bytes, "host_activations_model": act.host,
            "host_syncs": res.host_syncs, "seconds": res.seconds, "info": res.info,
            "flops_per_token": {"counted": counted, "formula": flops["hardware"],
                                "model": flops["model"]},
            "flops_by_op": res.flops_by_op}
    return report


def _measured_state(res: StepResult, layout, prec) -> dict[str, int]:
    """Parameters as measured; gradients and optimizer state from the measured parameter count
    by the planner's rules (plan/state.py: ZeRO over DP; with optimizer offload AdamW's state in
    host memory, 0 on the device)."""
    from tsp_trainer.plan.state import grad_bytes

    shards = layout.dp if layout.zero_stage >= 1 else 1
    optimizer = 0 if layout.offload_optimizer else -(-res.param_count * prec.optimizer // shards)
    return {"params": res.param_bytes, "grads": grad_bytes(res.param_count, layout.zero_stage,
                                                           layout.dp, prec),
            "optimizer": optimizer}


def format_dry_run(report: dict) -> str:
    gib = 2 ** 30
    m = report["model"]
    out = [f"dry run: {m['num_layers']} layers, h={m['hidden_size']}, I={m['intermediate_size']}, "
           f"V={m['vocab_size']}, seq {report['seq_len']} x micro-batch {report['micro_batch']}, "
           f"world {report['world_size']} = DP {report['dp']} x D {report['degree']} (fake process "
           f"group, FakeTensorMode), rank {report['rank']}, bf16, ZeRO-{report['zero_stage']}, "
           f"activation checkpointing {'on' if report['activation_checkpointing'] else 'off'}; "
           f"layers {report['layers']}; attention path {report.get('attention', 'cpu')}; TSP "
           f"recompute {report.get('tsp_recompute', 'full')}"
           + ("; activation offload" if report.get("offload_activations") else "")
           + ("; optimizer offload" if report.get("offload_optimizer") else "")]
    for scheme, r in report["schemes"].items():
        st = r["state_bytes"]
        out.append("")
        out.append(f"== {scheme}  ({r['seconds']:.1f} s)")
        out.append("  per-rank parameter shapes (layers.0 stands for every layer):")
        for name, shape in r["param_shapes"].items():
            out.append(f"    {name:40s} {tuple(shape)}")
        out.append(f"  parameters {r['param_count'] / 1e6:,.1f} M per rank (model: "
                   f"{r['param_count_model'] / 1e6:,.1f} M): params {st['params'] / gib:.2f} GiB, "
                   f"grads {st['grads'] / gib:.2f} GiB, AdamW (fp32 master + 2 moments, ZeRO over "
                   f"DP) {st['optimizer'] / gib:.2f} GiB")
        out.append(f"  communication per micro-step (ledger payload, P2P counted at the receiver): "
                   f"{r['comm_total_bytes'] / gib:.2f} GiB; equals the analytic model exactly: "
                   f"{r['comm_equals_model']}")
        for key, v in sorted(r["comm"].items()):
            if not key.startswith("send/"):
                out.append(f"    {key:28s} {v['count']:6d} ops {v['bytes'] / gib:9.3f} GiB")
        for key, diff in r["comm_diff"].items():
            out.append(f"    DIFF {key}: ledger {diff['ledger']} model {diff['model']}")
        out.append(f"  activations saved for backward {r['activations_stored'] / gib:.2f} GiB "
                   f"(model {r['activations_stored_model'] / gib:.2f}); peak activations + transients "
                   f"{r['activations_peak'] / gib:.2f} GiB (model {r['activations_peak_model'] / gib:.2f}, "
                   f"in its {r['peak_phase_model']} phase)")
        out.append(f"  peak per rank: {r['total_peak'] / gib:.2f} GiB = state + peak activations")
        if r.get("reserved_model"):
            out.append(f"  with the planner's reserve for {report['gpu']} ({r['reserved_model'] / gib:.2f} GiB: "
                       f"library buffers fake tensors do not show): {r['device_total'] / gib:.2f} GiB")
        if report.get("offload_activations"):
            out.append(f"  activations offloaded to host memory {r['host_activations'] / gib:.2f} GiB "
                       f"(model {r['host_activations_model'] / gib:.2f})")
        fl = r["flops_per_token"]
        out.append(f"  executed FLOPs per token {fl['counted'] / 1e9:.2f} G counted (torch's FLOP counter), "
                   f"{fl['formula'] / 1e9:.2f} G planner formula; model FLOPs {fl['model'] / 1e9:.2f} G; "
                   f"executed / model {fl['counted'] / fl['model']:.3f} counted, "
                   f"{fl['formula'] / fl['model']:.3f} formula")
        syncs = r.get("host_syncs", {})
        out.append(f"  host syncs per micro-step (model forward + backward): {sum(syncs.values())}"
                   + (f" ({', '.join(f'{k} {v}' for k, v in sorted(syncs.items()))})" if syncs else ""))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# the dry run at the planner's longest sequence


def dry_run_at_longest(cfg: ModelConfig, gpu, *, nodes: int = 1, offload: bool = False,
                       offload_optimizer: bool = True, ranks=(0,), log=None,
                       fields: dict | None = None) -> dict:
    """The dry run of TSP at the planner's longest sequence on `nodes` nodes of `gpu`
    (plan/longest.py, activations in HBM or with `offload`; gpu: a profile name or a
    HardwareProfile), with the layout the planner chose
    there (D, DP, ZeRO stage, AC, head buckets, recompute, both offloads; the CUDA attention
    route), for each of `ranks`, beside the planner's prediction. `dry_peak` is the largest
    device total over the ranks: the measured tensors plus the planner's reserve (the libraries'
    buffers, which fake tensors do not show); `ratio` = dry_peak / plan_peak. Per component
    (state, saved and peak activations, reserve) the dry run's bytes and the planner's.
    `fields`: Layout fields set on every candidate (longest_seq_len's; the ablation rows'
    switches, e.g. {"attention_chunk_tokens": layout.UNTILED} for K/V gathered whole)."""
    from tsp_trainer.plan.hardware import get_profile
    from tsp_trainer.plan.longest import longest_seq_len

    hw = get_profile(gpu) if isinstance(gpu, str) else gpu
    longest = longest_seq_len(cfg, "tsp", hw=hw, nodes=nodes, offload=offload,
                              offload_optimizer=offload_optimizer, fields=fields)
    if longest.best is None:
        raise ValueError(f"gpu={hw.name!r}, nodes={nodes}: no TSP layout fits even "
                         f"one granule ({longest.refused or 'nothing fits'})")
    pred, lay, seq = longest.best, longest.best.layout, longest.seq_len
    model = cfg.replace(max_seq_len=max(cfg.max_seq_len, seq))
    runs = {}
    for rank in ranks:
        report = dry_run(model, seq_len=seq, world_size=lay.world, degree=lay.degree, schemes=("tsp",),
                         head_buckets=lay.head_buckets, micro_batch=lay.micro_batch,
                         activation_checkpointing=lay.activation_checkpointing,
                         zero_stage=lay.zero_stage, rank=rank, attention="cuda",
                         tsp_recompute=lay.tsp_recompute, offload_activations=lay.offload_activations,
                         checkpoint_replay_keeps=lay.replay_keeps,
                         checkpoint_segment_blocks=lay.checkpoint_segment_blocks,
                         offload_prefetch=lay.offload_prefetch,
                         offload_optimizer=lay.offload_optimizer, gpu=hw.name, log=log,
                         attention_chunk_tokens=lay.attention_chunk_tokens)
        runs[rank] = report["schemes"]["tsp"]
    worst = max(runs.values(), key=lambda r: r["device_total"])
    m = pred.memory
    components = {
        "state": [sum(worst["state_bytes"].values()), m["params"] + m["grads"] + m["optimizer"]],
        "activations_stored": [worst["activations_stored"], m["activations_stored"]],
        "activations_peak": [worst["activations_peak"], m["activations_peak"]],
        "reserved": [worst["reserved_model"], m["reserved"]],
        "host_activations": [worst["host_activations"], m["host_offloaded"]]}
    return {"gpu": hw.name, "nodes": nodes, "seq_len": seq, "layout": lay.label(),
            "layout_fields": lay.as_dict(), "ranks": list(runs),
            "device_total_by_rank": {r: v["device_total"] for r, v in runs.items()},
            "dry_peak": worst["device_total"], "plan_peak": m["total"], "usable_hbm": pred.capacity,
            "ratio": worst["device_total"] / m["total"], "peak_phase_model": worst["peak_phase_model"],
            "components": components, "seconds": sum(v["seconds"] for v in runs.values())}


def format_at_longest(c: dict) -> str:
    gib = 2 ** 30
    lines = [f"{c['gpu']} x {c['nodes']} node(s): longest TSP sequence {c['seq_len']:,} tokens, "
             f"{c['layout']}; ranks {c['ranks']}, {c['seconds']:.0f} s",
             f"  dry-run peak {c['dry_peak'] / gib:.2f} GiB, planner {c['plan_peak'] / gib:.2f} GiB, "
             f"usable HBM {c['usable_hbm'] / gib:.2f} GiB; dry / plan {c['ratio']:.4f}"]
    for name, (dry, plan) in c["components"].items():
        lines.append(f"    {name:20s} dry {dry / gib:9.3f} GiB  plan {plan / gib:9.3f} GiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m tsp_trainer.plan.dry_run --model llama3_8b --gpu h100 [--offload] [--ranks 0,1]:
    `dry_run_at_longest`, printed (and written as JSON with --json)."""
    import argparse
    import json

    from tsp_trainer.config.model_source import add_model_args, model_from_name_or_path
    from tsp_trainer.plan.layout import UNTILED

    p = argparse.ArgumentParser(prog="python -m tsp_trainer.plan.dry_run",
                                description="the dry run at the planner's longest TSP sequence")
    add_model_args(p, default="llama3_8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--offload", action="store_true", help="the activation-offload layout")
    p.add_argument("--no-offload-optimizer", action="store_true",
                   help="AdamW's state on the GPU (default: zero.offload_optimizer=cpu)")
    p.add_argument("--whole-kv", action="store_true",
                   help="K/V gathered whole (parallel.attention_chunk_tokens untiled, the ablation's "
                        "lean replay row); default: the chunks auto resolves")
    p.add_argument("--ranks", default="0", help="comma-separated global ranks, or 'all'")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    cfg = model_from_name_or_path(args.model)
    if args.ranks == "all":
        from tsp_trainer.plan.hardware import get_profile

        ranks = range(args.nodes * get_profile(args.gpu).gpus_per_node)
    else:
        ranks = [int(r) for r in args.ranks.split(",")]
    c = dry_run_at_longest(cfg, args.gpu, nodes=args.nodes, offload=args.offload,
                           offload_optimizer=not args.no_offload_optimizer, ranks=ranks,
                           log=lambda msg: print(msg, flush=True),
                           fields={"attention_chunk_tokens": UNTILED} if args.whole_kv else None)
    print(format_at_longest(c))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(c, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
