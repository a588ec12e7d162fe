"""msrun benchmark: the 8-rank Llama block, forward and backward, as 1 node x 8 and as 2 nodes x 4.

Both layouts run on this one machine through ``layout-prop``'s MindSpore engine
(``MsrunEngine``): one msrun with 8 workers, or two msruns of 4 workers each
(``emulate_nodes=2``, master 127.0.0.1), whose results then travel to every node over
the collective backend instead of the run folder.  The wall time of
``MsrunEngine.execute`` (msrun start, MindSpore import and cluster set-up in every worker,
the program, the results back) is measured for each, interleaved, best of ``--repeat``;
the ratio says what the second msrun and the collective gather of the results cost here.
It is not a target: on a real cluster the nodes are other machines.

Run: ``cd benchmarks && python msrun_nodes.py [--repeat 2] [--layers 1] [--seq 8] [--hidden 32]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from layout_prop.api import analyze
from layout_prop.engines.msrun_engine import MsrunEngine
from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec
from layout_prop.passes.lower import Lower
from layout_prop.runner import random_inputs

LAYOUTS = {"1 x 8": None, "2 x 4": 2}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    args = parser.parse_args(argv)
    spec = llama_spec(args.layers, mesh=(("dp", 2), ("sp", 2), ("tp", 2)), seq=args.seq, hidden=args.hidden)
    graph = analyze(load_spec(spec), reshard=True, backward=True).graph
    program = Lower().run(graph).program
    inputs = random_inputs(graph, 0)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(args.repeat):
        for name, nodes in LAYOUTS.items():  # interleaved: both see the same machine load
            engine = MsrunEngine(timeout=600, emulate_nodes=nodes)
            start = time.perf_counter()
            engine.execute(program, inputs, np.random.default_rng(1), wanted=list(graph.outputs))
            times[name].append(time.perf_counter() - start)
    print(f"Llama block, {args.layers} layer(s), seq {args.seq}, hidden {args.hidden}, forward and backward, "
          f"8 ranks (dp 2 x sp 2 x tp 2), best of {args.repeat}")
    print(f"{'nodes x workers':>16} {'best s':>8} {'all runs s':>24}")
    for name, runs in times.items():
        print(f"{name:>16} {min(runs):8.1f} {' '.join(f'{t:.1f}' for t in runs):>24}")
    print(f"time(2 x 4) / time(1 x 8): {min(times['2 x 4']) / min(times['1 x 8']):.2f}")


if __name__ == "__main__":
    main()
