"""Calibration of run's time estimate: what the simulator costs on this machine.

``run`` refuses up front a run estimated to take longer than ``--max-time`` (default
``DEFAULT_MAX_TIME`` in layout_prop/runner.py); the estimate is ``SIM_COSTS`` times counts
of calls, elements and bytes (``estimate_run_time``).  This script measures each cost on
this machine, in one run, and prints:

1. kernels: microseconds per call and rank (small pieces on many ranks) and nanoseconds
   per element read or written (large pieces on 2 ranks), per op family;
2. slices and collectives: microseconds per rank and nanoseconds per piece (a local slice
   or an all-to-all cuts each rank's array into one view per member of its group: small
   pieces on groups of 256 and 1,024 ranks, fitted), and nanoseconds per byte read or
   written over all ranks (large pieces on 4 ranks);
3. buffer donation: nanoseconds per pair of ranks of a reduction whose input dies there
   (the simulator checks every rank against every other: quadratic in the ranks);
4. inputs and outputs: microseconds per rank to cut a graph input, and to assemble and
   compare an output;
5. whole runs (``run_graph``): the estimate against the measured time, and their ratio.

Each figure is the best of ``--repeat`` timings.  Compare the table with ``SIM_COSTS``.

    python benchmarks/run_estimate.py [--repeat 3] [--ranks 4096] [--groups 256 1024] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from layout_prop.api import analyze, clear_caches
from layout_prop.engines import simulator as simulator_module
from layout_prop.engines.collectives import assemble
from layout_prop.engines.simulator import Simulator
from layout_prop.io.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.runner import (DEFAULT_MAX_TIME, SIM_COSTS, compare, estimate_run_time, random_inputs,
                                run_graph)

REPEAT = 3


def best(fn, repeat: int | None = None) -> float:
    """The least wall time of ``repeat`` calls of ``fn`` (its setup returned by a first call is
    not timed: ``fn`` returns the callable to time)."""
    times = []
    for _ in range(repeat or REPEAT):
        work = fn()
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def program_of(text: str):
    """The lowered program of a spec, and every value of one simulated run (kept)."""
    clear_caches()
    graph = analyze(load_spec(text), reshard=True).graph
    program = Lower().run(graph).program
    env = Simulator().execute(program, random_inputs(graph, 0), np.random.default_rng(1))
    return graph, program, env


# ------------------------------------------------------------------------- kernels
def kernel_spec(op: str, ranks: int, size: int) -> str:
    """One ``op`` whose inputs are cut on a mesh of ``ranks`` (each rank's piece about ``size`` elements)."""
    head = f"mesh: {{shape: [{ranks}], names: [dp]}}\ninputs:\n"
    if op in ("add", "mul", "silu_mul"):
        return head + (f"  x: {{shape: [{ranks}, {size}], placements: [\"S(0)\"]}}\n"
                       f"  y: {{shape: [{ranks}, {size}], placements: [\"S(0)\"]}}\n"
                       f"nodes:\n  - {{name: z, op: {op}, inputs: [x, y]}}\n")
    if op in ("softmax", "silu"):
        return head + (f"  x: {{shape: [{ranks}, {size}], placements: [\"S(0)\"]}}\n"
                       f"nodes:\n  - {{name: z, op: {op}, inputs: [x]}}\n")
    if op == "rms_norm":
        return head + (f"  x: {{shape: [{ranks}, {size}], placements: [\"S(0)\"]}}\n  w: {{shape: [{size}]}}\n"
                       "nodes:\n  - {name: z, op: rms_norm, inputs: [x, w]}\n")
    if op == "rotary_position_embedding":
        seq = max(1, size // 64)
        return head + (f"  x: {{shape: [{ranks}, 1, {seq}, 64], placements: [\"S(0)\"]}}\n"
                       f"  cos: {{shape: [1, 1, {seq}, 64]}}\n  sin: {{shape: [1, 1, {seq}, 64]}}\n"
                       "nodes:\n  - {name: z, op: rotary_position_embedding, inputs: [x, cos, sin]}\n")
    if op == "matmul":
        rows = max(1, size // 64)
        return head + (f"  x: {{shape: [{ranks * rows}, 64], placements: [\"S(0)\"]}}\n  w: {{shape: [64, 64]}}\n"
                       "nodes:\n  - {name: z, op: matmul, inputs: [x, w]}\n")
    raise ValueError(op)


KERNEL_OPS = ("add", "mul", "silu", "softmax", "rms_norm", "rotary_position_embedding", "matmul")


def time_kernel(op: str, ranks: int, size: int) -> tuple[float, int]:
    """Seconds of the kernel op on every rank, and the elements it reads and writes (all ranks)."""
    graph, program, env = program_of(kernel_spec(op, ranks, size))
    kernel = next(o for o in program.ops if o.kind == "kernel" and o.source == "z")
    sim = Simulator()
    seconds = best(lambda: (lambda: sim._run_kernel(kernel, env, ranks)))
    elements = sum(int(a.size) for v in (*kernel.inputs, *kernel.outputs) for a in env[v])
    return seconds, elements


# ------------------------------------------------------------------------- steps
STEPS = {"local-slice": ("R", "S(0)"), "all-gather": ("S(0)", "R"), "all-reduce": ("P(sum)", "R"),
         "reduce-scatter": ("P(sum)", "S(0)"), "all-to-all": ("S(0)", "S(1)"), "local-partial": ("R", "P(sum)")}


def step_spec(kind: str, ranks: int, size: int) -> str:
    src, dst = STEPS[kind]
    cols = max(ranks, size // ranks * ranks) if kind == "all-to-all" else max(1, size)
    rows = ranks
    return (f"mesh: {{shape: [{ranks}], names: [dp]}}\ninputs:\n"
            f"  x: {{shape: [{rows}, {cols}], placements: [\"{src}\"]}}\n"
            f"nodes:\n  - {{name: z, op: redistribute, inputs: [x], attrs: {{placements: [\"{dst}\"]}}}}\n")


def time_step(kind: str, ranks: int, size: int, donate: bool = False) -> tuple[float, int]:
    """Seconds of the step on every group, and the bytes it reads and writes (all ranks)."""
    graph, program, env = program_of(step_spec(kind, ranks, size))
    op = next(o for o in program.ops if o.step is not None)
    sim = Simulator()

    def setup():
        fresh = dict(env)
        fresh[op.inputs[0]] = [a.copy() for a in env[op.inputs[0]]]  # owned by nobody else: donatable
        return lambda: sim._run_step(op, fresh, donate)

    seconds = best(setup)
    nbytes = sum(int(a.nbytes) for v in (*op.inputs, *op.outputs) for a in env[v])
    return seconds, nbytes


# ------------------------------------------------------------------------- inputs and outputs
def time_io(ranks: int, size: int) -> tuple[float, float, float, float]:
    """Seconds to cut an input of ``size`` elements a rank, to assemble and compare an output
    (both per rank), to draw an input and to assemble and compare an output (both per element)."""
    text = (f"mesh: {{shape: [{ranks}], names: [dp]}}\ninputs:\n  x: {{shape: [{ranks}, {size}], "
            "placements: [\"S(0)\"]}\nnodes:\n  - {name: z, op: neg, inputs: [x]}\n")
    graph, program, env = program_of(text)
    inputs = random_inputs(graph, 0)
    op = program.ops[0]
    cut = best(lambda: (lambda: simulator_module._cut_input(op, inputs, None, None)))
    spec = program.specs["z"]
    reference = -inputs["x"]
    check = best(lambda: (lambda: compare("z", assemble(env["z"], spec), reference, spec)))
    draw = best(lambda: (lambda: random_inputs(graph, 0)))
    elements = ranks * size
    return cut / ranks, check / ranks, draw / elements, check / elements


# ------------------------------------------------------------------------- whole runs
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CASES = {
    "rpe dp_tp_sp (8 ranks)": (EXAMPLES / "rpe" / "dp_tp_sp.yaml", True),
    "llama block (8 ranks)": (EXAMPLES / "llama_block.yaml", True),
}


def rpe_spec(dp: int, tp: int, sp: int, d: int = 8, grads: bool = True) -> str:
    """RoPE of x (S(0), S(1), S(2)); cos and sin cut on sp with gradients (their gradients are
    all-reduced over dp and tp), or replicated without (sliced on every rank instead)."""
    table = "placements: [R, R, \"S(2)\"]" if grads else "requires_grad: false"
    return (f"mesh: {{shape: [{dp}, {tp}, {sp}], names: [dp, tp, sp]}}\ninputs:\n"
            f"  x:   {{shape: [{dp}, {tp}, {sp}, {d}], placements: [\"S(0)\", \"S(1)\", \"S(2)\"]}}\n"
            f"  cos: {{shape: [1, 1, {sp}, {d}], {table}}}\n"
            f"  sin: {{shape: [1, 1, {sp}, {d}], {table}}}\n"
            "nodes:\n  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}\n")


def whole_runs(quick: bool):
    from layout_prop.frontends.generate import llama_spec

    cases = [(name, path.read_text(), backward) for name, (path, backward) in CASES.items()]
    cases.append(("rpe 256 ranks", rpe_spec(4, 4, 16), True))
    if not quick:
        cases.append(("rpe 1024 ranks", rpe_spec(4, 4, 64), True))
        cases.append(("rpe 2048 ranks", rpe_spec(4, 8, 64), True))
        cases.append(("rpe 4096 ranks", rpe_spec(4, 4, 256), True))
        cases.append(("rpe 4096 ranks, no grad of cos, sin", rpe_spec(4, 4, 256, grads=False), True))
        cases.append(("rpe 256 ranks, big pieces", rpe_spec(4, 4, 16, d=4096), True))
        cases.append(("llama 2 layers, 64 ranks", llama_spec(2, (("dp", 4), ("sp", 4), ("tp", 4)), batch=4, seq=16,
                                                             hidden=64, heads=4, ffn=128), True))
        cases.append(("llama 1 layer, 1 rank, big", llama_spec(1, (("dp", 1), ("sp", 1), ("tp", 1)), batch=2,
                                                               seq=256, hidden=512, heads=8, ffn=1024), True))
    rows = []
    for name, text, backward in cases:
        clear_caches()
        graph = analyze(load_spec(text), reshard=True, backward=backward).graph
        estimate = estimate_run_time(graph)
        start = time.perf_counter()
        report = run_graph(load_spec(text), backward=backward)
        measured = time.perf_counter() - start
        assert report.ok, name
        rows.append((name, estimate, measured))
    return rows


def main() -> None:
    global REPEAT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4096, help="ranks of the per-rank measurements")
    parser.add_argument("--groups", type=int, nargs=2, default=[256, 1024],
                        help="the two group sizes the per-rank cost of slices and collectives is fitted on (a mesh "
                             "axis of 256 to 1,024 ranks; larger groups cost more per piece: caches)")
    parser.add_argument("--quick", action="store_true", help="fewer ops and smaller whole runs")
    args = parser.parse_args()
    REPEAT = args.repeat
    ranks = args.ranks

    print(f"SIM_COSTS in layout_prop/runner.py: {SIM_COSTS}; DEFAULT_MAX_TIME {DEFAULT_MAX_TIME:g} s\n")
    print("kernels                      us/call/rank  ns/element")
    calls, per_element = [], []
    for op in KERNEL_OPS[:3] if args.quick else KERNEL_OPS:
        small, _ = time_kernel(op, ranks, 8)
        large, elements = time_kernel(op, 2, 1 << 20)
        calls.append(small / ranks)
        per_element.append(large / elements)
        print(f"  {op:<26} {small / ranks * 1e6:>12.2f} {large / elements * 1e9:>11.2f}")
    print(f"  {'median':<26} {statistics.median(calls) * 1e6:>12.2f} {statistics.median(per_element) * 1e9:>11.2f}")
    print(f"  {'SIM_COSTS':<26} {SIM_COSTS['kernel_call'] * 1e6:>12.2f} {SIM_COSTS['element'] * 1e9:>11.2f}")

    print("\nslices and collectives       us/rank   ns/piece     ns/byte   (a rank's cost: us + ns x group size)")
    step_ranks, per_piece, per_byte = [], [], []
    n1, n2 = args.groups
    for kind in STEPS:  # per rank: a + b x group size (the pieces a slice or all-to-all cuts), fitted on two sizes
        small, _ = time_step(kind, n1, 8)
        big, _ = time_step(kind, n2, 8)
        t1, t2 = small / n1, big / n2
        b = max(0.0, (t2 - t1) / (n2 - n1))
        a = max(0.0, t1 - b * n1)
        large, nbytes = time_step(kind, 4, 1 << 20)
        step_ranks.append(a)
        if kind in ("local-slice", "all-to-all"):
            per_piece.append(b)
        if kind != "local-slice":  # a view: no bytes
            per_byte.append(large / nbytes)
        print(f"  {kind:<26} {a * 1e6:>8.2f} {b * 1e9:>10.1f} {large / nbytes * 1e9:>11.3f}")
    print(f"  {'median':<26} {statistics.median(step_ranks) * 1e6:>8.2f} {statistics.median(per_piece) * 1e9:>10.1f} "
          f"{statistics.median(per_byte) * 1e9:>11.3f}")
    print(f"  {'SIM_COSTS':<26} {SIM_COSTS['step_rank'] * 1e6:>8.2f} {SIM_COSTS['step_piece'] * 1e9:>10.1f} "
          f"{SIM_COSTS['byte'] * 1e9:>11.3f}")

    print("\nbuffer donation (all-reduce whose input dies)   ns/rank pair")
    pairs = []
    for n in (ranks // 4, ranks // 2, ranks) if not args.quick else (ranks // 2, ranks):
        kept, _ = time_step("all-reduce", n, 8)
        donated, _ = time_step("all-reduce", n, 8, donate=True)
        pairs.append((donated - kept) / n ** 2)
        print(f"  {n:>6} ranks: {donated:.3f} s donating, {kept:.3f} s not: {(donated - kept) / n ** 2 * 1e9:>8.2f}")
    print(f"  SIM_COSTS: {SIM_COSTS['donation_pair'] * 1e9:.2f}")

    print("\ninputs and outputs           us/rank   ns/element")
    cut, check, _, _ = time_io(ranks, 8)
    _, _, draw, checked = time_io(4, 1 << 20)
    print(f"  cut an input               {cut * 1e6:>8.2f}")
    print(f"  assemble and compare       {check * 1e6:>8.2f} {checked * 1e9:>11.1f}")
    print(f"  draw an input                       {draw * 1e9:>11.1f}")
    print(f"  SIM_COSTS                  {SIM_COSTS['rank_io'] * 1e6:>8.2f}   "
          f"in {SIM_COSTS['input_element'] * 1e9:.0f}, out {SIM_COSTS['output_element'] * 1e9:.0f}")

    print("\nwhole runs (run_graph, backward)         estimate s  measured s  estimate/measured  largest part")
    for name, estimate, measured in whole_runs(args.quick):
        part, seconds = max(estimate.parts().items(), key=lambda item: item[1])
        print(f"  {name:<38} {estimate.seconds:>10.2f} {measured:>11.2f} {estimate.seconds / measured:>18.2f}"
              f"  {part} {seconds:.2f} s")

if __name__ == "__main__":
    main()
