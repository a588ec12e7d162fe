"""Every command accounts for every value: a value with no layout is a ``no-layout`` violation
naming the node that stopped propagation, never a value left out of a clean report."""

from __future__ import annotations

from pathlib import Path

import pytest

from layout_prop import OpRule, RuleResult, register_op
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, OpError
from layout_prop.core.registry import is_registered, registered_ops
from layout_prop.io.loader import load_spec
from layout_prop.testing import combination_specs

ROOT = Path(__file__).resolve().parent.parent

#: the issue's reproducer: an opaque node with no inputs (``import --opaque`` writes them)
OPAQUE_SOURCE = """\
mesh: {shape: [2], names: [dp]}
inputs:
  x: {shape: [4, 8], placements: ["S(0)"]}
nodes:
  - {name: c, op: opaque, inputs: [], attrs: {op_type: CastLike, shape: [], dtype: float32}}
  - {name: y, op: mul, inputs: [x, c]}
  - {name: z, op: softmax, inputs: [y]}
outputs: [z]
"""

SILENT = """\
mesh: {shape: [2], names: [dp]}
inputs:
  x: {shape: [4, 8], placements: ["S(0)"]}
nodes:
  - {name: s, op: silent_test_op, inputs: [x]}
  - {name: y, op: relu, inputs: [s]}
  - {name: z, op: add, inputs: [y, x]}
outputs: [z]
"""


if not is_registered("silent_test_op"):
    @register_op
    class SilentTestOp(OpRule):
        """A rule that describes no output and says nothing: what the check must not stay silent about."""

        name = "silent_test_op"
        operands = ("x",)

        def infer_layout(self, inputs, attrs):
            return RuleResult((None,))


def unaccounted(graph) -> list[str]:
    """Values with no layout and no violation at their node or upstream of it."""
    blamed: set[str] = set()
    missing = []
    for node in graph.topo_order():
        if node.is_input:
            continue
        explained = bool(node.meta.get(meta.VIOLATIONS)) or any(value in blamed for value in node.inputs)
        specs = node.meta.get(meta.SPECS) or (None,) * node.num_outputs
        for value, spec in zip(node.outputs, specs):
            if spec is None:
                if explained:
                    blamed.add(value)
                else:
                    missing.append(value)
    return missing


def test_an_opaque_node_without_inputs_takes_its_declared_shape_replicated(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(OPAQUE_SOURCE)
    assert main(["check", str(spec)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.strip() and line[0] != " "}
    assert rows["c"][1:4] == ["[]", "float32", "(R)"]
    assert rows["y"][1:5] == ["[4,", "8]", "float32", "(S(0))"] and "z" in rows
    assert "no violations" in out


def test_a_rule_that_describes_nothing_is_reported_with_every_value_after_it(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(SILENT)
    for flags in ([], ["--backward"], ["--reshard"]):
        assert main(["check", str(spec), *flags]) == 1
        out = capsys.readouterr().out
        assert "no violations" not in out
        assert "[no-layout] s (silent_test_op): value 's' has no layout: the rule of 'silent_test_op' describes " \
               "no output for its inputs" in out
        for value in ("y", "z"):
            assert f"value {value!r} has no layout: propagation stopped at node 's' (silent_test_op)" in out
    analysis = analyze(load_spec(SILENT))
    assert [(v.code, v.node, v.details["stopped_at"]) for v in analysis.check.violations] == [
        ("no-layout", "s", "s"), ("no-layout", "y", "s"), ("no-layout", "z", "s")]
    assert not analysis.ok


def test_values_after_a_violation_are_explained_by_it_not_reported_again():
    # a sharded contraction dim into an opaque op's consumer is a violation of its own; the
    # values after a refused node are covered by that violation
    g = load_spec(SILENT.replace("silent_test_op", "relu"))
    assert analyze(g).ok and unaccounted(analyze(g).graph) == []


def test_run_refuses_a_graph_with_a_value_without_layout(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(SILENT)
    assert main(["run", str(spec)]) in (1, 2)
    out, err = capsys.readouterr()
    assert "no-layout" in out + err


def _built_in_ops() -> list[str]:
    import layout_prop.frontends.pointwise  # noqa: F401  (the ops imported models use)

    # the ops layout_prop itself registers: other test files register ops of their own (at
    # import, so which of them are present depends on the order pytest collects in)
    return sorted(name for name, rule in registered_ops().items()
                  if name == rule.name and type(rule).__module__.startswith("layout_prop."))


#: ops with no sample inputs of their own: gradient ops (reached through --backward of their
#: forward op below), the explicit redistribute (every move of every op's --reshard) and
#: opaque (tested above and through the importers)
WALKED_OTHERWISE = {"embedding_grad", "max_grad", "sum_grad", "rotary_position_embedding_grad", "redistribute",
                    "opaque"}


@pytest.mark.parametrize("op", _built_in_ops())
def test_every_value_of_every_op_database_graph_has_a_layout_or_a_named_reason(op):
    try:
        specs = combination_specs(op, meshes=[(2,), (2, 2)], placements=4, seed=1)
    except OpError as err:
        assert err.code == "no-samples" and op in WALKED_OTHERWISE
        return
    analysed = 0
    for spec in specs:
        try:
            graph = load_spec(spec)
        except LayoutPropError:  # a layout that cannot exist: unusable input (exit 2), as verify skips it
            continue
        for backward, reshard in ((False, False), (True, True)):
            analysis = analyze(graph.copy_structure(), backward=backward, reshard=reshard)
            assert unaccounted(analysis.graph) == [], spec
            no_layout = [v for v in analysis.check.violations if v.code == "no-layout"]
            assert no_layout == [], (spec, no_layout)
        analysed += 1
    assert analysed


@pytest.mark.parametrize("model", ["llama_block.onnx", "llama_block.mindir"])
@pytest.mark.parametrize("backward", [False, True])
def test_every_value_of_an_imported_model_has_a_layout(model, backward):
    pytest.importorskip("onnx")
    from layout_prop.frontends import load_model

    graph = load_model(ROOT / "examples" / model, ROOT / "examples" / "llama_plan.yaml")
    analysis = analyze(graph, backward=backward)
    assert unaccounted(analysis.graph) == []
    specs = [s for n in analysis.graph.nodes if not n.is_input for s in n.meta[meta.SPECS]]
    assert specs and all(s is not None for s in specs)
