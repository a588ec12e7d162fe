"""Core value types and the graph IR: DeviceMesh, placements, Layout, TensorSpec, Graph.

Expected values are written by hand (or come from numpy / small helpers in this file that
restate DESIGN.md's definitions); nothing expected is computed with the code under test.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from layout_prop import (
    DeviceMesh,
    GraphError,
    Layout,
    LayoutError,
    LayoutPropError,
    OpError,
    Partial,
    Replicate,
    Shard,
    TensorSpec,
    parse_placement,
)
from layout_prop.core.errors import SpecError
from layout_prop.core.graph import Graph, Node
from layout_prop.io.loader import load_spec

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _code(excinfo) -> str:
    return excinfo.value.code


# =========================================================================== strategies
@st.composite
def meshes(draw, max_axes: int = 3, max_size: int = 4, max_ranks: int | None = None) -> DeviceMesh:
    ndim = draw(st.integers(1, max_axes))
    shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=ndim, max_size=ndim)))
    if max_ranks is not None:
        assume(math.prod(shape) <= max_ranks)
    names = tuple(f"m{i}" for i in range(ndim))
    return DeviceMesh(shape, names)


@st.composite
def shard_layouts(draw, mesh_strategy=None):
    """(mesh, tensor rank, raw placements, expected normalised placements, expected tensor_map).

    Every mesh axis independently replicates or shards a dim in ``-rank..rank-1``; several
    axes may pick the same dim.  The expected tensor_map restates DESIGN.md: -1, or
    k = ndim_mesh - 1 - axis, or a tuple of k's outer axis first.
    """
    mesh = draw(mesh_strategy if mesh_strategy is not None else meshes())
    rank = draw(st.integers(1, 4))
    raw, norm = [], []
    for _ in range(mesh.ndim):
        d = draw(st.one_of(st.none(), st.integers(-rank, rank - 1)))
        if d is None:
            raw.append(draw(st.sampled_from(["R", "Replicate()", Replicate()])))
            norm.append(Replicate())
        else:
            raw.append(draw(st.sampled_from([f"S({d})", f"Shard({d})", Shard(d)])))
            norm.append(Shard(d % rank))
    tm = []
    for dim in range(rank):
        ks = [mesh.ndim - 1 - a for a, p in enumerate(norm) if p == Shard(dim)]
        tm.append(-1 if not ks else ks[0] if len(ks) == 1 else tuple(ks))
    return mesh, rank, raw, tuple(norm), tuple(tm)


# =========================================================================== DeviceMesh
class TestDeviceMesh:
    @FAST
    @given(meshes(max_axes=4))
    def test_rank_coords_round_trip_row_major(self, mesh):
        assert mesh.size == int(np.prod(mesh.shape))
        for r in range(mesh.size):
            expected = tuple(int(c) for c in np.unravel_index(r, mesh.shape))
            assert mesh.coords(r) == expected
            assert mesh.rank(expected) == r
        assert list(mesh.all_coords()) == [tuple(int(c) for c in np.unravel_index(r, mesh.shape))
                                           for r in range(mesh.size)]

    def test_coords_by_hand(self):
        mesh = DeviceMesh((2, 3), ("dp", "tp"))
        assert [mesh.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
        assert mesh.rank((1, 2)) == 5

    @FAST
    @given(meshes(max_axes=4))
    def test_groups_partition_and_differ_in_one_coordinate(self, mesh):
        for axis in range(mesh.ndim):
            groups = mesh.groups(axis)
            assert groups == mesh.groups(mesh.names[axis])
            flat = [r for g in groups for r in g]
            assert sorted(flat) == list(range(mesh.size))  # a partition: every rank exactly once
            assert len(groups) == mesh.size // mesh.shape[axis]
            for g in groups:
                assert len(g) == mesh.shape[axis]
                coords = [np.unravel_index(r, mesh.shape) for r in g]
                # ordered by the coordinate on `axis`, all other coordinates equal
                assert [int(c[axis]) for c in coords] == list(range(mesh.shape[axis]))
                for other in range(mesh.ndim):
                    if other != axis:
                        assert len({int(c[other]) for c in coords}) == 1
                for r in g:
                    assert mesh.group(r, axis) == g

    def test_groups_by_hand(self):
        mesh = DeviceMesh((2, 3), ("dp", "tp"))
        assert mesh.groups("dp") == ((0, 3), (1, 4), (2, 5))
        assert mesh.groups("tp") == ((0, 1, 2), (3, 4, 5))
        assert mesh.groups(-1) == ((0, 1, 2), (3, 4, 5))
        cube = DeviceMesh((2, 2, 2), ("dp", "tp", "sp"))
        assert cube.groups("tp") == ((0, 2), (1, 3), (4, 6), (5, 7))
        assert cube.group(5, "dp") == (1, 5)
        assert cube.group(5, "sp") == (4, 5)

    def test_submesh(self):
        mesh = DeviceMesh((2, 3, 4), ("dp", "tp", "sp"))
        sub = mesh.submesh(["sp", "dp"])
        assert sub.shape == (4, 2) and sub.names == ("sp", "dp")
        assert mesh.submesh([1]) == DeviceMesh((3,), ("tp",))

    def test_value_semantics_and_str(self):
        a = DeviceMesh((2, 2), ("dp", "tp"))
        assert a == DeviceMesh([2, 2], ["dp", "tp"])
        assert a != DeviceMesh((2, 2), ("tp", "dp"))
        assert hash(a) == hash(DeviceMesh((2, 2), ("dp", "tp")))
        assert str(a) == "DeviceMesh(dp=2, tp=2)"
        assert a.to_dict() == {"shape": [2, 2], "names": ["dp", "tp"]}
        assert DeviceMesh((3,)).names == ("axis0",)
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.shape = (4,)

    @pytest.mark.parametrize("shape", [(0,), (2, 0), (-1, 2), (2, -3), (True, 2), (2.0,), ("2",), ()],
                             ids=["zero", "zero-second", "negative", "negative-second", "bool", "float", "str",
                                  "no-axes"])
    def test_bad_sizes(self, shape):
        with pytest.raises(LayoutError) as e:
            DeviceMesh(shape, tuple(f"a{i}" for i in range(len(shape))))
        assert _code(e) == "invalid-mesh"
        assert e.value.hint

    @pytest.mark.parametrize("names, fragment", [
        (("dp", "dp"), "['dp']"),
        (("dp",), "2 axes but 1 names"),
        (("dp", "tp", "sp"), "2 axes but 3 names"),
        (("dp", ""), "''"),
        (("dp", 3), "3"),
    ], ids=["duplicate", "missing", "too-many", "empty", "not-a-string"])
    def test_bad_names(self, names, fragment):
        with pytest.raises(LayoutError) as e:
            DeviceMesh((2, 2), names)
        assert _code(e) == "invalid-mesh"
        assert fragment in e.value.message
        assert e.value.hint

    def test_bad_rank_and_axis(self):
        mesh = DeviceMesh((2, 2), ("dp", "tp"))
        with pytest.raises(LayoutError) as e:
            mesh.coords(4)
        assert _code(e) == "invalid-rank" and "4" in e.value.message
        with pytest.raises(LayoutError) as e:
            mesh.coords(-1)
        assert _code(e) == "invalid-rank"
        with pytest.raises(LayoutError) as e:
            mesh.groups("sp")
        assert _code(e) == "unknown-mesh-axis" and "'sp'" in e.value.message
        with pytest.raises(LayoutError) as e:
            mesh.axis_index(2)
        assert _code(e) == "unknown-mesh-axis"


# =========================================================================== placements
class TestPlacements:
    @pytest.mark.parametrize("text, expected", [
        ("R", Replicate()),
        ("Replicate()", Replicate()),
        ("Replicate", Replicate()),
        ("S(0)", Shard(0)),
        ("S(-1)", Shard(-1)),
        ("Shard(2)", Shard(2)),
        (" S( 3 ) ", Shard(3)),
        ("P", Partial("sum")),
        ("P(sum)", Partial("sum")),
        ("P(max)", Partial("max")),
        ("P(min)", Partial("min")),
        ("Partial(avg)", Partial("avg")),
        ("Partial", Partial("sum")),
    ])
    def test_parse(self, text, expected):
        p = parse_placement(text)
        assert p == expected
        assert type(p) is type(expected)

    def test_parse_passes_placements_through(self):
        s = Shard(1)
        assert parse_placement(s) is s

    @pytest.mark.parametrize("p, short, long", [
        (Replicate(), "R", "Replicate()"),
        (Shard(0), "S(0)", "Shard(dim=0)"),
        (Shard(-1), "S(-1)", "Shard(dim=-1)"),
        (Partial(), "P(sum)", "Partial(reduce_op='sum')"),
        (Partial("avg"), "P(avg)", "Partial(reduce_op='avg')"),
        (Partial("max"), "P(max)", "Partial(reduce_op='max')"),
    ])
    def test_str_and_repr(self, p, short, long):
        assert str(p) == short
        assert repr(p) == long
        assert eval(long) == p  # the repr is exact
        assert parse_placement(short) == p  # the short form parses back

    def test_frozen_and_hashable(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            Shard(0).dim = 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            Partial("sum").reduce_op = "max"
        items = {Replicate(), Replicate(), Shard(0), Shard(0), Shard(1), Partial("sum"), Partial(), Partial("max")}
        assert len(items) == 5
        assert Shard(0) != Shard(1)
        assert Shard(0) != Replicate()
        assert Partial("sum") != Partial("avg")
        assert {Shard(2): "x"}[parse_placement("S(2)")] == "x"

    def test_predicates(self):
        assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
        assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
        assert Partial().is_partial() and not Partial().is_replicate()

    @pytest.mark.parametrize("text", ["Q", "", "S", "S()", "S(x)", "S(1.5)", "S(0", "Shard[0]", "P(prod)",
                                      "Partial(mean)", "RR", "S(0)S(1)", 3, None, 1.0],
                             ids=lambda t: repr(t))
    def test_bad_strings(self, text):
        with pytest.raises(LayoutError) as e:
            parse_placement(text)
        assert _code(e) == "bad-placement"
        assert e.value.hint
        if isinstance(text, str) and text:
            assert repr(text) in e.value.message or text.split("(")[-1].rstrip(")") in e.value.message

    @pytest.mark.parametrize("make", [lambda: Shard("1"), lambda: Shard(True), lambda: Shard(1.0),
                                      lambda: Partial("prod")], ids=["str-dim", "bool-dim", "float-dim", "prod"])
    def test_bad_constructors(self, make):
        with pytest.raises(LayoutError) as e:
            make()
        assert _code(e) == "bad-placement"


# =========================================================================== Layout
MESH22 = DeviceMesh((2, 2), ("dp", "tp"))
MESH222 = DeviceMesh((2, 2, 2), ("dp", "tp", "sp"))


class TestLayout:
    @FAST
    @given(shard_layouts())
    def test_placements_tensor_map_round_trip(self, case):
        mesh, rank, raw, norm, tm = case
        lay = Layout(mesh, raw, rank)
        assert lay.placements == norm  # negative dims normalised, strings parsed
        assert lay.ndim == rank
        assert lay.tensor_map() == tm
        back = Layout.from_tensor_map(mesh, tm)
        assert back == lay
        assert back.placements == norm
        assert back.tensor_map() == tm
        # lists instead of tuples are accepted (that is what YAML gives)
        as_lists = [list(e) if isinstance(e, tuple) else e for e in tm]
        assert Layout.from_tensor_map(mesh, as_lists) == lay

    @FAST
    @given(shard_layouts())
    def test_sharded_dims_and_counts(self, case):
        mesh, rank, _, norm, _ = case
        lay = Layout(mesh, norm, rank)
        for dim in range(rank):
            axes = tuple(a for a, p in enumerate(norm) if p == Shard(dim))
            assert lay.dim_axes(dim) == axes
            assert lay.shard_count(dim) == math.prod(mesh.shape[a] for a in axes)

    def test_by_hand(self):
        assert Layout(MESH22, ["S(0)", "S(1)"], 4).tensor_map() == (1, 0, -1, -1)
        assert Layout(MESH22, ["R", "S(-1)"], 3).tensor_map() == (-1, -1, 0)
        assert Layout(MESH22, ["R", "S(-1)"], 3).placements == (Replicate(), Shard(2))
        assert Layout(MESH22, ["R", "R"], 2).tensor_map() == (-1, -1)
        assert str(Layout(MESH22, ["S(-1)", "P"], 3)) == "(S(2), P(sum))"
        # several axes on one dim: outer axis first (dp is mesh axis 0, tensor_map 2; sp is 0)
        assert Layout(MESH222, ["S(0)", "R", "S(0)"], 2).tensor_map() == ((2, 0), -1)
        assert Layout(MESH222, ["S(1)", "S(1)", "S(1)"], 2).tensor_map() == (-1, (2, 1, 0))
        assert Layout.from_tensor_map(MESH222, [(2, 0), -1]).placements == (Shard(0), Replicate(), Shard(0))
        assert Layout.from_tensor_map(MESH22, [-1, 1, 0]).placements == (Shard(1), Shard(2))
        assert Layout.from_tensor_map(MESH22, [(1,), -1]).tensor_map() == (1, -1)
        # inner mesh axis first: its blocks are the major ones, a strided shard of the outer axis (issue 37)
        assert Layout.from_tensor_map(MESH22, [(0, 1), -1]).placements == (parse_placement("_S(0,2)"), Shard(0))

    def test_from_tensor_map_partial(self):
        lay = Layout.from_tensor_map(MESH22, [-1, 0], partial={"dp": "sum"})
        assert lay.placements == (Partial("sum"), Shard(1))
        with pytest.raises(LayoutError) as e:
            Layout.from_tensor_map(MESH22, [-1, 0], partial={"tp": "sum"})
        assert _code(e) == "invalid-layout"

    @pytest.mark.parametrize("tm, fragment", [
        ([0, 0], "'tp'"),                  # mesh axis tp shards dim 0 and dim 1
        ([(1, 1), -1], "'dp'"),            # one axis twice inside a dim
        ([1, (1, 0)], "'dp'"),
        ([(-1, 0), -1], "-1"),             # -1 mixed with axes
        ([2, -1], "entry 2"),              # out of range for 2 mesh axes
        ([-2, -1], "entry -2"),
        ([-1, "0"], "'0'"),
        ([True, -1], "True"),
    ], ids=["axis-twice", "axis-twice-in-dim", "axis-twice-mixed", "minus-one-mixed",
            "too-large", "too-small", "string", "bool"])
    def test_bad_tensor_maps(self, tm, fragment):
        with pytest.raises(LayoutError) as e:
            Layout.from_tensor_map(MESH22, tm)
        assert _code(e) == "invalid-layout"
        assert fragment in e.value.message
        assert e.value.hint

    @pytest.mark.parametrize("placements, ndim, fragment", [
        (["S(2)", "R"], 2, "S(2)"),
        (["R", "S(-3)"], 2, "S(-3)"),
        (["S(0)", "R"], 0, "S(0)"),
        (["R"], 2, "1 placements"),
        (["R", "R", "R"], 2, "3 placements"),
    ], ids=["too-large", "too-negative", "scalar", "too-few", "too-many"])
    def test_bad_placements(self, placements, ndim, fragment):
        with pytest.raises(LayoutError) as e:
            Layout(MESH22, placements, ndim)
        assert _code(e) == "invalid-layout"
        assert fragment in e.value.message
        assert e.value.hint

    def test_bad_placement_string_in_layout(self):
        with pytest.raises(LayoutError) as e:
            Layout(MESH22, ["R", "X"], 2)
        assert _code(e) == "bad-placement"

    def test_value_semantics(self):
        a = Layout(MESH22, ["S(-1)", "R"], 2)
        assert a == Layout(MESH22, [Shard(1), Replicate()], 2)
        assert hash(a) == hash(Layout(MESH22, ["S(1)", "R"], 2))
        assert a != Layout(MESH22, ["S(1)", "R"], 3)
        assert a.with_placement("tp", "S(0)").placements == (Shard(1), Shard(0))
        assert a.placements == (Shard(1), Replicate())  # with_placement made a copy
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.ndim = 3


# =========================================================================== TensorSpec
def chunk_indices(indices: list[int], k: int, i: int) -> list[int]:
    """torch.chunk, restated: pieces of ceil(n / k); piece i (possibly short or empty)."""
    c = -(-len(indices) // k)
    return indices[i * c:(i + 1) * c]


def expected_indices(shape, mesh: DeviceMesh, placements, coords) -> list[list[int]]:
    """Per dim, the global indices a rank at ``coords`` holds: cut by each sharding axis, outer first."""
    out = []
    for dim, n in enumerate(shape):
        idx = list(range(n))
        for axis, p in enumerate(placements):  # mesh-axis order = outer first
            if p == Shard(dim):
                idx = chunk_indices(idx, mesh.shape[axis], coords[axis])
        out.append(idx)
    return out


@st.composite
def spec_cases(draw):
    mesh, rank, raw, norm, _ = draw(shard_layouts(meshes(max_axes=3, max_size=4, max_ranks=8)))
    shape = []
    for dim in range(rank):
        count = math.prod(mesh.shape[a] for a, p in enumerate(norm) if p == Shard(dim))
        sizes = st.sampled_from([0, 2, 3, 4, 5, 6, 7, 9, 10]) if count > 1 else st.integers(0, 10)
        shape.append(draw(sizes))
    return mesh, tuple(shape), raw, norm


class TestTensorSpec:
    @FAST
    @given(spec_cases())
    def test_blocks_cover_every_element_once(self, case):
        mesh, shape, raw, norm = case
        spec = TensorSpec(shape, "float32", Layout(mesh, raw, len(shape)))
        shard_axes = [a for a, p in enumerate(norm) if isinstance(p, Shard)]
        cover = np.zeros(shape, dtype=np.int64)
        blocks = {}
        for r in range(mesh.size):
            coords = tuple(int(c) for c in np.unravel_index(r, mesh.shape))
            want = expected_indices(shape, mesh, norm, coords)
            got = spec.local_slices(r)
            assert [list(range(a, b)) for a, b in got] == want, (r, coords)
            assert spec.local_shape(r) == tuple(len(w) for w in want)
            assert spec.local_index(r) == tuple(slice(a, b) for a, b in got)
            key = tuple(coords[a] for a in shard_axes)
            if key in blocks:  # ranks that differ only on Replicate axes hold the same block
                assert blocks[key] == got
            else:
                blocks[key] = got
                cover[spec.local_index(r)] += 1
        assert len(blocks) == math.prod(mesh.shape[a] for a in shard_axes)
        assert np.all(cover == 1)

    @FAST
    @given(spec_cases())
    def test_rank0_holds_a_largest_piece(self, case):
        mesh, shape, raw, _ = case
        spec = TensorSpec(shape, "float32", Layout(mesh, raw, len(shape)))
        first = spec.local_shape(0)
        assert spec.local_shape() == first
        for r in range(mesh.size):
            assert all(a <= b for a, b in zip(spec.local_shape(r), first))

    @FAST
    @given(spec_cases())
    def test_replica_groups_partition_the_ranks(self, case):
        mesh, shape, raw, norm = case
        spec = TensorSpec(shape, "float32", Layout(mesh, raw, len(shape)))
        groups = spec.replica_groups()
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(mesh.size))
        shard_axes = [a for a, p in enumerate(norm) if isinstance(p, Shard)]
        assert len(groups) == math.prod(mesh.shape[a] for a in shard_axes)
        for g in groups:
            coords = [np.unravel_index(r, mesh.shape) for r in g]
            for a in shard_axes:  # members differ only on Replicate axes
                assert len({int(c[a]) for c in coords}) == 1
            assert len({spec.local_slices(r) for r in g}) == 1

    def test_uneven_by_hand(self):
        m4 = DeviceMesh((4,), ("tp",))
        spec = TensorSpec((10, 3), "float32", Layout(m4, ["S(0)"], 2))
        assert [spec.local_shape(r) for r in range(4)] == [(3, 3), (3, 3), (3, 3), (1, 3)]
        assert [spec.local_slices(r)[0] for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
        five = TensorSpec((5,), "float64", Layout(m4, ["S(0)"], 1))
        assert [five.local_shape(r) for r in range(4)] == [(2,), (2,), (1,), (0,)]
        two = TensorSpec((2,), "float32", Layout(m4, ["S(0)"], 1))
        assert [two.local_slices(r) for r in range(4)] == [((0, 1),), ((1, 2),), ((2, 2),), ((2, 2),)]
        empty = TensorSpec((0, 4), "float32", Layout(m4, ["S(0)"], 2))
        assert [empty.local_shape(r) for r in range(4)] == [(0, 4)] * 4

    def test_nested_by_hand(self):
        # dim of 10 on dp=2 then tp=3: halves [0,5) [5,10), each cut in 2, 2, 1
        mesh = DeviceMesh((2, 3), ("dp", "tp"))
        spec = TensorSpec((10,), "float32", Layout(mesh, ["S(0)", "S(0)"], 1))
        assert [spec.local_slices(r)[0] for r in range(6)] == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 9), (9, 10)]
        # (4, 4, 16, 64) on dp=2 x sp=2, S(0) and S(2): rank 3 holds [2,4) x [0,4) x [8,16) x [0,64)
        m = DeviceMesh((2, 2), ("dp", "sp"))
        x = TensorSpec((4, 4, 16, 64), "float32", Layout(m, ["S(0)", "S(2)"], 4))
        assert x.local_slices(3) == ((2, 4), (0, 4), (8, 16), (0, 64))
        assert x.local_shape(0) == (2, 4, 8, 64)
        assert x.replica_groups() == ((0,), (1,), (2,), (3,))
        cos = TensorSpec((1, 1, 16, 64), "float32", Layout(m, ["R", "S(2)"], 4))
        assert cos.replica_groups() == ((0, 2), (1, 3))

    def test_to_dict_by_hand(self):
        m = DeviceMesh((2, 2), ("dp", "sp"))
        x = TensorSpec((4, 4, 16, 64), "float32", Layout(m, ["S(0)", "S(2)"], 4))
        assert x.to_dict() == {"shape": [4, 4, 16, 64], "dtype": "float32", "placements": ["S(0)", "S(2)"],
                               "tensor_map": [1, -1, 0, -1], "local_shape": [2, 4, 8, 64]}
        y = TensorSpec((6, 8), "float16", Layout(m, ["S(1)", "S(1)"], 2))
        assert y.to_dict()["tensor_map"] == [-1, [1, 0]]
        assert y.nbytes == 6 * 8 * 2 and y.local_nbytes(0) == 6 * 2 * 2

    @pytest.mark.parametrize("mesh_shape, placements, shape", [
        ((2,), ["S(0)"], (1, 4)),
        ((2, 2), ["R", "S(1)"], (4, 1)),
        ((1, 2), ["S(0)", "S(0)"], (1, 4)),
        ((2, 2), ["S(-1)", "R"], (4, 1)),
    ], ids=["one-axis", "second-axis", "two-axes", "negative-dim"])
    def test_size1_dim_sharded_over_several_devices(self, mesh_shape, placements, shape):
        mesh = DeviceMesh(mesh_shape, tuple(f"a{i}" for i in range(len(mesh_shape))))
        with pytest.raises(LayoutError) as e:
            TensorSpec(shape, "float32", Layout(mesh, placements, len(shape)))
        assert _code(e) == "invalid-layout"
        assert "size 1" in e.value.message
        assert e.value.hint

    def test_size1_dim_on_a_size1_axis_is_fine(self):
        mesh = DeviceMesh((1, 2), ("a", "b"))
        spec = TensorSpec((1, 4), "float32", Layout(mesh, ["S(0)", "S(1)"], 2))
        assert spec.local_shape(1) == (1, 2)

    def test_other_errors(self):
        with pytest.raises(LayoutError) as e:
            TensorSpec((4, 4), "float32", Layout(MESH22, ["R", "R"], 3))
        assert _code(e) == "invalid-layout"
        with pytest.raises(LayoutError) as e:
            TensorSpec((4, -1), "float32", Layout(MESH22, ["R", "R"], 2))
        assert _code(e) == "invalid-shape" and "-1" in e.value.message
        with pytest.raises(LayoutError) as e:
            TensorSpec((4,), "complex64", Layout(MESH22, ["R", "R"], 1))
        assert _code(e) == "bad-dtype" and "complex64" in e.value.message
        spec = TensorSpec((4,), np.float16, Layout(MESH22, ["R", "R"], 1))
        assert spec.dtype == "float16"
        with pytest.raises(LayoutError) as e:
            spec.local_slices(4)
        assert _code(e) == "invalid-rank"


# =========================================================================== Graph
def small_graph() -> Graph:
    g = Graph(DeviceMesh((2, 2), ("dp", "sp")))
    x = g.input("x", shape=(4, 4, 16, 64), placements=["S(0)", "S(2)"])
    cos = g.input("cos", shape=(1, 1, 16, 64), requires_grad=False)
    y = g.op("y", "rotary_position_embedding", [x, cos, cos], {"mode": 1})
    z = g.op("z", "add", [y, y])
    g.output(z)
    return g


class TestGraph:
    def test_builder_returns_value_names(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        x = g.input("x", shape=(4, 8))
        assert x == "x"
        assert g.op("y", "neg", [x]) == "y"
        grads = g.op("g", "rotary_position_embedding_grad", ["y", "x", "x", "x"], num_outputs=3)
        assert grads == ("g:0", "g:1", "g:2")
        assert g.producer("g:2")[0].name == "g" and g.producer("g:2")[1] == 2
        assert g.has_value("g:1") and not g.has_value("g") and not g.has_value("g:3")
        assert "g" in g and len(g) == 3
        assert [n.name for n in g.inputs()] == ["x"]
        assert g.node("x").attrs == {"shape": (4, 8), "dtype": "float32", "placements": ("R",),
                                     "requires_grad": True}

    def test_integer_inputs_default_to_no_gradient(self):
        g = Graph(DeviceMesh((2,), ("tp",)))
        g.input("ids", shape=(4,), dtype="int64")
        g.input("mask", shape=(4,), dtype="bool", requires_grad=False)
        g.input("h", shape=(4,), dtype="float16")
        g.input("pos", shape=(4,), dtype="int32", requires_grad=True)  # as a pass cutting a graph may ask
        assert [n.attrs["requires_grad"] for n in g.inputs()] == [False, False, True, True]

    def test_edge_per_use(self):
        g = small_graph()
        edges = sorted((u, v, k, d["value"]) for u, v, k, d in g.nx.edges(keys=True, data=True))
        assert edges == [("cos", "y", 1, "cos"), ("cos", "y", 2, "cos"), ("x", "y", 0, "x"),
                         ("y", "z", 0, "y"), ("y", "z", 1, "y")]
        assert g.nx.number_of_edges("y", "z") == 2
        assert [(n.name, i) for n, i in g.consumers("cos")] == [("y", 1), ("y", 2)]

    def test_lint_accepts_a_good_graph(self):
        small_graph().lint()

    def test_lint_catches_bad_arity(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        x = g.input("x", shape=(4,))
        g.op("y", "add", [x])  # add takes two inputs
        with pytest.raises(GraphError) as e:
            g.lint()
        assert _code(e) == "bad-arity"
        assert e.value.node == "y"
        assert "got 1" in e.value.message

    def test_lint_catches_wrong_output_count(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        x = g.input("x", shape=(4,))
        g.op("y", "neg", [x], num_outputs=2)
        with pytest.raises(GraphError) as e:
            g.lint()
        assert _code(e) == "bad-arity"

    def test_lint_catches_unknown_op(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        x = g.input("x", shape=(4,))
        g.op("y", "rotary_embeding", [x, x, x])
        with pytest.raises(OpError) as e:
            g.lint()
        assert _code(e) == "unknown-op"
        assert "rotary_position_embedding" in e.value.hint

    def test_duplicate_names(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        x = g.input("x", shape=(4,))
        with pytest.raises(GraphError) as e:
            g.input("x", shape=(4,))
        assert _code(e) == "duplicate-name" and "'x'" in e.value.message
        g.op("y", "neg", [x])
        with pytest.raises(GraphError) as e:
            g.op("y", "neg", [x])
        assert _code(e) == "duplicate-name"
        with pytest.raises(GraphError) as e:
            g.op("x", "neg", ["y"])
        assert _code(e) == "duplicate-name"
        assert len(g) == 2  # the failed inserts left nothing behind

    def test_undefined_values(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        x = g.input("x", shape=(4,))
        with pytest.raises(GraphError) as e:
            g.op("y", "add", [x, "w"])
        assert _code(e) == "undefined-value" and e.value.input == "w"
        assert "y" not in g
        with pytest.raises(GraphError) as e:
            g.output("nope")
        assert _code(e) == "undefined-value"
        g.op("y", "neg", [x])
        with pytest.raises(GraphError) as e:
            g.op("z", "neg", ["y:0"])  # y has one output, named y
        assert _code(e) == "undefined-value"
        # lint catches values that disappear behind the builder's back
        g.node("y").inputs = ("ghost",)
        with pytest.raises(GraphError) as e:
            g.lint()
        assert _code(e) == "undefined-value" and "'ghost'" in e.value.message
        g2 = small_graph()
        g2.outputs.append("ghost")
        with pytest.raises(GraphError) as e:
            g2.lint()
        assert _code(e) == "undefined-value"

    def test_lint_catches_a_cycle(self):
        g = small_graph()
        g.nx.add_edge("z", "x", key=0, value="z", index=0)
        with pytest.raises(GraphError) as e:
            g.lint()
        assert _code(e) == "cycle"

    def test_stable_topo_order(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        g.input("x", shape=(4,))
        g.input("w", shape=(4,))
        g.op("b", "neg", ["w"])
        g.op("a", "neg", ["x"])
        g.op("d", "add", ["a", "b"])
        g.op("c", "neg", ["b"])
        expected = ["x", "w", "b", "a", "d", "c"]  # insertion order, which is topological
        for _ in range(3):
            assert [n.name for n in g.topo_order()] == expected
            assert [n.name for n in g] == expected
        assert [n.name for n in g.copy_structure().topo_order()] == expected

    def test_spec_floats_with_an_exponent_are_numbers_as_in_json(self):
        from layout_prop.io.loader import parse_spec

        text = "a: {eps: 1e-6, big: 2E+3, neg: -1.5e-3, plain: 3, dotted: 1.0e-06, quoted: '1e-6', name: e1}"
        assert parse_spec(text)["a"] == {"eps": 1e-6, "big": 2000.0, "neg": -1.5e-3, "plain": 3, "dotted": 1e-6,
                                         "quoted": "1e-6", "name": "e1"}
        assert type(parse_spec(text)["a"]["plain"]) is int
        assert parse_spec('{"a": {"eps": 1e-06}}') == {"a": {"eps": 1e-6}}  # JSON text, by the json module
        assert parse_spec('{"a": NaN}') == parse_spec("a: NaN") == {"a": "NaN"}  # not JSON: read alike by YAML
        with pytest.raises(SpecError) as e:  # a key written twice in JSON is refused with its position, as in YAML
            parse_spec('{"a": 1,\n "a": 2}')
        assert _code(e) == "spec-syntax" and "line 2" in e.value.message and "twice" in e.value.message

    def test_a_name_with_a_colon_cannot_shadow_a_multi_output_value(self):
        # "g:1" is output 1 of a multi-output node g; a node of that name made the value mean two things
        for first, second in (("single", "multi"), ("multi", "single")):
            g = Graph(DeviceMesh((2,), ("dp",)))
            w = g.input("w", shape=(4, 6))
            with pytest.raises(GraphError) as e:
                for kind in (first, second):
                    if kind == "single":
                        g.op("g:1", "neg", [w])
                    else:
                        g.op("g", "split", [w], {"sections": 3, "dim": 1}, num_outputs=3)
            assert _code(e) == "duplicate-name" and "'g:1'" in e.value.message, first

    def test_loader_orders_a_long_chain_listed_backwards(self):
        # the loader's depth-first ordering once recursed per dependency: a chain of a few
        # thousand nodes listed last-first ended in a RecursionError traceback
        n = 3000
        nodes = [{"name": f"n{i}", "op": "neg", "inputs": [f"n{i - 1}" if i else "x"]} for i in range(n)]
        spec = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"x": {"shape": [4]}},
                "nodes": nodes[::-1], "outputs": [f"n{n - 1}"]}
        g = load_spec(spec)
        assert [node.name for node in g.topo_order()] == ["x"] + [f"n{i}" for i in range(n)]
        nodes[0]["inputs"] = [f"n{n - 1}"]  # close the chain into a cycle through all of it
        with pytest.raises(SpecError) as e:
            load_spec(dict(spec, nodes=nodes[::-1]))
        assert _code(e) == "cycle" and e.value.message.count("->") == n

    def test_format_is_stable_text(self):
        expected = "\n".join([
            "graph(mesh=DeviceMesh(dp=2, sp=2)):",
            '  x = input() {shape=[4, 4, 16, 64], dtype=float32, placements=["S(0)", "S(2)"], requires_grad=true}',
            '  cos = input() {shape=[1, 1, 16, 64], dtype=float32, placements=["R", "R"], requires_grad=false}',
            "  y = rotary_position_embedding(x, cos, cos) {mode=1}",
            "  z = add(y, y)",
            "  return z",
        ])
        g = small_graph()
        assert g.format() == expected
        assert str(g) == expected
        assert small_graph().format() == expected  # same graph, same text
        assert g.copy_structure().format() == expected

    def test_format_multi_output_and_meta(self):
        g = Graph(DeviceMesh((2,), ("dp",)))
        g.input("x", shape=(4,), placements="auto")
        g.op("g", "rotary_position_embedding_grad", ["x", "x", "x", "x"], num_outputs=3)
        g.output("g:0", "g:2")
        g.node("x").meta["note"] = ["a", "b"]
        assert g.format(meta_keys=["note"]) == "\n".join([
            "graph(mesh=DeviceMesh(dp=2)):",
            "  x = input() {shape=[4], dtype=float32, placements=auto, requires_grad=true}  # note: [a, b]",
            "  g:0, g:1, g:2 = rotary_position_embedding_grad(x, x, x, x)",
            "  return g:0, g:2",
        ])

    def test_copy_structure_is_independent(self):
        g = small_graph()
        g.node("y").meta["k"] = 1
        c = g.copy_structure()
        assert c.node("y").meta == {}
        assert c.node("y") is not g.node("y")
        assert c.outputs == ["z"] and c.outputs is not g.outputs

    def test_node_repr(self):
        assert repr(Node("y", "add", ("x", "x"))) == "Node('y', 'add', inputs=['x', 'x'])"

    def test_errors_share_the_hierarchy(self):
        for cls in (GraphError, LayoutError, OpError):
            assert issubclass(cls, LayoutPropError)
