"""Analysis time against the rank count: check --reshard --backward on growing meshes.

The graph is fixed (x [n, 8, 16] sharded over an n x 2 mesh, a linear with a weight that
needs a redistribution, a softmax; backward too), only the mesh grows.  Each size is run
``--repeat`` times, sizes interleaved, best taken; the last column is the time per rank,
and the ratios compare each size with the one before (time ratio against the rank ratio:
linear is about equal, quadratic about its square).

    python ranks.py [--ranks 1024 4096 16384 65536] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

from layout_prop.api import analyze, clear_caches, format_table
from layout_prop.io.loader import load_spec


def spec(ranks: int) -> str:
    dp = ranks // 2
    return (f"mesh: {{shape: [{dp}, 2], names: [dp, tp]}}\ninputs:\n"
            f"  x: {{shape: [{dp}, 8, 16], placements: [\"S(0)\", \"S(2)\"]}}\n"
            "  w: {shape: [32, 16], placements: [R, \"S(0)\"]}\n"
            "nodes:\n  - {name: y, op: linear, inputs: [x, w]}\n  - {name: z, op: softmax, inputs: [y]}\n")


def seconds(ranks: int) -> float:
    clear_caches()
    start = time.perf_counter()
    analysis = analyze(load_spec(spec(ranks)), reshard=True, backward=True)
    format_table(analysis)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    best = {n: float("inf") for n in args.ranks}
    for _ in range(args.repeat):
        for n in args.ranks:
            best[n] = min(best[n], seconds(n))
    print(f"{'ranks':>7} {'seconds':>9} {'us/rank':>9}")
    for n in args.ranks:
        print(f"{n:>7} {best[n]:>9.3f} {best[n] / n * 1e6:>9.1f}")
    for a, b in zip(args.ranks, args.ranks[1:]):
        print(f"time({b})/time({a}): {best[b] / best[a]:.2f} (ranks ratio {b / a:.2f})")


if __name__ == "__main__":
    main()
