"""Open a dataset as a `datasets` streaming IterableDataset and split it by DP rank only.

Sources: a Hugging Face Hub name, or a local file, folder or glob of jsonl/json, parquet, arrow,
txt or token files (`.bin`, see tokenfile.py). The format is `data.format`, or inferred from the
extension when it is "auto"; a folder's splits follow the Hub's file-naming conventions (e.g.
train-00000-of-00002.jsonl, validation.jsonl). Every TSP rank of a replica must see the same
documents, so the split is by `dp_rank` over `dp_degree`, never by global rank.

The split is by shards (whole files, parquet row groups, token-file ranges) so that each DP rank
reads about 1/dp of the bytes: `IterableDataset.reshard()` first when the shard count does not
divide the DP degree (parquet: one shard per row group), then datasets' "shards" strategy (ranks
get floor or ceil of shards/dp). Only with fewer shards than ranks does a rank have to read every
example and keep 1 in dp ("examples"): dp times the reading, so it is refused above
`max_example_split_dp` with a message that says how to fix it.
`datasets` is imported lazily (about 1.5 s). Never imports torch.distributed.
"""

from __future__ import annotations

import glob
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

if TYPE_CHECKING:
    from datasets import IterableDataset

# Extension -> data format (the values of data.format); "tokens" is tokenfile.py's memory map.
FORMAT_BY_EXTENSION = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text",
                       ".arrow": "arrow", ".bin": "tokens"}
# Data format -> datasets packaged builder.
BUILDER_BY_FORMAT = {"jsonl": "json", "parquet": "parquet", "text": "text", "arrow": "arrow"}
LOCAL_FORMATS = ("jsonl", "parquet", "text", "arrow", "tokens")
_GLOB_CHARS = ("*", "?", "[")
SplitMode = Literal["train", "eval"]


def looks_like_local_path(source: str) -> bool:
    """True when `source` cannot be a Hub id ('name' or 'org/name'), so a miss is a typo."""
    return (source.startswith(("/", "./", "../", "~")) or Path(source).suffix in FORMAT_BY_EXTENSION
            or any(c in source for c in _GLOB_CHARS) or source.count("/") > 1)


def open_text_stream(source: str | os.PathLike, *, split: str = "train", text_field: str = "text",
                     dp_rank: int = 0, dp_degree: int = 1, config_name: str | None = None,
                     load_kwargs: Mapping[str, Any] | None = None, data_format: str = "auto",
                     max_example_split_dp: int = 8, mode: SplitMode = "train") -> "IterableDataset":
    """This DP rank's streaming view of `source`'s `split` (`text_field` must be a column).

    `load_kwargs` go to `datasets.load_dataset` (e.g. `sample_by="document"` for txt files, whose
    default is one document per line, or `revision=` for a Hub dataset). `mode="eval"` never
    refuses the read-everything split: an evaluation reads only its few batches.
    """
    check_dp_layout(dp_rank=dp_rank, dp_degree=dp_degree)
    dataset = load_streaming(str(source), split=split, config_name=config_name,
                             load_kwargs=dict(load_kwargs or {}), data_format=data_format,
                             dp_degree=dp_degree)
    check_column(dataset, text_field, source=str(source), split=split, key="text_field")
    return split_by_dp_rank(dataset, dp_rank=dp_rank, dp_degree=dp_degree, source=str(source),
                            max_example_split_dp=max_example_split_dp, mode=mode)


def check_column(dataset: "IterableDataset", column: str, *, source: str, split: str,
                 key: str) -> None:
    features = dataset.features
    if features is not None and column not in features:
        raise ValueError(f"dataset {source!r} split {split!r} has no column {key}={column!r}; its "
                         f"columns are {sorted(features)}")


def check_dp_layout(*, dp_rank: int, dp_degree: int) -> None:
    if not isinstance(dp_degree, int) or dp_degree < 1:
        raise ValueError(f"dp_degree={dp_degree!r} must be a positive integer")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank={dp_rank!r} must be an integer in [0, dp_degree={dp_degree})")


