"""GPU acceptance run, one command, one GPU, about 4 minutes on an H200 (an estimate: no GPU has run
it yet). A time budget, 8 minutes by default, skips the parts that would not fit and says so in the
JSON:

    python experiments/gpu_acceptance.py --out docs/results/gpu_acceptance.json           # on one H200 / H100
    python experiments/gpu_acceptance.py --device cpu --tiny --out /tmp/acc.json  # the CPU twin (tests)

It writes one JSON. Parts, in the order they run:

(a) `plain`: our single-process model against transformers' LlamaForCausalLM, same config,
    weights and batch, steps interleaved (tsp_trainer/bench/run.py `single_process`): tokens/s and
    MFU, at a 1B shape, 8K tokens, bf16 (tiny: the tiny model, 128 tokens, fp32 on CPU);
(b) `tsp_rank`: rank 0 of the 7B 128K D = 8 recipe (recipes/7b_128k_8gpu.yaml; its
    parallel.head_buckets, parallel.tsp_recompute and train.activation_checkpointing unless given
    on the command line) under the attention kernel the recipe's train.attention_kernel selects
    (model/attention_kernel.py). The seven other ranks do not exist: the process group is torch's
    fake backend (plan/dry_run.py `fake_world`), and every collective and P2P op of N bytes the
    rank issues also copies N bytes on this GPU on the stream NCCL would use, waited the way NCCL's
    work is waited (tsp_trainer/tools/comm_traffic.py `CopyTraffic`), so the rank's time includes
    the HBM traffic and stream ordering of its communication, not the links' latency or
    bandwidth. Received buffers hold garbage: the loss is meaningless, time and memory are real.
    Reports the forward + backward's peak allocated memory above the step's start (peak_act_bytes,
    against the planner's activation peak, plan/activations.py) and the allocator's absolute peaks
    (max_memory_allocated, max_memory_reserved) under the trainer's allocator settings
    (tsp_trainer/cli.py `default_allocator_env`, applied before CUDA initialises), and the time of
    one micro-step (forward + backward, no optimizer);
(c) which attention kernels ran: the device kernels of one profiled micro-step (torch.profiler with
    ProfilerActivity.CUDA; the CPU twin: the CPU ops), classified by
    tsp_trainer/tools/kernel_names.py (FA2 standard or split-KV, FA3, FA4, cuDNN, memory-efficient);
(d) MFU of that rank: model FLOPs of its tokens (S / D) per micro-step time over the GPU's peak;
(e) `optimizer_step`: the optimizer step the trainer runs for this rank (bf16 + ZeRO-1: DeepSpeed's
    BF16_Optimizer, fp32 master weights and gradients around build_optimizer's AdamW), timed apart;
(f) `document_masking`: the same rank on a packed batch of several documents (the varlen path of
    model/documents.py): kernels, memory, time;
(g) `activation_offload`: the same rank with train.offload_activations (model/offload.py): memory
    (against the planner's offload variant) and time;
(h) `tsp_rank_by_kernel`: (b) and (c) once per other attention kernel installed that can take the
    run (those refused say why).

docs/benchmarks.md says which GPU figures have been measured; the CPU twin runs the same code path
at tiny sizes in tests/unit/test_gpu_acceptance.py, the GPU test in tests/gpu/test_gpu_acceptance.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tsp_trainer.bench import make_batch, single_process
from tsp_trainer.config.model import model_config
from tsp_trainer.model import Transformer
from tsp_trainer.observability.flops import flops_per_token
from tsp_trainer.observability.metrics import detect_peak_flops

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "7b_128k_8gpu.yaml"
BUDGET_S = 480.0          # 8 minutes: the run's promise on one H200
KERNELS = ("fa2", "fa3", "fa4", "cudnn")
# a packed 128K row: four documents (the tiny row: three), lengths summing to the sequence
DOCUMENTS = {131072: [49152, 32768, 40960, 8192], 512: [200, 150, 162]}


# ---------------------------------------------------------------------------------------------
# set-up: allocator, sizes, the time budget


def apply_allocator_settings(environ=os.environ) -> dict:
    """The trainer's CUDA allocator settings (expandable segments unless the user set their own),
    put into `environ` before CUDA initialises; what is in effect, for the report."""
    from tsp_trainer.cli import default_allocator_env

    initialised = torch.cuda.is_initialized()
    added = default_allocator_env(environ)
    environ.update(added)
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF")
    applied_late = False
    if initialised and added and hasattr(torch.cuda.memory, "_set_allocator_settings"):
        torch.cuda.memory._set_allocator_settings(conf)   # CUDA already up (e.g. under pytest)
        applied_late = True
    return {"PYTORCH_CUDA_ALLOC_CONF": conf, "set_by_this_run": bool(added),
            "cuda_initialised_before": initialised, "applied_after_cuda_init": applied_late}


def recipe_layout(args) -> dict:
    """The TSP layout of the run: the command line's values, else the recipe's (with --tiny: D = 4,
    one head bucket, full recompute, activation checkpointing)."""
    from tsp_trainer.config.load import load_config

    cfg = load_config(RECIPE)
    auto = None
    if not args.tiny:                  # the recipe as the trainer's auto resolves it on this device
        from tsp_trainer.plan.auto import choose_auto_settings

        cuda = torch.cuda.is_available()
        auto = choose_auto_settings(cfg, world_size=cfg.parallel.tsp_degree, cuda=cuda,
                                    device=torch.device("cuda", 0) if cuda else None)
        cfg = auto.apply(cfg) if auto is not None else cfg
    layout = {"degree": cfg.parallel.tsp_degree, "head_buckets": cfg.parallel.head_buckets,
              "tsp_recompute": cfg.parallel.tsp_recompute,
              "activation_checkpointing": cfg.train.activation_checkpointing,
              "attention_kernel": cfg.train.attention_kernel, "optim": cfg.optim,
              "max_grad_norm": cfg.optim.max_grad_norm,
              "auto": None if auto is None else auto.line()}
    given = {"head_buckets": args.head_buckets, "tsp_recompute": args.tsp_recompute,
             "activation_checkpointing": args.activation_checkpointing,
             "attention_kernel": args.attention_kernel}
    if args.tiny:      # seconds-sized: D = 4, the tiny model's 2 heads per shard in one bucket
        layout.update(degree=4, head_buckets=1, tsp_recompute="full", activation_checkpointing=True)
    layout.update({k: v for k, v in given.items() if v is not None})
    for key, dotted in (("head_buckets", "parallel.head_buckets"), ("tsp_recompute", "parallel.tsp_recompute"),
                        ("activation_checkpointing", "train.activation_checkpointing")):
        if layout[key] == "auto":
            raise SystemExit(f"gpu_acceptance: {dotted}=auto in {RECIPE.name}: this script takes the "
                             f"layout explicitly; pass --{key.replace('_', '-')} with the value the "
                             "trainer resolves it to")
    return layout


def shapes(tiny: bool, device: torch.device) -> dict:
    """(a) and (b) problem sizes: 1B at 8K and 7B at 128K on a GPU, seconds-sized with --tiny
    (bf16 on a GPU, so the flash kernels run; fp32 on CPU)."""
    if tiny:
        dtype = "bf16" if device.type == "cuda" else "fp32"
        return {"plain": {"name": "tiny", "model": model_config("tiny"), "seq_len": 128, "dtype": dtype},
                "tsp": {"name": "tiny (8 heads)", "model": model_config("tiny", num_heads=8, num_kv_heads=8),
                        "seq_len": 512, "dtype": dtype}}
    return {"plain": {"name": "1b", "model": model_config("1b"), "seq_len": 8192, "dtype": "bf16"},
            "tsp": {"name": "7b", "model": model_config("7b"), "seq_len": 131072, "dtype": "bf16"}}


class Budget:
    """The run's time budget: a part runs when the time so far plus its estimate fits; a part
    that does not is skipped with a note (`skipped`)."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()
        self.skipped: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, part: str, estimate_s: float) -> bool:
        if self.elapsed() + estimate_s <= self.seconds:
            return True
        self.skipped.append({"part": part, "estimate_s": round(estimate_s, 1),
                             "elapsed_s": round(self.elapsed(), 1),
                             "note": f"skipped: {self.elapsed():.0f} s spent + about {estimate_s:.0f} s "
                                     f"for this part exceeds the {self.seconds:.0f} s budget"})
        print(f"[acceptance] {part}: {self.skipped[-1]['note']}", flush=True)
        return False


