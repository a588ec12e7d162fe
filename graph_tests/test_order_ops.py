"""The order ops (topk, sort, argmax, argmin, cumsum, prod, maximum, minimum) beyond the op database:
kernels against hand-written answers (ties included), gradient kernels and vjp rules against
finite differences (float64), bad input through the command line (one line, exit 2), and
sharded runs whose collectives are pinned."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from layout_prop.cli import main
from layout_prop.core.registry import get_rule
from layout_prop.io.loader import load_spec
from layout_prop.kernels.order_numpy import KERNELS as K
from layout_prop.passes.backward import Backward
from layout_prop.passes.propagate import Propagate
from layout_prop.runner import execute_global, run_graph

from .cli_support import cli_env, console_command

NAN = float("nan")


# ============================================================================ kernels: hand-written answers
def test_topk_ties_keep_the_lowest_index_first():
    x = np.array([[3, 1, 3, 2, 3]], np.int32)
    values, indices = K["topk"](x, k=2)
    np.testing.assert_array_equal(values, [[3, 3]])
    np.testing.assert_array_equal(indices, [[0, 2]])
    assert indices.dtype == np.int64 and values.dtype == np.int32
    values, indices = K["topk"](x, k=3, largest=False)
    np.testing.assert_array_equal(values, [[1, 2, 3]])
    np.testing.assert_array_equal(indices, [[1, 3, 0]])
    values, indices = K["topk"](x.T, k=4, dim=0)
    np.testing.assert_array_equal(indices.ravel(), [0, 2, 4, 3])


def test_topk_nan_is_the_greatest_and_k_zero_is_empty():
    x = np.array([1.0, NAN, 2.0, NAN])
    values, indices = K["topk"](x, k=3)
    np.testing.assert_array_equal(indices, [1, 3, 2])
    np.testing.assert_array_equal(K["topk"](x, k=2, largest=False)[1], [0, 2])
    values, indices = K["topk"](x, k=0)
    assert values.shape == (0,) and indices.shape == (0,)


def test_sort_is_stable_both_ways():
    x = np.array([2, 1, 2, 1, 0], np.int32)
    np.testing.assert_array_equal(K["sort"](x)[1], [4, 1, 3, 0, 2])
    np.testing.assert_array_equal(K["sort"](x, descending=True)[1], [0, 2, 1, 3, 4])
    np.testing.assert_array_equal(K["sort"](x, descending=True)[0], [2, 2, 1, 1, 0])
    flags = np.array([True, False, True, False])
    np.testing.assert_array_equal(K["sort"](flags, descending=True)[1], [0, 2, 1, 3])
    floats = np.array([[0.5, -1.0], [0.5, 0.5], [-1.0, 0.5]])
    np.testing.assert_array_equal(K["sort"](floats, dim=0, descending=True)[1], [[0, 1], [1, 2], [2, 0]])


def test_argmax_argmin_first_of_ties_and_flattened():
    x = np.array([[1, 3, 3], [4, 0, 4]], np.int32)
    np.testing.assert_array_equal(K["argmax"](x, dim=1), [1, 0])
    np.testing.assert_array_equal(K["argmin"](x, dim=0), [0, 1, 0])
    assert K["argmax"](x) == 3 and K["argmin"](x) == 4  # dim None: the flattened index
    assert K["argmax"](x, keepdim=True).shape == (1, 1)
    np.testing.assert_array_equal(K["argmax"](x, dim=1, keepdim=True), [[1], [0]])
    assert K["argmax"](x, dim=1).dtype == np.int64


def test_cumsum_attrs_and_dtypes():
    x = np.array([1, 2, 3, 4], np.int32)
    np.testing.assert_array_equal(K["cumsum"](x, dim=0), [1, 3, 6, 10])
    np.testing.assert_array_equal(K["cumsum"](x, dim=0, exclusive=True), [0, 1, 3, 6])
    np.testing.assert_array_equal(K["cumsum"](x, dim=0, reverse=True), [10, 9, 7, 4])
    np.testing.assert_array_equal(K["cumsum"](x, dim=0, exclusive=True, reverse=True), [9, 7, 4, 0])
    assert K["cumsum"](x, dim=0).dtype == np.int64
    assert K["cumsum"](np.array([True, True]), dim=0).dtype == np.int64
    assert K["cumsum"](np.ones(3, np.float16), dim=0).dtype == np.float16
    assert K["cumsum"](np.zeros((2, 0)), dim=1, exclusive=True).shape == (2, 0)


def test_prod_values_and_dtypes():
    x = np.array([[1, 2, 3], [0, 4, 5]], np.int32)
    np.testing.assert_array_equal(K["prod"](x, dims=[1]), [6, 0])
    np.testing.assert_array_equal(K["prod"](x, dims=0, keepdim=True), [[0, 8, 15]])
    assert K["prod"](x).dtype == np.int64 and K["prod"](x) == 0
    assert K["prod"](np.zeros((2, 0)), dims=[1]).tolist() == [1.0, 1.0]


def test_maximum_minimum_broadcast():
    x = np.array([[1, 5], [3, 2]], np.int32)
    np.testing.assert_array_equal(K["maximum"](x, np.array([2, 2], np.int32)), [[2, 5], [3, 2]])
    np.testing.assert_array_equal(K["minimum"](x, np.array([[2], [4]], np.int32)), [[1, 2], [3, 2]])


def test_topk_grad_scatter_adds_within_its_range():
    dv = np.array([[1.0, 2.0, 4.0]])
    idx = np.array([[3, 1, 3]])
    np.testing.assert_array_equal(K["topk_grad"](dv, idx, dim=1, size=5), [[0.0, 2.0, 0.0, 5.0, 0.0]])
    # a rank holding elements 2..3 of the dim keeps the indices in its range
    np.testing.assert_array_equal(K["topk_grad"](dv, idx, dim=1, size=2, start=2), [[0.0, 5.0]])
    np.testing.assert_array_equal(K["topk_grad"](dv.T, idx.T, dim=0, size=2, start=0), [[0.0], [2.0]])


def test_maximum_grad_splits_ties_evenly():
    dx, dother = K["maximum_grad"](np.array([1.0, 1.0, 1.0]), np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 2.0]))
    np.testing.assert_array_equal(dx, [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(dother, [1.0, 0.5, 0.0])
    dx, dother = K["maximum_grad"](np.array([4.0, 4.0]), np.array([1.0, 3.0]), np.array([2.0]), minimum=True)
    np.testing.assert_array_equal(dx, [4.0, 0.0])
    np.testing.assert_array_equal(dother, [0.0, 4.0])  # (broadcast shape; sum_to reduces it)


def test_prod_grad_with_zeros_needs_no_division():
    dy = np.array([1.0, 2.0, 3.0])
    x = np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 3.0], [1.0, 2.0, 4.0]])
    np.testing.assert_array_equal(K["prod_grad"](dy, x, dims=[1]), [[0.0, 6.0, 0.0], [0.0, 0.0, 0.0],
                                                                     [24.0, 12.0, 6.0]])


# ============================================================================ kernels: finite differences
def numeric_grad(fn, args, index, cot, h=1e-6):
    """Central differences of ``sum(fn(*args) * cot)`` with respect to ``args[index]``."""
    x = args[index]
    grad = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        plus = [a.copy() for a in args]
        minus = [a.copy() for a in args]
        plus[index][i] += h
        minus[index][i] -= h
        grad[i] = (np.sum(fn(*plus) * cot) - np.sum(fn(*minus) * cot)) / (2 * h)
    return grad


def _check(forward, backward, args, wrt, seed=3):
    rng = np.random.default_rng(seed)
    cot = rng.standard_normal(forward(*args).shape)
    grads = backward(cot, *args)
    grads = grads if isinstance(grads, tuple) else (grads,)
    assert len(grads) == len(wrt)
    for grad, index in zip(grads, wrt):
        assert grad.dtype == np.float64
        np.testing.assert_allclose(grad, numeric_grad(forward, args, index, cot), rtol=1e-6, atol=1e-8)


def _normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape)  # no ties: the selection is locally constant


@pytest.mark.parametrize("attrs", [{"k": 2, "dim": 1}, {"k": 3, "dim": 0, "largest": False}, {"k": 4, "dim": -1}])
def test_topk_gradient_finite_differences(attrs):
    x = _normal(1, (3, 4))
    dim = attrs["dim"] % 2

    def forward(x):
        return K["topk"](x, **attrs)[0]

    def backward(dv, x):
        return K["topk_grad"](dv, K["topk"](x, **attrs)[1], dim=dim, size=x.shape[dim])

    _check(forward, backward, [x], [0])


@pytest.mark.parametrize("attrs", [{"dim": 0}, {"dim": 1, "descending": True}])
def test_sort_gradient_finite_differences(attrs):
    x = _normal(2, (3, 4))

    def forward(x):
        return K["sort"](x, **attrs)[0]

    def backward(dv, x):
        return K["topk_grad"](dv, K["sort"](x, **attrs)[1], dim=attrs["dim"], size=x.shape[attrs["dim"]])

    _check(forward, backward, [x], [0])


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_gradient_is_the_other_way_cumsum(exclusive, reverse):
    x = _normal(3, (3, 5))

    def forward(x):
        return K["cumsum"](x, dim=1, exclusive=exclusive, reverse=reverse)

    def backward(dy, x):
        return K["cumsum"](dy, dim=1, exclusive=exclusive, reverse=not reverse)

    _check(forward, backward, [x], [0])


@pytest.mark.parametrize("dims, keepdim", [([1], False), ([0, 2], True), ([0, 1, 2], False)])
def test_prod_gradient_finite_differences(dims, keepdim):
    x = _normal(4, (2, 3, 2))
    x[1, 1, 0] = 0.0  # a zero: prod is multilinear, the differences stay exact there

    def forward(x):
        return K["prod"](x, dims=dims, keepdim=keepdim)

    def backward(dy, x):
        return K["prod_grad"](dy, x, dims=dims, keepdim=keepdim)

    _check(forward, backward, [x], [0])


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_maximum_minimum_gradient_finite_differences(op):
    x, y = _normal(5, (3, 4)), _normal(6, (3, 4))

    def backward(dy, x, y):
        return K["maximum_grad"](dy, x, y, minimum=op == "minimum")

    _check(K[op], backward, [x, y], [0, 1])


# ============================================================================ vjp rules through the backward pass
VJP_CASES = {
    "topk": ([(3, 5)], {"k": 2}),
    "sort": ([(4, 3)], {"dim": 0, "descending": True}),
    "cumsum": ([(3, 4)], {"dim": 1, "exclusive": True}),
    "prod": ([(3, 4)], {"dims": [0], "keepdim": True}),
    "maximum": ([(3, 4), (4,)], {}),
    "minimum": ([(2, 1, 4), (3, 4)], {}),
}


@pytest.mark.parametrize("op", sorted(VJP_CASES))
def test_vjp_rule_matches_finite_differences(op):
    shapes, attrs = VJP_CASES[op]
    rule = get_rule(op)
    names = [rule.operand_name(i) for i in range(len(shapes))]
    out = "out:0" if rule.num_outputs > 1 else "out"
    graph = load_spec({"mesh": {"shape": [2], "names": ["dp"]},
                       "inputs": {n: {"shape": list(s), "dtype": "float64"} for n, s in zip(names, shapes)},
                       "nodes": [{"name": "out", "op": op, "inputs": names, "attrs": attrs}], "outputs": [out]})
    Propagate().run(graph)
    result = Backward().run(graph)
    rng = np.random.default_rng(9)
    values = {n: rng.standard_normal(s) for n, s in zip(names, shapes)}
    cot = rng.standard_normal(execute_global(graph, values)[out].shape)
    env = execute_global(result.graph, {**values, result.cotangents[out]: cot})

    def forward(*arrays):
        return execute_global(graph, dict(zip(names, arrays)))[out]

    args = [values[n] for n in names]
    for i, name in enumerate(names):
        np.testing.assert_allclose(env[result.grads[name]], numeric_grad(forward, args, i, cot), rtol=1e-6, atol=1e-8)


# ============================================================================ bad input: one line, exit 2
def _spec(tmp_path, node: dict, shapes=((4, 6),)) -> str:
    names = ["x", "y"][:len(shapes)]
    text = ("mesh: {shape: [2], names: [tp]}\ninputs:\n" +
            "".join(f"  {n}: {{shape: {list(s)}}}\n" for n, s in zip(names, shapes)) +
            f"nodes:\n  - {node}\n").replace("'", "")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return str(path)


BAD = [
    ({"name": "t", "op": "topk", "inputs": ["x"], "attrs": {"k": 7}}, ((4, 6),), "bad-attr",
     "topk: k=7 is larger than dim 1 of x (size 6)"),
    ({"name": "t", "op": "TopK", "inputs": ["x"], "attrs": {"k": -1}}, ((4, 6),), "bad-value",
     "topk: k must be a non-negative integer, got -1"),
    ({"name": "t", "op": "topk", "inputs": ["x"]}, ((4, 6),), "bad-attr", "needs attribute(s) ['k']"),
    ({"name": "t", "op": "topk", "inputs": ["x"], "attrs": {"k": 2, "dim": 2}}, ((4, 6),), "bad-attr",
     "topk: dim=2 is out of range for x of rank 2"),
    ({"name": "s", "op": "sort", "inputs": ["x"], "attrs": {"dim": -3}}, ((4, 6),), "bad-attr",
     "sort: dim=-3 is out of range"),
    ({"name": "a", "op": "argmax", "inputs": ["x"], "attrs": {"dim": 5}}, ((4, 6),), "bad-attr",
     "argmax: dim=5 is out of range"),
    ({"name": "a", "op": "argmin", "inputs": ["x"], "attrs": {"dim": 1}}, ((4, 0),), "bad-value",
     "argmin along dim 1 of x [4, 0], which is empty"),
    ({"name": "c", "op": "cumsum", "inputs": ["x"]}, ((4, 6),), "bad-attr", "needs attribute(s) ['dim']"),
    ({"name": "c", "op": "CumSum", "inputs": ["x"], "attrs": {"dim": 2}}, ((4, 6),), "bad-attr",
     "cumsum: dim=2 is out of range"),
    ({"name": "p", "op": "prod", "inputs": ["x"], "attrs": {"dims": [1, -1]}}, ((4, 6),), "bad-attr",
     "prod: dims [1, -1] name a dim twice"),
    ({"name": "m", "op": "maximum", "inputs": ["x", "y"]}, ((4, 6), (5, 6)), "broadcast-shape",
     "maximum: shapes [[4, 6], [5, 6]] do not broadcast"),
    ({"name": "m", "op": "Minimum", "inputs": ["x", "y"]}, ((4, 6), (4,)), "broadcast-shape",
     "minimum: shapes [[4, 6], [4]] do not broadcast"),
]


@pytest.mark.parametrize("node, shapes, code, text", BAD, ids=[f"{b[0]['op']}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, node, shapes, code, text):
    assert main(["check", _spec(tmp_path, node, shapes)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"layout-prop: error: {code}"), err
    assert text in err and "Traceback" not in err


def test_bad_k_through_the_installed_script(tmp_path):
    spec = _spec(tmp_path, {"name": "t", "op": "topk", "inputs": ["x"], "attrs": {"k": 9, "dim": 0}})
    done = subprocess.run(console_command() + ["run", spec], capture_output=True, text=True, env=cli_env(),
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("layout-prop: error: bad-attr") and "node 't'" in done.stderr
    assert "k=9 is larger than dim 0 of x (size 4)" in done.stderr


# ============================================================================ sharded runs
def _run(spec: dict, **kwargs):
    rep = run_graph(load_spec(spec), backward=True, seed=kwargs.pop("seed", 0), **kwargs)
    assert rep.ok, rep.mismatches or rep.violations
    return rep


def _collectives(rep) -> list[tuple[str, str, str]]:
    return sorted((c["node"], c["kind"], c["mesh_axis"]) for c in rep.collectives)


def test_router_topk_gathers_the_expert_dim_only():
    """MoE routing: logits [tokens, experts] sharded on tokens (dp) and experts (tp); top-2 experts
    per token. The experts are gathered on tp, the tokens stay sharded; uneven tokens (10 on 2 x 2)."""
    rep = _run({"mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
                "inputs": {"logits": {"shape": [10, 6], "placements": ["S(0)", "S(1)"]}},
                "nodes": [{"name": "route", "op": "topk", "inputs": ["logits"], "attrs": {"k": 2}}],
                "outputs": ["route:0", "route:1"]})
    # forward: one all-gather of the logits on tp; backward: the gradient is sliced back to S(1) for free
    assert _collectives(rep) == [("route/x", "all-gather", "tp")]
    assert sorted(rep.grads) == ["logits"]


def test_int_ties_sorted_on_sharded_rows_equal_one_device():
    rep = _run({"mesh": {"shape": [4], "names": ["dp"]},
                "inputs": {"x": {"shape": [5, 12], "placements": ["S(0)"], "dtype": "int32", "requires_grad": False}},
                "nodes": [{"name": "s", "op": "sort", "inputs": ["x"], "attrs": {"descending": True}},
                          {"name": "a", "op": "argmax", "inputs": ["x"], "attrs": {"dim": 1}}],
                "outputs": ["s:0", "s:1", "a"]}, seed=3)
    assert rep.collectives == []  # rows sharded, each sorted whole on its rank


def test_maximum_of_partial_maxima_stays_partial():
    """max(P(max) x, R y) is P(max): each rank takes the maximum of its term and y; the run equals one device."""
    spec = {"mesh": {"shape": [4], "names": ["tp"]},
            "inputs": {"x": {"shape": [6, 5], "placements": ["P(max)"], "requires_grad": False},
                       "y": {"shape": [5], "requires_grad": False}},
            "nodes": [{"name": "m", "op": "maximum", "inputs": ["x", "y"]},
                      {"name": "c", "op": "cumsum", "inputs": ["m"], "attrs": {"dim": 0}}]}
    graph = load_spec(spec)
    Propagate().run(graph)
    assert str(graph.node("m").meta["specs"][0].layout) == "(P(max))"
    assert not graph.node("m").meta["violations"]
    assert [v.code for v in graph.node("c").meta["violations"]] == ["partial-input"]
    rep = _run(spec)
    # the planner reduce-scatters x to S(1) before maximum (cheaper than all-reducing m before cumsum)
    assert _collectives(rep) == [("m/x", "reduce-scatter", "tp")]


# ============================================================================ top-k along a sharded dim
def _topk_spec(nodes, mesh, names, placements, shape) -> dict:
    return {"mesh": {"shape": list(mesh), "names": list(names)},
            "inputs": {"x": {"shape": list(shape), "placements": list(placements)}},
            "nodes": nodes, "outputs": ["top:0", "top:1"]}


def _split_topk(k: int, chunks: int) -> list[dict]:
    return [{"name": "cand", "op": "topk_candidates", "inputs": ["x"], "attrs": {"k": k, "chunks": chunks}},
            {"name": "top", "op": "topk_merge", "inputs": ["cand:0", "cand:1"], "attrs": {"k": k}}]


def test_candidates_then_merge_is_topk_and_moves_k_per_rank():
    """x [6, 40] with its 40 columns on 4 ranks: topk gathers the whole dim (720 bytes per rank); candidates
    (2 of each rank's 10 columns) then a merge move only the 8 candidates per row, values and indices."""
    plain = _run(_topk_spec([{"name": "top", "op": "topk", "inputs": ["x"], "attrs": {"k": 2}}], (4,), ("tp",),
                            ["S(1)"], (6, 40)))
    split = _run(_topk_spec(_split_topk(2, 4), (4,), ("tp",), ["S(1)"], (6, 40)))
    # the plain topk is expanded into the same two ops by itself (passes/expand.py): its rule's gather is 720
    assert "written as top/candidates (topk_candidates), top (topk_merge)" in plain.notes[0]
    assert plain.notes[0].endswith("instead of 720")
    assert sorted(c["bytes_per_rank"] for c in plain.collectives) == sorted(c["bytes_per_rank"]
                                                                            for c in split.collectives)
    # the planner turns the candidates to rows (all-to-all) rather than gathering them: 48 + 96 bytes
    forward = [c for c in split.collectives if not c["node"].startswith("grad/")]
    assert sorted((c["node"], c["kind"], c["bytes_per_rank"]) for c in forward) == [
        ("top/indices", "all-to-all", 96), ("top/values", "all-to-all", 48)]
    assert split.grads["x"]["max_abs_err"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_candidates_on_a_2x2_mesh_with_uneven_chunks_and_ties(dtype):
    """Rows on dp, the dim (61 = 31 + 30) on tp, k = 5: the candidates' dim is cut like x's."""
    spec = _topk_spec(_split_topk(5, 2), (2, 2), ("dp", "tp"), ["S(0)", "S(1)"], (5, 61))
    spec["inputs"]["x"].update({"dtype": dtype, "requires_grad": dtype == "float32"})
    graph = load_spec(spec)
    Propagate().run(graph)
    assert str(graph.node("cand").meta["specs"][0]) == f"{dtype}[5, 10] (S(0), S(1))"
    assert not graph.node("cand").meta["violations"]
    rep = _run(spec, seed=4)
    assert all(c["node"].startswith(("top/", "grad/")) for c in rep.collectives)  # x itself never moves


def test_candidates_refuse_a_cut_that_is_not_their_chunks():
    """10 on 2 x 2 is cut 3, 2, 3, 2, not torch.chunk(10, 4) = 3, 3, 3, 1: not one chunk per rank."""
    graph = load_spec(_topk_spec(_split_topk(2, 4), (2, 2), ("dp", "tp"), ["S(1)", "S(1)"], (3, 10)))
    Propagate().run(graph)
    (v,) = graph.node("cand").meta["violations"]
    assert v.code == "sharded-order-dim" and "not torch.chunk(10, 4)" in v.message and v.fixable
    assert _run(_topk_spec(_split_topk(2, 4), (2, 2), ("dp", "tp"), ["S(1)", "S(1)"], (3, 10))).ok


@pytest.mark.parametrize("node, code, text", [
    ({"name": "c", "op": "topk_candidates", "inputs": ["x"], "attrs": {"k": 2, "chunks": 0}}, "bad-value",
     "topk_candidates: chunks must be an integer >= 1, got 0"),
    ({"name": "c", "op": "topk_candidates", "inputs": ["x"], "attrs": {"k": 7, "chunks": 2}}, "bad-attr",
     "k=7 is larger than dim 1 of x (size 6)"),
    ({"name": "c", "op": "topk_candidates", "inputs": ["x"], "attrs": {"k": 2}}, "bad-attr",
     "needs attribute(s) ['chunks']"),
    ({"name": "c", "op": "topk_candidates", "inputs": ["x"], "attrs": {"k": 2, "chunks": 1000000000}}, "bad-attr",
     "topk_candidates: chunks=1000000000 is more than the dim's 6 elements and the mesh's 2 ranks"),
    ({"name": "c", "op": "chunk_cumsum", "inputs": ["x"], "attrs": {"dim": 0, "chunks": 5}}, "bad-attr",
     "chunk_cumsum: chunks=5 is more than the dim's 4 elements"),
    ({"name": "m", "op": "topk_merge", "inputs": ["x", "x"], "attrs": {"k": 7}}, "bad-attr",
     "topk_merge: k=7 is larger than dim 1 of values (size 6)"),
])
def test_bad_candidates_input_is_one_line_exit_2(tmp_path, capsys, node, code, text):
    assert main(["check", _spec(tmp_path, node)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"layout-prop: error: {code}") and text in err, err


def test_mindspore_kernels_order_nan_as_numpy():
    """MindSpore's CPU sort leaves rows with NaN unsorted and its argmax skips NaN: the kernels order NaN
    themselves (NaN the greatest, ties by index), as the numpy reference."""
    pytest.importorskip("mindspore")
    from layout_prop.kernels.mindspore_backend import KERNELS as MS, to_numpy

    x = np.array([[1.0, NAN, 2.0, NAN, -np.inf, 2.0, np.inf, 1.0]], np.float32)
    cands = K["topk_candidates"](x, k=3, chunks=3)
    for largest in (True, False):
        np.testing.assert_array_equal(to_numpy(MS["sort"](x, descending=largest)[1]),
                                      K["sort"](x, descending=largest)[1])
        np.testing.assert_array_equal(to_numpy(MS["topk"](x, k=5, largest=largest)[1]),
                                      K["topk"](x, k=5, largest=largest)[1])
        np.testing.assert_array_equal(to_numpy(MS["topk_merge"](*cands, k=5, largest=largest)[1]),
                                      K["topk_merge"](*cands, k=5, largest=largest)[1])
    np.testing.assert_array_equal(K["sort"](x, descending=True)[1], [[1, 3, 6, 2, 5, 0, 7, 4]])
    for op in ("argmax", "argmin"):
        assert to_numpy(MS[op](x, dim=1)).tolist() == K[op](x, dim=1).tolist() == [1]


# ============================================================================ cumsum along a sharded dim
def _cumsum_spec(nodes, shape=(4, 64), mesh=(4,), names=("sp",), placements=("S(1)",), dtype="float32") -> dict:
    return {"mesh": {"shape": list(mesh), "names": list(names)},
            "inputs": {"x": {"shape": list(shape), "placements": list(placements), "dtype": dtype,
                             "requires_grad": dtype == "float32"}},
            "nodes": nodes, "outputs": ["y"]}


def _split_cumsum(chunks: int, **attrs) -> list[dict]:
    chunked = {"dim": 1, "chunks": chunks}
    return [{"name": "t", "op": "chunk_sum", "inputs": ["x"], "attrs": chunked},
            {"name": "o", "op": "cumsum", "inputs": ["t"],
             "attrs": {"dim": 1, "exclusive": True, "reverse": attrs.get("reverse", False)}},
            {"name": "y", "op": "chunk_cumsum", "inputs": ["x", "o"], "attrs": {**chunked, **attrs}}]


def test_chunked_cumsum_moves_the_shard_totals_only():
    """x [4, 64], the scanned dim on 4 ranks: cumsum gathers x (768 bytes per rank); the local scans plus an
    exclusive scan of the 4 shard totals move 12 bytes forward and 24 backward."""
    plain = _run(_cumsum_spec([{"name": "y", "op": "cumsum", "inputs": ["x"], "attrs": {"dim": 1}}]))
    split = _run(_cumsum_spec(_split_cumsum(4)))
    # the plain cumsum is expanded into the same three ops by itself (passes/expand.py): its rule's gather is 768
    assert plain.notes[0].endswith("instead of 768")
    assert sum(c["bytes_per_rank"] for c in plain.collectives) == 48
    forward = sorted((c["node"], c["bytes_per_rank"]) for c in split.collectives if not c["node"].startswith("grad/"))
    assert forward == [("o/x", 12), ("y/offsets", 12)]
    assert sum(c["bytes_per_rank"] for c in split.collectives) == 48


@pytest.mark.parametrize("attrs", [{}, {"exclusive": True}, {"reverse": True}, {"exclusive": True, "reverse": True}])
def test_chunked_cumsum_is_cumsum(attrs):
    """The decomposition equals cumsum exactly on int64 (10 on 4 ranks: pieces 3, 3, 3, 1) and its sharded
    run equals one device."""
    spec = _cumsum_spec(_split_cumsum(4, **attrs), shape=(3, 10), dtype="int64")
    rng = np.random.default_rng(5)
    x = rng.integers(-9, 9, (3, 10))
    graph = load_spec(spec)
    Propagate().run(graph)
    got = execute_global(graph, {"x": x})["y"]
    np.testing.assert_array_equal(got, K["cumsum"](x, dim=1, **attrs))
    _run(spec)
    _run(_cumsum_spec(_split_cumsum(4, **attrs), shape=(3, 10)))  # float32, forward and backward


def test_chunked_cumsum_on_a_2x2_mesh_keeps_x_in_place():
    spec = _cumsum_spec(_split_cumsum(2), shape=(5, 9), mesh=(2, 2), names=("dp", "sp"), placements=("S(0)", "S(1)"))
    graph = load_spec(spec)
    Propagate().run(graph)
    assert str(graph.node("t").meta["specs"][0].layout) == "(S(0), S(1))"
    assert str(graph.node("y").meta["specs"][0].layout) == "(S(0), S(1))" and not graph.node("y").meta["violations"]
    rep = _run(spec)
    # only the totals (3 rows x 2 on rank 0) are gathered on sp, forward and backward
    assert _collectives(rep) == [("grad/o/cumsum1/x", "all-gather", "sp"), ("o/x", "all-gather", "sp")]


@pytest.mark.parametrize("nodes, out", [
    (_split_topk(3, 3), "top:0"),
    ([{"name": "c", "op": "topk_candidates", "inputs": ["x"], "attrs": {"k": 2, "chunks": 3, "largest": False}}],
     "c:0"),
    (_split_cumsum(3), "y"),
    (_split_cumsum(3, exclusive=True, reverse=True), "y"),
    ([{"name": "y", "op": "chunk_cumsum", "inputs": ["x"], "attrs": {"dim": 1, "chunks": 3, "reverse": True}}], "y"),
], ids=["topk-split", "candidates", "cumsum-split", "cumsum-split-exclusive-reverse", "chunk-cumsum"])
def test_split_graphs_gradients_match_finite_differences(nodes, out):
    """The backward graph of the split top-k and cumsum against central differences of the forward (x [3, 8])."""
    graph = load_spec({"mesh": {"shape": [2], "names": ["dp"]},
                       "inputs": {"x": {"shape": [3, 8], "dtype": "float64"}}, "nodes": nodes, "outputs": [out]})
    Propagate().run(graph)
    result = Backward().run(graph)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 8))
    cot = rng.standard_normal(execute_global(graph, {"x": x})[out].shape)
    env = execute_global(result.graph, {"x": x, result.cotangents[out]: cot})

    def forward(x):
        return execute_global(graph, {"x": x})[out]

    np.testing.assert_allclose(env[result.grads["x"]], numeric_grad(forward, [x], 0, cot), rtol=1e-6, atol=1e-8)


def test_argmax_along_a_sharded_dim_is_the_split_top_1():
    """argmax(x, dim, keepdim=True) is topk_merge(topk_candidates(x, k=1), k=1)'s indices, ties and NaN included,
    so the split form serves argmax along a sharded dim too (8 of 32 values per row move instead of 32)."""
    spec = _topk_spec(_split_topk(1, 4), (4,), ("tp",), ["S(1)"], (5, 32))
    spec["inputs"]["x"].update({"dtype": "int32", "requires_grad": False})
    graph = load_spec(spec)
    Propagate().run(graph)
    rng = np.random.default_rng(2)
    ints = rng.integers(0, 4, (5, 32)).astype(np.int32)
    np.testing.assert_array_equal(execute_global(graph, {"x": ints})["top:1"], K["argmax"](ints, dim=1, keepdim=True))
    floats = rng.standard_normal((5, 32))
    floats[rng.random(floats.shape) < 0.05] = NAN
    np.testing.assert_array_equal(K["topk_merge"](*K["topk_candidates"](floats, k=1, chunks=4), k=1)[1],
                                  K["argmax"](floats, dim=1, keepdim=True))
    rep = _run(spec, seed=2)
    assert all(c["node"].startswith("top/") for c in rep.collectives)
