"""`tsp-eval`: long-context evaluation of a checkpoint or a Hugging Face folder, under a layout.

    tsp-eval passkey MODEL --lengths 1024,4096 --depths 0,0.5,1      passkey accuracy + heatmap PNG
    tsp-eval loss MODEL --seq-len 4096 --batches 8                   eval loss by position + PNG
    tsp-eval retrieval-corpus OUT                                    a synthetic corpus to train on

MODEL is a tsp_trainer checkpoint (step_* folder, or a run / checkpoints folder: its `latest`) or a
Hugging Face model folder. One process, or any launcher (torchrun, accelerate launch, srun): the
model-parallel group is --tsp-degree ranks (default: all of them) under --scheme, the rest is data
parallel (haystacks and batches are split over it).

`prepare` checks everything (model, tokenizer, lengths against the layout, the text source, an
earlier result in the way) before any process group exists; `run` needs the group that
tsp_trainer/cli.py starts, evaluates (a progress bar on rank 0), and on rank 0 prints the table
and writes JSON + PNG into --out/<model name>/ (e.g. eval_results/tiny_passkey/step_00001500/).
A checkpoint trained with data.document_masking is evaluated with it (eval/documents.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tsp_trainer.config import EvalSection, ParallelSection, resolve_dp_degree
from tsp_trainer.config.schema import DType, Scheme, resolved_dtype
from tsp_trainer.config.validate import check_eval_length
from tsp_trainer.data import check_tokenizer_fits, iterate_eval_batches
from tsp_trainer.eval.documents import DocumentMasking
from tsp_trainer.eval.evaluator import FILLER_MARGIN, position_loss, read_filler
from tsp_trainer.eval.haystack import HaystackBuilder
from tsp_trainer.eval.passkey import PasskeyResult, PasskeyTask, replica_haystacks, run_passkey
from tsp_trainer.eval.position_loss import PositionLoss
from tsp_trainer.eval.source import EvalModel, Filler, bundled_corpus, load_weights, resolve_eval_model
from tsp_trainer.eval.synthetic import write_retrieval_corpus
from tsp_trainer.model import Transformer
from tsp_trainer.parallel.mesh import build_mesh
from tsp_trainer.parallel.schemes import parallelize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The files each command writes into its model's folder (an earlier one is refused unless --overwrite).
RESULTS = {"passkey": ("passkey.json", "passkey.png"),
           "loss": ("loss_by_position.json", "loss_by_position.png")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tsp-eval", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    passkey = sub.add_parser("passkey", help="passkey retrieval accuracy per (length, depth)")
    _common(passkey)
    passkey.add_argument("--lengths", required=True, type=_ints,
                         help="haystack lengths in tokens, comma-separated (each must split under the layout)")
    passkey.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                         help="needle depths in [0, 1], comma-separated (default 0,0.25,0.5,0.75,1)")
    passkey.add_argument("--samples", type=int, default=None,
                         help="haystacks per cell (default: the run's eval.passkey_samples, else 4)")
    passkey.add_argument("--digits", type=int, default=None,
                         help="digits of the key (default: the run's eval.passkey_digits, else 5)")
    passkey.add_argument("--seed", type=int, default=None,
                         help="keys and filler offsets (default: the run's eval.passkey_seed, else 0)")
    loss = sub.add_parser("loss", help="eval loss by position bucket on held-out text")
    _common(loss)
    loss.add_argument("--seq-len", type=int, default=None,
                      help="tokens per sequence (default: the checkpoint's data.seq_len)")
    loss.add_argument("--batches", type=int, default=None,
                      help="micro-batches per DP rank (default: a checkpoint's train.eval_batches; else 4)")
    corpus = sub.add_parser("retrieval-corpus", help="write a synthetic passkey-retrieval corpus "
                                                     "(jsonl train/validation) to train a model on")
    corpus.add_argument("out", help="output folder (train.jsonl, validation.jsonl)")
    corpus.add_argument("--tokenizer", default="data/tokenizer", help="tokenizer (default data/tokenizer)")
    corpus.add_argument("--text", default=None, help="filler text source (default: the bundled corpus)")
    corpus.add_argument("--docs", type=int, default=4000, help="training documents (default 4000)")
    corpus.add_argument("--min-tokens", type=int, default=128, help="shortest document (default 128)")
    corpus.add_argument("--max-tokens", type=int, default=256, help="longest document (default 256)")
    corpus.add_argument("--digits", type=int, default=5, help="digits of the keys (default 5)")
    corpus.add_argument("--seed", type=int, default=1, help="(default 1; evaluation uses seed 0)")
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="CHECKPOINT_OR_HF_FOLDER",
                   help="a step_* folder, a run or checkpoints folder (its latest), or a Hugging Face folder")
    # ulysses' attention is DeepSpeed's, which only the engine builds (tsp-train evaluates it)
    p.add_argument("--scheme", default="tsp", choices=[s for s in typing.get_args(Scheme) if s != "ulysses"])
    p.add_argument("--tsp-degree", type=int, default=None,
                   help="model-parallel group size D (default: every launched process)")
    p.add_argument("--tp-degree", type=int, default=None, help="tp_x_sp only: T (T x S = D)")
    p.add_argument("--sp-degree", type=int, default=None, help="tp_x_sp only: S")
    p.add_argument("--head-buckets", type=int, default=1, help="TSP K/V all-gathers per shard")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per forward (default: loss on a checkpoint, its run's "
                        "data.micro_batch_size; else 1)")
    p.add_argument("--dtype", choices=typing.get_args(DType), default="auto",
                   help="auto = bf16 on GPUs, fp32 on CPU")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer (default: the checkpoint's data.tokenizer or the folder's own)")
    p.add_argument("--text", default=None, help="text source for haystack filler / the loss "
                   "(default: the checkpoint's data.source, or the bundled corpus for a HF folder)")
    p.add_argument("--split", default=None, help="its split (default: the run's eval split / validation)")
    p.add_argument("--text-field", default=None, help="its text column (default text)")
    p.add_argument("--out", default="eval_results",
                   help="results go into OUT/<model name>/ (default eval_results), e.g. "
                        "eval_results/tiny_passkey/step_00001500/passkey.png")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier result of this command for this model")


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


@dataclass
class EvalJob:
    """Everything `run` needs, checked: built without a process group."""

    command: str
    model: EvalModel
    parallel: ParallelSection
    lengths: list[int]                # passkey lengths, or [seq_len] for the loss
    text: Filler
    micro_batch_size: int
    dtype: str
    out: Path                         # this model's results folder: --out/<model name>
    task: PasskeyTask | None = None
    batches: int = 0
    masking: DocumentMasking | None = None    # the run's data.document_masking (None: off / HF)
    warnings: list[str] = field(default_factory=list)     # printed once, by rank 0


def prepare(args: argparse.Namespace, *, world_size: int, rank: int, cuda: bool = False) -> EvalJob:
    """Resolve and check the job (ValueError naming the flag and the rule)."""
    model = resolve_eval_model(args.model, tokenizer=args.tokenizer, rank=rank, world_size=world_size)
    check_tokenizer_fits(model.tokenizer, model.cfg.vocab_size)
    degree = args.tsp_degree or world_size
    parallel = ParallelSection(scheme=args.scheme, tsp_degree=degree, head_buckets=args.head_buckets,
                               tp_degree=args.tp_degree, sp_degree=args.sp_degree)
    dp = resolve_dp_degree(parallel, world_size)
    _loss_defaults_of_the_run(args, model.train_config)
    _positive(args.micro_batch_size, "--micro-batch-size")
    text = _text(args, model.filler if args.command == "passkey" else model.held_out)
    dtype = resolved_dtype(args.dtype, cuda)
    out = Path(args.out) / model.name
    _refuse_earlier_result(out, args.command, overwrite=args.overwrite)
    job = EvalJob(args.command, model, parallel, [], text, args.micro_batch_size, dtype, out)
    if model.train_config is not None:
        job.masking = DocumentMasking.of(model.train_config.data, model.tokenizer.eos_id)
    if args.command == "passkey":
        _prepare_passkey(job, args)
    else:
        _prepare_loss(job, args)
        job.warnings += _other_dp_than_the_run(job, args, dp)
    key = "--lengths" if args.command == "passkey" else "--seq-len"
    for length in job.lengths:
        check_eval_length(model.cfg, parallel, length, key=key)
    job.warnings += _beyond_max_seq_len(model.cfg.max_seq_len, max(job.lengths), key=key)
    return job


def _refuse_earlier_result(out: Path, command: str, *, overwrite: bool) -> None:
    there = [out / name for name in RESULTS[command] if (out / name).exists()]
    if there and not overwrite:
        raise ValueError(f"{there[0]} exists (an earlier tsp-eval {command} of this model); pass "
                         "--overwrite to replace it, or another --out")


def _beyond_max_seq_len(max_seq_len: int, length: int, *, key: str) -> list[str]:
    """A warning when the evaluation is longer than the model's max_seq_len. Not refused: RoPE
    has no table that ends there (model/rope.py builds cos/sin for whatever positions a batch
    holds, with or without rope_scaling), so longer sequences run; they measure extrapolation."""
    if length <= max_seq_len:
        return []
    return [f"{key} {length} is longer than the model's max_seq_len {max_seq_len}: positions from "
            f"{max_seq_len} on run (RoPE is computed for any position) but the model was set up "
            "for fewer; this measures extrapolation"]


def _text(args, default: Filler | None) -> Filler:
    """--text / --split / --text-field, else the model's default text for the command."""
    if args.text:
        return Filler(args.text, args.split or "validation", args.text_field or "text")
    if default is None:
        raise ValueError("--text is needed: the checkpoint's run names no held-out text (a data.sources "
                         "mixture without data.eval_source); e.g. --text data/corpus")
    return Filler(default.source, args.split or default.split, args.text_field or default.text_field)


