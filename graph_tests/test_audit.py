"""``layout-prop audit``: hyper-parallel's own rules judged by execution, over the shared snapshot.

Bounded for CI: a few ops, one or two small meshes, sampled combinations.  Skipped where the
snapshot is missing (CI has it at ../shared/upstream/hyper-parallel).
"""

from __future__ import annotations

import json

import numpy as np
from pathlib import Path

import pytest

from layout_prop.cli import main

SNAPSHOT = Path(__file__).resolve().parent.parent.parent / "shared" / "upstream" / "hyper-parallel"
pytestmark = pytest.mark.skipif(not (SNAPSHOT / "hyper_parallel" / "core" / "shard" / "ops").is_dir(),
                                reason=f"no hyper-parallel snapshot at {SNAPSHOT}")


@pytest.fixture(scope="module")
def checkout():
    from layout_prop.interop.hyper_parallel import read_checkout

    return read_checkout(SNAPSHOT)


def _audit(checkout, names, meshes=((4,),), budget=64, modules=()):
    from layout_prop.interop.audit import run_audit
    from layout_prop.interop.hyper_parallel import read_checkout

    if modules:
        checkout = read_checkout(SNAPSHOT, modules=modules)
    return run_audit(checkout, names, meshes=meshes, budget=budget)


def test_the_snapshot_declares_every_yaml_op(checkout):
    assert len(checkout.entries) > 100
    assert checkout.entries["MatMul"].cls == "MatMulDistributedOp"
    assert checkout.entries["MatMul"].module == "hyper_parallel.core.shard.ops.parallel_matmul"


def test_the_snapshot_loads_in_the_worker_with_the_stand_in_platform(checkout):
    report = _audit(checkout, ["ReLU"])
    assert report.platform == "stand-in" and report.ok and not report.failed


def test_softmax_answers_are_all_right_and_sharded_axes_rejected(checkout):
    report = _audit(checkout, ["Softmax"], meshes=((4,), (2, 2)))
    counts = report.ops[0].counts
    assert report.ok and counts["wrong"] == 0
    assert counts["right"] > 0 and counts["rejected"] > 0


def test_matmul_with_a_partial_weight_is_caught(checkout):
    """MatMul's rule checks no Partial input: R @ P(sum) is answered R, which execution refutes."""
    report = _audit(checkout, ["MatMul"])
    audit = report.ops[0]
    assert not report.ok and audit.counts["wrong"] > 0
    wrong = audit.examples["wrong"]
    assert wrong.placements == (("R",), ("P(sum)",))
    assert wrong.upstream_answer == "(R)" and wrong.ours == "accepts: (P(sum))"
    assert 'in1.set_partial_by_dev_axis("tp", "sum")' in wrong.upstream_code()
    # over-strict: the contracting dim sharded on w only; layout-prop slices x locally and answers P(sum)
    over = audit.examples["over_strict"]
    assert over.placements == (("R",), ("S(0)",)) and over.ours == "accepts: (P(sum))"


#: the seed's RotaryPositionEmbedding proposal, written naively in upstream's shape (deliberately wrong): it
#: follows the issue's text: D never sharded, no Partial, output = x's layout, and cos/sin "sharded like x"
#: compared entry by entry from the left, which is wrong for a lower-rank (broadcast) cos/sin
SEED_RPE = """
from hyper_parallel.core.shard.ops.parallel_ops import DistributedOp


class SeedRotaryPositionEmbedding(DistributedOp):
    def infer_layout(self, layouts, extra_args):
        self._check_partial_inputs(layouts)
        x = layouts[0]
        for layout in layouts:
            if layout.tensor_map[-1] != -1:
                raise ValueError("D must not be sharded")
        for layout in layouts[1:]:
            for i, entry in enumerate(layout.tensor_map):
                if entry != -1 and entry != x.tensor_map[i]:
                    raise ValueError(f"cos/sin dim {i} must be sharded like x")
        return type(x).__call__(x, *x.alias_tensor_map)


SeedRotaryPositionEmbedding("RotaryPositionEmbedding")
"""


