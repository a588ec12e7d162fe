"""Ops take what torch and MindSpore take, and ``run`` draws inputs in each op's domain
(issue 37, found by replaying hyper-parallel's unit tests):

- ``scaled_dot_product_attention`` takes torch's 3-D q, k, v ``(N, L, E)``;
- a MindSpore tensor_map entry naming the inner mesh axis first (``(0, 2)``) is the layout
  MindSpore cuts (hyper-parallel's ``_infer_slice_area_by_rank``: the first entry major);
- ``multinomial`` refuses 3-D probabilities, as torch does;
- ``run`` draws indices within the indexed dim and positive weights for multinomial.

References are worked out by hand or with plain numpy, never with the code under test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import LayoutPropError
from layout_prop.core.registry import InputDomain, get_rule
from layout_prop.engines.collectives import scatter_global
from layout_prop.io.loader import load_spec
from layout_prop.runner import execute_global, random_inputs, run_graph


# ------------------------------------------------------------------------------ 3-D attention
def _attention(q, k, v, scale=None, causal=False):
    """softmax(q k^T * scale + mask) v for (N, L, E) arrays, in plain numpy."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    return probs / probs.sum(-1, keepdims=True) @ v


def _sdpa_spec(qp, kp, vp, causal=False, layout="BNSD", mesh=(2, 2)):
    return {"mesh": {"shape": list(mesh), "names": ["dp", "tp"][:len(mesh)]},
            "inputs": {"q": {"shape": [4, 6, 8], "placements": qp, "dtype": "float64"},
                       "k": {"shape": [4, 5, 8], "placements": kp, "dtype": "float64"},
                       "v": {"shape": [4, 5, 3], "placements": vp, "dtype": "float64"}},
            "nodes": [{"name": "y", "op": "scaled_dot_product_attention", "inputs": ["q", "k", "v"],
                       "attrs": {"causal": causal, "layout": layout}}]}


def test_three_d_attention_is_torchs_one_head_attention():
    g = load_spec(_sdpa_spec(["R", "R"], ["R", "R"], ["R", "R"], causal=True))
    analyze(g)
    assert g.node("y").meta["specs"][0].shape == (4, 6, 3)
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(shape) for name, shape in (("q", (4, 6, 8)), ("k", (4, 5, 8)),
                                                                   ("v", (4, 5, 3)))}
    got = execute_global(g, arrays)["y"]
    np.testing.assert_allclose(got, _attention(arrays["q"], arrays["k"], arrays["v"], causal=True), rtol=1e-12)


@pytest.mark.parametrize("qp, kp, vp", [
    (["S(0)", "S(1)"], ["S(0)", "R"], ["S(0)", "R"]),  # batch and query rows sharded: no move
    (["S(0)", "S(1)"], ["S(0)", "S(1)"], ["S(0)", "S(1)"]),  # k, v sequence sharded: gathered
    (["R", "S(2)"], ["S(0)", "R"], ["R", "R"]),  # the embedding sharded: gathered (whole head)
])
@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
def test_three_d_attention_sharded_equals_one_device(qp, kp, vp, layout):
    report = run_graph(load_spec(_sdpa_spec(qp, kp, vp, causal=True, layout=layout)), backward=True, seed=1,
                       verify=True)
    assert report.ok, report.mismatches
    assert set(report.grads) == {"q", "k", "v"}


def test_three_d_attention_output_keeps_query_rows_sharded():
    g = load_spec(_sdpa_spec(["S(0)", "S(1)"], ["S(0)", "R"], ["S(0)", "R"]))
    result = analyze(g)
    assert not result.check.violations
    assert str(g.node("y").meta["specs"][0].layout) == "(S(0), S(1))"


def test_three_d_attention_violation_says_how_dims_count():
    g = load_spec(_sdpa_spec(["S(0)", "S(1)"], ["S(0)", "S(1)"], ["S(0)", "R"]))
    (violation,) = analyze(g).check.violations
    assert violation.code == "sharded-kv-sequence" and "3-D q, k, v (N, L, E)" in violation.message
    assert violation.details["want"] == ["S(0)", "R"]  # on the 3-D k, not the one-head 4-D form


def test_mixed_ranks_are_still_refused():
    spec = _sdpa_spec(["R", "R"], ["R", "R"], ["R", "R"])
    spec["inputs"]["q"]["shape"] = [4, 1, 6, 8]
    codes = [v.code for v in analyze(load_spec(spec)).check.violations]
    assert codes and set(codes) == {"invalid-shape"}


# ------------------------------------------------------------------------------ tensor_map, inner axis first
def _mindspore_slice(mesh_shape, tensor_map_entry, rank, n):
    """hyper-parallel's _infer_slice_area_by_rank for a 1-D tensor: the first entry is the major one."""
    coords = np.unravel_index(rank, mesh_shape)
    split, slice_id, coef = 1, 0, 1
    for k in tensor_map_entry:
        split *= mesh_shape[-k - 1]
    for k in reversed(tensor_map_entry):
        slice_id += coords[-k - 1] * coef
        coef *= mesh_shape[-k - 1]
    size = n // split
    return list(range(slice_id * size, (slice_id + 1) * size))


