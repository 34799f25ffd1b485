"""Which SDPA kernel `attention_core` asks for, decided from (device, dtype, GQA, head_dim) and the
run's attention kernel and GQA path, and the SDPA calls of that route.

On CUDA a bottom-right causal call (a zigzag chunk against its key prefix) must reach a fused
kernel: torch's lower-right CausalBias otherwise materialises a dense [n_q, n_k] mask for the math
kernel, out of memory at long context. So the route names one fused kernel and `attention_core`
restricts SDPA to it: flash for bf16/fp16 with head_dim <= 256 (under GQA, by the run's
train.attention_gqa: SDPA's fused GQA call, or the per-group-member calls with the KV heads,
model/attention_gqa.py, so no dK/dV exists per query head),
memory-efficient otherwise (K/V heads expanded under GQA), cuDNN for square causal calls when the
run chose it (K/V expanded under GQA); what no fused
kernel takes is refused before any process group exists. Document masking runs one varlen fused
call per row on CUDA. On CPU (the validation path) a bottom-right call is split into its key
prefix and diagonal block, merged by log-sum-exp (model/attention_lse.py): no mask at all; a
blocked-mask route stays selectable for comparison (SdpaRoute("cpu_blocked_mask", query_block=)).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tsp_trainer.model.attention_kernel import FLASH_MAX_HEAD_DIM, Choice
from tsp_trainer.model.attention_gqa import grouped_query_attention
from tsp_trainer.model.attention_lse import prefix_causal_attention
from tsp_trainer.model.documents import DeviceVarlen, RowPlan, Segment, VarlenPlan

# Queries per SDPA call when a query slice needs a bottom-right causal mask on CPU: the mask (and
# the float copy SDPA makes of it) is [block, keys], so blocking bounds it at block * S elements
# instead of (S / D) * S.
CPU_MASK_QUERY_BLOCK = 512

_CPU_KERNELS = ("cpu_lse_merge", "cpu_blocked_mask")
# train.attention_gqa's concrete values: how CUDA's flash route attends under GQA. "native": one
# call per group member with the KV heads (model/attention_gqa.py), dK/dV never per query head;
# "fused": SDPA's own GQA (one flash call, enable_gqa), whose backward writes dK/dV per query head
GQA_PATHS = ("native", "fused")
_HALF = (torch.bfloat16, torch.float16)


class UnsupportedAttentionError(ValueError):
    """No fused attention kernel takes these shapes and dtype on this device."""


@dataclass(frozen=True)
class SdpaRoute:
    """How `attention_core` calls SDPA on one device: the kernel, and the calls themselves."""

    # "flash" | "efficient" | "cudnn" (CUDA, fused, no mask; cudnn: square causal calls only) |
    # "cpu_lse_merge" (CPU default: prefix and diagonal merged by log-sum-exp, no mask) |
    # "cpu_blocked_mask" (CPU, a mask per query block)
    kernel: str
    expand_kv: bool = False     # repeat K/V heads to the query heads before the call
    query_block: int | None = None   # queries per call for the CPU mask path
    # GQA: run model/attention_gqa.py's per-group-member calls with the KV heads (flash attention's
    # varlen calls on CUDA, the CPU flash kernel elsewhere) instead of this route's SDPA calls
    gqa_native: bool = False

    @property
    def lower_right_bias(self) -> bool:
        """Bottom-right causal runs use torch's CausalBias (no mask in memory)."""
        return self.kernel not in _CPU_KERNELS

    def kernels(self, device_type: str):
        """Context restricting SDPA on CUDA to this route's kernel. A no-op on CPU, also for a
        CUDA route run on CPU tensors (the CPU twin in the tests: CPU has no such kernels)."""
        if self.kernel in _CPU_KERNELS or device_type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION}
        return sdpa_kernel([backend[self.kernel]])

    # The SDPA calls. q, k, v: [B, H, T, d] (K/V already expanded when expand_kv).
    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, gqa: bool) -> torch.Tensor:
        """Square causal attention (queries are the keys)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, *,
               gqa: bool) -> torch.Tensor:
        """Queries [B, H, n, d] at positions first..first+n-1 against keys 0..first+n-1."""
        n_k = first + q.shape[2]
        return self.segment(q, k[:, :, :n_k], v[:, :, :n_k], gqa=gqa)

    def segment(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, gqa: bool) -> torch.Tensor:
        """Queries [B, H, n, d] against keys [B, H, n_k, d] (n_k >= n) with a bottom-right aligned
        causal mask: query i sees keys 0 .. n_k - n + i (a zigzag chunk's prefix, or the keys of
        one document)."""
        n, n_k = q.shape[2], k.shape[2]
        if self.kernel == "cudnn" and n_k != n:
            raise UnsupportedAttentionError(
                f"train.attention_kernel=cudnn: a query block of {n} against {n_k} keys needs a "
                "bottom-right causal call, which torch runs on flash or memory-efficient attention only")
        if self.kernel == "cpu_lse_merge":
            return prefix_causal_attention(q, k, v)
        if self.lower_right_bias:
            # imported here: torch.nn.attention.bias imports torch._dynamo, seconds of every
            # process's start-up that a route without the bias (the CPU's) never needs
            from torch.nn.attention.bias import causal_lower_right

            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, n_k),
                                                  enable_gqa=gqa)
        outs = []
        for s in range(0, n, self.query_block):
            e = min(n, s + self.query_block)
            k_end = n_k - (n - e)              # keys up to the block's last query
            mask = torch.ones(e - s, k_end, dtype=torch.bool, device=q.device).tril(diagonal=k_end - (e - s))
            outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :k_end], v[:, :, :k_end],
                                                       attn_mask=mask, enable_gqa=gqa))
        return torch.cat(outs, dim=2)

    def grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs, documents) -> torch.Tensor:
        """A gqa_native call: q [B, Hq, Tq, d] against the KV heads' k, v [B, Hkv, Tk, d], each
        kernel call with Hkv heads; q_runs None: the queries are the keys. Document masking on
        CUDA: per row G varlen calls (`grouped_varlen_attention`), one per group member, whatever
        the number of documents; otherwise model/attention_gqa.py's blocks."""
        if documents is not None and self.kernel in _VARLEN_KERNELS and q.device.type == "cuda":
            runs = q_runs if q_runs is not None else ((0, q.shape[2], 0),)
            kernel = _VARLEN_KERNELS[self.kernel]
            return torch.cat([grouped_varlen_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], row.varlen(q.device),
                                                       kernel)
                              for i, row in enumerate(documents.plan(runs))], dim=0)
        return grouped_query_attention(q, k, v, q_runs, documents)

    def documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  row: RowPlan | tuple[Segment, ...], *, gqa: bool) -> torch.Tensor:
        """One batch row under document masking: q [1, H, Tq, d] against logical-order keys
        [1, H, S, d]; each segment's queries see only their document's causal keys. On CUDA one
        varlen fused call (cu_seqlens, with the row plan's device tensors); elsewhere one
        bottom-right causal call per segment."""
        row = row if isinstance(row, RowPlan) else RowPlan(row)
        if self.kernel in _VARLEN_KERNELS and q.device.type == "cuda":
            return varlen_attention(q, k, v, row.varlen(q.device), _VARLEN_KERNELS[self.kernel])
        outs = []
        for s in row.segments:
            qs, ks, vs = q[:, :, s.q_start:s.q_stop], k[:, :, s.k_start:s.k_stop], v[:, :, s.k_start:s.k_stop]
            # a document that starts inside the run: its keys are the queries (square causal)
            call = self.causal if s.n_prefix == 0 else self.segment
            outs.append(call(qs, ks, vs, gqa=gqa))
        return torch.cat(outs, dim=2)


