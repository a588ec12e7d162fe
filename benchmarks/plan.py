"""Planner benchmark: plan an N-layer Llama whose weights are all ``auto``.

Builds ``gen llama`` specs (hidden 32, 4 heads, ffn 64, batch 2, sequence 8) on a mesh
dp=2 x sp=1 x tp=4 with only the token input declared (``S(0)`` on dp) and every other
input ``auto``, and for each number of layers prints: the nodes, the variables' classes
(identical layers share one), the strategies, the seconds to solve (candidate strategies,
their gradients' costs, edge costs and the ILP, from a new process's state), whether the
ILP was proven optimal within its time limit (else its gap), and the
measured bytes per rank per step (forward and backward) of the planned spec and of
Megatron's layouts as ``gen llama`` writes them, with their ratio, from the same run.
Run: ``python benchmarks/plan.py [--layers 1 8 32] [--memory-per-rank BYTES]``.
"""

from __future__ import annotations

import argparse
import time

from layout_prop.api import clear_caches
from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec
from layout_prop.commands.plan import graph_to_spec, measure, parse_bytes
from layout_prop.planner.solver import realise, solve

MESH = (("dp", 2), ("sp", 1), ("tp", 4))


def auto_spec(layers: int) -> dict:
    spec = llama_spec(layers, MESH)
    for name, inp in spec["inputs"].items():
        inp["placements"] = ["S(0)", "R", "R"] if name == "x" else "auto"
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--memory-per-rank", type=parse_bytes, default=None)
    args = parser.parse_args()
    print(f"mesh {' x '.join(f'{n}={s}' for n, s in MESH)}; memory limit per rank: {args.memory_per_rank}")
    print("| layers | nodes | classes | strategies | solve (s) | proven optimal | plan bytes/step | Megatron bytes/step "
          "| plan / Megatron |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        clear_caches()
        graph = load_spec(auto_spec(layers))
        start = time.perf_counter()
        solution = solve(graph, memory_limit=args.memory_per_rank)
        seconds = time.perf_counter() - start
        planned = graph.copy_structure()
        for node in planned.inputs():
            node.attrs["placements"] = solution.layouts[node.name]
        realised, _ = realise(planned, solution.strategies)
        plan = measure(load_spec(graph_to_spec(realised)))
        megatron = measure(load_spec(llama_spec(layers, MESH)))
        ratio = plan["bytes_per_step"] / megatron["bytes_per_step"]
        proven = "yes" if solution.optimal else f"no (gap {solution.gap:.1%})"
        print(f"| {layers} | {len(graph)} | {solution.classes} | {solution.variables} | {seconds:.1f} | {proven} | "
              f"{plan['bytes_per_step']} | {megatron['bytes_per_step']} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
