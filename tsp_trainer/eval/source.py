"""What `tsp-eval` evaluates: a tsp_trainer checkpoint (a step_* folder, or a checkpoints / run
folder through its `latest` pointer) or a Hugging Face model folder (config.json + safetensors).

`resolve_eval_model` runs before any process group: it finds the model config, the tokenizer
(--tokenizer, else the checkpoint's resolved data.tokenizer, else the folder's own) and the default
filler text, and checks the checkpoint files it will read (each rank hashes its share of them).
`load_weights` then gives every rank its slices under the evaluation layout (whatever layout wrote
the checkpoint): no rank reads or holds the full model.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tsp_trainer.checkpoint.hf import load_hf_state_dict, resolve_checkpoint
from tsp_trainer.checkpoint.disk_format import MANIFEST, META, sha256_file
from tsp_trainer.checkpoint.shards import read_local_state_dict
from tsp_trainer.config import ModelConfig, ModelSection, TrainConfig, load_config
from tsp_trainer.config.model_source import TOKENIZER_FILES, folder_tokenizer
from tsp_trainer.data import TextTokenizer, load_run_tokenizer, load_tokenizer
from tsp_trainer.data.build import eval_source
from tsp_trainer.eval.evaluator import filler_source
from tsp_trainer.parallel.schemes import Parallelized

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_CORPUS = "data/corpus"          # the filler for a Hugging Face folder (PSF docstrings)


@dataclass(frozen=True)
class Filler:
    source: str
    split: str
    text_field: str = "text"


@dataclass(frozen=True)
class EvalModel:
    kind: str                   # "checkpoint" or "hf"
    folder: Path                # the step_* folder or the Hugging Face folder
    cfg: ModelConfig
    tokenizer: TextTokenizer
    # default texts: for `loss` the run's held-out data, for `passkey` the run's haystack filler
    # (eval.passkey_filler, else the held-out data); the bundled corpus for a HF folder; None when
    # the run names none (a mixture without data.eval_source): then --text is needed
    held_out: Filler | None
    filler: Filler | None
    train_config: TrainConfig | None = None
    # the layout the checkpoint was trained under (meta.json "layout": scheme, tsp_degree,
    # dp_degree, world_size), None for a HF folder: shown beside, never as, the eval layout
    trained_layout: dict | None = None

    @property
    def name(self) -> str:
        """'tiny_passkey/step_00001500' for a checkpoint (<run>/checkpoints/step_*), the folder
        name for a HF folder: also the results' subfolder."""
        if self.kind == "hf":
            return self.folder.name
        return f"{self.folder.parent.parent.name}/{self.folder.name}"

    def describe(self) -> str:
        c = self.cfg
        return (f"{self.kind} {self.folder} ({c.family}, {c.num_layers} layers, hidden {c.hidden_size}, "
                f"vocab {c.vocab_size}); tokenizer {self.tokenizer.name}")


def bundled_corpus() -> str:
    """data/corpus of the working directory, else of the repository this package sits in."""
    here = Path(BUNDLED_CORPUS)
    return str(here if here.is_dir() else REPO_ROOT / BUNDLED_CORPUS)


def resolve_eval_model(path: str, *, tokenizer: str | None = None, rank: int = 0,
                       world_size: int = 1) -> EvalModel:
    """The model at `path`, with its tokenizer and default filler; ValueError naming what is wrong."""
    given = Path(path).expanduser()
    if not given.exists():
        raise ValueError(f"{path!r} does not exist; give a tsp_trainer checkpoint (step_* folder, "
                         "or a run / checkpoints folder with a `latest` pointer) or a Hugging Face "
                         "model folder")
    folder = resolve_checkpoint(given)
    if (folder / META).is_file():
        return _from_checkpoint(folder, tokenizer, rank, world_size)
    if (given / "config.json").is_file():
        return _from_hf_folder(given, tokenizer)
    raise ValueError(f"{path!r} is neither a tsp_trainer checkpoint (no {META}, no `latest` "
                     "pointer) nor a Hugging Face model folder (no config.json)")