# -- varlen fused attention (CUDA): all of a row's segments in one kernel call ----------------------
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     plan: DeviceVarlen | VarlenPlan, kernel) -> torch.Tensor:
    """q [1, H, Tq, d] (queries already in segment order), k, v [1, Hkv, S, d] -> [1, H, Tq, d].
    The keys of each segment are gathered into one packed [sum of key ranges, Hkv, d] buffer (at
    most two ranges per document and rank: linear in S); `kernel(q, k, v, cu_q, cu_k, max_q,
    max_k)` takes packed [total, heads, d] tensors and int32 offsets and applies a bottom-right
    causal mask per segment, as flash attention's varlen mode does. A VarlenPlan's tensors are
    made here; a DeviceVarlen (RowPlan.varlen) brings them made once per batch."""
    on_device = plan.on(q.device) if isinstance(plan, VarlenPlan) else plan
    qp = q[0].transpose(0, 1)                                   # [Tq, H, d]
    kp, vp = (t[0].index_select(1, on_device.key_index).transpose(0, 1) for t in (k, v))   # [K, Hkv, d]
    out = kernel(qp, kp, vp, on_device.cu_q, on_device.cu_k, on_device.plan.max_q, on_device.plan.max_k)
    return out.transpose(0, 1).unsqueeze(0)


