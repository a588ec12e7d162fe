"""A hint never names something that does not exist: operands, letters and mesh axes are checked.

Over a seeded sample of every op database record's rejected combinations, each violation's
hint may name (a) an operand to move (``all-gather x on 'tp'``, ``give y the layout (R)``):
it must be one of the op's operands, the layout one placement per mesh axis; (b) a letter of an operand (``shard letter 'b' of weight``): the operand's einsum
subscript (given in the message) must have it; (c) a mesh axis in quotes after ``on``: the
mesh must have it.
"""

import re

import pytest

from layout_prop.api import analyze
from layout_prop.core.errors import LayoutPropError
from layout_prop.io.loader import load_spec
from layout_prop.core.registry import get_rule
from layout_prop.testing import combination_specs
from layout_prop.testing.opdb import all_records

RECORDS = all_records()
MOVE = re.compile(r"\b(?:all-gather|reduce|keep|give|shard) (\w+) on '?(\w+)'?")
LETTER = re.compile(r"letter '(\w)' of (\w+)")
EQUATION = re.compile(r"'([a-z,]+)->([a-z]*)'")
GIVE = re.compile(r"\bgive (\w+) the layout \(((?:[^()]|\([^()]*\))*)\)")
PLACEMENT = re.compile(r"_S\(-?\d+,\d+\)|R|S\(-?\d+\)|P(?:\(\w+\))?")  # _S(d,k): a strided shard
STEP = re.compile(r"\b(?:all-gather|all-reduce|reduce-scatter|all-to-all|local-slice) on '?(\w+)'?")


def _violations(record):
    for spec in combination_specs(record.op, record.samples, record.meshes, 6, seed=1):
        try:
            graph = load_spec(spec)
        except LayoutPropError:
            continue
        for v in analyze(graph).check.violations:
            yield spec, v


@pytest.mark.parametrize("record", RECORDS, ids=[r.name for r in RECORDS])
def test_hints_name_only_what_exists(record):
    rule = get_rule(record.op)
    checked = 0
    for spec, v in _violations(record):
        operands = set(spec["inputs"]) | {rule.operand_name(i) for i in range(len(spec["inputs"]))}
        axes = set(spec["mesh"]["names"])
        for name, axis in MOVE.findall(v.hint):
            if name in ("it", "the", "another", "dim", "letter", "each", "every", "both", "them"):
                continue
            assert name in operands, f"hint names operand {name!r} not in {sorted(operands)}: {v.hint}"
            assert axis in axes, f"hint names mesh axis {axis!r} not in {sorted(axes)}: {v.hint}"
            checked += 1
        for name, layout in GIVE.findall(v.hint):
            assert name in operands, f"hint names operand {name!r} not in {sorted(operands)}: {v.hint}"
            assert len(PLACEMENT.findall(layout)) == len(axes), f"hint's layout does not fit the mesh: {v.hint}"
            checked += 1
        for axis in STEP.findall(v.hint):
            assert axis in axes, f"hint names mesh axis {axis!r} not in {sorted(axes)}: {v.hint}"
        equation = EQUATION.search(v.message)
        for letter, name in LETTER.findall(v.hint):
            assert equation, f"hint names a letter but the message gives no equation: {v.message}"
            names = [rule.operand_name(i) for i in range(len(spec["inputs"]))]
            subscripts = dict(zip(names, equation.group(1).split(",")))
            assert name in subscripts, f"hint names letter of unknown operand {name!r}: {v.hint}"
            assert letter in subscripts[name], (f"hint offers letter {letter!r} of {name} whose subscript is "
                                                f"{subscripts[name]!r}: {v.hint}")
            checked += 1
    if record.op in ("linear", "matmul", "add", "rotary_position_embedding"):
        assert checked, "expected at least one hint that names an operand"


def test_the_llama_block_hint_for_l0_q_names_a_letter_the_weight_has():
    from pathlib import Path

    graph = load_spec(Path(__file__).resolve().parent.parent / "examples" / "llama_block.yaml")
    hints = [v.hint for v in analyze(graph).check.violations if v.node == "l0_q"]
    assert hints and all("letter 'b' of weight" not in h for h in hints)
    assert any("all-gather weight on 'tp' instead (weight has no letter 'b' to shard)" in h for h in hints)
