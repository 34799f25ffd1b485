"""Hardware profiles for the planner: peak dense bf16 FLOP/s, HBM capacity and bandwidth, and the
two link classes a layout uses (intra-node GPU fabric, inter-node network).

Peak FLOP/s come from `observability.metrics.DEVICE_PEAK_FLOPS` (one place for those numbers; MFU
logging and the planner use the same peaks). Everything else is from the vendors' data sheets, as
noted per field. Bandwidths are bytes/s **per GPU, per direction** (unidirectional):

* `intra_node_bw`: what one GPU can send to the other GPUs of its node at once (all links).
  Collectives over a group inside a node (all-gather, reduce-scatter, all-reduce, broadcast,
  reduce) are costed at this bandwidth.
* `p2p_bw`: what one GPU can send to *one* peer (a ring hop). On NVSwitch systems (H100, H200) a
  single peer gets the full NVLink bandwidth; on MI300X's fully connected xGMI mesh a peer is one
  link away, so a ring (TSP's MLP / vocab rings) gets one link, 1/7 of the node bandwidth.
* `inter_node_bw`: one GPU's NIC (rail-optimised clusters give each GPU its own NIC).

Achievable fractions (bus-bandwidth efficiency, GEMM efficiency) are parameters of the planner, not
of the profile (`predict.Assumptions`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tsp_trainer.observability.metrics import DEVICE_PEAK_FLOPS

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: float          # dense bf16 FLOP/s per GPU (no sparsity)
    hbm_bytes: float           # HBM capacity per GPU
    hbm_bw: float              # HBM bandwidth, bytes/s
    intra_node_bw: float       # per GPU, unidirectional, to the rest of the node (all links)
    p2p_bw: float              # per GPU, unidirectional, to one peer of the node (a ring hop)
    inter_node_bw: float       # per GPU NIC, unidirectional
    gpus_per_node: int = 8
    # GPU <-> host, per GPU and per direction (activation offload, optimizer offload): PCIe Gen5
    # x16, 64 GB/s per direction on MI300X, H100 SXM and H200 SXM alike (their data sheets),
    # assuming every GPU has its own x16 path to host memory (a node whose two GPUs share one
    # switch uplink gives each half of it); achievable: Assumptions.comm_efficiency of it
    host_bw: float = 64 * GB
    # host DRAM bandwidth of the whole node (optimizer offload: DeepSpeedCPUAdam streams the fp32
    # master, the moments and the gradient through it; the node's GPUs share it)
    host_mem_bw: float = 614 * GB
    # host DRAM capacity of the whole node: what activation offload, ZeRO-Offload's optimizer
    # state and the async checkpoint's staging may pin (docs/planner.md gives each source)
    host_memory_bytes: float = 2000 * GB

    def as_dict(self) -> dict:
        return asdict(self)


def _peak(key: str) -> float:
    value = DEVICE_PEAK_FLOPS[key]
    assert value is not None
    return value


PROFILES: dict[str, HardwareProfile] = {
    # AMD Instinct MI300X (OAM, 750 W). Peak bf16 dense 1,307 TFLOP/s (data sheet: 1,307.4);
    # 192 GB HBM3 at 5.3 TB/s (AMD MI300X data sheet). Infinity Fabric (xGMI): 7 links per GPU
    # to the 7 peers of a fully connected 8-GPU node, 64 GB/s per link per direction (AMD: "896
    # GB/s aggregate peak bidirectional" = 7 x 128) -> 448 GB/s per direction in total, 64 GB/s
    # to one peer. Network: one 400 Gb/s NIC per GPU (e.g. ConnectX-7 / Pollara 400 in
    # rail-optimised clusters) -> 50 GB/s per direction. The TSP paper does not state the
    # interconnect it measured on, so these are the data sheets' figures.
    # Host: 2 x AMD EPYC 9004 (12 channels of DDR5-4800 each, 12 x 38.4 = 461 GB/s per socket)
    # -> 922 GB/s per node (AMD's MI300X platform reference design). Host memory: 1.5 TiB
    # (24 x 64 GiB DDR5: AMD's 8 x MI300X + 2 x EPYC 9374F MLPerf Inference v4.1 system; Azure's
    # ND MI300X v5 VM gives 1,850 GiB) -- an assumption: MI300X platforms differ in memory.
    "mi300x": HardwareProfile("mi300x", _peak("mi300x"), 192 * GB, 5.3e12,
                              intra_node_bw=448 * GB, p2p_bw=64 * GB, inter_node_bw=50 * GB,
                              host_mem_bw=922 * GB, host_memory_bytes=1536 * GiB),
    # NVIDIA H100 SXM5 80 GB. Peak bf16 dense 989 TFLOP/s (data sheet: 989.4); 80 GB HBM3 at
    # 3.35 TB/s (H100 data sheet). NVLink 4: 18 links, 900 GB/s bidirectional -> 450 GB/s per
    # direction, and through NVSwitch a single peer can use all of it. DGX H100: 8 x ConnectX-7
    # 400 Gb/s (one per GPU) -> 50 GB/s per direction. Host: 2 x Xeon Platinum 8480C (8 channels
    # of DDR5-4800 each, 8 x 38.4 = 307 GB/s per socket) -> 614 GB/s per node (DGX H100); 2 TB
    # of system memory (DGX H100 data sheet).
    "h100": HardwareProfile("h100", _peak("h100"), 80 * GB, 3.35e12,
                            intra_node_bw=450 * GB, p2p_bw=450 * GB, inter_node_bw=50 * GB),
    # NVIDIA H200 SXM 141 GB: the H100 compute die (same peak) with 141 GB HBM3e at 4.8 TB/s
    # (H200 data sheet); NVLink 4, network and host as H100 (DGX H200: 8 x 400 Gb/s, the same
    # two Xeon 8480C, 2 TB of system memory).
    "h200": HardwareProfile("h200", _peak("h200"), 141 * GB, 4.8e12,
                            intra_node_bw=450 * GB, p2p_bw=450 * GB, inter_node_bw=50 * GB),
}


def get_profile(name: str, *, gpus_per_node: int | None = None,
                host_memory_gb: float | None = None) -> HardwareProfile:
    """The named profile, optionally with another node size or another host memory per node
    (GB, 1e9 bytes)."""
    key = name.lower()
    if key not in PROFILES:
        raise ValueError(f"--gpu={name!r} is not a known profile; use one of {', '.join(sorted(PROFILES))}")
    profile = PROFILES[key]
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node={gpus_per_node} must be >= 1")
        profile = HardwareProfile(**{**profile.as_dict(), "gpus_per_node": gpus_per_node})
    if host_memory_gb is not None:
        if not host_memory_gb > 0:
            raise ValueError(f"--host-memory-gb={host_memory_gb} must be > 0 (GB of host memory per node)")
        profile = HardwareProfile(**{**profile.as_dict(), "host_memory_bytes": host_memory_gb * GB})
    return profile
