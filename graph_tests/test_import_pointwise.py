"""The importers' pointwise ops (sqrt, rsqrt, reciprocal, sigmoid, tanh, erf, pow, relu, cos, sin, gelu_erf): kernels,
gradients against central finite differences, layouts on several ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest

import layout_prop.frontends.pointwise  # noqa: F401  (registers the ops)
from layout_prop.api import analyze
from layout_prop.kernels.numpy_backend import KERNELS
from layout_prop.io.loader import load_spec
from layout_prop.runner import execute_global, run_graph

CASES = [("sqrt", {}, np.sqrt), ("rsqrt", {}, lambda x: 1 / np.sqrt(x)), ("reciprocal", {}, lambda x: 1 / x),
         ("sigmoid", {}, lambda x: 1 / (1 + np.exp(-x))), ("tanh", {}, np.tanh),
         ("erf", {}, np.vectorize(math.erf)), ("pow", {"exponent": 3.0}, lambda x: x ** 3),
         ("pow", {"exponent": 0.5}, np.sqrt), ("pow", {"exponent": 1.0}, lambda x: x),
         ("relu", {}, lambda x: np.maximum(x, 0)), ("cos", {}, np.cos), ("sin", {}, np.sin),
         ("gelu_erf", {}, lambda x: x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2))))]
SIGNED = {"relu", "sigmoid", "tanh", "erf", "cos", "sin", "gelu_erf"}  # tried on both signs (the others need x > 0)


def _spec(op, attrs, mesh=(1,), placements=("R",), dtype="float64"):
    return {"mesh": {"shape": list(mesh), "names": [f"a{i}" for i in range(len(mesh))]},
            "inputs": {"x": {"shape": [4, 6], "placements": list(placements), "dtype": dtype}},
            "nodes": [{"name": "y", "op": op, "inputs": ["x"], "attrs": attrs}], "outputs": ["y"]}


def _positive(seed=0):
    return np.random.default_rng(seed).uniform(0.5, 2.0, (4, 6))


@pytest.mark.parametrize("op,attrs,reference", CASES, ids=[f"{c[0]}{c[1].get('exponent', '')}" for c in CASES])
def test_kernel_and_gradient(op, attrs, reference):
    x = _positive() - (1.25 if op in SIGNED else 0.0)  # in (-0.75, 0.75) then: relu's kink is never hit
    np.testing.assert_allclose(KERNELS[op](x, **attrs), reference(x), rtol=1e-12)
    joint = analyze(load_spec(_spec(op, attrs)), backward=True).graph
    cot = np.random.default_rng(1).standard_normal((4, 6))
    env = execute_global(joint, {"x": x, "cotangent/y": cot})
    h = 1e-6
    grad = env["grad/x"]
    for index in [(0, 0), (1, 3), (3, 5)]:
        up, down = x.copy(), x.copy()
        up[index] += h
        down[index] -= h
        numeric = (np.sum(cot * reference(up)) - np.sum(cot * reference(down))) / (2 * h)
        assert abs(grad[index] - numeric) <= 1e-6 * max(1.0, abs(numeric)), (index, grad[index], numeric)


@pytest.mark.parametrize("op,attrs", [(c[0], c[1]) for c in CASES[:7] + CASES[9:]],
                         ids=[c[0] for c in CASES[:7] + CASES[9:]])  # pow once
def test_sharded_runs_match_one_device_and_partial_is_refused(op, attrs):
    # exp first: every op sees positive values (sqrt and rsqrt of the random inputs stay finite)
    spec = _spec(op, attrs, mesh=(2, 2), placements=("S(0)", "S(1)"), dtype="float32")
    spec["nodes"] = [{"name": "e", "op": "exp", "inputs": ["x"]},
                     {"name": "y", "op": op, "inputs": ["e"], "attrs": attrs}]
    rep = run_graph(load_spec(spec), backward=True)
    assert rep.ok, rep.mismatches
    partial = _spec(op, attrs, mesh=(2,), placements=("P(sum)",))
    assert [v.code for v in analyze(load_spec(partial)).check.violations] == ["partial-input"]