# ---------------------------------------------------------------------------------------------
# (a) the plain model


def plain_model(device: torch.device, name: str, cfg, seq_len: int, dtype: str, steps: int,
                peak: float | None) -> dict:
    """(a): ours vs transformers, interleaved steps (tsp_trainer/bench/run.py single_process)."""
    job = {"model": cfg, "seq_len": seq_len, "micro_batch": 1, "steps": steps, "warmup": 1, "seed": 0,
           "backend": "nccl" if device.type == "cuda" else "gloo", "dtype": dtype,
           "activation_checkpointing": False}
    out = single_process(device.index or 0, 1, job)
    fpt = flops_per_token(cfg, seq_len)
    result = {"model": name, "seq_len": seq_len, "dtype": dtype}
    for name in ("ours", "hf"):
        t = out[name]["step_time"]
        tps = seq_len / t
        result[name] = {"step_time_s": t, "tokens_per_s": tps, "mfu": fpt * tps / peak if peak else None,
                        "peak_act_bytes": out[name]["peak_act_bytes"], "first_loss": out[name]["first_loss"]}
    result["ours_over_hf_tokens_per_s"] = result["ours"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    return result


# ---------------------------------------------------------------------------------------------
# measuring one micro-step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def memory_of(fn, device: torch.device, ignore) -> dict:
    """Peak memory of one call of fn: on CUDA the allocator's (allocated above the start, and the
    absolute allocated / reserved peaks, the cache emptied first); on CPU the live tensors
    (tools/memory.py), no reserve."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.empty_cache()          # each part's reserved peak from the memory it holds, not
        torch.cuda.reset_peak_memory_stats(device)   # from blocks an earlier part left cached
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"peak_act_bytes": peak - base, "peak_allocated_bytes": peak,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    from tsp_trainer.tools.memory import LiveTensorMemory

    tracker = LiveTensorMemory()
    tracker.ignore(*ignore)
    with tracker:
        fn()
    return {"peak_act_bytes": tracker.peak, "peak_allocated_bytes": None, "peak_reserved_bytes": None}


def measure_micro_step(fwd_bwd, device: torch.device, steps: int, *, ignore, traffic, ledger,
                       profile: bool = True) -> dict:
    """One profiled micro-step (kernel names), the warm-up that also sizes the traffic scratch
    (profile=False: an unprofiled one on CUDA, none on CPU); one for memory; `steps` timed; the
    last timed step's communication (ledger and copies)."""
    from tsp_trainer.tools.kernel_names import classify_names, profiled_names

    kernels = classify_names(profiled_names(fwd_bwd, device) if profile else [])
    if not profile and device.type == "cuda":     # the warm-up (pinned buffers, kernel caches)
        fwd_bwd()
    memory = memory_of(fwd_bwd, device, [*ignore, *traffic.scratch()])
    times = []
    for _ in range(steps):
        ledger.reset()
        traffic.reset_counts()
        times.append(timed(fwd_bwd, device))
    ledger_bytes = sum(r.nbytes for r in ledger.records if r.op != "send")
    return {**memory, "step_time_s": statistics.median(times), "step_times_s": times,
            "sdpa_kernels": kernels["kernels"], "attention_kernel_families": kernels["families"],
            "comm_twin": {"ledger_bytes_per_step": ledger_bytes, "copied_bytes_per_step": traffic.bytes,
                          "copies_per_step": traffic.copies, "stream_waits_per_step": traffic.waits,
                          "by_op": {op: dict(v) for op, v in traffic.by_op.items()},
                          "scratch_bytes": traffic.scratch_bytes}}


# ---------------------------------------------------------------------------------------------
# (e) the trainer's optimizer step


class Bf16MasterAdamW:
    """The optimizer step of a bf16 + ZeRO-1 run at DP 1 (DeepSpeed's BF16_Optimizer around
    build_optimizer's AdamW): per parameter group (tsp_trainer/optim.py param_groups) a flat fp32
    master copy and a flat fp32 gradient buffer. A step copies the bf16 gradients into the fp32
    buffer, clips them to optim.max_grad_norm, runs AdamW on the masters and copies them back into
    the bf16 parameters. (DeepSpeed also sums the norm over the model-parallel group: 4 bytes.)"""

    def __init__(self, model: torch.nn.Module, optim, max_grad_norm: float):
        from tsp_trainer.optim import param_groups

        self.groups, masters = [], []
        for group in param_groups(model, optim.weight_decay):
            params = group["params"]
            if not params:
                continue
            master = torch.cat([p.detach().float().flatten() for p in params]).requires_grad_()
            master.grad = torch.zeros_like(master)
            self.groups.append((params, master))
            masters.append({"params": [master], "weight_decay": group["weight_decay"]})
        self.opt = torch.optim.AdamW(masters, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
        self.max_grad_norm = max_grad_norm

    def state_bytes(self) -> int:
        """fp32 masters, fp32 gradients and AdamW's two moments (after a step)."""
        per = sum(m.numel() * 4 for _, m in self.groups)
        moments = sum(t.numel() * t.element_size() for s in self.opt.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return 2 * per + moments

    def step(self) -> None:
        for params, master in self.groups:
            torch.cat([p.grad.flatten() for p in params], out=master.grad)   # bf16 -> fp32
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([m for _, m in self.groups], self.max_grad_norm)
        self.opt.step()
        for params, master in self.groups:
            offset = 0
            for p in params:
                p.data.copy_(master.detach()[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def optimizer_step(model, device: torch.device, layout: dict) -> dict:
    """(e): the BF16_Optimizer step of this rank's parameters, timed apart (the second step: the
    first creates AdamW's state)."""
    opt = Bf16MasterAdamW(model, layout["optim"], layout["max_grad_norm"])
    first = timed(opt.step, device)
    second = timed(opt.step, device)
    return {"optimizer": "fp32 master + AdamW (torch.optim.AdamW, bf16 + ZeRO-1 at DP 1)",
            "step_time_s": second, "first_step_time_s": first, "state_bytes": opt.state_bytes(),
            "param_count": sum(p.numel() for p in model.parameters())}


# ---------------------------------------------------------------------------------------------
# (b)-(h) one TSP rank


def attention_kernels(device: torch.device, spec: dict, layout: dict):
    """(the kernel the recipe selects, [(kernel, Choice or the refusal), ...] for every other
    kernel installed) on this device (CPU: SDPA's CPU kernels only)."""
    from tsp_trainer.model.attention_kernel import installed_attention_kernels, select_attention_kernel

    cfg = spec["model"]
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    available = installed_attention_kernels() if device.type == "cuda" else frozenset()
    facts = dict(capability=capability, dtype=spec["dtype"], head_dim=cfg.head_dim,
                 gqa=cfg.num_heads != cfg.num_kv_heads, available=available,
                 needs_varlen=False, needs_prefix=layout["degree"] > 1)
    chosen = select_attention_kernel(layout["attention_kernel"] if capability else "auto", **facts)
    others = []
    for kernel in KERNELS:
        if kernel == chosen.kernel or kernel not in available:
            continue
        try:
            others.append((kernel, select_attention_kernel(kernel, **facts)))
        except ValueError as err:
            others.append((kernel, str(err)))
    return chosen, others


def tsp_rank(device: torch.device, spec: dict, layout: dict, steps: int, peak: float | None,
             budget: Budget) -> dict:
    """(b)-(h): rank 0 of a D-rank TSP group whose peers are the fake process group with copy
    traffic. Returns {"tsp_rank": ..., and the parts that ran}. A part's estimate is its steps
    plus one (the profiler's own time) at the measured micro-step time."""
    from tsp_trainer.model.activation_checkpoint import checkpointed_block
    from tsp_trainer.model.attention_route import use_attention_kernel
    from tsp_trainer.model.attention_kernel import Choice
    from tsp_trainer.model.documents import Documents
    from tsp_trainer.model.offload import ActivationOffload
    from tsp_trainer.parallel.loss import global_count
    from tsp_trainer.parallel.mesh import build_mesh
    from tsp_trainer.parallel.schemes import parallelize
    from tsp_trainer.plan.dry_run import fake_world
    from tsp_trainer.tools.comm_traffic import CopyTraffic

    cfg, seq, d, nb = spec["model"], spec["seq_len"], layout["degree"], layout["head_buckets"]
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    chosen, others = attention_kernels(device, spec, layout)
    parts: dict = {}
    with fake_world(d, 0), CopyTraffic(device) as traffic:
        mesh = build_mesh(d, device=device)
        with torch.device("meta"):
            model = Transformer(cfg.replace(max_seq_len=max(seq, cfg.max_seq_len)))
        par = parallelize(model, "tsp", mesh, seq_len=seq, init_seed=0, head_buckets=nb,
                          tsp_recompute=layout["tsp_recompute"])
        model.to(device=device, dtype=dtype)
        plain_wrapper = checkpointed_block if layout["activation_checkpointing"] else None
        model.block_wrapper = plain_wrapper
        params = list(model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)            # preallocated: not counted as activations
        ids, labels = make_batch(cfg, 1, seq, 0)
        ids, labels = ids.to(device), labels.to(device)

        def step_of(batch):
            def fwd_bwd():
                loss_sum, count = par.loss_sum(*batch)
                total = global_count(count, par.token_comms)
                (loss_sum / total).backward()
            return fwd_bwd

        def measure(batch, n_steps: int, profile: bool = True) -> dict:
            return measure_micro_step(step_of(batch), device, n_steps, traffic=traffic, ledger=mesh.ledger,
                                      ignore=[*params, *(p.grad for p in params), *batch], profile=profile)

        batch = list(par.local_batch(ids, labels))
        try:
            use_attention_kernel(chosen)
            model.attention_kernel = chosen.kernel
            main = measure(batch, steps)
            main["attention_kernel"] = chosen.kernel
            parts["tsp_rank"] = main
            step_s = main["step_time_s"]
            parts["tsp_rank_by_kernel"] = {chosen.kernel: _kernel_summary(main, chosen.reason)}
            print(f"[acceptance] (b) TSP rank under {chosen.kernel}: step {step_s:.2f} s", flush=True)

            if budget.allows("optimizer_step", 3 * step_s / 10):
                parts["optimizer_step"] = optimizer_step(model, device, layout)
            if budget.allows("document_masking", 4 * step_s):
                lengths = DOCUMENTS[seq]
                docs = Documents.from_lengths([lengths])
                parts["document_masking"] = {"document_lengths": lengths,
                                             **measure(list(par.local_batch(ids, labels, docs)), 1)}
            if layout["tsp_recompute"] != "full":
                parts["activation_offload"] = {"skipped": f"parallel.tsp_recompute={layout['tsp_recompute']} "
                                                          "with train.offload_activations is refused"}
            elif budget.allows("activation_offload", 3 * step_s):
                model.block_wrapper = ActivationOffload(plain_wrapper)
                try:
                    parts["activation_offload"] = measure(batch, 1, profile=False)
                finally:
                    model.block_wrapper = plain_wrapper
            for kernel, choice in others:
                if not isinstance(choice, Choice):
                    parts["tsp_rank_by_kernel"][kernel] = {"skipped": choice}
                elif budget.allows(f"tsp_rank_by_kernel/{kernel}", (steps + 3) * step_s):
                    use_attention_kernel(choice)
                    model.attention_kernel = choice.kernel
                    run = measure(batch, steps)
                    parts["tsp_rank_by_kernel"][kernel] = _kernel_summary(run, choice.reason)
        finally:
            use_attention_kernel(Choice("fa2", "restored"))     # torch's own FA2 again
        parts["tsp_rank"]["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    parts["tsp_rank"].update(_planner_fields(spec, layout, parts["tsp_rank"], device, peak))
    if "peak_act_bytes" in parts.get("activation_offload", {}):
        off = parts["activation_offload"]
        predicted = _planner_peak(spec, layout, device, offload=True).peak
        off["planner_peak_act_bytes"] = predicted
        off["measured_over_planner"] = off["peak_act_bytes"] / predicted if predicted else None
    return parts


def _kernel_summary(run: dict, reason: str) -> dict:
    return {"reason": reason, **{k: run[k] for k in ("step_time_s", "step_times_s", "peak_act_bytes",
                                                     "peak_allocated_bytes", "peak_reserved_bytes",
                                                     "sdpa_kernels", "attention_kernel_families")}}


def _planner_peak(spec: dict, layout: dict, device: torch.device, *, offload: bool = False):
    """The planner's activation memory (plan/activations.py) of this rank's layout."""
    from tsp_trainer.plan.activations import activation_memory
    from tsp_trainer.plan.layout import Layout
    from tsp_trainer.plan.precision import BF16, FP32

    prec = BF16 if spec["dtype"] == "bf16" else FP32
    lay = Layout("tsp", layout["degree"], dp=1, zero_stage=1,
                 activation_checkpointing=layout["activation_checkpointing"],
                 head_buckets=layout["head_buckets"], tsp_recompute=layout["tsp_recompute"],
                 offload_activations=offload)
    return activation_memory(spec["model"], lay, spec["seq_len"], prec, device=device.type)


def _planner_fields(spec: dict, layout: dict, main: dict, device: torch.device, peak) -> dict:
    """(b)'s planner comparison and (d)'s throughput and MFU."""
    predicted = _planner_peak(spec, layout, device)
    cfg, seq, d = spec["model"], spec["seq_len"], layout["degree"]
    local_tokens = seq // d
    step = main["step_time_s"]
    return {"model": spec["name"], "seq_len": seq, "degree": d, "head_buckets": layout["head_buckets"],
            "tsp_recompute": layout["tsp_recompute"],
            "activation_checkpointing": layout["activation_checkpointing"], "dtype": spec["dtype"],
            "planner_peak_act_bytes": predicted.peak, "planner_peak_phase": predicted.peak_phase,
            "measured_over_planner": main["peak_act_bytes"] / predicted.peak if predicted.peak else None,
            "local_tokens": local_tokens, "tokens_per_s_this_rank": local_tokens / step,
            "mfu": flops_per_token(cfg, seq) * local_tokens / step / peak if peak else None,
            "note": "peers are torch's fake process group; each op's bytes are copied on this GPU on "
                    "the op's stream (tools/comm_traffic.py), so the time includes the HBM traffic "
                    "and stream waits of communication but not link latency or bandwidth; the loss "
                    "is meaningless; step_time_s is one micro-step (forward + backward), the "
                    "optimizer is timed apart (optimizer_step)"}


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU twin of the test suite)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per part (default 3)")
    p.add_argument("--skip-plain", action="store_true", help="only parts (b)-(h)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help=f"time budget in seconds (default {BUDGET_S:.0f}): parts that would not fit are skipped")
    p.add_argument("--head-buckets", type=int, help="parallel.head_buckets (default: the recipe's)")
    p.add_argument("--tsp-recompute", choices=("full", "selective", "none"),
                   help="parallel.tsp_recompute (default: the recipe's)")
    p.add_argument("--activation-checkpointing", type=lambda s: {"true": True, "false": False}[s.lower()],
                   metavar="{true,false}", help="train.activation_checkpointing (default: the recipe's)")
    p.add_argument("--attention-kernel", choices=("auto", *KERNELS),
                   help="train.attention_kernel of part (b) (default: the recipe's)")
    p.add_argument("--out", default="gpu_acceptance.json", metavar="PATH")
    args = p.parse_args(argv)
    allocator = apply_allocator_settings() if args.device == "cuda" else None   # before CUDA initialises
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu --tiny for the CPU twin")
    if args.steps < 1:
        p.error(f"--steps={args.steps} must be >= 1")
    if args.budget_s <= 0:
        p.error(f"--budget-s={args.budget_s} must be > 0")
    budget = Budget(args.budget_s)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    peak = detect_peak_flops(device)
    sizes = shapes(args.tiny, device)
    layout = recipe_layout(args)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "peak_flops": peak, "torch": torch.__version__, "tiny": args.tiny, "budget_s": args.budget_s,
              "allocator": allocator, "auto": layout["auto"]}
    if not args.skip_plain and budget.allows("plain", 0.0):
        s = sizes["plain"]
        report["plain"] = plain_model(device, s["name"], s["model"], s["seq_len"], s["dtype"], args.steps, peak)
        print(f"[acceptance] (a) plain: {json.dumps(report['plain'], default=str)}", flush=True)
    report.update(tsp_rank(device, sizes["tsp"], layout, args.steps, peak, budget))
    report["skipped"] = budget.skipped
    report["seconds"] = budget.elapsed()
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    t = report["tsp_rank"]
    reserved = t["peak_reserved_bytes"]
    print(f"[acceptance] (b) TSP rank: peak {t['peak_act_bytes'] / 2**30:.2f} GiB vs planner "
          f"{t['planner_peak_act_bytes'] / 2**30:.2f} GiB"
          + (f", reserved {reserved / 2**30:.2f} GiB" if reserved is not None else "")
          + f", step {t['step_time_s']:.2f} s; (c) {t['attention_kernel']}: "
          f"{t['attention_kernel_families']}; (d) MFU {t['mfu']}; {len(budget.skipped)} part(s) "
          f"skipped; wrote {args.out} in {report['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
