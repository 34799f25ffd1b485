"""How one job is laid out: the scheme, the model-parallel degree D = T x S_p (T splits weights, S_p
splits tokens; TSP splits both D ways), DP replicas, the ZeRO stage, activation checkpointing (AC),
TSP's head buckets and recompute mode, micro-batch and grad accumulation, the GQA attention path. `Layout` refuses what
the trainer refuses, so no layout the planner offers is one the trainer would not run."""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass

from tsp_trainer.config.schema import ReplayKeeps, Scheme, TspRecompute

# parallel.scheme's values the planner models as layouts of its own; ulysses is planned as a peer's
# stack (plan/peers.py), and a run of it is modelled as sp (`planned_scheme`)
SCHEMES = tuple(s for s in typing.get_args(Scheme) if s != "ulysses")


def planned_scheme(scheme: str) -> str:
    """The Layout scheme that models a run of parallel.scheme=`scheme` (auto settings, logged
    FLOPs). ulysses holds what sp holds (the same weights and state, S/D tokens) and its attention's
    full-sequence q/k/v/o of D-th of the heads stand in for sp's gathered K/V (the same order);
    sp's backward also re-runs the attention forward, which ulysses does not."""
    return "sp" if scheme == "ulysses" else scheme
TSP_RECOMPUTE = typing.get_args(TspRecompute)   # parallel.tsp_recompute (parallel/tsp/)
REPLAY_KEEPS = typing.get_args(ReplayKeeps)     # parallel.checkpoint_replay_keeps (tsp/kept.py)
# the values the planner's searches and `auto` take by default: all three. The dry run at the
# longest lengths (plan/dry_run.py dry_run_at_longest) confirms the planner's model of a replay
# keeping attention or nothing (docs/long_context/longest_context.md); the ranking prefers all
# wherever it fits (the lean values run a third forward of what they do not keep)
PLANNED_REPLAY_KEEPS = REPLAY_KEEPS

# train.checkpoint_segment_blocks values the longest-context search and `auto` try (1 = per-block
# checkpointing): a segment of k blocks regains k - 1 block inputs on the GPU in backward, so
# only small k pay off against HBM
NESTING_CANDIDATES = (1, 2, 3, 4, 8)

# train.attention_gqa's values (model/attention_route.py GQA_PATHS): CUDA's flash route under GQA
# runs the per-group-member calls (native) or SDPA's fused GQA call (fused); the planner's searches
# and `auto` weigh both where the model has GQA in bf16 (`search.gqa_paths`)
GQA_PATHS = ("native", "fused")

# the short marker of a tsp_recompute other than full in layout labels and tables
RECOMPUTE_MARK = {"selective": "sel", "none": "keep"}
# the label mark of a checkpoint_replay_keeps other than all (TSP under checkpointing)
REPLAY_MARK = {"attention": "keep=attn", "nothing": "keep=nothing"}

# a chunk setting larger than any rank's tokens: parallel.loss_chunk_tokens or mlp_chunk_tokens
# set to it takes all local tokens at once (no tiling; the trainer takes any such integer)
UNTILED = 1 << 62


