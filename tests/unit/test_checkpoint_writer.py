"""The checkpoint writer on one process: the streaming safetensors writer (read back by safetensors,
hashed while writing) and the CheckpointWriter's phases (snapshot, background write, publish last, at
most one save in flight, a failed write never published)."""

import errno
import hashlib
import json
import os
import threading
import time

import pytest
import torch
from safetensors import safe_open

from tsp_trainer.checkpoint.background import HostStaging
from tsp_trainer.checkpoint.disk_format import atomic_torch_save, verify_manifest
from tsp_trainer.checkpoint.store import CheckpointStore
from tsp_trainer.checkpoint.writer import CheckpointSaveError, CheckpointWriter, Snapshot
from tsp_trainer.checkpoint.reshard import ShardFile
from tsp_trainer.checkpoint.shards import save_safetensors
from tsp_trainer.parallel.comm import Comm
from tsp_trainer.parallel.ledger import CommLedger


def test_streaming_writer_is_read_by_safetensors_and_hashed_in_one_pass(tmp_path):
    tensors = {"w": torch.randn(5, 7), "b16": torch.randn(3, 4).bfloat16(), "i": torch.arange(6),
               "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 3), "t": torch.randn(4, 6).t()}       # non-contiguous
    path = tmp_path / "x.safetensors"
    entry = save_safetensors(path, tensors, {"k": "v"})
    data = path.read_bytes()
    assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"} and set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name


def _world():
    return Comm(group=None, ranks=[0], rank=0, ledger=CommLedger(), axis="world")


class _Gate:
    """Holds the writer thread until opened."""

    def __init__(self):
        self.open = threading.Event()
        self.entered = threading.Event()


def _snapshot_fn(value: float, gate: _Gate | None = None, fail: bool = False, live=None):
    """A snapshot of one live tensor (`live["w"]`, which the test's "training" changes later)."""
    live = live if live is not None else {}

    def snapshot(host_copy):
        weights = live.setdefault("w", torch.full((64, 64), value))
        kept = host_copy("w", weights, "live") if host_copy else weights
        shard = ShardFile("model/model-tsp000-of-001.safetensors", {"w": kept},
                          {"w": {"dim": None, "degree": 1, "axis": "tsp", "index": 0}})
        if gate is not None or fail:
            write = shard.write

            def slow_write(folder):
                if gate is not None:
                    gate.entered.set()
                    assert gate.open.wait(30)
                if fail:
                    raise OSError(28, "No space left on device", str(folder))
                return write(folder)
            shard.write = slow_write
        return Snapshot([shard], {"loader": {"pos": value}}, {"step": int(value)})
    return snapshot


def _read_w(folder):
    with safe_open(str(folder / "model" / "model-tsp000-of-001.safetensors"), framework="pt") as f:
        return f.get_tensor("w")


def test_async_save_publishes_only_when_the_write_is_complete(tmp_path):
    store = CheckpointStore(tmp_path, world=_world(), keep_last=5)
    ckpt = CheckpointWriter(store, world=_world(), async_save=True, device=torch.device("cpu"))
    ckpt.save(1, _snapshot_fn(1.0))
    assert ckpt.wait() == tmp_path / "step_00000001"
    gate, live = _Gate(), {}
    ckpt.save(2, _snapshot_fn(2.0, gate, live=live))         # returns while the write is held
    ckpt.before_update()                                     # the copy is done before an update
    live["w"].add_(1.0)                                      # training moves on
    assert gate.entered.wait(30) and ckpt.in_flight
    for _ in range(3):                                       # steps go on; nothing is published
        assert ckpt.poll() is None
    assert store.latest() == tmp_path / "step_00000001"
    assert (tmp_path / ".step_00000002.tmp").exists() and not (tmp_path / "step_00000002").exists()
    gate.open.set()
    deadline = time.time() + 30
    while ckpt.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    assert store.latest() == tmp_path / "step_00000002" and not ckpt.in_flight
    assert torch.equal(_read_w(tmp_path / "step_00000002"), torch.full((64, 64), 2.0))  # the snapshot
    assert verify_manifest(tmp_path / "step_00000002") is None
    manifest = json.loads((tmp_path / "step_00000002" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"meta.json", "model/model-tsp000-of-001.safetensors",
                                      "ranks/rank_00000.pt"}
    assert ckpt.take_stall_s() > 0 and ckpt.take_stall_s() == 0


def test_at_most_one_save_in_flight(tmp_path):
    store = CheckpointStore(tmp_path, world=_world(), keep_last=5)
    ckpt = CheckpointWriter(store, world=_world(), async_save=True, device=torch.device("cpu"))
    gate = _Gate()
    ckpt.save(1, _snapshot_fn(1.0, gate))
    assert gate.entered.wait(30)
    second = threading.Thread(target=ckpt.save, args=(2, _snapshot_fn(2.0)))
    second.start()
    second.join(0.5)
    assert second.is_alive()                 # the new save waits for the one in flight
    assert not (tmp_path / ".step_00000002.tmp").exists()
    gate.open.set()
    second.join(30)
    assert not second.is_alive() and store.latest() == tmp_path / "step_00000001"
    assert ckpt.wait() == tmp_path / "step_00000002"


@pytest.mark.parametrize("async_save", [True, False])
def test_failed_write_is_never_published(tmp_path, async_save):
    store = CheckpointStore(tmp_path, world=_world(), keep_last=5)
    ckpt = CheckpointWriter(store, world=_world(), async_save=async_save, device=torch.device("cpu"))
    ckpt.save(1, _snapshot_fn(1.0))
    ckpt.wait()
    with pytest.raises(CheckpointSaveError, match="step-2 checkpoint failed on rank 0: .*No space"
                                                  ".*step_00000001 is still the latest"):
        ckpt.save(2, _snapshot_fn(2.0, fail=True))
        ckpt.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert not ckpt.in_flight


def test_before_update_waits_for_the_deferred_copy(tmp_path):
    """The live tensors are copied by the writer thread; before_update() blocks until then."""
    store = CheckpointStore(tmp_path, world=_world(), keep_last=5)
    ckpt = CheckpointWriter(store, world=_world(), async_save=True, device=torch.device("cpu"))
    ckpt.staging.complete = lambda real=ckpt.staging.complete: (time.sleep(0.5), real())[1]
    live = {}
    ckpt.save(1, _snapshot_fn(1.0, live=live))
    start = time.perf_counter()
    ckpt.before_update()
    assert time.perf_counter() - start > 0.3 and ckpt.staging.copied.is_set()
    live["w"].add_(5.0)
    assert ckpt.wait() == tmp_path / "step_00000001"
    assert torch.equal(_read_w(tmp_path / "step_00000001"), torch.full((64, 64), 1.0))


def test_sync_save_writes_live_tensors_without_a_copy(tmp_path):
    store = CheckpointStore(tmp_path, world=_world(), keep_last=5)
    ckpt = CheckpointWriter(store, world=_world(), async_save=False, device=torch.device("cpu"))
    live = {}
    ckpt.save(1, _snapshot_fn(1.0, live=live))
    assert ckpt.staging is None and not ckpt.in_flight
    ckpt.before_update()                                    # nothing to wait for
    assert torch.equal(_read_w(tmp_path / "step_00000001"), torch.full((64, 64), 1.0))


def test_host_staging_copies_live_tensors_and_reuses_buffers():
    staging = HostStaging()
    live = torch.ones(3)
    first = staging("w", live, "live")                      # deferred to the writer thread
    assert not staging.copied.is_set()
    staging.complete()
    assert staging.copied.is_set()
    live.add_(1)
    assert torch.equal(first, torch.ones(3)) and first.data_ptr() != live.data_ptr()
    assert staging("w", live, "live").data_ptr() == first.data_ptr()        # reused
    fresh = torch.zeros(2)
    assert staging("m", fresh, "fresh") is fresh                              # nothing else writes it


def test_gpu_staging_path_pins_copies_async_and_syncs_once(monkeypatch):
    """CPU twin of the GPU snapshot: a tensor that says it is on CUDA is copied (even when fresh)
    into a pinned buffer with a non-blocking copy; an event recorded after the copies is what the
    writer thread waits for. torch.empty (no pinned allocator without CUDA) and the CUDA event
    are stood in for."""

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    calls = {"pinned": [], "synced": 0}
    real_empty = torch.empty

    def empty(*shape, dtype=None, pin_memory=False):
        calls["pinned"].append(pin_memory)
        return real_empty(*shape, dtype=dtype)

    class Event:
        def record(self):
            pass

        def synchronize(self):
            calls["synced"] += 1
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    staging = HostStaging()
    live = torch.arange(4.0).as_subclass(OnCuda)
    out = staging("m", live, "fresh")               # fresh, but device memory: copied to host
    assert calls["pinned"] == [True] and out.data_ptr() != live.data_ptr()
    assert torch.equal(out.as_subclass(torch.Tensor), torch.arange(4.0))
    staging.staged()                                 # an event after the last copy ...
    staging.complete()                               # ... that the writer thread waits for
    assert calls["synced"] == 1 and staging.copied.is_set()
    staging.staged()
    staging.complete()                               # nothing pending the second time
    assert calls["synced"] == 1


@pytest.mark.parametrize("pinned_staging", [True, False], ids=["pinned", "pageable"])
def test_pinned_staging_decides_whether_gpu_staging_buffers_are_page_locked(tmp_path, monkeypatch,
                                                                         pinned_staging):
    """checkpoint.pinned_staging reaches the async writer's HostStaging: a GPU tensor's buffer is
    allocated pinned only when it is on; a host tensor's never is. The buffers held between saves
    are counted (bytes_held: what tsp-plan's pinned-memory line estimates)."""
    from tsp_trainer.config import load_config

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    asked = []
    real_empty = torch.empty

    def empty(*shape, dtype=None, pin_memory=False):
        asked.append(pin_memory)
        return real_empty(*shape, dtype=dtype)

    monkeypatch.setattr(torch, "empty", empty)
    cfg = load_config(None, [f"checkpoint.pinned_staging={str(pinned_staging).lower()}"])
    store = CheckpointStore(tmp_path, world=_world(), keep_last=2)
    ckpt = CheckpointWriter(store, world=_world(), async_save=True, device=torch.device("cpu"),
                            pinned_staging=cfg.checkpoint.pinned_staging)
    ckpt.staging("w", torch.ones(8, 4).as_subclass(OnCuda), "live")
    ckpt.staging("host", torch.ones(3), "live")
    assert asked == [pinned_staging, False]
    assert ckpt.staging.bytes_held == (8 * 4 + 3) * 4


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("full_file", ["model/model-tsp000-of-001.safetensors", "ranks/rank_00000.pt.tmp"])
def test_disk_full_is_reported_by_its_errno_and_path(tmp_path, full_file):
    """A real ENOSPC: the file the save writes is a link to /dev/full, whose every write fails so.
    torch.save's zip writer alone would turn it into "unexpected pos" / "iostream error"."""
    store = CheckpointStore(tmp_path, world=_world(), keep_last=5)
    ckpt = CheckpointWriter(store, world=_world(), async_save=False, device=torch.device("cpu"))
    tmp = tmp_path / ".step_00000002.tmp"
    make = _snapshot_fn(2.0)

    def snapshot_onto_a_full_disk(host_copy):
        (tmp / full_file).parent.mkdir(parents=True, exist_ok=True)
        (tmp / full_file).symlink_to("/dev/full")
        return make(host_copy)
    with pytest.raises(CheckpointSaveError) as info:
        ckpt.save(2, snapshot_onto_a_full_disk)
    assert (f"step-2 checkpoint failed on rank 0: [Errno 28] No space left on device: "
            f"'{tmp / full_file}'") in str(info.value)
    assert info.value.seen_here and "unexpected pos" not in str(info.value)
    assert not tmp.exists() and not ckpt.in_flight


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_atomic_torch_save_raises_the_os_error(tmp_path):
    (tmp_path / "state.pt.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as info:
        atomic_torch_save({"pos": torch.arange(100)}, tmp_path / "state.pt")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "state.pt.tmp")
    assert not (tmp_path / "state.pt").exists()
