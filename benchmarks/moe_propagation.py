"""MoE propagation benchmark: the per-node cost of a 64-expert MoE layer against a Llama layer.

Issue 28's target: a 64-expert MoE layer (``gen moe --experts 64 --top-k 8``: router,
softmax, top-k, renormalised weights, moe_dispatch, the redistribute to expert parallelism,
SwiGLU experts as batched matmuls, moe_combine) propagates at most at twice the per-node
cost of a Llama layer (``gen llama``).  Both are generated with ``--layers`` layers (each count
in turn: one layer is the cost of every rule run once; with more, identical layers hit the
rule cache) on meshes of 8 ranks (dp=2, ep=2, tp=2 and dp=2, sp=2, tp=2), the same hidden size and heads, and timed
in the same run: propagate + reshard + check, as ``check --reshard`` runs them, in CPU
seconds of this process (see :func:`analyse`), cold (caches
cleared) and warm (the cache of the run before), best of ``--repeat`` with the two graphs
interleaved.  Nodes count every input and op node of the spec as loaded.

Run: ``python benchmarks/moe_propagation.py [--layers 1 16] [--experts 64] [--top-k 8] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import time

from layout_prop.api import clear_caches
from layout_prop.core.graph import Graph, paused_gc
from layout_prop.frontends.generate import llama_spec, moe_spec
from layout_prop.io.loader import load_spec
from layout_prop.passes.check import Check
from layout_prop.passes.propagate import Propagate
from layout_prop.passes.reshard import Reshard

#: the issue's bound on the MoE layer's per-node cost, in Llama layers' per-node costs
TARGET = 2.0


def graphs(layers: int, experts: int, top_k: int) -> dict[str, Graph]:
    return {"llama": load_spec(llama_spec(layers)),
            "moe": load_spec(moe_spec(layers, experts=experts, top_k=top_k))}


def analyse(graph: Graph, cache: dict) -> float:
    """The process's CPU seconds of propagate + reshard + check (the time it ran, not the
    time other processes of a shared machine took it off the CPU: under load, wall-clock
    times of a few milliseconds came in scheduler slices of about 4 ms)."""
    start = time.process_time()
    with paused_gc():  # as layout_prop.api.analyze runs the passes
        propagate = Propagate(cache)
        new = Reshard(propagate).run(graph).graph
        result = Check().run(new)
    elapsed = time.process_time() - start
    assert result.ok, [v.code for v in result.violations][:5]
    return elapsed


def measure(layers: int, experts: int, top_k: int, repeat: int) -> dict[str, tuple[int, float, float]]:
    """Per graph: nodes, best cold and best warm seconds."""
    cold: dict[str, list[float]] = {"llama": [], "moe": []}
    warm: dict[str, list[float]] = {"llama": [], "moe": []}
    nodes = {}
    for _ in range(repeat):
        for name, graph in graphs(layers, experts, top_k).items():  # interleaved
            nodes[name] = len(graph)
            cache: dict = {}
            clear_caches()
            cold[name].append(analyse(graph, cache))
            warm[name].append(analyse(graph, cache))
    return {name: (nodes[name], min(cold[name]), min(warm[name])) for name in nodes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(f"MoE: {args.experts} experts, top-{args.top_k}; best of {args.repeat}")
    print(f"{'layers':>6} {'graph':<6} {'nodes':>6} {'cold s':>8} {'cold us/node':>13} {'warm s':>8} "
          f"{'warm us/node':>13}")
    worst = 0.0
    ratios = []
    for layers in args.layers:
        rows = measure(layers, args.experts, args.top_k, args.repeat)
        for name, (nodes, cold, warm) in rows.items():
            print(f"{layers:>6} {name:<6} {nodes:>6} {cold:>8.4f} {cold / nodes * 1e6:>13.2f} {warm:>8.4f} "
                  f"{warm / nodes * 1e6:>13.2f}")
        (n_l, c_l, w_l), (n_m, c_m, w_m) = rows["llama"], rows["moe"]
        cold_ratio, warm_ratio = (c_m / n_m) / (c_l / n_l), (w_m / n_m) / (w_l / n_l)
        worst = max(worst, cold_ratio)
        ratios.append(f"{layers} layers: cold {cold_ratio:.2f}, warm {warm_ratio:.2f}")
    verdict = "OK" if worst <= TARGET else "OVER"
    print(f"{verdict}: MoE per-node cost / Llama per-node cost: {'; '.join(ratios)} (target <= {TARGET:g}, cold)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
