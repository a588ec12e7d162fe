"""Simulator benchmark: all ranks of an 8-rank mesh in one process vs one device.

For generated Llama graphs (Megatron TP + SP on dp x sp x tp, forward, or forward and
backward; ``--graph rpe`` for chains of RPE blocks), measures in the same run the wall
time of executing every rank's lowered program in the simulator (collectives included)
and of executing the global graph once on one device with the same numpy kernels, and
prints the ratio.  Lowering and input scattering are timed apart (they are done once per
program, not per step).  Both sides are asked for the graph's outputs only (``wanted``), as
``layout-prop run`` asks: each drops every other value after its last use (memory the
allocator can then hand out again without new page faults), and the simulator's
reductions also reuse dying buffers.

Three Llama sizes (``--size``): ``small`` (batch 4, sequence 128, hidden 256, 8 heads of
32, ffn 512), ``base`` (batch 2, sequence 256, hidden 1024, 8 heads of 128 as in Llama,
ffn 2816) and ``large`` (base with batch 8 and sequence 512: 4,096 tokens, 1,024 per
data-parallel rank).  The tokens per rank set the inner dimension of the per-rank
weight-gradient products: at 128 (small, base) they run at a third to two thirds of the
speed of the one-device products.

Inputs come from ``random_inputs``, which draws the weights of products with standard
deviation 1/sqrt(fan-in) as a model is initialised: with unit-variance weights the
attention softmax saturates and its gradients fill with float32 subnormals, whose
arithmetic is ten times slower and says nothing about the simulator.

Run: ``cd benchmarks && python simulate.py [--graph llama|rpe] [--size small base large]
[--blocks 1 4] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from layout_prop.api import analyze
from layout_prop.engines.collectives import scatter_global
from layout_prop.engines.simulator import Simulator
from layout_prop.passes.lower import Lower
from layout_prop.runner import execute_global, random_inputs

from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec

from propagate import build  # noqa: E402  (benchmarks/ is the working folder)

#: Llama widths: batch, seq, hidden, heads, ffn.
SIZES = {
    "small": dict(batch=4, seq=128, hidden=256, heads=8, ffn=512),
    "base": dict(batch=2, seq=256, hidden=1024, heads=8, ffn=2816),
    "large": dict(batch=8, seq=512, hidden=1024, heads=8, ffn=2816),
}


def llama(layers: int, size: str = "small"):
    return load_spec(llama_spec(layers, **SIZES[size]))


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
    parser.add_argument("--size", choices=list(SIZES), nargs="+", default=list(SIZES),
                        help="Llama sizes to run (default all)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--graph", choices=["llama", "rpe"], default="llama")
    args = parser.parse_args()
    blocks_list = args.blocks or ([1, 4] if args.graph == "llama" else [4, 16])
    sizes = args.size if args.graph == "llama" else ["-"]
    print(f"graph: {args.graph}")
    print(f"{'size':>5} {'blocks':>6} {'backward':>8} {'nodes':>6} {'one device s':>13} {'simulator s':>12} "
          f"{'ratio':>6} {'lower s':>8}")
    for size in sizes:
        for blocks in blocks_list:
            for backward in (False, True):
                source = llama(blocks, size) if args.graph == "llama" else build(3 * blocks)
                g = analyze(source, backward=backward, reshard=True).graph
                start = time.perf_counter()
                program = Lower().run(g).program
                lower_s = time.perf_counter() - start
                inputs = random_inputs(g, 0)
                # pre-scatter the inputs so both sides start from data in place
                local_inputs = {op.name: scatter_global(inputs[op.name], op.specs[0]) for op in program.ops
                                if op.kind == "input"}
                sim = Simulator()
                wanted = list(g.outputs)
                one = best(lambda: execute_global(g, inputs, wanted=wanted), args.repeat)
                many = best(lambda: sim.execute(program, inputs, np.random.default_rng(0),
                                                scattered=local_inputs, wanted=wanted), args.repeat)
                print(f"{size:>5} {blocks:>6} {str(backward):>8} {len(g):>6} {one:>13.4f} {many:>12.4f} "
                      f"{many / one:>6.2f} {lower_s:>8.4f}")


if __name__ == "__main__":
    main()
