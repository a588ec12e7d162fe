"""Cluster profiles: what a device computes and how fast its links move bytes.

A :class:`Cluster` gives the peak dense throughput per dtype, the HBM capacity and
bandwidth, the links inside a node and between nodes, and the efficiency factors the step
model applies (the fraction of a peak that real kernels and collectives reach).  Three
are built in (:data:`BUILTIN`); a user's own is a YAML file (:func:`load_cluster`).

Every built-in figure carries its source in ``sources``: a vendor datasheet where one was
reachable, a published micro-benchmark for what kernels reach (the large-GEMM fraction of the
peak, FlashAttention's), and otherwise a third-party report or an assumption, said as such.
None is fitted to training runs; ``benchmarks/published.py`` measures the model against
published ones.  The device model of a matrix product (``cores``, ``gemm_tiles``,
``gemm_efficiency``, ``l2_GBps``; :func:`layout_prop.perf.costs.gemm_time`) replaces the flat
``matmul_efficiency`` on the built-in profiles; a profile without ``cores`` keeps it.

Link figures are per device and per direction: a device inside a node reaches its peers at
``intra`` (NVLink, HCCS), and each device has its own network port between nodes
(``inter``: DGX's eight HDR/NDR InfiniBand ports, one per GPU; Atlas 800T A2's eight RoCE
ports, one per NPU), so collectives across nodes run one rail per device.

Examples
--------
>>> a100 = get_cluster("a100-80g")
>>> a100.devices_per_node, a100.peak_flops("float16") / 1e12, a100.hbm_bytes_per_s / 1e9
(8, 312.0, 2039.0)
>>> get_cluster("a100").name
Traceback (most recent call last):
...
layout_prop.core.errors.SpecError: unknown-cluster: no built-in cluster 'a100' (hint: built in: a100-80g, ascend-910b, h100-80g; or give a cluster YAML file)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layout_prop.core.errors import SpecError, cut, printable
from layout_prop.io.reader import MAX_TEXT

__all__ = ["Network", "Cluster", "BUILTIN", "get_cluster", "load_cluster", "parse_cluster"]


@dataclass(frozen=True)
class Network:
    """A link class: bandwidth per device and direction in GB/s (1e9 bytes/s), latency per hop in us."""

    GBps: float
    latency_us: float


@dataclass(frozen=True)
class Cluster:
    """A cluster profile (see the module docstring)."""

    name: str
    device: str
    devices_per_node: int
    peak_tflops: dict[str, float]  # dense, per dtype (matrix units)
    vector_tflops: float  # what elementwise work reaches (no matrix units), float32
    hbm_gb: float  # capacity, 1e9 bytes
    hbm_GBps: float
    intra: Network
    inter: Network
    matmul_efficiency: float = 0.54
    memory_efficiency: float = 0.8
    link_efficiency: float = 0.8
    nodes: int | None = None  # how many nodes the cluster has (None: as many as a mesh needs)
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # the device model of a matrix product (perf/costs.py gemm_time); ``cores`` None: the flat matmul_efficiency
    cores: int | None = None  # streaming multiprocessors (NVIDIA) or AI cores (Ascend): one output tile each
    gemm_tiles: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
    l2_GBps: float | None = None  # on-chip (L2) bandwidth feeding the cores' tiles, all cores (None: no bound)
    gemm_efficiency: float = 0.54  # the fraction of the peak a large, whole-wave GEMM reaches (measured)
    attention_efficiency: tuple[float, float] = (0.54, 0.54)  # fused attention, forward and backward
    launch_us: float = 0.0  # a kernel's fixed cost on the device beyond its work

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of the matrix units in ``dtype`` (float64 falls back to float32)."""
        key = dtype if dtype in self.peak_tflops else "float32"
        return self.peak_tflops[key] * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_GBps * 1e9

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gb * 1e9)


