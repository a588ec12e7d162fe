"""Propagation benchmark: propagate + check + reshard over graphs of N nodes.

Builds generated Llama graphs (``layout_prop.frontends.generate.llama_spec``: 23 nodes and 9 weights
a layer, Megatron TP + SP on a dp x sp x tp mesh of 8 ranks, so reshard inserts 6
redistributions a layer) and, with ``--graph rpe``, chains of RotaryPositionEmbedding
blocks (RPE, a scale, a residual add).  It prints, for each size: the time of
propagate + check + reshard, microseconds per node cold (an empty rule cache, and the
planner's memory cleared: a new process) and warm (the cache of a previous run), best of
``--repeat`` runs with the sizes interleaved, and the ratio of times for 10x the nodes,
measured in the same run.
Run: ``python benchmarks/propagate.py [--graph llama|rpe] [--sizes 1000 10000]``.
"""

from __future__ import annotations

import argparse
import time

from layout_prop.api import clear_caches
from layout_prop.core.graph import paused_gc
from layout_prop.core.graph import Graph
from layout_prop.io.loader import load_spec
from layout_prop.core.mesh import DeviceMesh
from layout_prop.frontends.generate import llama_spec
from layout_prop.passes.check import Check
from layout_prop.passes.propagate import Propagate
from layout_prop.passes.reshard import Reshard


def build(nodes: int) -> Graph:
    """A chain of RPE blocks with about ``nodes`` nodes."""
    g = Graph(DeviceMesh((2, 2, 2), ("dp", "tp", "sp")))
    x = g.input("x", shape=(8, 16, 128, 64), placements=["S(0)", "S(1)", "S(2)"])
    cos = g.input("cos", shape=(1, 1, 128, 64), placements=["R", "R", "S(2)"], requires_grad=False)
    sin = g.input("sin", shape=(1, 1, 128, 64), placements=["R", "R", "R"], requires_grad=False)
    w = g.input("w", shape=(64,), placements=["R", "R", "R"])
    for i in range(max(1, nodes // 3)):
        h = g.op(f"rope{i}", "rotary_position_embedding", [x, cos, sin], {"mode": i % 4})
        s = g.op(f"scale{i}", "mul", [h, w])
        x = g.op(f"res{i}", "add", [s, x])
    g.output(x)
    return g


def build_llama(nodes: int) -> Graph:
    """A generated Llama graph with about ``nodes`` nodes (inputs included)."""
    per_layer = 23 + 9
    return load_spec(llama_spec(max(1, round(nodes / per_layer))))


def analyse(g: Graph, cache: dict) -> float:
    start = time.perf_counter()
    with paused_gc():  # as layout_prop.api.analyze runs the passes
        propagate = Propagate(cache)
        new = Reshard(propagate).run(g).graph
        result = Check().run(new)
    elapsed = time.perf_counter() - start
    assert result.ok
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--graph", choices=["llama", "rpe"], default="llama")
    args = parser.parse_args()
    make = build_llama if args.graph == "llama" else build
    print(f"graph: {args.graph}")
    cold: dict[int, list[float]] = {n: [] for n in args.sizes}
    warm: dict[int, list[float]] = {n: [] for n in args.sizes}
    for _ in range(args.repeat):
        for n in args.sizes:  # sizes interleaved, so that a drift of the machine's speed reaches all alike
            cache: dict = {}
            clear_caches()  # cold: nothing remembered from earlier runs, as in a new process
            # each graph is built just before and dropped just after its run, so that a run
            # does not share the memory with the graphs of earlier runs
            cold[n].append(analyse(make(n), cache))
            warm[n].append(analyse(make(n), cache))
    rows = [(n, len(make(n)), min(cold[n]), min(warm[n])) for n in args.sizes]
    print(f"{'N':>7} {'nodes':>7} {'cold s':>9} {'cold us/node':>13} {'warm s':>9} {'warm us/node':>13}")
    for n, nodes, cold, warm in rows:
        print(f"{n:>7} {nodes:>7} {cold:>9.4f} {cold / nodes * 1e6:>13.2f} {warm:>9.4f} {warm / nodes * 1e6:>13.2f}")
    for (n1, nodes1, c1, w1), (n2, nodes2, c2, w2) in zip(rows, rows[1:]):
        print(f"time({n2})/time({n1}): cold {c2 / c1:.2f}, warm {w2 / w1:.2f} (nodes ratio {nodes2 / nodes1:.2f})")


if __name__ == "__main__":
    main()