@pytest.mark.parametrize("mesh_shape, entry", [
    ((2, 1, 2), (0, 2)),  # the example
    ((2, 3, 2), (0, 2)),
    ((2, 3, 2), (0, 1, 2)),
    ((2, 3, 2), (1, 2, 0)),
    ((2, 3, 2), (2, 0, 1)),
    ((3, 2), (0, 1)),
    ((2, 3, 2), (2, 1, 0)),  # mesh order: plain shards, as before
])
def test_tensor_map_entry_cuts_as_mindspore_does(mesh_shape, entry):
    n = 24
    mesh = DeviceMesh(mesh_shape, tuple("abc"[:len(mesh_shape)]))
    layout = Layout.from_tensor_map(mesh, [entry])
    pieces = scatter_global(np.arange(n, dtype=np.float64), TensorSpec((n,), "float64", layout))
    for rank in range(mesh.size):
        assert pieces[rank].tolist() == _mindspore_slice(mesh_shape, entry, rank, n), (rank, str(layout))


def test_spec_with_inner_first_tensor_map_runs():
    spec = {"mesh": {"shape": [2, 1, 2], "names": ["dp", "pp", "tp"]},
            "inputs": {"x": {"shape": [8, 4], "tensor_map": [[0, 2], -1]}, "w": {"shape": [4, 3]}},
            "nodes": [{"name": "y", "op": "matmul", "inputs": ["x", "w"]}]}
    g = load_spec(spec)
    assert str(g.node("x").attrs["placements"]) == "('_S(0,2)', 'R', 'S(0)')"
    assert run_graph(load_spec(spec), backward=True, seed=2, verify=True).ok


# ------------------------------------------------------------------------------ multinomial
@pytest.mark.parametrize("shape, ok", [((9,), True), ((5, 9), True), ((2, 5, 9), False), ((2, 1, 5, 9), False)])
def test_multinomial_takes_one_or_two_dims_as_torch(shape, ok):
    rule = get_rule("multinomial")
    probs = TensorSpec(shape, "float32", Layout.replicated(DeviceMesh((2,), ("dp",)), len(shape)))
    attrs = rule.normalize_attrs({"num_samples": 2})
    if ok:
        assert rule.infer_layout((probs,), attrs).outputs[0].shape == shape[:-1] + (2,)
    else:
        with pytest.raises(LayoutPropError) as err:
            rule.infer_layout((probs,), attrs)
        assert err.value.code == "invalid-shape" and "one or two dims" in err.value.message


# ------------------------------------------------------------------------------ inputs in the domain
DOMAIN_SPEC = """\
mesh: {shape: [2], names: [tp]}
inputs:
  x: {shape: [3, 4], placements: ["S(1)"]}
  i: {shape: [5, 4], dtype: int64}
  j: {shape: [6], dtype: int64, placements: ["S(0)"]}
  p: {shape: [4, 6]}
  c: {shape: [4, 5], dtype: int64}
  s: {shape: [5, 4]}
  t: {shape: [7], dtype: int64}
nodes:
  - {name: g, op: gather, inputs: [x, i], attrs: {dim: 0}}
  - {name: sc, op: scatter_add, inputs: [x, i, s], attrs: {dim: 0}}
  - {name: sel, op: index_select, inputs: [x, j], attrs: {dim: 1}}
  - {name: m, op: multinomial, inputs: [p], attrs: {num_samples: 6}}
  - {name: mc, op: multinomial, inputs: [c], attrs: {num_samples: 5}}
  - {name: o, op: one_hot, inputs: [t], attrs: {num_classes: 3}}
"""


def test_run_draws_each_input_in_its_consumers_domain():
    g = load_spec(DOMAIN_SPEC)
    analyze(g)
    for seed in range(5):
        arrays = random_inputs(g, seed)
        assert arrays["i"].min() >= 0 and arrays["i"].max() < 3  # x's dim 0 has 3 rows (gather and scatter_add)
        assert arrays["j"].min() >= 0 and arrays["j"].max() < 4  # x's dim 1 has 4 columns
        assert arrays["t"].min() >= 0 and arrays["t"].max() < 3  # 3 classes
        assert arrays["p"].min() > 0 and arrays["c"].min() > 0  # every class can be drawn (6 of 6 without replacement)
        assert arrays["i"].dtype == np.int64 and arrays["p"].dtype == np.float32


def test_valid_specs_of_gather_scatter_multinomial_run(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(DOMAIN_SPEC)
    assert main(["run", str(path)]) == 0, capsys.readouterr().err
    assert "matches one device" in capsys.readouterr().out


def test_input_without_a_domain_draws_as_before():
    # ids into an embedding-free graph: no consumer declares a domain, so ints stay in [0, 8), floats normal
    g = load_spec("mesh: {shape: [2]}\ninputs:\n  x: {shape: [64]}\n  n: {shape: [64], dtype: int64}\n"
                  "nodes:\n  - {name: y, op: relu, inputs: [x]}\n  - {name: z, op: neg, inputs: [n]}\n")
    analyze(g)
    arrays = random_inputs(g, 0)
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(arrays["x"], rng.standard_normal(64).astype(np.float32))
    np.testing.assert_array_equal(arrays["n"], rng.integers(0, 8, 64))


def test_domains_meet_over_consumers():
    # i indexes x (3 rows) and y (5 rows): it must fit both
    g = load_spec("mesh: {shape: [2]}\ninputs:\n  x: {shape: [3, 2]}\n  y: {shape: [5, 2]}\n"
                  "  i: {shape: [40], dtype: int64}\n"
                  "nodes:\n  - {name: a, op: index_select, inputs: [x, i], attrs: {dim: 0}}\n"
                  "  - {name: b, op: index_select, inputs: [y, i], attrs: {dim: 0}}\n")
    analyze(g)
    drawn = random_inputs(g, 1)["i"]
    assert drawn.max() < 3 and set(drawn.tolist()) == {0, 1, 2}
    assert InputDomain(0, 3).meet(InputDomain(0, 5)) == InputDomain(0, 3)
