"""Simulator benchmark: all ranks of an 8-rank mesh in one process vs one device.

For generated Llama graphs (Megatron TP + SP on dp x sp x tp, forward, or forward and
backward; ``--graph rpe`` for chains of RPE blocks), measures in the same run the wall
time of executing every rank's lowered program in the simulator (collectives included)
and of executing the global graph once on one device with the same numpy kernels, and
prints the ratio.  Lowering and input scattering are timed apart (they are done once per
program, not per step).
Run: ``cd benchmarks && python simulate.py [--graph llama|rpe] [--blocks 1 4] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from layout_prop.api import analyze
from layout_prop.kernels.collectives import scatter_global
from layout_prop.kernels.simulator import Simulator
from layout_prop.passes.lower import Lower
from layout_prop.runner import execute_global, random_inputs

from layout_prop.loader import load_spec
from layout_prop.models import llama_spec

from propagate import build  # noqa: E402  (benchmarks/ is the working folder)


def llama(layers: int):
    # a wider block than the default so that kernels, not Python, dominate
    return load_spec(llama_spec(layers, batch=4, seq=128, hidden=256, heads=8, ffn=512))


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=None,
                        help="layers (llama) or RPE blocks (rpe); default 1 4 / 4 16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--graph", choices=["llama", "rpe"], default="llama")
    args = parser.parse_args()
    blocks_list = args.blocks or ([1, 4] if args.graph == "llama" else [4, 16])
    print(f"graph: {args.graph}")
    print(f"{'blocks':>6} {'backward':>8} {'nodes':>6} {'one device s':>13} {'simulator s':>12} {'ratio':>6} "
          f"{'lower s':>8}")
    for blocks in blocks_list:
        for backward in (False, True):
            source = llama(blocks) if args.graph == "llama" else build(3 * blocks)
            g = analyze(source, backward=backward, reshard=True).graph
            start = time.perf_counter()
            program = Lower().run(g).program
            lower_s = time.perf_counter() - start
            inputs = random_inputs(g, 0)
            # pre-scatter the inputs so both sides start from data in place
            local_inputs = {op.name: scatter_global(inputs[op.name], op.specs[0]) for op in program.ops
                            if op.kind == "input"}
            sim = Simulator()
            one = best(lambda: execute_global(g, inputs), args.repeat)
            many = best(lambda: sim.execute(program, inputs, np.random.default_rng(0),
                                            scattered=local_inputs), args.repeat)
            print(f"{blocks:>6} {str(backward):>8} {len(g):>6} {one:>13.4f} {many:>12.4f} {many / one:>6.2f} "
                  f"{lower_s:>8.4f}")


if __name__ == "__main__":
    main()