A100_DATASHEET = "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column)"
DGX_A100 = "NVIDIA DGX A100 datasheet (8x A100 80GB, NVLink 3 / NVSwitch, 8x single-port 200 Gb/s HDR InfiniBand)"
H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column, dense figures: half the sparsity ones)"
DGX_H100 = "NVIDIA DGX H100 datasheet (8x H100 SXM, NVLink 4, 8x 400 Gb/s NDR ConnectX-7 for compute)"
ASSUMED_LATENCY = "assumed: a typical per-hop latency of the link class, not a published figure"
FITTED = ("memory_efficiency and link_efficiency 0.8 assumed, not fitted; matmul_efficiency 0.54 (fitted on "
          "Megatron-LM's published 1.7B row) is no longer read on a profile with cores: the GEMM model is")
SM_A100 = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs in the A100 product"
SM_H100 = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs in the H100 SXM5 product"
TILES = ("NVIDIA Deep Learning Performance Guide, 'Matrix Multiplication Background' (docs.nvidia.com/deeplearning/"
         "performance/dl-performance-matrix-multiplication): cuBLAS computes a GEMM in output tiles of 256x128 "
         "down to 64x64, one thread block a tile on an SM, the larger tiles the more efficient; tile and wave "
         "quantization as there (the wave example: 108 SMs on A100)")
MAMF = ("Maximum Achievable Matmul FLOPS, measured (S. Bekman, ml-engineering, compute/accelerator/README.md, "
        "'Maximum Achievable Matmul FLOPS comparison table', mamf-finder.py, BF16 matmul, CUDA 12.1)")
FLASH2 = ("Dao, 'FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning' (arXiv:2307.08691, "
          "2023): 50-73% of the theoretical maximum FLOPs/s on A100; the forward reaches the top of that range at "
          "head dim 128, the backward its lower end")
FLASH3 = ("Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision' "
          "(arXiv:2407.08608, 2024): FP16 forward up to 740 TFLOPs/s on H100 (75% of the peak); the backward "
          "taken at 50%, the FlashAttention-2 paper's lower end (no single H100 backward figure quoted)")
L2_A100 = ("4,956 GB/s: 2.3x the V100's L2 read bandwidth (NVIDIA A100 Tensor Core GPU Architecture whitepaper, "
           "2020: '2.3x L2 cache read bandwidth' of V100) on the V100's measured 2,155 GB/s (Jia, Maggioni, Staiger, "
           "Scarpazza, 'Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking', arXiv:1804.06826, 2018)")
LAUNCH = ("not priced (0): a kernel's fixed cost (about 1 us when launches overlap, NVIDIA Developer Blog, A. Gray, "
          "'Getting Started with CUDA Graphs', 2019, an order of magnitude) is left out because the search, the "
          "solver and estimate enumerate a step's small kernels differently: priced, it moved their agreement on "
          "small graphs by 15-20% while the calibration rows moved by 0.4%")
ASCEND_REPORT = ("third-party report (boardor.com, 'Huawei Ascend 910B outperforms H20', 2024): FP16 about "
                 "320 TFLOPS, 64 GB HBM2e; no vendor datasheet of the 910B was reachable")
AIBENCH = ("Xiao and Wang, 'AIbench: a Tool for Benchmarking Huawei Ascend AI Processors', CCF Transactions on High "
           "Performance Computing, 2024 (doi:10.1007/s42514-024-00187-x): the Ascend 910's matrix units measured at "
           "216 TFLOPS float16 of its 256 peak (84.4%); taken for the 910B, whose AI cores keep the Da Vinci cube "
           "(16 x 16 x 16 a cycle); no 910B measurement found")
CANN_CORES = ("Huawei CANN documentation (hiascend.com: ATC tool, option --aicore_num, and the Ascend C programming "
              "guide's hardware architecture): the platform_config .ini of an Atlas A2 training product lists "
              "ai_core_cnt=24, cube_core_cnt=24, vector_core_cnt=48 (the A2's AI core split into a cube core and "
              "two vector cores); each cube unit multiplies a 16 x 16 by a 16 x 16 fp16 block a cycle")
