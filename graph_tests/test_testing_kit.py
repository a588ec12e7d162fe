"""The testing kit catches wrong transfer functions and shrinks them to a minimal failing spec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given

from layout_prop import Layout, OpRule, RuleResult, Shard, TensorSpec, register_kernel, register_op
from layout_prop.cli import main
from layout_prop.io.loader import load_spec
from layout_prop.runner import run_graph
from layout_prop.testing import OpSample, verify_op
from layout_prop.testing.strategies import meshes, tensor_specs

ROOT = Path(__file__).resolve().parent.parent


@register_op
class _KitWrongRowSum(OpRule):
    """sum over dim 1; claims S(0) for any shard, where sharding dim 1 really gives P(sum)."""

    name = "kit_wrong_row_sum"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        ps = [Shard(0) if p.is_shard() else p for p in x.layout.placements]
        return RuleResult((TensorSpec(x.shape[:1], x.dtype, Layout(x.mesh, ps, 1)),))


@register_op
class _KitNoBroadcastAdd(OpRule):
    """a + b with numpy broadcasting; forgets that b's dims align from the right."""

    name = "kit_no_broadcast_add"
    operands = ("a", "b")

    def infer_layout(self, inputs, attrs):
        a, b = inputs
        ps = [pa if pa.is_shard() else pb for pa, pb in zip(a.layout.placements, b.layout.placements)]
        return RuleResult((TensorSpec(a.shape, a.dtype, Layout(a.mesh, ps, a.ndim)),))


@register_op
class _KitWrongFlatten(OpRule):
    """(a, b) -> (a*b); claims a shard of the inner dim b maps to a shard of the flat dim."""

    name = "kit_wrong_flatten"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        ps = [Shard(0) if p.is_shard() else p for p in x.layout.placements]
        return RuleResult((TensorSpec((x.shape[0] * x.shape[1],), x.dtype, Layout(x.mesh, ps, 1)),))


register_kernel("kit_wrong_row_sum", lambda x: x.sum(axis=1))
register_kernel("kit_no_broadcast_add", lambda a, b: a + b)
register_kernel("kit_wrong_flatten", lambda x: x.reshape(-1))


def _only_mismatch_causes(spec: dict) -> list[str]:
    return [p for entry in spec["inputs"].values() for p in entry["placements"] if p != "R"]


def test_kit_catches_shard_claimed_where_the_truth_is_partial():
    report = verify_op("kit_wrong_row_sum", [OpSample([(6, 5)], partial_ok=False)], meshes=[(2, 2)],
                       backward=False)
    assert report.mismatches
    minimal = report.mismatches[0].spec
    # shrunk to one mesh axis, x sharded on the summed dim only, smaller shapes
    assert minimal["mesh"]["shape"] == [2]
    assert minimal["inputs"]["x"]["placements"] == ["S(1)"]
    assert minimal["inputs"]["x"]["shape"][0] < 6 and minimal["inputs"]["x"]["shape"][1] <= 5
    # the minimal spec is ready to run and still fails
    assert not run_graph(load_spec(minimal)).ok
    # sharding dim 0 is right: those combinations are accepted
    assert report.accepted > 0


def test_kit_catches_a_rule_that_forgets_broadcasting():
    report = verify_op("kit_no_broadcast_add", [OpSample([(4, 6), (6,)], partial_ok=False)], meshes=[(2,)],
                       backward=False)
    assert report.mismatches
    minimal = report.mismatches[0].spec
    assert minimal["inputs"]["b"]["placements"] == ["S(0)"]
    assert minimal["inputs"]["a"]["placements"] == ["R"]
    assert "kit_no_broadcast_add" in report.mismatches[0].message or "b" in json.dumps(minimal)


def test_kit_catches_a_wrong_reshape_mapping():
    report = verify_op("kit_wrong_flatten", [OpSample([(4, 6)], partial_ok=False)], meshes=[(2,), (2, 2)],
                       backward=False)
    assert report.mismatches
    minimal = report.mismatches[0].spec
    assert minimal["mesh"]["shape"] == [2] and minimal["inputs"]["x"]["placements"] == ["S(1)"]
    # a shard of the outer dim really is a shard of the flat dim: accepted and right
    assert report.accepted > 0


def test_verify_cli_passes_for_rope_on_2x2(capsys):
    assert main(["verify", "rotary_position_embedding", "--mesh", "2x2", "--backward", "--samples", "300",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["op"] == "rotary_position_embedding" and out["mismatches"] == []
    assert out["combinations"] >= 300 and set(out["rejected"]) <= {
        "partial-input", "sharded-rotation-dim", "sharding-mismatch"}


def test_verify_cli_exits_1_and_prints_the_minimal_spec_for_a_wrong_rule(tmp_path):
    module = tmp_path / "wrong_op.py"
    module.write_text('''
from layout_prop import Layout, OpRule, RuleResult, Shard, TensorSpec, register_kernel, register_op
from layout_prop.testing import OpSample

@register_op
class WrongColSum(OpRule):
    name = "user_wrong_col_sum"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        ps = [Shard(0) if p.is_shard() else p for p in x.layout.placements]
        return RuleResult((TensorSpec(x.shape[1:], x.dtype, Layout(x.mesh, ps, 1)),))

    def sample_inputs(self):
        return [OpSample([(4, 6)], partial_ok=False)]

register_kernel("user_wrong_col_sum", lambda x: x.sum(axis=0))
''')
    out = subprocess.run([sys.executable, "-m", "layout_prop.cli", "verify", "user_wrong_col_sum", "--module",
                          str(module), "--json"], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    assert data["mismatches"]
    assert data["mismatches"][0]["spec"]["inputs"]["x"]["placements"] in (["S(0)"], ["S(1)"])


def test_verify_cli_on_the_readme_custom_op_example():
    out = subprocess.run([sys.executable, "-m", "layout_prop.cli", "verify", "fused_rope_scale", "--module",
                          str(ROOT / "examples" / "custom_op" / "fused_rope_scale.py"), "--backward",
                          "--samples", "60"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all combinations are right" in out.stdout


def test_verify_cli_errors_are_one_line_exit_2(capsys):
    assert main(["verify", "no_such_op"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown-op" in err[0]
    assert main(["verify", "rope", "--module", "/nonexistent/x.py"]) == 2
    assert "module-not-found" in capsys.readouterr().err


@given(tensor_specs(max_rank=3))
def test_strategies_produce_specs_that_exist(spec):
    # every drawn spec can be scattered: one block per replica group covers the tensor once
    count = np.zeros(spec.shape, dtype=int)
    for group in spec.replica_groups():
        count[spec.local_index(group[0])] += 1
    assert (count == 1).all()


@given(meshes())
def test_strategies_meshes_are_small(mesh):
    assert mesh.size <= 8 and 1 <= mesh.ndim <= 3


def test_a_rule_that_raises_is_reported_as_rule_failed(tmp_path, capsys):
    module = tmp_path / "raising_op.py"
    module.write_text('''
from layout_prop import OpRule, register_kernel, register_op
from layout_prop.testing import OpSample

@register_op
class Raising(OpRule):
    name = "user_raising_rule"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        return {}["oops"]

    def sample_inputs(self):
        return [OpSample([(4,)])]

register_kernel("user_raising_rule", lambda x: x)
''')
    out = subprocess.run([sys.executable, "-m", "layout_prop.cli", "verify", "user_raising_rule", "--module",
                          str(module)], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "rule-failed" in out.stderr and "KeyError" in out.stderr