def test_a_deliberately_wrong_rule_in_upstream_shape_is_caught(checkout, tmp_path):
    module = tmp_path / "seed_rpe.py"
    module.write_text(SEED_RPE)
    report = _audit(checkout, ["RotaryPositionEmbedding"], budget=48, modules=[module])
    audit = report.ops[0]
    assert audit.source == str(module)
    assert not report.ok and audit.counts["wrong"] > 0 and audit.counts["right"] > 0
    wrong = audit.examples["wrong"]
    # x sharded on S with a replicated cos: "R broadcasts" claims a full cos fits x's local piece
    assert wrong.placements == (("S(2)",), ("R",), ("R",)), wrong.placements
    assert "broadcast-shape" in wrong.message  # the kernel refuses the local shapes the claim implies


def test_cli_json_and_exit_codes(checkout, capsys):
    code = main(["audit", str(SNAPSHOT), "--op", "topk", "--op", "ReLU", "--mesh", "4", "--samples", "16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["ok"] is False
    by_op = {o["op"]: o for o in data["ops"]}
    assert by_op["ReLU"]["wrong"] == 0 and by_op["topk"]["wrong"] > 0  # topk passes P(sum) through
    assert by_op["topk"]["wrong_silently"] == by_op["topk"]["wrong"]  # the local top-k runs: no error warns
    assert by_op["topk"]["reproducers"]["wrong"]["layout_prop_spec"]["nodes"][0]["op"] == "topk"
    again = main(["audit", str(SNAPSHOT), "--op", "topk", "--op", "ReLU", "--mesh", "4", "--samples", "16", "--json"])
    assert again == 1 and json.loads(capsys.readouterr().out) == data  # the same report every run
    assert main(["audit", str(SNAPSHOT), "--op", "ReLU", "--mesh", "4"]) == 0
    assert "every accepted answer is right" in capsys.readouterr().out


def test_a_folder_without_rules_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["audit", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not-a-checkout" in err[0]


def test_an_unknown_op_is_exit_2(checkout, capsys):
    assert main(["audit", str(SNAPSHOT), "--op", "NoSuchOp"]) == 2
    assert "unknown-op" in capsys.readouterr().err


def test_audit_module_adds_a_proposal_from_a_file(checkout, tmp_path, capsys):
    """``--module FILE``: a file of the user's DistributedOp subclasses, imported after the checkout."""
    module = tmp_path / "wrong_softmax.py"
    module.write_text(
        "from hyper_parallel.core.shard.ops.parallel_ops import DistributedOp\n\n\n"
        "class AnyAxisSoftmax(DistributedOp):\n"
        "    '''Deliberately wrong: accepts a sharded softmax axis and keeps the layout.'''\n\n"
        "    def infer_layout(self, layouts, extra_args):\n"
        "        return layouts[0]\n\n\n"
        "AnyAxisSoftmax('Softmax')\n")
    code = main(["audit", str(SNAPSHOT), "--module", str(module), "--op", "Softmax", "--mesh", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    softmax = data["ops"][0]
    assert code == 1 and softmax["source"] == str(module)
    assert softmax["wrong"] > 0 and softmax["reproducers"]["wrong"]["inputs"]["in0"]["placements"] == ["S(1)"]


# --------------------------------------------------------------------------- the judges added for every op
def _audit_rule(checkout, tmp_path, name, infer_layout: str, meshes=((4,),), budget=48):
    """Audit a rule whose ``infer_layout`` body is ``infer_layout``, registered under upstream op ``name`` by a
    --module file (upstream's own rule is untouched: the worker process is the audit's)."""
    module = tmp_path / f"rule_{name}_{abs(hash(infer_layout))}.py"
    module.write_text("from hyper_parallel.core.shard.ops.parallel_ops import DistributedOp\n\n\n"
                      "class TestRule(DistributedOp):\n"
                      "    def infer_layout(self, layouts, extra_args):\n"
                      + "".join(f"        {line}\n" for line in infer_layout.strip().splitlines())
                      + f"\n\nTestRule({name!r})\n")
    report = _audit(checkout, [name], meshes=meshes, budget=budget, modules=[module])
    assert report.ops[0].failure is None, report.ops[0].failure
    return report.ops[0]


#: right for any elementwise op: identical layouts without Partial, else refused
SAME_LAYOUT_OR_REFUSE = """
first = layouts[0]
for layout in layouts:
    if layout is None:
        continue
    if layout.is_partial() or layout.tensor_map != first.tensor_map:
        raise ValueError("give identical layouts without Partial")
return first
"""


def test_a_comparison_judged_by_the_helper_kernel(checkout, tmp_path):
    """ge has no layout-prop op: numpy's greater_equal executes it; a rule passing Partial through is caught."""
    right = _audit_rule(checkout, tmp_path, "ge", SAME_LAYOUT_OR_REFUSE)
    assert right.counts["wrong"] == 0 and right.counts["right"] > 0
    assert right.op == "numpy greater_equal of interop/judges.py, layout-prop's maximum rule as stand-in"
    partial_kept = """
first = layouts[0]
if any(layout.tensor_map != first.tensor_map for layout in layouts):
    raise ValueError("give identical tensor maps")
return first
"""  # deliberately wrong: a comparison of partial terms
    wrong = _audit_rule(checkout, tmp_path, "ge", partial_kept)
    assert wrong.counts["wrong"] > 0
    assert "P(sum)" in sum(wrong.examples["wrong"].placements, ())  # the smallest: a P(sum) operand


def test_reshape_is_judged_with_the_local_shape_the_rule_returns(checkout, tmp_path):
    global_shape_kept = """
x = layouts[0]
if x.is_partial() or any(m != -1 for m in x.tensor_map[1:]):
    raise ValueError("dim 0 sharded at most")
out = [x.alias_tensor_map[0]] + ["None"] * (len(extra_args[0]) - 1)
return x.__class__.__call__(x, *out), list(extra_args[0])
"""  # deliberately wrong: the global shape as the local one
    replicated_only = """
x = layouts[0]
if any(m != -1 for m in x.tensor_map) or x.is_partial():
    raise ValueError("replicated inputs only")
return x.__class__.__call__(x, *(["None"] * len(extra_args[0]))), list(extra_args[0])
"""
    right = _audit_rule(checkout, tmp_path, "Reshape", replicated_only)
    assert right.counts["wrong"] == 0 and right.counts["right"] > 0
    wrong = _audit_rule(checkout, tmp_path, "Reshape", global_shape_kept)
    assert wrong.counts["wrong"] > 0
    assert "shape" in wrong.examples["wrong"].upstream_answer  # the returned local shape is shown


def test_the_snapshot_reshape_is_wrong_on_uneven_shards(checkout):
    """Upstream's Reshape divides the dim by the shard count: 6 rows on 4 devices give rank 0 a [6] piece."""
    audit = _audit(checkout, ["Reshape"]).ops[0]
    wrong = audit.examples["wrong"]
    assert wrong.placements == (("S(0)",),) and wrong.case.shapes == ((6, 4),)
    assert "cannot reshape array of size 8 into shape (6,)" in wrong.message


def test_multinomial_is_judged_by_its_invariants(checkout, tmp_path):
    from layout_prop.interop import judges

    check = judges.check("multinomial_invariants")
    probs = np.array([[0.0, 1.0, 2.0]])
    attrs = {"num_samples": 2, "replacement": False}
    assert check(np.array([[1, 2]]), [probs], attrs) is None
    assert "not positive" in check(np.array([[0, 2]]), [probs], attrs)
    assert "repeated" in check(np.array([[2, 2]]), [probs], attrs)
    guard = """
x = layouts[0]
if x.is_partial() or x.tensor_map[-1] != -1:
    raise ValueError("no")
"""
    rows_dropped = guard + "return x.__class__.__call__(x, *(['None'] * len(x.tensor_map)))\n"  # deliberately wrong
    rows_kept = guard + "return x.__class__.__call__(x, *x.alias_tensor_map)\n"
    assert _audit_rule(checkout, tmp_path, "multinomial", rows_kept).counts["wrong"] == 0
    wrong = _audit_rule(checkout, tmp_path, "multinomial", rows_dropped)
    assert wrong.counts["wrong"] > 0 and "S(0)" in wrong.examples["wrong"].placements[0]


def test_attention_runs_the_rules_own_expansion(checkout):
    """sdpa: upstream's expansion runs around layout-prop's kernel; K/V sharded on the sequence with a whole
    query is answered R by the snapshot, and the replicas differ."""
    audit = _audit(checkout, ["scaled_dot_product_attention"], budget=32).ops[0]
    assert audit.counts["right"] > 0 and audit.counts["wrong"] > 0
    wrong = audit.examples["wrong"]
    assert wrong.placements[0] == ("R",) and wrong.placements[1] == wrong.placements[2] == ("S(2)",)
    assert "replicas" in wrong.message


def test_every_snapshot_op_has_a_case(checkout):
    from layout_prop.interop.cases import CASES, NOT_MAPPED

    assert [n for n in checkout.entries if n not in CASES] == []  # every op of the snapshot has a case
    assert all(n not in CASES for n in NOT_MAPPED)


def test_the_transcripts_of_docs_audit_md_are_the_command_output(capsys, monkeypatch):
    """docs/audit.md's ```text transcripts of `layout-prop audit ../shared/...` (not run by test_readme, whose
    folder has no ../shared) are what the command prints from the repository's root."""
    import re
    import shlex

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "audit.md").read_text()
    runs = [chunk for block in re.findall(r"```text\n(.*?)```", page, re.S)
            for chunk in re.split(r"^\$ ", block, flags=re.M)[1:] if "\n" in chunk.strip()]
    assert len(runs) >= 2
    monkeypatch.chdir(root)
    for chunk in runs:
        command, expected = chunk.split("\n", 1)
        args = shlex.split(command)
        assert args[:2] == ["layout-prop", "audit"], command
        main(args[1:])
        assert capsys.readouterr().out.strip() == expected.strip(), command


def test_audit_module_with_a_wrong_comparison_rule(checkout, tmp_path, capsys):
    """``--module FILE``: a comparison rule that keeps Partial inputs is caught by numpy's greater_equal."""
    module = tmp_path / "wrong_ge.py"
    module.write_text(
        "from hyper_parallel.core.shard.ops.parallel_ops import DistributedOp\n\n\n"
        "class PartialKeepingCompare(DistributedOp):\n"
        "    '''Deliberately wrong: identical tensor maps accepted with their partial status kept.'''\n\n"
        "    def infer_layout(self, layouts, extra_args):\n"
        "        if layouts[0].tensor_map != layouts[1].tensor_map:\n"
        "            raise ValueError('identical tensor maps only')\n"
        "        return layouts[0]\n\n\n"
        "PartialKeepingCompare('ge')\n")
    code = main(["audit", str(SNAPSHOT), "--module", str(module), "--op", "ge", "--mesh", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    ge = data["ops"][0]
    assert code == 1 and ge["source"] == str(module) and ge["wrong"] > 0
    wrong = ge["reproducers"]["wrong"]
    assert "P(sum)" in wrong["inputs"]["in0"]["placements"] + wrong["inputs"]["in1"]["placements"]
    assert wrong["judged_by"].startswith("interop/judges.py greater_equal")


def test_an_audit_of_nothing_does_not_say_every_answer_is_right(checkout, tmp_path, capsys):
    """An op a --module registers without an audit case: nothing is judged, and the last line says so
    (it said 'every accepted answer is right' of 0 combinations)."""
    module = tmp_path / "new_op.py"
    module.write_text("from hyper_parallel.core.shard.ops.parallel_ops import DistributedOp\n\n\n"
                      "class Passthrough(DistributedOp):\n"
                      "    def infer_layout(self, layouts, extra_args):\n"
                      "        return layouts[0]\n\n\nPassthrough('AnOpWithoutACase')\n")
    code = main(["audit", str(SNAPSHOT), "--module", str(module), "--op", "AnOpWithoutACase", "--mesh", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "AnOpWithoutACase: no audit case written" in out
    assert out.splitlines()[-1] == "no combination audited: nothing was judged"
