"""``layout-prop demo``: the main job on a built-in example, with no files needed.

It analyses the built-in Llama decoder block (RMSNorm, Q/K/V linears, reshape to heads,
RotaryPositionEmbedding on q and k, causal attention, output projection, SwiGLU MLP,
residual adds) on a dp x sp x tp mesh of 8 ranks with Megatron tensor and sequence
parallelism: it prints the layout table, the violations the declared layouts have and
the redistributions that fix them with their bytes, writes ``layout-prop-demo.html``
(the sharding flow, forward and backward) in the current folder, then lowers the block
and runs all 8 ranks in the simulator, forward and backward, and says whether every
output and gradient matches one device.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

__all__ = ["run_demo", "DEMO_HTML", "run"]

DEMO_HTML = "layout-prop-demo.html"


def run_demo(print_fn: Callable[[str], None] = print, folder: Path | None = None) -> bool:
    """Run the demo; returns whether the simulated ranks match one device."""
    from layout_prop.api import analyze, format_table
    from layout_prop.io.loader import load_spec
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.viz import write_graph
    from layout_prop.runner import run_graph
    from layout_prop.io.output import check_output

    path = (folder or Path.cwd()) / DEMO_HTML
    check_output(path)  # a folder one cannot write to is said before the demo starts
    spec = llama_spec(layers=1)
    print_fn("layout-prop demo: a Llama decoder block with RotaryPositionEmbedding on a dp x sp x tp mesh "
             "of 8 ranks (Megatron tensor + sequence parallelism)")
    print_fn("")
    plain = analyze(load_spec(spec))
    print_fn(f"1. As declared, the block has {len(plain.check.violations)} layout violations "
             "(each a collective Megatron inserts by hand):")
    for v in plain.check.violations:
        print_fn(f"   [{v.code}] {v.node}: input {v.input}")
    print_fn("")
    fixed = analyze(load_spec(spec), reshard=True, backward=True)
    print_fn("2. With --reshard and --backward (layouts, then the inserted redistributions):")
    print_fn(format_table(fixed))
    print_fn("")
    write_graph(fixed.graph, path, check=fixed.check, title="Llama block, --reshard --backward")
    print_fn(f"3. Wrote {path.resolve()}: open it in a browser; hover a value to see its spec and moves.")
    rep = run_graph(load_spec(spec), backward=True, seed=0)
    worst_out = max(e["max_rel_err"] for e in rep.outputs.values())
    worst_grad = max(e["max_rel_err"] for e in rep.grads.values())
    print_fn(f"4. Simulated all 8 ranks forward and backward with {len(rep.collectives)} collectives: "
             f"{len(rep.outputs)} output(s) and {len(rep.grads)} gradients, largest relative error "
             f"{max(worst_out, worst_grad):.1e}: " + ("matches one device" if rep.ok else
                                                    "MISMATCH: " + "; ".join(rep.mismatches)))
    return rep.ok


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop demo``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("demo", help="analyse and simulate a built-in example (no files needed; writes "
                   "./layout-prop-demo.html)")
    return parser


def run(args) -> int:
    """``layout-prop demo``: 0 when the simulated ranks match one device."""
    return 0 if run_demo() else 1