def _prepare_passkey(job: EvalJob, args) -> None:
    run = job.model.train_config.eval if job.model.train_config is not None else EvalSection()
    for flag in ("samples", "digits", "seed"):      # as the run's periodic passkey, unless given
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(run, f"passkey_{flag}"))
    for flag in ("samples", "digits"):
        _positive(getattr(args, flag), f"--{flag}")
    if not args.lengths:
        raise ValueError("--lengths is empty; give haystack lengths in tokens, e.g. --lengths 1024,4096")
    bad = [d for d in args.depths if not 0 <= d <= 1]
    if bad or not args.depths:
        raise ValueError(f"--depths {bad[0] if bad else '(empty)'}: each depth must be in [0, 1] "
                         "(0 = needle at the start of the haystack, 1 = at its end)")
    job.lengths = sorted(set(args.lengths))
    filler = read_filler(job.text.source, split=job.text.split, text_field=job.text.text_field,
                         tokenizer=job.model.tokenizer, min_tokens=max(job.lengths) + FILLER_MARGIN)
    builder = HaystackBuilder(job.model.tokenizer, filler, digits=args.digits, seed=args.seed,
                              bos_id=job.model.cfg.bos_token_id)
    job.task = PasskeyTask(tuple(job.lengths), tuple(sorted(set(args.depths))), args.samples, builder)