@dataclass(frozen=True)
class Layout:
    """How one job is laid out. `degree` is D, the model-parallel group (the mesh's inner axis);
    for tp_x_sp, tp x sp = D."""

    scheme: str
    degree: int
    dp: int = 1
    tp: int | None = None                  # tp_x_sp only
    sp: int | None = None                  # tp_x_sp only
    tp_sequence_parallel: bool = False     # tp_x_sp only: Megatron SP inside the tp sub-axis
    zero_stage: int = 1
    activation_checkpointing: bool = False
    head_buckets: int = 1                  # tsp only
    micro_batch: int = 1                   # sequences per replica per micro-step
    grad_accum: int = 1
    offload_activations: bool = False      # blocks' saved tensors in host memory (model/offload.py)
    tsp_recompute: str = "full"            # tsp only: "selective" keeps q, k/v, attention outputs;
                                           # "none" also the MLP's gate/up pre-activations
    replay_keeps: str = "all"              # tsp under AC: what the replay keeps, "all",
                                           # "attention" or "nothing" (no effect without AC)
    offload_optimizer: bool = False        # zero.offload_optimizer=cpu: DeepSpeed's ZeRO-Offload
    loss_chunk_tokens: int | str = "auto"  # parallel.loss_chunk_tokens (UNTILED: one chunk)
    mlp_chunk_tokens: int | str = "auto"   # parallel.mlp_chunk_tokens (UNTILED: one chunk)
    attention_chunk_tokens: int | str = "auto"   # tsp: parallel.attention_chunk_tokens (UNTILED: one)
    # train.checkpoint_segment_blocks: AC keeps every k-th block input only, each segment of k
    # blocks re-run forward in backward (model/activation_checkpoint.py); 1 = per-block AC
    checkpoint_segment_blocks: int = 1
    # train.offload_prefetch (with offload_activations): a block's backward fetches the next
    # block's saved tensors ahead (model/offload.py); False fetches each when its backward asks,
    # one block's on the GPU at a time, each copy exposed
    offload_prefetch: bool = True
    # planner-only, for the ablation table: False keeps a tiled TSP layer's [N/D, h] output and
    # dX accumulators in fp32, as an untiled layer has them (the trainer puts them in the
    # activation dtype whenever the MLP's tokens are tiled)
    tiled_accumulators: bool = True
    # planner-only, for the ablation table: False keeps a tiled TSP layer's norm outputs [N/D, h]
    # saved, as an untiled layer has them (the trainer hands each norm's work to its consumer
    # whenever the layer is tiled: parallel/tsp/norm.py)
    norm_handoff: bool = True
    # train.attention_gqa: "native" (model/attention_gqa.py: no dK/dV per query head, slower) or
    # "fused" (SDPA's GQA: FA2's backward writes dK/dV per query head, plan/reserved.py); acts on
    # CUDA's flash route under GQA only (plan/transients.py native_gqa)
    attention_gqa: str = "native"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} is not one of {', '.join(SCHEMES)}")
        if self.attention_gqa not in GQA_PATHS:
            raise ValueError(f"attention_gqa={self.attention_gqa!r} is not one of {', '.join(GQA_PATHS)}")
        self._check_recompute()
        for key in ("loss_chunk_tokens", "mlp_chunk_tokens", "attention_chunk_tokens"):
            value = getattr(self, key)
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{key}={value!r} must be 'auto' or an integer >= 1 (tokens per chunk)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.zero_stage == 3 and self.scheme != "sp":       # config/validate.py's rule
            raise ValueError(f"zero_stage=3 with scheme {self.scheme!r}: ZeRO-3 shards the weights of "
                             "sp and ulysses (planned as sp) only; use zero_stage 0, 1 or 2")
        if self.offload_optimizer and self.zero_stage == 0:     # config/validate.py's rule
            raise ValueError("offload_optimizer with zero_stage=0: DeepSpeed offloads the optimizer "
                             "only under ZeRO 1 or 2; use zero_stage 1 or 2")
        if self.offload_optimizer and self.zero_stage == 3:     # the planner's rule, not the trainer's
            raise ValueError("offload_optimizer with zero_stage=3: the planner models ZeRO-Offload "
                             "under ZeRO 1 or 2 only (a ZeRO-3 run is planned with its optimizer "
                             "on the device); use zero_stage 1 or 2")
        k = self.checkpoint_segment_blocks
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (k > 1 and not self.activation_checkpointing):
            raise ValueError(f"checkpoint_segment_blocks={k!r} must be an integer >= 1, and 1 without "
                             "activation checkpointing (the trainer's rule)")
        if self.scheme == "tp_x_sp":
            t, s, _ = self.axes
            if t * s != self.degree:
                raise ValueError(f"tp x sp = {t} x {s} is not the degree {self.degree}")

    def _check_recompute(self) -> None:
        """The trainer's rules (config/validate.py::_check_tsp_recompute), so that no layout the
        planner offers is one the trainer refuses."""
        if self.replay_keeps not in REPLAY_KEEPS:
            raise ValueError(f"replay_keeps={self.replay_keeps!r} is not one of {', '.join(REPLAY_KEEPS)}")
        mode = self.tsp_recompute
        if mode not in TSP_RECOMPUTE:
            raise ValueError(f"tsp_recompute={mode!r} is not one of {', '.join(TSP_RECOMPUTE)}")
        if mode == "full":
            return
        if self.scheme != "tsp":
            raise ValueError(f"tsp_recompute={mode!r} with scheme {self.scheme!r}: only tsp "
                             "recomputes by shard; use tsp_recompute='full'")
        if self.activation_checkpointing or self.offload_activations:
            raise ValueError(f"tsp_recompute={mode!r} with "
                             f"{'activation checkpointing' if self.activation_checkpointing else 'activation offload'}: "
                             "the trainer refuses it (under activation checkpointing every mode "
                             "runs the same, the replay keeping one block's items; activation "
                             "offload would leave the kept items of every layer on the device); "
                             "use tsp_recompute='full'")

    @property
    def selective(self) -> bool:
        """tsp_recompute == "selective" exactly (the attention kept, the MLP recomputed)."""
        return self.tsp_recompute == "selective"

    @property
    def keeps_attention(self) -> bool:
        """TSP keeps each item's q, k/v, attention output and log-sum-exp (selective and none):
        backward re-runs neither the q/k/v projections nor the attention forward."""
        return self.scheme == "tsp" and self.tsp_recompute in ("selective", "none")

    @property
    def keeps_mlp(self) -> bool:
        """TSP keeps every ring step's gate/up pre-activations (none): backward re-runs no
        gate/up GEMM."""
        return self.scheme == "tsp" and self.tsp_recompute == "none"

    @property
    def replay_keeps_attention(self) -> bool:
        """TSP under checkpointing: the block's replay keeps the attention items for its backward
        (replay_keeps all, attention), so that backward runs no projection or attention forward."""
        return self._replays() and self.replay_keeps in ("all", "attention")

    @property
    def replay_keeps_mlp(self) -> bool:
        """TSP under checkpointing: the replay also keeps every ring step's gate/up (all), so the
        MLP's backward runs no gate/up GEMM."""
        return self._replays() and self.replay_keeps == "all"

    def _replays(self) -> bool:
        return self.scheme == "tsp" and self.activation_checkpointing

    @property
    def axes(self) -> tuple[int, int, bool]:
        """(T, S_p, Megatron SP): weight split, token split, sequence-parallel TP regions."""
        d = self.degree
        if self.scheme == "tsp":
            return d, d, False
        if self.scheme == "tp":
            return d, 1, False
        if self.scheme == "tp_sp":
            return d, 1, d > 1
        if self.scheme == "sp":
            return 1, d, False
        if self.tp is None or self.sp is None:
            raise ValueError("scheme tp_x_sp needs tp and sp (tp x sp = degree)")
        return self.tp, self.sp, self.tp_sequence_parallel and self.tp > 1

    @property
    def world(self) -> int:
        return self.degree * self.dp

    def label(self) -> str:
        name = self.scheme
        if self.scheme == "tp_x_sp":
            name = f"tp{self.tp}xsp{self.sp}" + ("+seqpar" if self.tp_sequence_parallel else "")
        zero = f"Z{self.zero_stage}" + ("+cpuopt" if self.offload_optimizer else "")
        parts = [name, f"D={self.degree}", f"DP={self.dp}", zero,
                 "AC" if self.activation_checkpointing else "noAC"]
        if self.scheme == "tsp":
            parts.append(f"nb={self.head_buckets}")
            if self.tsp_recompute != "full":
                parts.append(RECOMPUTE_MARK[self.tsp_recompute])
            if self.activation_checkpointing and self.replay_keeps != "all":
                parts.append(REPLAY_MARK[self.replay_keeps])
        if self.checkpoint_segment_blocks > 1:
            parts.append(f"nest={self.checkpoint_segment_blocks}")
        if self.attention_gqa != "native":
            parts.append(f"gqa={self.attention_gqa}")
        parts.append(f"mb={self.micro_batch}x{self.grad_accum}")
        if self.offload_activations:
            parts.append("offload" if self.offload_prefetch else "offload noprefetch")
        parts += self._tiling_marks()
        return " ".join(parts)

    def _tiling_marks(self) -> list[str]:
        """Label marks of chunk settings other than auto, and of fp32 accumulators."""
        marks = []
        for name, value in (("loss", self.loss_chunk_tokens), ("mlp", self.mlp_chunk_tokens),
                            ("attn", self.attention_chunk_tokens)):
            if value == UNTILED:
                marks.append(f"{name}=untiled")
            elif value != "auto":
                marks.append(f"{name}={value}")
        if not self.tiled_accumulators:
            marks.append("fp32acc")
        if not self.norm_handoff:
            marks.append("norms-kept")
        return marks

    def kept_block_inputs(self, num_layers: int) -> int:
        """Block inputs AC keeps through the step: one per segment of checkpoint_segment_blocks
        blocks (every layer's under per-block AC)."""
        return -(-num_layers // self.checkpoint_segment_blocks)

    def nested_forward_blocks(self, num_layers: int) -> int:
        """Block forwards nesting adds per micro-step: each segment re-runs its blocks but the
        last (non-reentrant checkpointing stops once the last inner input is rebuilt)."""
        return num_layers - self.kept_block_inputs(num_layers)

    @property
    def chunks(self) -> dict:
        """The chunk settings as the FLOP and activation models take them."""
        return {"loss_chunk_tokens": self.loss_chunk_tokens, "mlp_chunk_tokens": self.mlp_chunk_tokens,
                "attention_chunk_tokens": self.attention_chunk_tokens}

    def as_dict(self) -> dict:
        return asdict(self)


__all__ = ["GQA_PATHS", "NESTING_CANDIDATES", "PLANNED_REPLAY_KEEPS", "planned_scheme", "RECOMPUTE_MARK", "REPLAY_KEEPS", "REPLAY_MARK", "SCHEMES", "TSP_RECOMPUTE", "UNTILED", "Layout"]