def grouped_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             plan: DeviceVarlen | VarlenPlan, kernel) -> torch.Tensor:
    """`varlen_attention` under GQA without dK/dV per query head: the keys packed once
    ([K, Hkv, d]), then one varlen call per group member g with query heads g, G + g, ... against
    the Hkv heads (multi-head calls: the kernel's backward writes dK, dV [K, Hkv, d] each, autograd
    sums the G of them into the packed keys' gradient). q [1, Hq, Tq, d] -> [1, Hq, Tq, d]."""
    on_device = plan.on(q.device) if isinstance(plan, VarlenPlan) else plan
    hq, tq, d = q.shape[1], q.shape[2], q.shape[3]
    g = hq // k.shape[1]
    kp, vp = (t[0].index_select(1, on_device.key_index).transpose(0, 1) for t in (k, v))   # [K, Hkv, d]
    outs = [kernel(q[0, i::g].transpose(0, 1), kp, vp, on_device.cu_q, on_device.cu_k, on_device.plan.max_q,
                   on_device.plan.max_k) for i in range(g)]                                  # [Tq, Hkv, d]
    # head j G + i is member i's head j: [Tq, Hkv, G, d] -> [Tq, Hq, d]
    return torch.stack(outs, dim=2).reshape(tq, hq, d).transpose(0, 1).unsqueeze(0)


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k):
    """torch's flash attention in varlen mode (bf16/fp16, GQA native, causal bottom-right)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True,
                                                   False)[0]


def _efficient_varlen(q, k, v, cu_q, cu_k, max_q, max_k):
    """torch's memory-efficient attention in varlen mode (fp32; custom_mask_type 2 = causal from
    the bottom right). K/V heads are already expanded to the query heads (route.expand_kv)."""
    return torch.ops.aten._efficient_attention_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, cu_q, cu_k, max_q, max_k, 0.0, 2,
        True)[0].squeeze(0)


_VARLEN_KERNELS = {"flash": _flash_varlen, "efficient": _efficient_varlen}


def use_attention_kernel(choice: Choice) -> None:
    """Set torch's flash implementation for `choice` (select_attention_kernel): FA3 / FA4 are
    activated in torch's dispatcher, a process-wide setting of torch's, any other choice restores
    torch's FA2 there. The route itself takes the kernel as an argument (`sdpa_route(kernel=)`)."""
    from torch.nn import attention

    impl = {"fa3": "FA3", "fa4": "FA4"}.get(choice.kernel)
    if impl is not None:
        attention.activate_flash_attention_impl(impl)
    elif attention.current_flash_attention_impl() is not None:
        attention.restore_flash_attention_impl()


def sdpa_route(device_type: str, dtype: torch.dtype, *, gqa: bool, head_dim: int,
               kernel: str = "fa2", gqa_path: str = "native") -> SdpaRoute:
    """The kernel `attention_core` uses for these inputs (see the module docstring); `kernel`
    (the run's train.attention_kernel choice) decides only whether cuDNN replaces flash;
    `gqa_path` (the run's train.attention_gqa choice, GQA_PATHS) whether the flash route under GQA
    runs the GQA-native calls or SDPA's fused GQA call."""
    if device_type != "cuda":
        return SdpaRoute("cpu_lse_merge")
    if dtype in _HALF and head_dim <= FLASH_MAX_HEAD_DIM:
        if kernel == "cudnn":
            return SdpaRoute("cudnn", expand_kv=gqa)    # torch documents GQA for flash and math only
        if gqa_path not in GQA_PATHS:
            raise ValueError(f"gqa_path={gqa_path!r} is not one of {', '.join(GQA_PATHS)}")
        # torch pads head_dim to a multiple of 8 for flash. Under GQA FA2's backward writes dK/dV
        # per query head ([B, n_k, H_q, d] each) before summing them per KV head: "native" runs
        # the KV heads' own calls instead (model/attention_gqa.py; their varlen kernel calls take
        # head_dim as it is, a multiple of 8; SDPA pads the others), which hold no tensor per
        # query head but run slower (experiments/gqa_native_cost.py); "fused" one SDPA call
        return SdpaRoute("flash", gqa_native=gqa and gqa_path == "native" and head_dim % 8 == 0)
    alignment = 8 if dtype in _HALF else 4
    if dtype in (*_HALF, torch.float32) and head_dim % alignment == 0:
        return SdpaRoute("efficient", expand_kv=gqa)
    raise UnsupportedAttentionError(
        f"attention with head_dim={head_dim} in {str(dtype).removeprefix('torch.')} on CUDA: no "
        f"fused kernel takes it (flash: bf16/fp16 and head_dim <= {FLASH_MAX_HEAD_DIM}; "
        f"memory-efficient: head_dim a multiple of {alignment}), and the math "
        f"fallback needs a dense [queries, keys] score matrix per head (out of memory at long "
        f"context); change model.hidden_size / model.num_heads or train.dtype")


def check_cuda_attention(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         kernel: str = "fa2", gqa_path: str = "native") -> SdpaRoute:
    """The CUDA route of a model under attention kernel `kernel` and GQA path `gqa_path`, or
    UnsupportedAttentionError (the Trainer calls this before it starts any process group)."""
    return sdpa_route("cuda", dtype, gqa=num_heads != num_kv_heads, head_dim=head_dim, kernel=kernel,
                      gqa_path=gqa_path)
