"""Simulated collectives: group semantics, scatter/assemble, and executing planned moves.

Expected values are written out by hand or computed by the small independent references
at the top of this file (nested torch.chunk bounds, ring byte counts), never by the code
under test.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from layout_prop import DeviceMesh, ExecutionError, Layout, LayoutError, TensorSpec
from layout_prop.engines.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    apply_plan,
    apply_step,
    assemble,
    local_slice,
    reduce_scatter,
    reduce_terms,
    scatter_global,
    split_terms,
)
from layout_prop.core.placement import Partial, Shard, StridedShard
from layout_prop.core.redistribute import enumerate_plans, plan_redistribution


# --------------------------------------------------------------------------- independent references
def ref_chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk: pieces of ceil(n / k), the last ones short or empty."""
    size = -(-n // k)
    return min(i * size, n), min((i + 1) * size, n)


def ref_slices(shape, mesh: DeviceMesh, placements, rank: int) -> list[tuple[int, int]]:
    """Per dim, the global range held by ``rank``: mesh axes cut a dim outer first."""
    coords = np.unravel_index(rank, mesh.shape)
    out = []
    for d, n in enumerate(shape):
        lo, hi = 0, n
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim == d:
                a, b = ref_chunk(hi - lo, mesh.shape[axis], int(coords[axis]))
                lo, hi = lo + a, lo + b
        out.append((lo, hi))
    return out


def ref_indices(shape, mesh: DeviceMesh, placements, rank: int) -> list[list[int]]:
    """Per dim, the global indices held by ``rank``, strided shards included: each mesh axis
    cuts the list the outer ones left; ``_S(d,k)`` cuts each of the list's k equal blocks."""
    coords = np.unravel_index(rank, mesh.shape)
    out = []
    for d, n in enumerate(shape):
        held = list(range(n))
        for axis, p in enumerate(placements):
            c, k = int(coords[axis]), mesh.shape[axis]
            if isinstance(p, Shard) and p.dim == d:
                a, b = ref_chunk(len(held), k, c)
                held = held[a:b]
            elif isinstance(p, StridedShard) and p.dim == d and k > 1:  # on a size-1 axis: nothing cut
                m = len(held) // p.split_factor
                blocks = [held[i * m:(i + 1) * m] for i in range(p.split_factor)]
                a, b = ref_chunk(m, k, c)
                held = [x for block in blocks for x in block[a:b]]
        out.append(held)
    return out


def ref_local(array: np.ndarray, spec: TensorSpec, rank: int) -> np.ndarray:
    return array[np.ix_(*ref_indices(spec.shape, spec.mesh, spec.layout.placements, rank))]


def ref_step_bytes(step, before: list[np.ndarray], after: list[np.ndarray]) -> int:
    """The ring cost model of the brief, evaluated on the actual arrays of each group."""
    mesh, n = step.src.mesh, step.src.mesh.shape[step.mesh_axis]
    worst = 0
    for group in mesh.groups(step.mesh_axis):
        ins = [before[r].nbytes for r in group]
        outs = [after[r].nbytes for r in group]
        if step.kind in ("local-slice", "local-partial"):
            sent = 0
        elif step.kind == "all-gather":
            sent = sum(ins) - min(ins)
        elif step.kind == "reduce-scatter":
            sent = ins[0] - min(outs)
        elif step.kind == "all-reduce":
            m, item = before[group[0]].size, before[group[0]].itemsize
            pieces = [ref_chunk(m, n, i) for i in range(n)]
            sent = 2 * (m - min(b - a for a, b in pieces)) * item
        else:  # all-to-all: local bytes minus the bytes the rank holds both before and after
            sent = 0
            for r in group:
                old = ref_indices(step.src.shape, mesh, step.src.layout.placements, r)
                new = ref_indices(step.src.shape, mesh, step.dst.layout.placements, r)
                kept = np.prod([len(set(a) & set(b)) for a, b in zip(old, new)])
                sent = max(sent, before[r].nbytes - int(kept) * before[r].itemsize)
        worst = max(worst, sent)
    return worst


def spec(shape, placements, mesh, dtype="float64") -> TensorSpec:
    return TensorSpec(shape, dtype, Layout(mesh, placements, len(shape)))


MESH4 = DeviceMesh((4,), ("tp",))
MESH22 = DeviceMesh((2, 2), ("dp", "tp"))


# --------------------------------------------------------------------------- group functions
class TestGroupCollectives:
    def test_all_gather_uneven_and_empty(self):
        pieces = [np.array([[0, 1], [2, 3]]), np.array([[4, 5]]), np.zeros((0, 2), int)]
        out = all_gather(pieces, 0)
        assert len(out) == 3
        for r in out:
            assert r.tolist() == [[0, 1], [2, 3], [4, 5]]
        # the ranks share one read-only result: a write fails instead of reaching another rank
        with pytest.raises(ValueError):
            out[0][0, 0] = 99
        assert out[1][0, 0] == 0

    def test_all_gather_last_dim(self):
        out = all_gather([np.array([[1], [2]]), np.array([[3], [4]])], 1)
        assert out[1].tolist() == [[1, 3], [2, 4]]

    @pytest.mark.parametrize("op, expected", [
        ("sum", [6.0, 3.0]), ("avg", [2.0, 1.0]), ("max", [4.0, 2.0]), ("min", [1.0, 0.0]),
    ])
    def test_all_reduce_ops(self, op, expected):
        terms = [np.array([1.0, 2.0]), np.array([4.0, 1.0]), np.array([1.0, 0.0])]
        out = all_reduce(terms, op)
        assert [r.tolist() for r in out] == [expected] * 3

    def test_reduce_scatter_uneven(self):
        # 5 elements in 2 pieces: 3 and 2; 3 elements in 4 pieces: 1, 1, 1, 0
        out = reduce_scatter([np.arange(5.0), np.full(5, 10.0)], "sum", 0, 2)
        assert [r.tolist() for r in out] == [[10.0, 11.0, 12.0], [13.0, 14.0]]
        out = reduce_scatter([np.array([[1, 2, 3]])] * 4, "max", 1)
        assert [r.tolist() for r in out] == [[[1]], [[2]], [[3]], [[]]]

    def test_reduce_scatter_checks_group_size(self):
        with pytest.raises(ExecutionError) as info:
            reduce_scatter([np.zeros(4), np.zeros(4)], "sum", 0, 3)
        assert info.value.code == "group-size-mismatch"

    def test_all_to_all_uneven(self):
        # a (3, 5) tensor S(0) on 2 ranks (rows 2, 1) -> S(1) (cols 3, 2)
        full = np.arange(15).reshape(3, 5)
        out = all_to_all([full[:2], full[2:]], split_dim=1, concat_dim=0)
        assert out[0].tolist() == [[0, 1, 2], [5, 6, 7], [10, 11, 12]]
        assert out[1].tolist() == [[3, 4], [8, 9], [13, 14]]

    def test_local_slice(self):
        out = local_slice([np.arange(7)] * 3, 0)  # 7 on 3: 3, 3, 1
        assert [r.tolist() for r in out] == [[0, 1, 2], [3, 4, 5], [6]]

    def test_reduce_needs_equal_shapes(self):
        with pytest.raises(ExecutionError) as info:
            all_reduce([np.zeros(2), np.zeros(3)], "sum")
        assert info.value.code == "shape-mismatch" and "[(2,), (3,)]" in info.value.message


# --------------------------------------------------------------------------- terms of Partial values
class TestSplitTerms:
    value = np.array([[0.1, -3.75, 1e300], [2.0 / 3.0, 0.0, -1e-300]])

    @pytest.mark.parametrize("n", [1, 2, 3, 4])
    def test_sum_terms_add_up_exactly(self, n):
        terms = split_terms(self.value, n, "sum", np.random.default_rng(n))
        total = terms[0].copy()
        for t in terms[1:]:
            total = total + t
        assert np.array_equal(total, self.value)
        if n > 1:
            assert not all(np.array_equal(t, terms[0]) for t in terms)  # really split

    @pytest.mark.parametrize("op", ["max", "min"])
    def test_extreme_terms(self, op):
        n = 3
        terms = np.stack(split_terms(self.value, n, op, np.random.default_rng(1)))
        fold = terms.max(axis=0) if op == "max" else terms.min(axis=0)
        assert np.array_equal(fold, self.value)

    def test_avg_terms(self):
        terms = split_terms(self.value[:, :2], 4, "avg", np.random.default_rng(2))
        mean = sum(terms) / 4
        np.testing.assert_allclose(mean, self.value[:, :2], rtol=1e-15, atol=1e-15)

    def test_without_rng(self):
        v = np.array([1.0, -2.0])
        assert [t.tolist() for t in split_terms(v, 3, "sum")] == [[1.0, -2.0], [0.0, 0.0], [0.0, 0.0]]
        assert [t.tolist() for t in split_terms(v, 2, "min")] == [[1.0, -2.0], [np.inf, np.inf]]
        assert [t.tolist() for t in split_terms(v, 2, "avg")] == [[1.0, -2.0], [1.0, -2.0]]
        ints = split_terms(np.array([5], dtype=np.int32), 2, "max")
        assert ints[1].tolist() == [np.iinfo(np.int32).min]

    def test_integer_sum_wraps_exactly(self):
        big = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 7])
        terms = split_terms(big, 3, "sum", np.random.default_rng(3))
        assert np.array_equal(reduce_terms(terms, "sum"), big)


