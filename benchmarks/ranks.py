"""Analysis time against the rank count: check --reshard --backward on growing meshes.

``--graph small`` (the default): the graph is fixed (x [n, 8, 16] sharded over an n x 2
mesh, a linear with a weight that needs a redistribution, a softmax; backward too), only
the mesh grows.  ``--graph llama``: a generated Llama layer (``gen llama``, reshapes of
sharded heads included) on a dp x sp=16 x tp mesh (tp up to 256), its sequence cut
unevenly by sp and tp (forward only, as ``check`` runs it).  Each size is run ``--repeat`` times, sizes
interleaved, best taken; the last column is the time per rank, and the ratios compare
each size with the one before (time ratio against the rank ratio: work per mesh axis,
independent of the ranks, is about 1; linear about equal, quadratic about its square).

    python ranks.py [--graph small|llama] [--ranks 1024 4096 16384 65536] [--repeat 3]
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


def llama(ranks: int) -> str:
    """The issue's Llama layer, scaled: tp = heads up to 256, sp 16, dp the rest (65,536 ranks:
    dp=16 x sp=16 x tp=256, a sequence of 256 cut 4,096 ways, most pieces empty)."""
    from layout_prop.frontends.generate import llama_spec

    tp = min(256, max(1, ranks // 16))
    sp = min(16, ranks // tp)
    dp = ranks // (tp * sp)
    return llama_spec(1, (("dp", dp), ("sp", sp), ("tp", tp)), batch=dp, seq=256, hidden=4 * tp, heads=tp,
                      ffn=8 * tp)


def seconds(ranks: int, graph: str = "small") -> float:
    text = spec(ranks) if graph == "small" else llama(ranks)
    clear_caches()
    start = time.perf_counter()
    if graph == "small":
        analysis = analyze(load_spec(text), reshard=True, backward=True)
    else:
        analysis = analyze(load_spec(text))
    format_table(analysis)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--graph", choices=["small", "llama"], default="small")
    args = parser.parse_args()
    best = {n: float("inf") for n in args.ranks}
    for _ in range(args.repeat):
        for n in args.ranks:
            best[n] = min(best[n], seconds(n, args.graph))
    print(f"{'ranks':>7} {'seconds':>9} {'us/rank':>9}")
    for n in args.ranks:
        print(f"{n:>7} {best[n]:>9.3f} {best[n] / n * 1e6:>9.1f}")
    for a, b in zip(args.ranks, args.ranks[1:]):
        print(f"time({b})/time({a}): {best[b] / best[a]:.2f} (ranks ratio {b / a:.2f})")


if __name__ == "__main__":
    main()
