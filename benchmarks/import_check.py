"""Import benchmark: an ONNX Llama model of N layers, imported with a plan and checked end to end.

The model is :func:`layout_prop.frontends.samples.llama_onnx` (each layer laid out as
torch.onnx.export writes a Llama decoder layer: decomposed RMSNorm, rotate-half RoPE,
attention as MatMul/Softmax, SwiGLU), saved to a file; the timed part is what
``layout-prop check MODEL.onnx --plan PLAN --reshard`` does after start-up: read the file,
infer shapes, fold shape subgraphs, canonicalise, lower to a spec, apply the plan, load
the spec, propagate, reshard and check.  It prints, per size, the ONNX node count, the
imported graph's node count, the import and the check times (best of ``--repeat`` runs
with the sizes interleaved) and their sum, and the ratio of totals between the largest
and the smallest size, measured in the same run.
Run: ``python benchmarks/import_check.py [--layers 32 160] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from layout_prop.api import analyze, clear_caches
from layout_prop.frontends import load_model
from layout_prop.frontends.samples import LLAMA_PLAN, llama_onnx


def measure(path: Path) -> tuple[float, float, int]:
    """(import seconds, check seconds, graph nodes) of one cold run."""
    clear_caches()
    start = time.perf_counter()
    graph = load_model(path, LLAMA_PLAN)
    imported = time.perf_counter()
    analysis = analyze(graph, reshard=True)
    checked = time.perf_counter()
    assert analysis.ok
    return imported - start, checked - imported, len(graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 160])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import onnx

    with tempfile.TemporaryDirectory() as folder:
        paths, onnx_nodes = {}, {}
        for layers in args.layers:
            model = llama_onnx(layers=layers)
            onnx_nodes[layers] = len(model.graph.node)
            paths[layers] = Path(folder) / f"llama{layers}.onnx"
            onnx.save(model, str(paths[layers]))
        best: dict[int, tuple[float, float, int]] = {}
        for _ in range(args.repeat):
            for layers in args.layers:
                run = measure(paths[layers])
                if layers not in best or sum(run[:2]) < sum(best[layers][:2]):
                    best[layers] = run
    print(f"{'layers':>6} {'onnx nodes':>10} {'graph nodes':>11} {'import s':>9} {'check s':>8} {'total s':>8}")
    for layers in args.layers:
        imp, chk, nodes = best[layers]
        print(f"{layers:>6} {onnx_nodes[layers]:>10} {nodes:>11} {imp:>9.3f} {chk:>8.3f} {imp + chk:>8.3f}")
    small, large = min(args.layers), max(args.layers)
    if small != large:
        ratio = sum(best[large][:2]) / sum(best[small][:2])
        print(f"total({large})/total({small}): {ratio:.2f} for {large / small:.1f}x the layers")


if __name__ == "__main__":
    main()