# --------------------------------------------------------------------------- scatter and assemble
class TestScatterAssemble:
    def test_scatter_shards_by_hand(self):
        # (5, 2) S(0) on dp=2 (rows 3, 2), S(1) on tp=2 (cols 1, 1)
        a = np.arange(10.0).reshape(5, 2)
        pieces = scatter_global(a, spec((5, 2), ["S(0)", "S(1)"], MESH22))
        assert [p.tolist() for p in pieces] == [
            [[0.0], [2.0], [4.0]], [[1.0], [3.0], [5.0]], [[6.0], [8.0]], [[7.0], [9.0]],
        ]

    def test_scatter_nested_shards(self):
        # 10 on (S(0), S(0)): dp halves 5 + 5, tp cuts each half 3 + 2
        pieces = scatter_global(np.arange(10), spec((10,), ["S(0)", "S(0)"], MESH22, "int64"))
        assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]

    def test_scatter_partial_without_rng(self):
        pieces = scatter_global(np.array([1.0, 2.0]), spec((2,), ["P(max)", "R"], MESH22))
        assert [p.tolist() for p in pieces] == [[1.0, 2.0], [1.0, 2.0], [-np.inf, -np.inf], [-np.inf, -np.inf]]

    def test_assemble_reduces_inner_partial_first(self):
        # (P(max), P(sum)): value = max over dp of (sum over tp); ranks 0, 1 are dp=0
        locals_ = [np.array([1.0]), np.array([2.0]), np.array([5.0]), np.array([-4.0])]
        # max(1 + 2, 5 - 4) = 3; the other order would give max(1, 2) + max(5, -4)... = 2 + 5 = 7
        assert assemble(locals_, spec((1,), ["P(max)", "P(sum)"], MESH22)).tolist() == [3.0]

    def test_replica_mismatch_names_ranks_and_index(self):
        s = spec((2, 3), ["S(0)", "R"], MESH22)
        locals_ = [np.zeros((1, 3)) for _ in range(4)]
        locals_[3] = locals_[3].copy()
        locals_[3][0, 2] = 1e-9
        with pytest.raises(ExecutionError) as info:
            assemble(locals_, s)
        err = info.value
        assert err.code == "replica-mismatch"
        assert "ranks 2 and 3" in err.message and "[0, 2]" in err.message
        # within tolerance it passes, and rank 2's value is used, not an average
        out = assemble(locals_, s, atol=1e-6)
        assert np.array_equal(out, np.zeros((2, 3)))

    def test_assemble_checks_shapes(self):
        with pytest.raises(ExecutionError) as info:
            assemble([np.zeros(3)] * 4, spec((4,), ["S(0)"], MESH4))
        assert info.value.code == "shape-mismatch" and "rank 0" in info.value.message

    def test_apply_step_checks_shapes(self):
        plan = plan_redistribution(spec((4,), ["S(0)"], MESH4), Layout(MESH4, ["R"], 1))
        with pytest.raises(ExecutionError) as info:
            apply_step(plan.steps[0], [np.zeros(4)] * 4)
        assert info.value.code == "shape-mismatch"


