"""``layout-prop demo``: the main job on a built-in example, with no files needed.

It analyses the upstream RotaryPositionEmbedding scenario on a dp x tp x sp mesh of 8
ranks (x sharded on B, N and S; cos/sin broadcast along B and N, sharded on S like x),
prints the layout table and the redistributions, then lowers it and runs every rank in
the simulator, forward and backward, and says whether it matches one device.
"""

from __future__ import annotations

DEMO_SPEC = """
mesh: {shape: [2, 2, 2], names: [dp, tp, sp]}
inputs:
  x:   {shape: [4, 8, 32, 64], placements: ["S(0)", "S(1)", "S(2)"]}
  cos: {shape: [1, 1, 32, 64], placements: [R, R, "S(2)"]}
  sin: {shape: [1, 1, 32, 64], placements: [R, R, R]}
  w:   {shape: [64], placements: [R, R, R]}
nodes:
  - {name: q_rot, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}
  - {name: y, op: mul, inputs: [q_rot, w]}
outputs: [y]
"""


def run_demo(print_fn=print) -> bool:
    """Run the demo; returns whether the simulated ranks match one device."""
    from .api import analyze, format_table
    from .loader import load_spec
    from .runner import run_graph

    print_fn("layout-prop demo: RotaryPositionEmbedding then a scale, on a dp x tp x sp mesh of 8 ranks")
    print_fn("")
    print_fn(format_table(analyze(load_spec(DEMO_SPEC), backward=True, reshard=True)))
    print_fn("")
    rep = run_graph(load_spec(DEMO_SPEC), backward=True, seed=0)
    for title, table in (("output", rep.outputs), ("gradient", rep.grads)):
        for name, err in table.items():
            print_fn(f"{title} {name}: max relative error {err['max_rel_err']:.2g} against one device")
    print_fn("simulated 8 ranks forward and backward: " + ("matches one device" if rep.ok else
                                                            "MISMATCH: " + "; ".join(rep.mismatches)))
    return rep.ok
