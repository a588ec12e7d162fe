"""Benchmark the numpy RotaryPositionEmbedding forward against a numpy copy of the same bytes.

Usage::

    python benchmarks/rpe_kernel.py [--size-mib 64] [--repeat 15] [--head-dim 64 128] [--seq 1024]

x is float32 BNSD with B=8 and cos / sin of shape (1, 1, S, D); N is chosen so that x
has ``--size-mib`` MiB.  One table per head dim D (default 64 and Llama's 128).  In one run and interleaved (so that machine noise hits both
alike) it times ``np.copyto`` of x into a preallocated array and ``rpe_forward`` of each
mode into a preallocated output, and prints the median time, the bandwidth counting one
read of x and one write of y, and the ratio to the copy's bandwidth.  The row "0 new y"
is mode 0 allocating its output (page faults included), for information.

Exit status: 0 when mode 0 reaches at least ``--min-ratio`` (default 0.5) of the copy
bandwidth at every D, 1 otherwise.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np

from layout_prop.kernels.rpe_numpy import DEFAULT_BLOCK_BYTES, MODE_NAMES, rpe_forward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=64.0, help="size of x in MiB (default 64)")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per kernel (default 15)")
    parser.add_argument("--batch", type=int, default=8, help="B (default 8)")
    parser.add_argument("--seq", type=int, default=1024, help="S (default 1024)")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="D, one table each (default 64 128)")
    parser.add_argument("--block-kib", type=int, default=DEFAULT_BLOCK_BYTES // 1024, help="rpe_forward block size")
    parser.add_argument("--min-ratio", type=float, default=0.5, help="required mode-0 / copy bandwidth ratio")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.size_mib <= 0:
        parser.error("--repeat must be >= 1 and --size-mib > 0")
    return args


def bnsd_shape(size_mib: float, batch: int, seq: int, head_dim: int) -> tuple[int, int, int, int]:
    """(B, N, S, D) with N chosen so that float32 x has about ``size_mib`` MiB."""
    heads = max(1, round(size_mib * 2**20 / (batch * seq * head_dim * 4)))
    return batch, heads, seq, head_dim


def time_interleaved(kernels: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds per kernel; one warm-up call each, then ``repeat`` rounds of all."""
    for kernel in kernels.values():
        kernel()
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(repeat):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_head_dim(args: argparse.Namespace, head_dim: int) -> float:
    """Print the table for one D; return mode 0's bandwidth as a fraction of the copy's."""
    shape = bnsd_shape(args.size_mib, args.batch, args.seq, head_dim)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    angles = rng.uniform(-np.pi, np.pi, (1, 1, shape[2], shape[3]))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    copy_dst, y = np.empty_like(x), np.empty_like(x)
    block_bytes = args.block_kib * 1024

    kernels: dict[str, Callable[[], object]] = {"copy": lambda: np.copyto(copy_dst, x)}
    for mode in MODE_NAMES:
        kernels[str(mode)] = lambda mode=mode: rpe_forward(x, cos, sin, mode, out=y, block_bytes=block_bytes)
    kernels["0 new y"] = lambda: rpe_forward(x, cos, sin, 0, block_bytes=block_bytes)
    medians = time_interleaved(kernels, args.repeat)

    moved = 2 * x.nbytes  # read x + write y
    copy_bandwidth = moved / medians["copy"]
    print(
        f"x float32 BNSD {shape} = {x.nbytes / 2**20:.1f} MiB, cos/sin {cos.shape}, block {args.block_kib} KiB, "
        f"median of {args.repeat}; numpy {np.__version__}, Python {platform.python_version()}, {platform.machine()}"
    )
    print(f"{'kernel':<26} {'ms (median)':>12} {'GB/s':>8} {'vs copy':>8}")
    for name, seconds in medians.items():
        if name == "copy":
            label = "np.copyto"
        else:
            label = f"mode {name} ({MODE_NAMES[int(name)]})" if name.isdigit() else f"mode {name}"
        bandwidth = moved / seconds
        print(f"{label:<26} {seconds * 1e3:>12.2f} {bandwidth / 1e9:>8.2f} {bandwidth / copy_bandwidth:>8.2f}")
    print()
    return medians["copy"] / medians["0"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ratios = {head_dim: bench_head_dim(args, head_dim) for head_dim in args.head_dim}
    text = ", ".join(f"{ratio:.2f} at D={head_dim}" for head_dim, ratio in ratios.items())
    if min(ratios.values()) < args.min_ratio:
        print(f"FAIL: mode 0 reaches {text} of the copy bandwidth (wanted >= {args.min_ratio})", file=sys.stderr)
        return 1
    print(f"OK: mode 0 reaches {text} of the copy bandwidth (>= {args.min_ratio})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