# --------------------------------------------------------------------------- executing plans
class TestApplyPlan:
    def test_swap_by_hand(self):
        a = np.arange(16.0).reshape(4, 4)
        src = spec((4, 4), ["S(0)", "S(1)"], MESH22)
        plan = plan_redistribution(src, Layout(MESH22, ["S(1)", "S(0)"], 2))
        out = apply_plan(plan, scatter_global(a, src))
        # dst: dp cuts cols (2 | 2), tp cuts rows (2 | 2); rank 1 = (dp 0, tp 1)
        assert out[1].tolist() == [[8.0, 9.0], [12.0, 13.0]]
        assert out[2].tolist() == [[2.0, 3.0], [6.0, 7.0]]

    def test_every_enumerated_plan_gives_the_same_data(self):
        mesh = DeviceMesh((2, 3), ("dp", "tp"))
        a = np.random.default_rng(0).standard_normal((5, 7))
        src = spec((5, 7), ["S(1)", "P(sum)"], mesh)
        dst = Layout(mesh, ["S(0)", "S(1)"], 2)
        locals_ = scatter_global(a, src, np.random.default_rng(1))
        plans = enumerate_plans(src, dst)
        assert len(plans) > 2
        for plan in plans:
            out = apply_plan(plan, locals_)
            for rank in range(mesh.size):
                np.testing.assert_allclose(out[rank], ref_local(a, plan.dst, rank), rtol=1e-13, atol=1e-13)

    @pytest.mark.parametrize("dtype", ["int64", "bool", "float32"])
    def test_other_dtypes(self, dtype):
        a = (np.arange(24).reshape(4, 6) % 5).astype(dtype)
        src = spec((4, 6), ["P(max)", "S(1)"], MESH22, dtype)
        dst = Layout(MESH22, ["S(1)", "S(0)"], 2)
        out = apply_plan(plan_redistribution(src, dst), scatter_global(a, src, np.random.default_rng(5)))
        for rank in range(4):
            assert out[rank].dtype == np.dtype(dtype)
            assert np.array_equal(out[rank], ref_local(a, TensorSpec((4, 6), dtype, dst), rank))