ASCEND_PEAKS = ("the peak is uncertain: the Gitee AI compute documentation (ai.gitee.com, Ascend 910B) lists 280 "
                "TFLOPS fp16 for its 910B; the 910B ships in variants (CANN has a platform_config file for 910B1 to "
                "910B4, 910B4 with 20 AI cores and half the HBM and L2) and no vendor table of their peaks was "
                "reachable")

BUILTIN: dict[str, Cluster] = {
    "a100-80g": Cluster(
        name="a100-80g", device="NVIDIA A100 80GB SXM (DGX A100)", devices_per_node=8,
        peak_tflops={"float16": 312.0, "bfloat16": 312.0, "float32": 156.0},
        vector_tflops=19.5, hbm_gb=80.0, hbm_GBps=2039.0,
        intra=Network(GBps=300.0, latency_us=3.0), inter=Network(GBps=25.0, latency_us=6.0),
        matmul_efficiency=0.54, memory_efficiency=0.8, link_efficiency=0.8,
        cores=108, gemm_efficiency=round(267.9 / 312, 4), attention_efficiency=(0.73, 0.50), launch_us=0.0,
        l2_GBps=2.3 * 2155.0,
        sources={"cores": SM_A100, "l2_GBps": L2_A100, "gemm_tiles": TILES, "gemm_efficiency": MAMF + ": A100 SXM 267.9 of 312 TFLOPS "
                 "(85.9%)", "attention_efficiency": FLASH2, "launch_us": LAUNCH,
                 "peak_tflops": A100_DATASHEET + ": FP16/BF16 tensor 312 TFLOPS, TF32 156 (used for float32)",
                 "vector_tflops": A100_DATASHEET + ": FP32 19.5 TFLOPS", "hbm": A100_DATASHEET + ": 80 GB HBM2e, "
                 "2,039 GB/s", "intra": A100_DATASHEET + ": NVLink 600 GB/s (both directions: 300 each way)",
                 "inter": DGX_A100 + ": 200 Gb/s = 25 GB/s per GPU", "latency": ASSUMED_LATENCY,
                 "efficiency": FITTED}),
    "h100-80g": Cluster(
        name="h100-80g", device="NVIDIA H100 80GB SXM (DGX H100)", devices_per_node=8,
        peak_tflops={"float16": 989.0, "bfloat16": 989.0, "float32": 495.0},
        vector_tflops=67.0, hbm_gb=80.0, hbm_GBps=3350.0,
        intra=Network(GBps=450.0, latency_us=3.0), inter=Network(GBps=50.0, latency_us=6.0),
        matmul_efficiency=0.54, memory_efficiency=0.8, link_efficiency=0.8,
        cores=132, gemm_efficiency=round(792.1 / 989, 4), attention_efficiency=(0.75, 0.50), launch_us=0.0,
        l2_GBps=round(2.3 * 2155.0 * 132 / 108 * 1830 / 1410, 1),
        sources={"cores": SM_H100, "l2_GBps": "assumed: the A100's (" + L2_A100 + ") per SM and clock, times H100's "
                 "132 SMs at 1,830 MHz against A100's 108 at 1,410 (the whitepapers' boost clocks); no H100 L2 "
                 "measurement found", "gemm_tiles": TILES, "gemm_efficiency": MAMF + ": H100 SXM 792.1 of 989 TFLOPS "
                 "(80.1%)", "attention_efficiency": FLASH3, "launch_us": LAUNCH,
                 "peak_tflops": H100_DATASHEET + ": FP16/BF16 tensor 989 TFLOPS, TF32 495 (used for float32)",
                 "vector_tflops": H100_DATASHEET + ": FP32 67 TFLOPS", "hbm": H100_DATASHEET + ": 80 GB HBM3, "
                 "3.35 TB/s", "intra": H100_DATASHEET + ": NVLink 900 GB/s (450 each way)",
                 "inter": DGX_H100 + ": 400 Gb/s = 50 GB/s per GPU", "latency": ASSUMED_LATENCY,
                 "efficiency": "memory_efficiency and link_efficiency 0.8 assumed, as on A100"}),
    "ascend-910b": Cluster(
        name="ascend-910b", device="Huawei Ascend 910B (Atlas 800T A2 class: 8 NPUs a node)", devices_per_node=8,
        peak_tflops={"float16": 320.0, "bfloat16": 320.0, "float32": 80.0},
        vector_tflops=20.0, hbm_gb=64.0, hbm_GBps=1600.0,
        intra=Network(GBps=196.0, latency_us=3.0), inter=Network(GBps=25.0, latency_us=8.0),
        matmul_efficiency=0.54, memory_efficiency=0.8, link_efficiency=0.8,
        cores=24, gemm_efficiency=round(216 / 256, 4), attention_efficiency=(0.73, 0.50), launch_us=0.0,
        l2_GBps=round(2.3 * 2155.0 * 320 / 312, 1),
        sources={"l2_GBps": "assumed: the A100's (" + L2_A100 + ") per unit of peak FLOP/s","cores": CANN_CORES,
                 "gemm_tiles": "assumed: the cuBLAS tiles (" + TILES + ")",
                 "gemm_efficiency": AIBENCH,
                 "attention_efficiency": "assumed: the A100 figures (" + FLASH2 + ")", "launch_us": LAUNCH,
                 "peak_tflops": ASCEND_REPORT + "; float32 assumed a quarter of float16; " + ASCEND_PEAKS,
                 "vector_tflops": "assumed (no published vector-unit figure found)",
                 "hbm": ASCEND_REPORT + "; the bandwidth (1.6 TB/s) is an assumption",
                 "intra": "assumed: HCCS inside an Atlas 800T A2, 196 GB/s per NPU each way (unconfirmed)",
                 "inter": "assumed: one 200 Gb/s RoCE port per NPU (25 GB/s), as the Atlas 800T A2 is described",
                 "latency": ASSUMED_LATENCY,
                 "efficiency": "memory_efficiency and link_efficiency 0.8 assumed, as on A100; against "
                               "MindFormers' published Llama 2 7B and Llama 3 8B throughput on one Atlas 800T A2 "
                               "node the model predicts 11-31% more (benchmarks/published.py)"}),
}

