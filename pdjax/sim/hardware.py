"""Hardware specs for the cost model: peak rates, memory, and links, from vendor datasheets.

Choices:
- Every rate is the *datasheet peak* (dense, no sparsity). What real kernels reach is the cost model's business
  (`CostParams` efficiency factors, fitted per machine), so a spec never mixes a measurement into a peak.
- Link bandwidths are per device and per direction (bytes/s one device can push into a collective), because that
  is what an alpha-beta ring model needs. Datasheets quote NVLink and ICI bidirectional totals; the comment next
  to each figure shows the division.
- `intra_node_topology` says how devices of one node/slice are wired: "switch" (NVSwitch: any group at full
  link rate), "pairwise" (NVLink bridges join pairs; a larger group is bounded by the PCIe hop), "pcie" (no
  NVLink), "torus" (TPU ICI).
- `host_cpu()` measures the machine it runs on (numpy fp32 matmul rate, memory copy bandwidth), so the CPU
  engine can be simulated with honest ceilings.

No JAX here (the simulator must not import it).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import numpy as np

GB = 1e9
GiB = 2**30
TERA = 1e12

TOPOLOGIES = ("switch", "pairwise", "pcie", "torus", "none")


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One accelerator type (per-device figures) and how devices are connected.

    Units: FLOP/s, bytes/s, bytes, seconds. Link bandwidths are per device per direction.
    compute_units: parallel matmul engines a GEMM must fill (GPU SMs; TPU MXUs in 128x128 equivalents; CPU
      cores); the cost model's GEMM occupancy term scales with it.
    pairwise_bandwidth: the bridge bandwidth within a pair when intra_node_topology == "pairwise" (the
      intra_node_bandwidth is then the slower link a group of more than two devices must cross).
    """
    name: str
    kind: str  # "gpu" | "tpu" | "cpu"
    peak_flops_bf16: float
    peak_flops_fp16: float
    peak_flops_fp32: float
    hbm_bandwidth: float
    hbm_capacity: float
    devices_per_node: int
    intra_node_topology: str
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    pairwise_bandwidth: Optional[float] = None
    compute_units: int = 108
    # Dense TF32 tensor-core peak (Ampere and later NVIDIA GPUs); 0: none. JAX computes float32 matmuls in TF32 on
    # these GPUs at its default precision ("TF32 on recent GPUs", JAX docs, Matmul precision), so a float32 model's
    # GEMMs run at this rate, not at the non-tensor FP32 peak (`peak_flops`).
    peak_flops_tf32: float = 0.0

    def __post_init__(self):
        for field in ("peak_flops_bf16", "peak_flops_fp16", "peak_flops_fp32", "hbm_bandwidth", "hbm_capacity",
                      "intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"HardwareSpec {self.name!r}: {field}={value!r}, expected a positive number")
        if not self.peak_flops_tf32 >= 0:
            raise ValueError(f"HardwareSpec {self.name!r}: peak_flops_tf32={self.peak_flops_tf32!r}, expected >= 0 "
                             "(0: no TF32 tensor cores)")
        if self.intra_node_topology not in TOPOLOGIES:
            raise ValueError(f"HardwareSpec {self.name!r}: intra_node_topology={self.intra_node_topology!r}, "
                             f"expected one of {TOPOLOGIES}")
        if self.intra_node_topology == "pairwise" and not self.pairwise_bandwidth:
            raise ValueError(f"HardwareSpec {self.name!r}: pairwise topology needs pairwise_bandwidth")
        if not isinstance(self.compute_units, int) or self.compute_units < 1:
            raise ValueError(f"HardwareSpec {self.name!r}: compute_units={self.compute_units!r}, "
                             "expected a positive int")
        if self.devices_per_node < 1:
            raise ValueError(f"HardwareSpec {self.name!r}: devices_per_node={self.devices_per_node}, expected >= 1")

    def peak_flops(self, dtype: str) -> float:
        """Dense peak matmul FLOP/s for a dtype name ('bfloat16', 'float16', 'float32'; 8-bit types use fp16's
        rate): float32 at the TF32 tensor-core rate where the GPU has one (JAX's default precision), else FP32."""
        if dtype == "bfloat16":
            return self.peak_flops_bf16
        if dtype in ("float16", "int8", "float8"):
            return self.peak_flops_fp16
        if dtype == "float32":
            return self.peak_flops_tf32 or self.peak_flops_fp32
        raise ValueError(f"peak_flops: dtype={dtype!r}, expected 'bfloat16', 'float16' or 'float32'")

    def group_link(self, group_size: int) -> tuple[float, float]:
        """(bandwidth per device per direction, per-hop latency) of the slowest link in a ring of `group_size`
        consecutive devices: pairs on a pairwise box use the bridge, larger groups cross PCIe, groups larger
        than a node cross the inter-node network."""
        if group_size < 1:
            raise ValueError(f"group_link: group_size={group_size}, expected >= 1")
        if group_size > self.devices_per_node:
            return self.inter_node_bandwidth, self.inter_node_latency
        if self.intra_node_topology == "pairwise" and group_size <= 2:
            return self.pairwise_bandwidth, self.intra_node_latency
        return self.intra_node_bandwidth, self.intra_node_latency

    def link_kind(self, group_size: int) -> str:
        """The kind of the slowest link a ring of `group_size` consecutive devices crosses (what `group_link`
        returns the figures of): 'network' (beyond one node), 'pair' (an NVLink bridge pair of a pairwise box),
        'switch' (NVSwitch), 'pcie' (PCIe, incl. the hop between pairs of a pairwise box), 'torus' (TPU ICI),
        'memory' (host CPU). The cost model keeps fitted all-reduce terms per kind."""
        if group_size < 1:
            raise ValueError(f"link_kind: group_size={group_size}, expected >= 1")
        if group_size > self.devices_per_node:
            return "network"
        topology = self.intra_node_topology
        if topology == "pairwise":
            return "pair" if group_size <= 2 else "pcie"
        return {"switch": "switch", "pcie": "pcie", "torus": "torus", "none": "memory"}[topology]

    def replace(self, **changes) -> "HardwareSpec":
        return dataclasses.replace(self, **changes)


# Shared link figures.
_PCIE4_X16 = 32 * GB       # PCIe Gen4 x16: 64 GB/s bidirectional (A100 PCIe datasheet) -> 32 GB/s per direction
_PCIE5_X16 = 64 * GB       # PCIe Gen5 x16: 128 GB/s bidirectional -> 64 GB/s per direction
_HDR_IB = 25 * GB          # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU -> 25 GB/s per direction
_NDR_IB = 50 * GB          # DGX H100/H200: one 400 Gb/s NDR NIC per GPU -> 50 GB/s per direction
_NVLINK_LATENCY = 2e-6     # per hop incl. NCCL protocol (order of magnitude from NCCL small-message tests)
_PCIE_LATENCY = 5e-6
_IB_LATENCY = 5e-6
_ICI_LATENCY = 2e-6        # not in the datasheet; order of magnitude of published ICI hop latencies
_DCN_LATENCY = 20e-6


def _a100(name, hbm_bw, hbm_gib, form):
    # A100 datasheet: BF16/FP16 Tensor Core 312 TFLOPS dense (624 with sparsity); TF32 Tensor Core 156 TFLOPS dense
    # (312 with sparsity); FP32 19.5 TFLOPS (non-tensor). 108 SMs.
    common = dict(kind="gpu", compute_units=108, peak_flops_bf16=312 * TERA, peak_flops_fp16=312 * TERA,
                  peak_flops_fp32=19.5 * TERA, peak_flops_tf32=156 * TERA, hbm_bandwidth=hbm_bw,
                  hbm_capacity=hbm_gib * GiB)
    if form == "sxm":
        # SXM: third-gen NVLink 600 GB/s bidirectional through NVSwitch (HGX/DGX A100, 8 GPUs) -> 300 GB/s/dir.
        return HardwareSpec(name=name, devices_per_node=8, intra_node_topology="switch",
                            intra_node_bandwidth=300 * GB, intra_node_latency=_NVLINK_LATENCY,
                            inter_node_bandwidth=_HDR_IB, inter_node_latency=_IB_LATENCY, **common)
    if form == "pcie-nvlink":
        # PCIe card with NVLink bridges: "NVLink Bridge for 2 GPUs: 600 GB/s" (bidirectional) -> 300 GB/s/dir;
        # pairs bridged, the other pairs reached over PCIe Gen4 (e.g. Azure NC A100 v4: 4 GPUs, pairwise NVLink).
        return HardwareSpec(name=name, devices_per_node=4, intra_node_topology="pairwise",
                            pairwise_bandwidth=300 * GB, intra_node_bandwidth=_PCIE4_X16,
                            intra_node_latency=_PCIE_LATENCY, inter_node_bandwidth=_HDR_IB,
                            inter_node_latency=_IB_LATENCY, **common)
    # Plain PCIe: no NVLink.
    return HardwareSpec(name=name, devices_per_node=8, intra_node_topology="pcie", intra_node_bandwidth=_PCIE4_X16,
                        intra_node_latency=_PCIE_LATENCY, inter_node_bandwidth=_HDR_IB,
                        inter_node_latency=_IB_LATENCY, **common)


def _hopper(name, hbm_bw, hbm_gb):
    # H100 SXM5 / H200 SXM datasheets: BF16/FP16 Tensor Core 1,979 TFLOPS *with sparsity* -> 989.5 dense;
    # TF32 Tensor Core 989 TFLOPS with sparsity -> 494.5 dense; FP32 67 TFLOPS. NVLink 900 GB/s bidirectional
    # through NVSwitch -> 450 GB/s per direction. 132 SMs.
    return HardwareSpec(name=name, kind="gpu", compute_units=132, peak_flops_bf16=989.5 * TERA,
                        peak_flops_fp16=989.5 * TERA, peak_flops_fp32=67 * TERA, peak_flops_tf32=494.5 * TERA,
                        hbm_bandwidth=hbm_bw,
                        hbm_capacity=hbm_gb,
                        devices_per_node=8, intra_node_topology="switch", intra_node_bandwidth=450 * GB,
                        intra_node_latency=_NVLINK_LATENCY, inter_node_bandwidth=_NDR_IB,
                        inter_node_latency=_IB_LATENCY)


def _tpu(name, bf16_tflops, hbm_bw, hbm_bytes, ici_bidir_per_chip, ici_ports, chips_per_host, mxu_128_units):
    # TPUs have no fp16 matmul path (XLA computes it like bf16) and no fp32 datasheet figure: fp32 matmuls run as
    # 3 bf16 passes at precision=HIGH, so we take bf16/3 (an estimate, not a datasheet figure).
    # ICI: a ring collective uses two ports, both directions: per-port per-direction rate x 2.
    per_port_per_dir = ici_bidir_per_chip / ici_ports / 2
    return HardwareSpec(name=name, kind="tpu", compute_units=mxu_128_units, peak_flops_bf16=bf16_tflops * TERA,
                        peak_flops_fp16=bf16_tflops * TERA, peak_flops_fp32=bf16_tflops * TERA / 3,
                        hbm_bandwidth=hbm_bw, hbm_capacity=hbm_bytes, devices_per_node=chips_per_host,
                        intra_node_topology="torus", intra_node_bandwidth=2 * per_port_per_dir,
                        intra_node_latency=_ICI_LATENCY,
                        # Multi-host groups in one slice still use ICI; DCN only between slices. We model the
                        # "inter-node" link as ICI too (same slice), the common serving case.
                        inter_node_bandwidth=2 * per_port_per_dir, inter_node_latency=_ICI_LATENCY)


_SPECS = [
    # A100 40GB: HBM2 1,555 GB/s, 40 GB. A100 80GB SXM: HBM2e 2,039 GB/s; A100 80GB PCIe: 1,935 GB/s.
    _a100("a100-40gb-sxm", 1555 * GB, 40, "sxm"),
    _a100("a100-80gb-sxm", 2039 * GB, 80, "sxm"),
    _a100("a100-40gb-pcie", 1555 * GB, 40, "pcie"),
    _a100("a100-80gb-pcie", 1935 * GB, 80, "pcie-nvlink"),
    _a100("a100-80gb-pcie-nolink", 1935 * GB, 80, "pcie"),
    # H100 SXM5: HBM3 3.35 TB/s, 80 GB. H200 SXM: HBM3e 4.8 TB/s, 141 GB.
    _hopper("h100-sxm", 3350 * GB, 80 * GiB),
    _hopper("h200", 4800 * GB, 141 * GB),
    # A40: FP16/BF16 Tensor 149.7 TFLOPS dense (299.4 sparse), TF32 Tensor 74.8 dense (149.6 sparse), FP32 37.4
    # TFLOPS, 48 GB GDDR6 at 696 GB/s, NVLink bridge (pairs) 112.5 GB/s bidirectional -> 56.25 GB/s/dir, PCIe Gen4.
    HardwareSpec(name="a40", kind="gpu", compute_units=84, peak_flops_bf16=149.7 * TERA, peak_flops_fp16=149.7 * TERA,
                 peak_flops_fp32=37.4 * TERA, peak_flops_tf32=74.8 * TERA, hbm_bandwidth=696 * GB,
                 hbm_capacity=48 * GiB, devices_per_node=8,
                 intra_node_topology="pairwise", pairwise_bandwidth=56.25 * GB, intra_node_bandwidth=_PCIE4_X16,
                 intra_node_latency=_PCIE_LATENCY, inter_node_bandwidth=_HDR_IB / 2, inter_node_latency=_IB_LATENCY),
    # L4: FP16/BF16 Tensor 121 TFLOPS dense (242 sparse), TF32 Tensor 60 dense (120 sparse), FP32 30.3 TFLOPS, 24 GB
    # GDDR6 at 300 GB/s, PCIe Gen4 x16, no NVLink. Typical cloud host (g2-standard-96): 8 L4, 100 Gb/s network
    # shared -> 12.5 GB/s per node.
    HardwareSpec(name="l4", kind="gpu", compute_units=58, peak_flops_bf16=121 * TERA, peak_flops_fp16=121 * TERA,
                 peak_flops_fp32=30.3 * TERA, peak_flops_tf32=60 * TERA, hbm_bandwidth=300 * GB, hbm_capacity=24 * GiB,
                 devices_per_node=8,
                 intra_node_topology="pcie", intra_node_bandwidth=_PCIE4_X16, intra_node_latency=_PCIE_LATENCY,
                 inter_node_bandwidth=12.5 * GB / 8, inter_node_latency=_DCN_LATENCY),
    # Cloud TPU docs. v4: 275 TFLOPS bf16, 32 GiB HBM2 at 1,200 GB/s, 6 ICI ports (3D torus), 4 chips/host;
    # ICI per chip ~ 6 x 50 GB/s/dir (TPU v4 paper, Jouppi et al. 2023) = 600 GB/s bidirectional.
    _tpu("tpu-v4", 275, 1200 * GB, 32 * GiB, ici_bidir_per_chip=600 * GB, ici_ports=6, chips_per_host=4,
         mxu_128_units=8),  # 2 TensorCores x 4 MXUs (128x128)
    # v5e: 197 TFLOPS bf16, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s bidirectional per chip, 4 ports, 8 chips/host.
    _tpu("tpu-v5e", 197, 819 * GB, 16 * GB, ici_bidir_per_chip=400 * GB, ici_ports=4, chips_per_host=8,
         mxu_128_units=4),  # 1 TensorCore x 4 MXUs
    # v5p: 459 TFLOPS bf16, 95 GB HBM2e at 2,765 GB/s, ICI 1,200 GB/s bidirectional per chip, 6 ports (3D torus),
    # 4 chips/host.
    _tpu("tpu-v5p", 459, 2765 * GB, 95 * GB, ici_bidir_per_chip=1200 * GB, ici_ports=6, chips_per_host=4,
         mxu_128_units=8),  # 2 TensorCores x 4 MXUs
    # v6e (Trillium): 918 TFLOPS bf16, 32 GB HBM at 1,638 GB/s, ICI 800 GB/s bidirectional per chip, 4 ports,
    # 8 chips/host.
    _tpu("tpu-v6e", 918, 1638 * GB, 32 * GB, ici_bidir_per_chip=800 * GB, ici_ports=4, chips_per_host=8,
         mxu_128_units=8),  # 1 TensorCore x 2 MXUs of 256x256 = 8 of 128x128
]

HARDWARE_SPECS: dict[str, HardwareSpec] = {s.name: s for s in _SPECS}
_ALIASES = {"a100": "a100-80gb-sxm", "a100-40gb": "a100-40gb-sxm", "a100-80gb": "a100-80gb-sxm", "h100": "h100-sxm",
            "h200-sxm": "h200", "v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e"}


def known_hardware() -> list[str]:
    """Registry names plus aliases plus 'host-cpu'."""
    return sorted(HARDWARE_SPECS) + sorted(_ALIASES) + ["host-cpu"]


def get_hardware_spec(name: str) -> HardwareSpec:
    """The spec called `name` (case-insensitive; 'host-cpu' measures this machine). Unknown names raise a
    ValueError listing the known ones."""
    key = name.strip().lower()
    if key in ("host-cpu", "cpu"):
        return host_cpu()
    key = _ALIASES.get(key, key)
    try:
        return HARDWARE_SPECS[key]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(known_hardware())}") from None


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(n: int = 512, repeats: int = 5) -> float:
    """fp32 FLOP/s of an n x n numpy matmul (best of `repeats`, after one warm-up)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    a @ b
    return 2 * n**3 / _best_time(lambda: a @ b, repeats)


def measure_copy_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth (bytes read + written per second) of copying a `num_bytes` buffer (bigger than caches)."""
    src = np.ones(num_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return 2 * src.nbytes / _best_time(lambda: np.copyto(dst, src), repeats)


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def host_cpu() -> HardwareSpec:
    """The machine this runs on, measured now (~0.1 s): numpy fp32 matmul rate for every dtype (the CPU engine
    computes bf16 through fp32), copy bandwidth for 'HBM', physical RAM as capacity, and one 'device' per node
    linked through memory (collectives between fake CPU devices are memory copies)."""
    flops = measure_matmul_flops()
    bandwidth = measure_copy_bandwidth()
    return HardwareSpec(name="host-cpu", kind="cpu", compute_units=max(1, os.cpu_count() or 1),
                        peak_flops_bf16=flops, peak_flops_fp16=flops, peak_flops_fp32=flops, hbm_bandwidth=bandwidth,
                        hbm_capacity=_host_memory_bytes(),
                        devices_per_node=max(1, os.cpu_count() or 1), intra_node_topology="none",
                        intra_node_bandwidth=bandwidth / 2, intra_node_latency=5e-6,
                        inter_node_bandwidth=1.25 * GB, inter_node_latency=50e-6)