def _prepare_loss(job: EvalJob, args) -> None:
    seq_len = args.seq_len
    if seq_len is None and job.model.train_config is not None:
        seq_len = job.model.train_config.data.seq_len
    if seq_len is None:
        raise ValueError("--seq-len is needed for a Hugging Face folder (a checkpoint defaults to "
                         "its data.seq_len)")
    _positive(seq_len, "--seq-len")
    _positive(args.batches, "--batches")
    job.lengths, job.batches = [seq_len], args.batches


def _loss_defaults_of_the_run(args, run) -> None:
    """`loss` on a checkpoint evaluates the batches its run evaluated, unless told otherwise: the
    run's data.micro_batch_size and train.eval_batches (with its seq_len and held-out text)."""
    is_loss = args.command == "loss"
    if args.micro_batch_size is None:
        args.micro_batch_size = run.data.micro_batch_size if is_loss and run is not None else 1
    if is_loss and args.batches is None:
        args.batches = run.train.eval_batches if run is not None and run.train.eval_batches else 4


def _other_dp_than_the_run(job: EvalJob, args, dp: int) -> list[str]:
    """Each DP rank packs its own share of the documents, so the trainer's eval loss is reproduced
    only on as many DP ranks as the run had: said when everything else is the run's evaluation."""
    trained, run = job.model.trained_layout, job.model.train_config
    if not trained or run is None or trained["dp_degree"] == dp or args.text is not None:
        return []
    if (job.lengths[0], job.batches, job.micro_batch_size) != (
            run.data.seq_len, run.train.eval_batches, run.data.micro_batch_size):
        return []
    return [f"this evaluation runs on dp {dp} and the checkpoint's run evaluated on dp "
            f"{trained['dp_degree']}: each DP rank packs its own share of the documents, so the loss "
            f"differs from the run's eval loss; to reproduce it run {trained['dp_degree']} x "
            "--tsp-degree processes"]