_POSITIVE = ("devices_per_node", "vector_tflops", "hbm_gb", "hbm_GBps")
_FRACTIONS = ("matmul_efficiency", "memory_efficiency", "link_efficiency")
_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: the range of each figure a cluster file may give: what the physics of a device allows, far inside
#: what a float holds, so that the step model's products and quotients of figures stay finite and
#: non-zero (a latency of 1e308 us is not a step time of inf; two tiny figures never multiply to 0)
RANGES: dict[str, tuple[float, float]] = {
    "devices_per_node": (1, 2 ** 20), "nodes": (1, 2 ** 20),
    "tflops": (1e-6, 1e6),  # peak_tflops per dtype and vector_tflops: a micro-TFLOP/s to an exa-FLOP/s
    "hbm_gb": (1e-6, 1e6), "hbm_GBps": (1e-6, 1e6), "GBps": (1e-6, 1e6),
    "latency_us": (0.0, 1e6),  # up to a second a hop
    "efficiency": (1e-3, 1.0),
}
#: the keys a cluster file may have
CLUSTER_KEYS = frozenset({"base", "name", "device", "nodes", "devices_per_node", "peak_tflops", "vector_tflops",
                          "hbm_gb", "hbm_GBps", "intra", "inter", *_FRACTIONS, "sources"})
#: the longest text of a ``sources:`` entry
MAX_SOURCE = 4096


