"""Reading a rank's state file (ranks/rank_XXXXX.pt) without running anything from it.

A checkpoint may come from someone else (a colleague's run, a shared file system, a download), and
whoever hands it over writes its manifest too: the sha256 check proves a file complete, not
harmless. So a rank state is only ever read with torch.load(weights_only=True), whose unpickler
builds tensors, numbers, strings and plain containers and refuses every other class or function,
and it may name only the globals our own writer emits (tensor rebuilds and storages).

    state = read_rank_state(path)      # RankStateRefused (a ValueError) naming the file and type
    check_rank_states(folder)          # every rank's file of a checkpoint, one process, before
                                       # any process group (run/rundir.py choose_resume)

The globals a refused file names are found by disassembling its pickle (pickletools: parsing,
nothing is built or called). Files of the older format (the NumPy RNG state as a numpy array)
need numpy's array globals: they are refused with the one command that converts them,
`tsp-train convert-checkpoint` (checkpoint/convert.py), for the user to run on a checkpoint they
trust.
"""

from __future__ import annotations

import functools
import io
import pickletools
import zipfile
from pathlib import Path

import torch

from tsp_trainer.checkpoint.train_state import RANK_STATE_FORMAT, pack_rank_state

# What the older format's NumPy RNG state (a numpy array) needs, under numpy 2 and numpy 1 names.
OLDER_FORMAT_GLOBALS = frozenset({"numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                                  "numpy.core.multiarray._reconstruct", "numpy.dtypes.UInt32DType",
                                  "_codecs.encode"})
CONVERT_COMMAND = "tsp-train convert-checkpoint"


class RankStateRefused(ValueError):
    """A rank state file torch.load(weights_only=True) refuses, or that names a global our writer
    never emits; `found`: those globals; `older_format`: they are the older format's numpy ones."""

    def __init__(self, message: str, *, path: Path, found: tuple[str, ...] = (), older_format: bool = False):
        super().__init__(message)
        self.path, self.found, self.older_format = path, found, older_format


def read_rank_state(path: str | Path) -> dict:
    """The saved state of one rank (train_state.pack_rank_state's form), read without running
    anything from the file; RankStateRefused naming the file (and the type found) otherwise."""
    path = Path(path)
    found = foreign_globals(path)
    if found:
        raise refusal(path, found)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError...
        raise RankStateRefused(f"checkpoint file {path} is not a readable rank state: "
                               f"torch.load(weights_only=True) refuses it ({_reason(err)})",
                               path=path) from None
    if not isinstance(saved, dict) or saved.get("format") != RANK_STATE_FORMAT:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise RankStateRefused(f"checkpoint file {path} is not a tsp_trainer rank state of format "
                               f"{RANK_STATE_FORMAT} (found {got!r})", path=path)
    return saved


def check_rank_states(folder: str | Path) -> int:
    """Read every ranks/rank_*.pt of a checkpoint (RankStateRefused on the first refused one);
    returns how many. One process, before any process group: a refusal is a bad input."""
    files = sorted(Path(folder).glob("ranks/rank_*.pt"))
    for path in files:
        read_rank_state(path)
    return len(files)


def refusal(path: Path, found: tuple[str, ...]) -> RankStateRefused:
    if set(found) <= OLDER_FORMAT_GLOBALS:
        return RankStateRefused(
            f"checkpoint file {path} is in the older rank-state format (its NumPy RNG state is a "
            f"numpy array: {', '.join(found)}), which only a conversion reads: if you trust this "
            f"checkpoint, run `{CONVERT_COMMAND} {path.parent.parent}` once, then resume",
            path=path, found=found, older_format=True)
    return RankStateRefused(
        f"checkpoint file {path} needs {', '.join(found)}, which a rank state never holds (tensors, "
        "numbers, strings and plain containers only); refused without running anything from it",
        path=path, found=found)


def foreign_globals(path: Path) -> tuple[str, ...]:
    """The classes and functions the file's pickle names (module.name) that our writer never emits,
    in order of appearance; found by disassembling it, nothing built or called."""
    return tuple(name for name in pickle_globals(_pickle_bytes(path)) if name not in writer_globals())


@functools.cache
def writer_globals() -> frozenset[str]:
    """Every global torch.save names in a rank state of ours: found by saving a sample of one."""
    sample = pack_rank_state({"ids": list(range(32)), "flag": True}, {"lr": [0.1]}, {
        "torch": torch.zeros(8, dtype=torch.uint8), "python": (3, tuple(range(625)), None),
        "numpy": {"bit_generator": "MT19937", "state": {"key": list(range(624)), "pos": 0},
                  "has_gauss": 0, "gauss": 0.0},
        "cuda": torch.zeros(8, dtype=torch.uint8)})
    buffer = io.BytesIO()
    torch.save(sample, buffer)
    return frozenset(pickle_globals(_pickle_bytes(buffer.getvalue())))


def _pickle_bytes(source: Path | bytes) -> bytes:
    """The pickle stream of a torch.save archive (its data.pkl), or the file itself if it is none."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    if zipfile.is_zipfile(io.BytesIO(data)):
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            return archive.read(records[0]) if records else b""
    return data


def pickle_globals(stream: bytes) -> list[str]:
    """module.name of every GLOBAL, INST and STACK_GLOBAL of a pickle stream, in order, each once
    (up to where the stream stops parsing: torch.load then refuses the rest itself)."""
    found: list[str] = []
    pushed: list[str | None] = []       # what each op pushed: a string, or None for anything else
    memo: dict[int, str | None] = {}
    try:
        for op, arg, _ in pickletools.genops(stream):
            if op.name in ("GLOBAL", "INST"):
                found.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                module, name = (pushed[-2:] if len(pushed) >= 2 else [None, None])
                found.append(f"{module}.{name}")
            if op.name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = pushed[-1] if pushed else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(int(arg)))
            else:
                pushed.append(arg if isinstance(arg, str) and "GLOBAL" not in op.name else None)
    except (ValueError, EOFError):      # pickletools' errors for a stream it cannot parse
        pass
    return list(dict.fromkeys(found))


def _reason(err: BaseException) -> str:
    """torch's own reason, without its advice to turn weights_only off (which would run
    whatever the file names): the first line after "WeightsUnpickler error:", else the first."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    for i, line in enumerate(lines[:-1]):
        if line.endswith("WeightsUnpickler error:"):
            return lines[i + 1]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