def split_by_dp_rank(dataset: "IterableDataset", *, dp_rank: int, dp_degree: int,
                     source: str = "<dataset>", max_example_split_dp: int = 8,
                     mode: SplitMode = "train") -> "IterableDataset":
    """Whole shards per DP rank (after `reshard()` where the format allows); the example split,
    which makes every rank read everything, only when there are fewer shards than ranks."""
    from datasets.distributed import split_dataset_by_node

    if dp_degree == 1:
        return dataset
    dataset = reshard_for(dataset, dp_degree)
    if dataset.num_shards >= dp_degree:
        return split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_degree, strategy="shards")
    if mode == "train":
        refuse_example_split(num_shards=dataset.num_shards, dp_degree=dp_degree, source=source,
                             max_example_split_dp=max_example_split_dp)
        if _local_bytes(source) < SMALL_SOURCE_BYTES:   # reading it all on each rank costs little
            return split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_degree, strategy="examples")
        warn_once_per_job(
            f"dataset {source!r} has num_shards={dataset.num_shards}, not a multiple of "
            f"dp_degree={dp_degree}, and fewer shards than DP ranks: every DP rank will stream "
            f"all of it and keep 1 example in {dp_degree}; split it into a multiple of "
            f"{dp_degree} files to read each file once")
    return split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_degree, strategy="examples")


def warn_once_per_job(message: str) -> None:
    """A UserWarning from the job's first process only: every rank opens the same source and
    would print the same line (RANK, as torchrun, accelerate launch and tsp_trainer/cli.py set
    it for SLURM too; a process without it is a job of its own)."""
    if os.environ.get("RANK", "0") == "0":
        warnings.warn(message, stacklevel=4)     # the caller of open_text_stream


# A local source below this size is streamed whole by each DP rank without a warning (the bundled
# data and `tsp-eval retrieval-corpus` output are a few MiB).
SMALL_SOURCE_BYTES = 64 * 2**20


def _local_bytes(source: str) -> float:
    """Bytes of the local file or folder `source` (inf for a hub dataset or anything unreadable)."""
    path = Path(source)
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        pass
    return float("inf")


def reshard_for(dataset: "IterableDataset", dp_degree: int) -> "IterableDataset":
    """More shards when the current count does not divide dp (parquet: one per row group)."""
    if dataset.num_shards % dp_degree == 0:
        return dataset
    resharded = dataset.reshard()
    return resharded if resharded.num_shards > dataset.num_shards else dataset


def refuse_example_split(*, num_shards: int, dp_degree: int, source: str,
                         max_example_split_dp: int) -> None:
    """The split that reads everything on every rank is refused for training above a DP degree."""
    if dp_degree > max_example_split_dp:
        # huggingface/datasets#6623: the example split reads the whole dataset on each rank.
        raise ValueError(
            f"data source {source!r} has {num_shards} file(s)/shard(s) for dp_degree={dp_degree} "
            f"DP ranks: every rank would read all of it and keep 1 example in {dp_degree} "
            f"({dp_degree}x the reading; allowed up to data.max_example_split_dp="
            f"{max_example_split_dp}); split it into at least {dp_degree} files (a multiple of "
            f"{dp_degree} is best), write it as parquet with row groups, or run tsp-tokenize "
            f"SRC OUT --shards {dp_degree * 4}")


def load_streaming(source: str, *, split: str, config_name: str | None = None,
                   load_kwargs: dict[str, Any] | None = None, data_format: str = "auto",
                   dp_degree: int = 1) -> "IterableDataset":
    """`datasets.load_dataset(..., streaming=True)` for a local path or a Hub name; token files
    (`.bin`) through tokenfile.py, cut into ranges for `dp_degree` ranks."""
    import datasets

    load_kwargs = dict(load_kwargs or {})
    local = resolve_local_files(source, split=split, data_format=data_format)
    if local is None:
        try:
            return datasets.load_dataset(source, name=config_name, split=split, streaming=True,
                                         **load_kwargs)
        except Exception as exc:  # offline, unknown name, gated repo: one message that names it
            raise ValueError(f"could not open {source!r} (split {split!r}) as a Hugging Face Hub "
                             f"dataset, and it is not a local file or folder: {exc}") from exc
    fmt, files = local
    if fmt == "tokens":
        from tsp_trainer.data.tokenfile import open_token_files

        return open_token_files(files, num_ranges=token_ranges_for(dp_degree))
    if fmt == "text":
        # A stray non-UTF-8 byte should not stop a long run: decode it as U+FFFD instead.
        load_kwargs.setdefault("encoding_errors", "replace")
    if fmt == "jsonl":
        # The json builder logs every parse error (without its line) on every rank; the DataError
        # of read_errors.py names the file and the line instead, once.
        logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(BUILDER_BY_FORMAT[fmt], data_files={split: files}, split=split,
                                     streaming=True, **load_kwargs)
    except StopIteration as exc:
        # datasets 5.2.0's json builder peeks at the first table and leaks StopIteration when the
        # files hold no rows; escaping into a caller's generator it would end that silently.
        raise ValueError(f"dataset {source!r} split {split!r} is empty: no rows in {files}") from exc