def _positive(value: int, flag: str) -> None:
    if value < 1:
        raise ValueError(f"{flag}={value} must be >= 1")


# -- running (inside the process group) ---------------------------------------------------------------
def run(job: EvalJob, *, rank: int, device: torch.device | str = "cpu") -> PasskeyResult | PositionLoss:
    """Build the sharded model on this rank, load its slices, evaluate; rank 0 reports."""
    if rank == 0:
        for line in job.warnings:
            print(f"tsp-eval: warning: {line}", file=sys.stderr, flush=True)
    p = job.parallel
    mesh = build_mesh(p.tsp_degree, device=device)     # the Comm guards check this device
    with torch.device("meta"):                       # no rank ever holds the full model
        model = Transformer(job.model.cfg)
    par = parallelize(model, p.scheme, mesh, seq_len=max(job.lengths), head_buckets=p.head_buckets,
                      init_seed=0, tp_degree=p.tp_degree, sp_degree=p.sp_degree,
                      loss_chunk_tokens=p.loss_chunk_tokens, mlp_chunk_tokens=p.mlp_chunk_tokens)
    load_weights(par, job.model)
    par.model.to(device=device, dtype=DTYPES[job.dtype])
    if job.command == "passkey":
        total = replica_haystacks(job.task, dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp)
        with _progress(total, "passkey", "haystack", rank=rank) as bar:
            result = run_passkey(par, job.task, dp=mesh.dp, micro_batch_size=job.micro_batch_size,
                                 device=device, masking=job.masking, progress=bar)
    else:
        with _progress(job.batches, "loss", "batch", rank=rank) as bar:
            result = _loss(par, mesh, job, device, bar)
    if rank == 0:
        _report(job, result, mesh.dims)
    return result