def _from_hf_folder(folder: Path, tokenizer: str | None) -> EvalModel:
    section = ModelSection(init_from=str(folder))
    cfg = section.to_model_config()                       # refuses what it cannot represent
    if tokenizer is None and folder_tokenizer(str(folder)) is None:
        raise ValueError(f"Hugging Face folder {folder} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, "
                         "...); pass --tokenizer with the tokenizer this model was trained with")
    tok = load_tokenizer(tokenizer) if tokenizer else load_run_tokenizer(None, section)
    bundled = Filler(bundled_corpus(), "validation")
    return EvalModel("hf", folder, cfg, tok, bundled, bundled)


def _from_checkpoint(folder: Path, tokenizer: str | None, rank: int, world_size: int) -> EvalModel:
    verify_model_files(folder, rank=rank, world_size=world_size)
    meta = json.loads((folder / META).read_text())
    try:
        cfg = ModelConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {folder}: {META} has no usable model config ({err})") from err
    train_cfg = _resolved_config(meta, folder)
    tok = load_tokenizer(tokenizer) if tokenizer else load_run_tokenizer(train_cfg.data.tokenizer,
                                                                         train_cfg.model)
    return EvalModel("checkpoint", folder, cfg, tok, *_run_texts(train_cfg), train_cfg,
                     meta.get("layout"))


def _run_texts(cfg: TrainConfig) -> tuple[Filler | None, Filler | None]:
    """(held-out text, passkey filler) of the run, as the Trainer evaluated them."""
    d = cfg.data
    located = eval_source(d)
    held_out = Filler(*located, d.text_field) if located else None
    try:
        filler = Filler(*filler_source(cfg), d.text_field)
    except ValueError:
        filler = None
    return held_out, filler


def _resolved_config(meta: dict, folder: Path) -> TrainConfig:
    """The run's resolved config, saved in meta.json (its data.tokenizer, data.source)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(meta.get("config_yaml", ""))
        try:
            return load_config(path)
        except ValueError as err:
            raise ValueError(f"checkpoint {folder}: its resolved config does not load ({err}); "
                             "pass --tokenizer and --text explicitly") from None


def verify_model_files(folder: Path, *, rank: int = 0, world_size: int = 1) -> None:
    """The files evaluation reads (meta.json, model/) against the checkpoint's manifest: every rank
    checks that they exist with their sizes, and hashes its share (file i on rank i mod world), so
    a corrupted file is found without every rank reading every byte. The optimizer state is not
    read, so not checked."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"checkpoint {folder} has no {MANIFEST}: it is incomplete or not a checkpoint")
    files = {rel: e for rel, e in json.loads(manifest_path.read_text())["files"].items()
             if rel == META or rel.startswith("model/")}
    if not any(rel.startswith("model/") for rel in files):
        raise ValueError(f"checkpoint {folder} lists no model/ shards in its {MANIFEST}")
    for i, (rel, entry) in enumerate(sorted(files.items())):
        f = folder / rel
        if not f.is_file() or f.stat().st_size != entry["bytes"]:
            raise ValueError(f"checkpoint file {f} is missing or has the wrong size ({MANIFEST} "
                             f"says {entry['bytes']} bytes)")
        if i % world_size == rank and sha256_file(f) != entry["sha256"]:
            raise ValueError(f"checkpoint file {f} fails its sha256 check (corrupted)")


def load_weights(par: Parallelized, model: EvalModel) -> None:
    """This rank's slices of the weights, under the layout `par` was built with."""
    if model.kind == "hf":
        par.load_full_state_dict(load_hf_state_dict(model.folder, model.cfg))
        return
    params = dict(par.model.named_parameters())
    ranks = {axis: comm.rank for axis, comm in par.axis_comms.items()}
    local = read_local_state_dict(model.folder / "model", par.specs, ranks, list(params))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(local[name])
