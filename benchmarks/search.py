"""How fast ``plan --search`` is: an 80-layer model on 1,024 devices (issue #31, item 5).

Target: at least 200 candidate configurations searched in at most 60 s on this machine.
The model is a Llama-2-70B-shaped ``gen llama --full`` (80 layers, hidden 8192, 64 heads,
8 key/value heads, ffn 28672, sequence 4096, vocabulary 32000, float16) on ``a100-80g``,
global batch 1024.  The spec is generated and loaded first (not timed: it is the input);
the timing is the search itself (layer recognition, the one-layer estimates, the
composition of every candidate, the ranking), measured in this run.

    python benchmarks/search.py [--layers 80] [--devices 1024] [--global-batch 1024] [--cluster a100-80g]
"""

from __future__ import annotations

import argparse
import time

from layout_prop.workflows.search import format_result, load_model_shape, run_search
from layout_prop.frontends.generate import llama_spec
from layout_prop.io.loader import load_spec
from layout_prop.perf.clusters import get_cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--cluster", default="a100-80g")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    build = time.perf_counter()
    spec = llama_spec(layers=args.layers, mesh=(("dp", 1), ("sp", 1), ("tp", 8)), batch=1, seq=4096, hidden=8192,
                      heads=64, kv_heads=8, ffn=28672, dtype="float16", full=True, vocab=32000)
    graph = load_spec(spec)
    build = time.perf_counter() - build
    start = time.perf_counter()
    model = load_model_shape(graph)
    result = run_search(model, get_cluster(args.cluster), args.devices, args.global_batch)
    took = time.perf_counter() - start
    print(format_result(result, args.top))
    print(f"spec built and loaded in {build:.1f} s (not timed); search {took:.1f} s for {result.candidates:,} "
          f"candidates ({result.layer_evaluations} one-layer estimates, {took / result.candidates * 1e3:.2f} ms a "
          f"candidate); target: at least 200 candidates in at most 60 s: "
          f"{'met' if result.candidates >= 200 and took <= 60 else 'NOT met'}")


if __name__ == "__main__":
    main()
