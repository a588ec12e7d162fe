"""Planner benchmark: plan an N-layer Llama whose weights are all ``auto``.

Builds ``gen llama`` specs (hidden 32, 4 heads, ffn 64, batch 2, sequence 8) on a mesh
dp=2 x sp=1 x tp=4 with only the token input declared (``S(0)`` on dp) and every other
input ``auto``, and for each number of layers prints: the nodes, the variables' classes
(identical layers share one), the strategies, the seconds to solve (candidate strategies,
their gradients' costs, edge costs and the ILP, from a new process's state), whether the
ILP was proven optimal within its time limit (else its gap; "among the N kept per node" when
a node's candidates were pruned: optimal over those only), and the
measured bytes per rank per step (forward and backward) of the planned spec and of
Megatron's layouts as ``gen llama`` writes them, with their ratio, from the same run.
With ``--compare-cache`` it first builds each problem twice (after one warm-up build), from a
cold start of the redistribution caches each time,
with move costs remembered across edges (the planner's default) and without (each edge
alone, as before), and prints the two construction times (candidates and edge costs, the
ILP left out) and the distinct moves priced.
With ``--seven-b`` it instead times the intra-op plan of 7B-class layers (hidden 4096, 32 heads, ffn
11008, sequence 4096, batch 8, float16; ``--layers`` of them, the input ``S(0)`` on dp, every weight
``auto``) on 64 ranks (dp=8 x tp=8; issue #31 item 5a's case, whose target is 5 s): per phase (the
candidate strategies with their gradients, the edge costs, the ILP), with the move cache off (each edge
alone, as before #30) and on, from a cold start of the redistribution caches each time, and the whole
``plan`` command (:func:`~layout_prop.workflows.plan.plan_spec`: the baseline's measurement, the solve,
the realised plan's measurement), all in the same run.
Run: ``python benchmarks/plan.py [--layers 1 8 32] [--memory-per-rank BYTES] [--mesh dp=2,sp=2,tp=2]
[--compare-cache] [--seven-b]``.
"""

from __future__ import annotations

import argparse
import time

from layout_prop.api import clear_caches
from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec
from layout_prop.workflows.plan import graph_to_spec, measure, parse_bytes
from layout_prop.planner.solver import Problem, default_cap, realise, solve

MESH = (("dp", 2), ("sp", 1), ("tp", 4))


def auto_spec(layers: int, mesh=MESH) -> dict:
    spec = llama_spec(layers, mesh)
    for name, inp in spec["inputs"].items():
        inp["placements"] = ["S(0)", "R", "R"] if name == "x" else "auto"
    return spec


def _mesh(text: str):
    return tuple((name, int(size)) for name, size in (part.split("=") for part in text.split(",")))


def build_seconds(layers: int, mesh, cache: bool) -> tuple[float, int]:
    """Seconds to build the problem (strategies and the program's edge costs) from a cold start,
    and the moves priced (with the cache: distinct ones)."""
    clear_caches()
    graph = load_spec(auto_spec(layers, mesh))
    start = time.perf_counter()
    problem = Problem(graph, True, "bytes", None, cap=default_cap(graph.mesh), cache_moves=cache)
    problem._program()
    return time.perf_counter() - start, len(problem._move_cache)


def compare_cache(layers_list, mesh) -> None:
    print("| layers | build, moves cached (s) | build, per edge only (s) | speed-up | distinct moves |")
    print("|---|---|---|---|---|")
    build_seconds(1, mesh, True)  # warm-up: the first build imports and sets up what every later one reuses
    for layers in layers_list:
        uncached, _ = build_seconds(layers, mesh, False)
        cached, moves = build_seconds(layers, mesh, True)
        print(f"| {layers} | {cached:.1f} | {uncached:.1f} | {uncached / cached:.2f} | {moves} |", flush=True)


SEVEN_B = dict(batch=8, seq=4096, hidden=4096, heads=32, ffn=11008, dtype="float16")
SEVEN_B_MESH = (("dp", 8), ("sp", 1), ("tp", 8))