def token_ranges_for(dp_degree: int) -> int:
    """Token files are cut into this many ranges of equal tokens: 4 per DP rank, so every rank
    gets the same number and epochs can reshuffle which ones."""
    return 4 * dp_degree


def resolve_local_files(source: str, *, split: str,
                        data_format: str = "auto") -> tuple[str, list[str]] | None:
    """(format, files) for a local file, folder or glob; None for a Hub name.

    A single file or a glob is taken as the requested split; a folder is split by file names.
    """
    path = Path(source).expanduser()
    if data_format == "hub":
        if path.exists():
            raise ValueError(f"data.format='hub' but {source!r} is a local path; use "
                             "data.format=auto (or the file format) for local data")
        return None
    if any(c in source for c in _GLOB_CHARS):
        files = sorted(p for p in glob.glob(str(path), recursive=True) if os.path.isfile(p))
        if not files:
            raise ValueError(f"data path pattern {source!r} matches no files")
    elif path.is_file():
        files = [str(path)]
    elif path.is_dir():
        files = folder_split_files(path, split=split)
    elif looks_like_local_path(source) or data_format in LOCAL_FORMATS:
        raise ValueError(f"data path {source!r} does not exist (resolved to {path.resolve()})")
    else:
        return None
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataset {source!r} split {split!r} is empty: all of {files} are 0 bytes")
    return format_of(files, source=source, data_format=data_format), files


def is_single_file_source(source: str, data_format: str = "auto") -> bool:
    """A file or a glob: it is one split, whatever split is asked for (folders have named splits)."""
    if data_format == "hub":
        return False
    path = Path(source).expanduser()
    return any(c in source for c in _GLOB_CHARS) or path.is_file()


def folder_split_files(folder: Path, *, split: str) -> list[str]:
    token_files = sorted(str(p) for p in folder.glob(f"{split}*.bin")
                         if p.name == f"{split}.bin" or p.name.startswith(f"{split}-"))
    if token_files:
        return token_files
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
    # datasets lists every file matching the split's name; keep the data files only.
    return sorted(str(f) for f in files_by_split[split]
                  if Path(str(f)).suffix.lower() in FORMAT_BY_EXTENSION)


def format_of(files: list[str], *, source: str, data_format: str = "auto") -> str:
    """The one format of `files`: from their extensions, checked against `data.format`."""
    found = {}
    for f in files:
        ext = Path(f).suffix.lower()
        if ext in FORMAT_BY_EXTENSION:
            found[FORMAT_BY_EXTENSION[ext]] = f
        elif data_format == "auto":
            raise ValueError(f"data file {f!r} (from {source!r}) has extension {ext!r}; supported: "
                             f"{sorted(FORMAT_BY_EXTENSION)}, or set data.format to read it as one "
                             f"of {list(LOCAL_FORMATS)}")
    if len(found) > 1:
        raise ValueError(f"data source {source!r} mixes formats {sorted(found)}; "
                         "point it at files of one format")
    if data_format == "auto":
        return next(iter(found))
    if found and data_format not in found:
        inferred, example = next(iter(found.items()))
        raise ValueError(f"data.format={data_format!r} but {example!r} (from {source!r}) is a "
                         f"{inferred} file by its extension; set data.format=auto or {inferred!r}")
    return data_format