@st.composite
def cases(draw):
    sizes = []
    for _ in range(draw(st.integers(1, 3))):
        room = 8 // int(np.prod(sizes, dtype=int))
        sizes.append(draw(st.integers(1, min(4, room))))
    mesh = DeviceMesh(tuple(sizes), tuple("xyz"[: len(sizes)]))
    shape = tuple(draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 12])) for _ in range(draw(st.integers(1, 3))))
    nd = len(shape)
    shards = ["R"] + [f"S({d})" for d in range(nd)] + [f"_S({d},{k})" for d in range(nd) for k in (2, 3)]
    src = [draw(st.sampled_from(shards + ["P(sum)", "P(avg)", "P(max)", "P(min)"])) for _ in sizes]
    partials = ["P(sum)", "P(avg)", "P(max)", "P(min)"]
    dst = [draw(st.sampled_from(shards + ([s] if s.startswith("P") else partials))) for s in src]  # R/S -> P too
    try:
        src_spec = TensorSpec(shape, "float64", Layout(mesh, src, nd))
        dst_layout = Layout(mesh, dst, nd)
        TensorSpec(shape, "float64", dst_layout)
    except LayoutError:
        assume(False)
    return src_spec, dst_layout, draw(st.integers(0, 2**32 - 1))


def _needs_tolerance(src: TensorSpec) -> bool:
    """Sum and avg terms may round when reduced in another order than they were split."""
    return any(isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for p in src.layout.placements)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_redistribution_moves_the_right_data(case):
    src, dst, seed = case
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(src.shape)
    mesh = src.mesh
    # the spec's local pieces agree with the independent nested torch.chunk reference
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        assert [src.dim_indices(d, coords).tolist() for d in range(src.ndim)] == \
            ref_indices(src.shape, mesh, src.layout.placements, rank)
        if not src.layout.has_strided:
            assert list(src.local_slices(rank)) == ref_slices(src.shape, mesh, src.layout.placements, rank)

    locals_ = scatter_global(a, src, rng)
    tol = dict(rtol=1e-12, atol=1e-12) if _needs_tolerance(src) else dict(rtol=0, atol=0)
    np.testing.assert_allclose(assemble(locals_, src, **tol), a, **tol)
    np.testing.assert_array_equal(assemble(scatter_global(a, src), src), a)

    try:
        plan = plan_redistribution(src, dst)
    except LayoutError as err:  # only mixed Partial ops can block a move (details in test_redistribute)
        ops = {p.reduce_op for a, p in enumerate(src.layout.placements)
               if isinstance(p, Partial) and mesh.shape[a] > 1}
        assert err.code == "no-redistribution" and len(ops) > 1 and ops != {"sum", "avg"}
        return
    arrays = [x.copy() for x in locals_]
    for step in plan.steps:
        after = apply_step(step, arrays)
        assert step.bytes_per_rank == ref_step_bytes(step, arrays, after)
        arrays = after
    before = [x.copy() for x in locals_]
    out = apply_plan(plan, locals_)
    for rank in range(mesh.size):
        assert np.array_equal(out[rank], arrays[rank])
        assert np.array_equal(locals_[rank], before[rank])  # inputs untouched
        if not dst.has_partial():  # a kept Partial axis holds terms, checked by assemble below
            np.testing.assert_allclose(out[rank], ref_local(a, plan.dst, rank), **tol)
    np.testing.assert_allclose(assemble(out, plan.dst, **tol), a, **tol)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_split_terms_of_a_scalar(op):
    # a 0-d value with a Partial placement (seen crashing on element assignment before)
    terms = split_terms(np.array(2.5), 3, op, np.random.default_rng(0))
    assert [t.shape for t in terms] == [()] * 3
    assert float(reduce_terms(terms, op)) == 2.5
