"""Every differentiable op's gradient rule against central finite differences of its forward.

The numerical check of layouts (``run``) compares the ranks with a one-device run of the same
backward graph, so a wrong vjp rule would be wrong on both sides.  This test closes that gap:
for the first float sample of every op-database record it builds the backward graph on one
device in float64 and compares every input gradient with central differences of
``sum(cotangent * output)``, at a few random elements per input.
"""

from __future__ import annotations

import numpy as np
import pytest

from layout_prop.core import meta
from layout_prop.api import analyze
from layout_prop.io.loader import load_spec
from layout_prop.core.registry import get_rule
from layout_prop.runner import execute_global, random_inputs
from layout_prop.testing import single_op_spec
from layout_prop.testing.opdb import all_records

H = 1e-6
CASES = []
for record in all_records():
    rule = get_rule(record.op)
    if not rule.differentiable or "dtype" in rule.attr_defaults:  # a cast rounds whatever the step
        continue
    sample = record.samples[0]
    if all(0 in shape for shape in sample.shapes):  # no input has an element to nudge
        continue
    CASES.append(pytest.param(record.op, sample, id=record.name))


def _float64_spec(op, sample) -> dict:
    spec = single_op_spec(op, sample, (1,), ["R"] * len(sample.shapes))
    for entry in spec["inputs"].values():
        if entry.get("dtype", "float32").startswith("float"):
            entry["dtype"] = "float64"
    return spec


def _loss(forward, inputs, cotangents) -> float:
    env = execute_global(forward, inputs)
    return float(sum(np.sum(cotangents[v] * env[v]) for v in forward.outputs))


@pytest.mark.parametrize("op,sample", CASES)
def test_gradient_rule_matches_finite_differences(op, sample):
    spec = _float64_spec(op, sample)
    joint = analyze(load_spec(spec), backward=True).graph
    assert not [v for n in joint.nodes for v in n.meta.get(meta.VIOLATIONS, ())]
    inputs = random_inputs(joint, seed=7)
    env = execute_global(joint, inputs)
    forward = analyze(load_spec(spec)).graph
    cotangents = {v: inputs[f"cotangent/{v}"] for v in forward.outputs if f"cotangent/{v}" in inputs}
    rng = np.random.default_rng(3)
    checked = 0
    for node in forward.inputs():
        grad_name = f"grad/{node.name}"
        if grad_name not in env:
            continue
        x = inputs[node.name]
        grad = env[grad_name]
        assert grad.shape == x.shape
        for flat in rng.choice(x.size, size=min(6, x.size), replace=False):
            index = np.unravel_index(flat, x.shape)
            up, down = dict(inputs), dict(inputs)
            up[node.name] = x.copy()
            down[node.name] = x.copy()
            up[node.name][index] += H
            down[node.name][index] -= H
            numeric = (_loss(forward, up, cotangents) - _loss(forward, down, cotangents)) / (2 * H)
            assert abs(grad[index] - numeric) <= 1e-5 * max(1.0, abs(numeric)), (node.name, index, grad[index],
                                                                                  numeric)
            checked += 1
    wants_grads = any(e.get("requires_grad", True) and e.get("dtype", "float64").startswith("float")
                      for e in spec["inputs"].values())
    assert checked > 0 or not wants_grads
