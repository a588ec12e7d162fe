"""Import speed: ``layout-prop import CHAIN.onnx --plan PLAN -o OUT`` of long ONNX Relu chains, to YAML and to JSON.

Each model is a chain of N Relu nodes on a 4 x 4 input, sharded on a mesh of 2.  The timed
part is the ``import`` command in this process (``layout_prop.cli.main``: read the model,
infer shapes, canonicalise, lower to a spec, apply the plan, load the spec to check it,
format it and write the file), without the interpreter's start-up.  It prints, per size and
output format, the best of ``--repeat`` runs (sizes and formats interleaved), then, measured in
this one run, the ratio YAML / JSON per size and the cost per node between the smallest and the
largest size (the slope, so that start-up and fixed costs do not count).
Targets (issue #27): YAML within 1.3x of JSON, and a slope of at most 50 us per node.
Run: ``python benchmarks/import_speed.py [--nodes 10000 100000] [--repeat 3] [--profile]``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import tempfile
import time
from pathlib import Path


def relu_chain_onnx(length: int):
    """An ONNX model of ``length`` chained Relu nodes on a float32 4 x 4 input ``x``."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"v{i - 1}"], [f"v{i}"], name=f"relu{i}")
             for i in range(length)]
    graph = helper.make_graph(nodes, "relu_chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info(f"v{length - 1}", TensorProto.FLOAT, [4, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


PLAN = "mesh: {shape: [2], names: [dp]}\ninputs:\n  x: [\"S(0)\"]\n"


def import_once(model: Path, plan: Path, out: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``layout-prop import`` in this process (its output silenced)."""
    from layout_prop.api import clear_caches
    from layout_prop.cli import main

    clear_caches()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        start, cpu = time.perf_counter(), time.process_time()
        code = main(["import", str(model), "--plan", str(plan), "-o", str(out)])
        seconds = (time.perf_counter() - start, time.process_time() - cpu)
    if code != 0:
        raise SystemExit(f"import of {model} to {out.suffix} failed with exit code {code}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print the top functions of one YAML import "
                                                               "of the largest chain")
    args = parser.parse_args()
    import onnx

    sizes = sorted(args.nodes)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        plan = root / "plan.yaml"
        plan.write_text(PLAN)
        models = {}
        for n in sizes:
            models[n] = root / f"chain{n}.onnx"
            onnx.save(relu_chain_onnx(n), str(models[n]))
        best: dict[tuple[int, str], tuple[float, float]] = {}  # (size, format) -> the run of least CPU time
        for _ in range(args.repeat):
            for n in sizes:
                for fmt in ("json", "yaml"):
                    out = root / f"out{n}.{fmt}"
                    seconds = import_once(models[n], plan, out)
                    best[n, fmt] = min(seconds, best.get((n, fmt), seconds), key=lambda run: run[1])
                    os.unlink(out)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            import_once(models[sizes[-1]], plan, root / "profiled.yaml")
            profiler.disable()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; CPU time is this process's, wall time "
          "what a user waits (both of the run of least CPU time)")
    print(f"{'nodes':>8} {'json cpu s':>10} {'yaml cpu s':>10} {'yaml/json':>9} {'json wall s':>11} {'yaml wall s':>11} "
          f"{'yaml/json':>9}")
    for n in sizes:
        (json_wall, json_cpu), (yaml_wall, yaml_cpu) = best[n, "json"], best[n, "yaml"]
        print(f"{n:>8} {json_cpu:>10.3f} {yaml_cpu:>10.3f} {yaml_cpu / json_cpu:>9.2f} {json_wall:>11.3f} "
              f"{yaml_wall:>11.3f} {yaml_wall / json_wall:>9.2f}")
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        for fmt in ("json", "yaml"):
            cpu = (best[large, fmt][1] - best[small, fmt][1]) / (large - small) * 1e6
            wall = (best[large, fmt][0] - best[small, fmt][0]) / (large - small) * 1e6
            print(f"{fmt}: {cpu:.1f} us of CPU ({wall:.1f} us of wall time) per node between {small} and {large} nodes "
                  "(target: at most 50)")
    if args.profile:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