def get_cluster(name_or_path: str) -> Cluster:
    """A built-in profile by name, or the profile in a YAML file (a path ending .yaml/.yml/.json)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if name_or_path.endswith((".yaml", ".yml", ".json")) or os.sep in name_or_path or os.path.lexists(name_or_path):
        return load_cluster(Path(name_or_path))  # a path: the file's own refusal (a device, a folder, a link loop)
    raise SpecError("unknown-cluster", f"no built-in cluster {cut(name_or_path)}",
                    hint=f"built in: {', '.join(sorted(BUILTIN))}; or give a cluster YAML file")


def load_cluster(path: Path) -> Cluster:
    """Read and check a cluster YAML file (:func:`parse_cluster`), as a spec is read
    (:func:`layout_prop.io.reader.read_mapping`: size cap, regular files and pipes only, UTF-8,
    YAML aliases and nesting bounded); codes ``cluster-not-found``, ``cluster-too-large``,
    ``cluster-syntax``, ``cluster-too-deep``."""
    from layout_prop.io.reader import read_mapping

    data = read_mapping(path, what="cluster", hint="give a readable cluster YAML file or a built-in name "
                        f"({', '.join(sorted(BUILTIN))}); see docs/performance.md for the format")
    return parse_cluster(data, default_name=_file_name(path))


def _file_name(path: Path) -> str:
    """A profile's name when its file gives none: the file's stem, or its whole name where the stem is a
    built-in's (``a100-80g.yaml`` is named ``a100-80g.yaml``: a file never passes for a built-in), its
    control characters escaped (a file name cannot forge an output line).

    >>> _file_name(Path("a100-80g.yaml")), _file_name(Path("slow.yaml")), _file_name(Path("x\\nstep time 0.yaml"))
    ('a100-80g.yaml', 'slow', 'x\\\\nstep time 0')
    """
    name = path.stem if path.stem not in BUILTIN else path.name
    return printable(name)[:MAX_TEXT] or "custom"


def parse_cluster(data: Any, default_name: str = "custom") -> Cluster:
    """A :class:`Cluster` from a mapping, every figure checked (a number in its physical range,
    :data:`RANGES`; fractions in [0.001, 1]), every key known, names one printable line.

    A file may start from a built-in profile (``base: a100-80g``) and change some figures; its
    ``name:`` may not be a built-in's (a file never passes for a built-in profile).

    >>> c = parse_cluster({"base": "a100-80g", "inter": {"GBps": 50}})
    >>> c.inter, c.intra.GBps, c.name
    (Network(GBps=50.0, latency_us=6.0), 300.0, 'custom')
    >>> parse_cluster({"base": "a100-80g", "hbm_GBps": -1})
    Traceback (most recent call last):
    ...
    layout_prop.core.errors.SpecError: bad-value at cluster.hbm_GBps: hbm_GBps is -1, not a number in [1e-06, 1e+06] (hint: give a number from 1e-06 to 1e+06)
    """
    from layout_prop.io.reader import check_keys, check_text

    if not isinstance(data, dict):
        raise SpecError("bad-type", f"a cluster is a mapping of figures, got {cut(data)}", path="cluster",
                        hint="see docs/performance.md for the cluster file format")
    check_keys(data, CLUSTER_KEYS, "cluster")
    base = data.get("base")
    if base is not None:
        if not isinstance(base, str) or base not in BUILTIN:
            raise SpecError("unknown-cluster", f"no built-in cluster {cut(base)} to start from", path="cluster.base",
                            hint=f"write base: NAME, one of {', '.join(sorted(BUILTIN))}")
        fields = dict(BUILTIN[base].__dict__)
        fields["sources"] = {}
    else:
        missing = [k for k in ("devices_per_node", "peak_tflops", "vector_tflops", "hbm_gb", "hbm_GBps", "intra",
                               "inter") if k not in data]
        if missing:
            raise SpecError("missing-key", f"cluster needs {missing} (or base: NAME)", path="cluster",
                            hint=f"start from a built-in profile with base: {sorted(BUILTIN)[0]} and change figures")
        fields = {"device": "custom"}
    name = check_text(data["name"], "cluster.name", "name") if "name" in data else default_name
    if name in BUILTIN:
        raise SpecError("bad-name", f"a cluster file may not take the built-in profile's name {name!r}",
                        path="cluster.name", hint=f"name it otherwise (its figures are its own); base: {name} "
                        "starts from the built-in figures")
    fields["name"] = name
    if "device" in data:
        fields["device"] = check_text(data["device"], "cluster.device", "device")
    for key in _POSITIVE:
        if key in data:
            fields[key] = _number(data[key], f"cluster.{key}", key, integer=key == "devices_per_node")
    if data.get("nodes") is not None:
        fields["nodes"] = _number(data["nodes"], "cluster.nodes", "nodes", integer=True)
    for key in _FRACTIONS:
        if key in data:
            fields[key] = _number(data[key], f"cluster.{key}", "efficiency")
    if "peak_tflops" in data:
        peaks = data["peak_tflops"]
        if not isinstance(peaks, dict) or not peaks:
            raise SpecError("bad-type", f"peak_tflops is a mapping dtype -> TFLOP/s, got {cut(peaks)}",
                            path="cluster.peak_tflops", hint="write peak_tflops: {float16: 312, float32: 156}")
        for dtype in peaks:
            if not isinstance(dtype, str) or dtype not in _DTYPES:
                raise SpecError("bad-dtype", f"peak_tflops names dtype {cut(dtype)}",
                                path=f"cluster.peak_tflops.{cut(dtype, 40)[1:-1]}", hint=f"dtypes: {', '.join(_DTYPES)}")
        merged = {} if base is None else dict(fields["peak_tflops"])
        merged.update({d: _number(v, f"cluster.peak_tflops.{d}", "tflops") for d, v in peaks.items()})
        if "float32" not in merged:
            raise SpecError("missing-key", "peak_tflops needs float32 (the fallback of other dtypes)",
                            path="cluster.peak_tflops", hint="add float32: N")
        fields["peak_tflops"] = merged
    for key in ("intra", "inter"):
        if key in data:
            fields[key] = _network(data[key], f"cluster.{key}", None if base is None else fields[key])
    if "sources" in data:
        fields["sources"] = _sources(data["sources"])
    return Cluster(**fields)


def _sources(value: Any) -> dict[str, str]:
    """A ``sources:`` mapping: figure -> where it comes from, both one printable line."""
    from layout_prop.io.reader import check_text

    if not isinstance(value, dict):
        raise SpecError("bad-type", f"sources is a mapping figure -> where it comes from, got {cut(value)}",
                        path="cluster.sources", hint="write sources: {hbm: 'vendor datasheet, 2024'}")
    out = {}
    for key, text in value.items():
        label = check_text(key, "cluster.sources", "a sources key")
        out[label] = check_text(text, f"cluster.sources.{label}", "a source", limit=MAX_SOURCE)
    return out


def _number(value: Any, path: str, key: str, integer: bool = False) -> float:
    """``value`` checked against ``RANGES[key]`` (:func:`layout_prop.io.reader.check_number`)."""
    from layout_prop.io.reader import check_number

    low, high = RANGES.get(key, RANGES["tflops"])
    return check_number(value, path, low=low, high=high, integer=integer)


def _network(value: Any, path: str, base: Network | None) -> Network:
    from layout_prop.io.reader import check_keys

    if not isinstance(value, dict):
        raise SpecError("bad-value", f"a link class is {{GBps, latency_us}}, got {cut(value)}", path=path,
                        hint="write {GBps: 25, latency_us: 6}")
    check_keys(value, {"GBps", "latency_us"}, path)
    if base is None and set(value) != {"GBps", "latency_us"}:
        raise SpecError("missing-key", "a link class needs GBps and latency_us", path=path,
                        hint="write {GBps: 25, latency_us: 6}")
    gbps = _number(value["GBps"], f"{path}.GBps", "GBps") if "GBps" in value else base.GBps
    latency = _number(value["latency_us"], f"{path}.latency_us", "latency_us") if "latency_us" in value \
        else base.latency_us
    return Network(float(gbps), float(latency))
