"""Open a text dataset as a `datasets` streaming IterableDataset and split it by DP rank only.

Sources: a Hugging Face Hub name, or a local file, folder or glob of jsonl/json, parquet or txt files
(format inferred from the extension; a folder's splits follow the Hub's file-naming conventions,
e.g. train-00000-of-00002.jsonl, validation.jsonl). Every TSP rank of a replica must see the same
documents, so the split is by `dp_rank` over `dp_degree`, never by global rank (STYLE.md 5.4).
`datasets` is imported lazily (about 1.5 s). Never imports torch.distributed.
"""

from __future__ import annotations

import glob
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from datasets import IterableDataset

# Extension -> datasets packaged builder. Plain files only; compressed inputs are untested.
BUILDER_BY_EXTENSION = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_GLOB_CHARS = ("*", "?", "[")


def looks_like_local_path(source: str) -> bool:
    """True when `source` cannot be a Hub id ('name' or 'org/name'), so a miss is a typo."""
    return (source.startswith(("/", "./", "../", "~")) or Path(source).suffix in BUILDER_BY_EXTENSION
            or any(c in source for c in _GLOB_CHARS) or source.count("/") > 1)


def open_text_stream(source: str | os.PathLike, *, split: str = "train", text_field: str = "text",
                     dp_rank: int = 0, dp_degree: int = 1, config_name: str | None = None,
                     load_kwargs: Mapping[str, Any] | None = None) -> "IterableDataset":
    """This DP rank's streaming view of `source`'s `split`.

    `load_kwargs` go to `datasets.load_dataset` (e.g. `sample_by="document"` for txt files, whose
    default is one document per line, or `revision=` for a Hub dataset).
    """
    check_dp_layout(dp_rank=dp_rank, dp_degree=dp_degree)
    dataset = load_streaming(str(source), split=split, config_name=config_name,
                             load_kwargs=dict(load_kwargs or {}))
    features = dataset.features
    if features is not None and text_field not in features:
        raise ValueError(f"dataset {str(source)!r} split {split!r} has no column "
                         f"text_field={text_field!r}; its columns are {sorted(features)}")
    return split_by_dp_rank(dataset, dp_rank=dp_rank, dp_degree=dp_degree, source=str(source))


def check_dp_layout(*, dp_rank: int, dp_degree: int) -> None:
    if not isinstance(dp_degree, int) or dp_degree < 1:
        raise ValueError(f"dp_degree={dp_degree!r} must be a positive integer")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank={dp_rank!r} must be an integer in [0, dp_degree={dp_degree})")


def split_by_dp_rank(dataset: "IterableDataset", *, dp_rank: int, dp_degree: int,
                     source: str = "<dataset>") -> "IterableDataset":
    """`split_dataset_by_node` over the DP group: whole shards per rank when the shard count
    divides evenly, otherwise every rank reads every example and keeps 1 in dp_degree."""
    from datasets.distributed import split_dataset_by_node

    if dp_degree == 1:
        return dataset
    if dataset.num_shards % dp_degree:
        # huggingface/datasets#6623: the example-level fallback reads the whole dataset on each rank.
        warnings.warn(
            f"dataset {source!r} has num_shards={dataset.num_shards}, not a multiple of "
            f"dp_degree={dp_degree}: every DP rank will stream all of it and keep 1 example in "
            f"{dp_degree}; split it into a multiple of {dp_degree} files to read each file once",
            stacklevel=3)
    return split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_degree)


def load_streaming(source: str, *, split: str, config_name: str | None = None,
                   load_kwargs: dict[str, Any] | None = None) -> "IterableDataset":
    """`datasets.load_dataset(..., streaming=True)` for a local path or a Hub name."""
    import datasets

    load_kwargs = dict(load_kwargs or {})
    local = resolve_local_files(source, split=split)
    if local is None:
        try:
            return datasets.load_dataset(source, name=config_name, split=split, streaming=True,
                                         **load_kwargs)
        except Exception as exc:  # offline, unknown name, gated repo: one message that names it
            raise ValueError(f"could not open {source!r} (split {split!r}) as a Hugging Face Hub "
                             f"dataset, and it is not a local file or folder: {exc}") from exc
    builder, files = local
    if builder == "text":
        # A stray non-UTF-8 byte should not stop a long run: decode it as U+FFFD instead.
        load_kwargs.setdefault("encoding_errors", "replace")
    try:
        return datasets.load_dataset(builder, data_files={split: files}, split=split,
                                     streaming=True, **load_kwargs)
    except StopIteration as exc:
        # datasets 5.2.0's json builder peeks at the first table and leaks StopIteration when the
        # files hold no rows; escaping into a caller's generator it would end that silently.
        raise ValueError(f"dataset {source!r} split {split!r} is empty: no rows in {files}") from exc


def resolve_local_files(source: str, *, split: str) -> tuple[str, list[str]] | None:
    """(builder, files) for a local file, folder or glob; None for a Hub name.

    A single file or a glob is taken as the requested split; a folder is split by file names.
    """
    path = Path(source).expanduser()
    if any(c in source for c in _GLOB_CHARS):
        files = sorted(p for p in glob.glob(str(path), recursive=True) if os.path.isfile(p))
        if not files:
            raise ValueError(f"data path pattern {source!r} matches no files")
    elif path.is_file():
        files = [str(path)]
    elif path.is_dir():
        files = _folder_split_files(path, split=split)
    elif looks_like_local_path(source):
        raise ValueError(f"data path {source!r} does not exist (resolved to {path.resolve()})")
    else:
        return None
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataset {source!r} split {split!r} is empty: all of {files} are 0 bytes")
    return _builder_for(files, source=source), files


def _folder_split_files(folder: Path, *, split: str) -> list[str]:
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        patterns = get_data_patterns(str(folder))
    except EmptyDatasetError as exc:
        raise ValueError(f"data folder {str(folder)!r} contains no data files") from exc
    files_by_split = DataFilesDict.from_patterns(patterns, base_path=str(folder))
    if split not in files_by_split:
        raise ValueError(f"data folder {str(folder)!r} has no files for split {split!r}; found "
                         f"splits {sorted(map(str, files_by_split))} (named like train-*.jsonl, "
                         "validation.jsonl)")
    return sorted(str(f) for f in files_by_split[split])


def _builder_for(files: list[str], *, source: str) -> str:
    builders = {}
    for f in files:
        ext = Path(f).suffix.lower()
        if ext not in BUILDER_BY_EXTENSION:
            raise ValueError(f"data file {f!r} (from {source!r}) has extension {ext!r}; supported: "
                             f"{sorted(BUILDER_BY_EXTENSION)}")
        builders[BUILDER_BY_EXTENSION[ext]] = f
    if len(builders) > 1:
        raise ValueError(f"data source {source!r} mixes formats {sorted(builders)}; "
                         "point it at files of one format")
    return next(iter(builders))