def _progress(total: int, what: str, unit: str, *, rank: int):
    """A tqdm bar on stderr for rank 0's share of the work (the others' bars would interleave).
    It stays at its final state when done (leave=True): a cleared bar may never have shown its last
    update (tqdm redraws at most every mininterval), and a log file would then end at 0%."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"tsp-eval {what}", unit=unit, disable=rank != 0, leave=True,
                dynamic_ncols=True)


def _loss(par, mesh, job: EvalJob, device, progress=None) -> PositionLoss:
    batches = iterate_eval_batches(job.text.source, tokenizer=job.model.tokenizer, seq_len=job.lengths[0],
                                   micro_batch_size=job.micro_batch_size, num_batches=job.batches,
                                   split=job.text.split, text_field=job.text.text_field,
                                   dp_rank=mesh.dp_rank, dp_degree=mesh.dims.dp)
    return position_loss(par, batches, seq_len=job.lengths[0], comms=par.token_comms + [mesh.dp],
                         device=device, masking=job.masking, progress=progress)


def _report(job: EvalJob, result, dims) -> None:
    from tsp_trainer.eval.plot import loss_by_position_plot, passkey_heatmap

    p = job.parallel
    layout = {"scheme": p.scheme, "tsp_degree": p.tsp_degree, "dp_degree": dims.dp,
              "world_size": dims.world_size, "tp_degree": p.tp_degree, "sp_degree": p.sp_degree,
              "dtype": job.dtype}
    evaluated = (f"{p.scheme} D={p.tsp_degree} x dp {dims.dp} on {dims.world_size} process(es), "
                 f"{job.dtype}" + (f", {job.masking.describe()}" if job.masking else ""))
    trained = _trained(job.model)
    title = [job.model.name + (f", {trained}" if trained else ""), f"evaluated under {evaluated}"]
    head = {"model": str(job.model.folder), "kind": job.model.kind, "layout": layout,
            "trained_layout": job.model.trained_layout, "text": asdict(job.text),
            "document_masking": asdict(job.masking) if job.masking else None}
    print(f"tsp-eval {job.command}: {job.model.describe()}")
    if trained:
        print(trained)
    print(f"evaluated under {evaluated}; text {job.text.source} [{job.text.split}]")
    job.out.mkdir(parents=True, exist_ok=True)
    if job.command == "passkey":
        t = job.task
        record = {**head, "samples": t.samples, "digits": t.builder.digits, "seed": t.builder.seed,
                  "accuracy": result.accuracy,
                  "cells": [dict(zip(("length", "depth", "accuracy", "token_accuracy", "key_nll",
                                      "samples"), row)) for row in result.rows()]}
        print(f"{'length':>8} {'depth':>6} {'accuracy':>9} {'token acc':>10} {'key nll':>8}")
        for n, d, acc, tok_acc, nll, _ in result.rows():
            print(f"{n:>8} {100 * d:>5.0f}% {acc:>9.2f} {tok_acc:>10.2f} {nll:>8.3f}")
        print(f"mean accuracy {result.accuracy:.3f} ({t.samples} haystacks per cell, "
              f"{t.builder.digits}-digit keys)")
        files = [_write_json(job.out / "passkey.json", record),
                 passkey_heatmap(result, job.out / "passkey.png", title=title)]
    else:
        record = {**head, "seq_len": job.lengths[0], "batches_per_dp_rank": job.batches,
                  "loss": result.mean_loss,
                  "buckets": [dict(zip(("position_start", "position_end", "loss", "tokens"), row))
                              for row in result.rows()]}
        print(f"{'positions':>14} {'loss':>8} {'tokens':>9}")
        for a, b, loss, n in result.rows():
            print(f"{f'{a}-{b}' if a != b else str(a):>14} {loss if loss is not None else float('nan'):>8.4f} {n:>9}")
        print(f"mean loss {result.mean_loss:.4f} over {int(sum(result.tokens))} tokens")
        files = [_write_json(job.out / "loss_by_position.json", record),
                 loss_by_position_plot(result, job.out / "loss_by_position.png", title=title)]
    print("wrote " + ", ".join(str(f) for f in files))


def _trained(model) -> str | None:
    """'trained at seq_len 128 under tsp D=2 x dp 2' for a checkpoint (its meta.json layout);
    None for a HF folder (its training is unknown)."""
    if model.train_config is None:
        return None
    line = f"trained at seq_len {model.train_config.data.seq_len}"
    t = model.trained_layout
    if t:
        line += f" under {t['scheme']} D={t['tsp_degree']} x dp {t['dp_degree']}"
    return line


def _write_json(path: Path, record: dict) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(record), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def _finite(value):
    """Strict JSON: NaN / inf (an empty bucket) as null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


# Config keys in messages shared with the trainer -> this CLI's flags.
FLAGS = {"parallel.tsp_degree": "--tsp-degree", "parallel.tp_degree": "--tp-degree",
         "parallel.sp_degree": "--sp-degree", "parallel.head_buckets": "--head-buckets",
         "parallel.scheme": "--scheme", "parallel.dp_degree": "dp degree"}


def as_flags(message: str) -> str:
    for key, flag in FLAGS.items():
        message = message.replace(key, flag)
    return message


def corpus_main(args: argparse.Namespace) -> Path:
    """`tsp-eval retrieval-corpus` (one process, no group)."""
    from tsp_trainer.data import load_tokenizer

    return write_retrieval_corpus(args.out, tokenizer=load_tokenizer(args.tokenizer),
                                  text=args.text or bundled_corpus(), docs=args.docs,
                                  min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                  digits=args.digits, seed=args.seed)