def seven_b_spec(layers: int) -> dict:
    spec = llama_spec(layers, SEVEN_B_MESH, **SEVEN_B)
    for name, inp in spec["inputs"].items():
        inp["placements"] = ["S(0)", "R", "R"] if name == "x" else "auto"
    return spec


def seven_b(layers_list) -> None:
    """The 7B-class table (module docstring)."""
    from layout_prop.workflows.plan import plan_spec

    print("7B-class layers (hidden 4096, ffn 11008, seq 4096, batch 8, fp16) on dp=8 x tp=8, every weight auto")
    print("| layers | move cache | candidates (s) | edge costs (s) | ILP (s) | solve (s) | distinct moves "
          "| whole plan command (s) | plan bytes/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    build_seconds(1, MESH, True)  # warm-up (imports)
    for layers in layers_list:
        for cache in (False, True):
            clear_caches()
            graph = load_spec(seven_b_spec(layers))
            start = time.perf_counter()
            problem = Problem(graph, True, "bytes", None, cap=default_cap(graph.mesh), cache_moves=cache)
            built = time.perf_counter()
            problem._program()
            edges = time.perf_counter()
            solution = solve(graph, problem=problem)
            end = time.perf_counter()
            whole, planned = "-", "-"
            if cache:
                clear_caches()
                begin = time.perf_counter()
                report = plan_spec(load_spec(seven_b_spec(layers)))
                whole = f"{time.perf_counter() - begin:.1f}"
                planned = str(report.plan["bytes_per_step"])
            moves = len(problem._move_cache) if cache else "-"
            print(f"| {layers} | {'on' if cache else 'off'} | {built - start:.1f} | {edges - built:.1f} | "
                  f"{end - edges:.1f} | {end - start:.1f} | {moves} | {whole} | {planned} |", flush=True)
            assert solution.layouts  # (the solve found a plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--memory-per-rank", type=parse_bytes, default=None)
    parser.add_argument("--mesh", type=_mesh, default=MESH, help="axes and sizes, like dp=2,sp=2,tp=2")
    parser.add_argument("--compare-cache", action="store_true",
                        help="first time the problem's construction with and without the move cache")
    parser.add_argument("--seven-b", action="store_true",
                        help="time the plan of 7B-class layers on dp=8 x tp=8 instead (--layers of them; 1 4 by "
                             "default)")
    args = parser.parse_args()
    if args.seven_b:
        seven_b(args.layers if args.layers != [1, 8, 32] else [1, 4])
        return
    mesh = args.mesh
    print(f"mesh {' x '.join(f'{n}={s}' for n, s in mesh)}; memory limit per rank: {args.memory_per_rank}")
    if args.compare_cache:
        compare_cache(args.layers, mesh)
    print("| layers | nodes | classes | strategies | solve (s) | proven optimal | plan bytes/step | Megatron bytes/step "
          "| plan / Megatron |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        clear_caches()
        graph = load_spec(auto_spec(layers, mesh))
        start = time.perf_counter()
        solution = solve(graph, memory_limit=args.memory_per_rank)
        seconds = time.perf_counter() - start
        planned = graph.copy_structure()
        for node in planned.inputs():
            node.attrs["placements"] = solution.layouts[node.name]
        realised, _ = realise(planned, solution.strategies)
        plan = measure(load_spec(graph_to_spec(realised)))
        megatron = measure(load_spec(llama_spec(layers, mesh)))
        ratio = plan["bytes_per_step"] / megatron["bytes_per_step"]
        if not solution.optimal:
            proven = f"no (gap {solution.gap:.1%})"
        else:
            proven = f"among the {solution.cap} kept per node" if solution.pruned else "yes"
        print(f"| {layers} | {len(graph)} | {solution.classes} | {solution.variables} | {seconds:.1f} | {proven} | "
              f"{plan['bytes_per_step']} | {megatron['bytes_per_step']} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
