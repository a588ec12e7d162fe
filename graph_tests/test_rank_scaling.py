"""Per-mesh-axis answers against the per-rank computations they replaced.

Analysis visits classes of alike ranks (``rank_classes``: per mesh axis, the runs of equal
chunk sizes) instead of every rank.  Each test here recomputes the old way, rank by rank, on
small meshes with uneven shards (shapes that do not divide by the axis sizes, empty pieces,
a dim cut by several axes, strided shards) and asserts the same numbers, so that the
optimisation is checked, not assumed.  The run-time estimate (``run-too-large``) is tested
at the end.
"""

from __future__ import annotations

import math
import time
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.api import analyze
from layout_prop.core.errors import ExecutionError, LayoutError
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.placement import Partial, Replicate, Shard, StridedShard
from layout_prop.core.redistribute import enumerate_plans, step_bytes
from layout_prop.core.spec import (TensorSpec, chunk_bounds, chunk_classes, class_of_rank, class_ranks,
                                   rank_classes)
from layout_prop.frontends.generate import llama_spec
from layout_prop.io.loader import load_spec
from layout_prop.passes.kernel_check import KernelCheck
from layout_prop.passes.memory import Memory, _walk

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MESHES = [DeviceMesh((3,), ("tp",)), DeviceMesh((2, 3), ("dp", "tp")), DeviceMesh((4, 2, 2), ("dp", "sp", "tp")),
          DeviceMesh((5, 1, 3), ("dp", "cp", "tp"))]


# ----------------------------------------------------------------------------- strategies
@st.composite
def uneven_specs(draw, mesh: DeviceMesh, shape: tuple[int, ...] | None = None) -> TensorSpec:
    """A spec on ``mesh`` whose dims rarely divide by the axis sizes (several axes may cut
    one dim; sometimes a strided shard), with Partial axes too."""
    if shape is None:
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, 13), min_size=ndim, max_size=ndim)))
    ndim = len(shape)
    for _ in range(20):
        placements = []
        for _axis in range(mesh.ndim):
            kind = draw(st.sampled_from(["R", "S", "S", "P", "_S"]))
            dim = draw(st.integers(0, ndim - 1))
            if kind == "R":
                placements.append(Replicate())
            elif kind == "P":
                placements.append(Partial("sum"))
            elif kind == "S":
                placements.append(Shard(dim))
            else:
                placements.append(StridedShard(dim, draw(st.sampled_from([2, 3]))))
        try:
            return TensorSpec(shape, "float32", Layout(mesh, placements, ndim))
        except LayoutError:
            continue
    return TensorSpec(shape, "float32", Layout.replicated(mesh, ndim))


# ----------------------------------------------------------------------------- the old computations
def old_check_strided(shape, layout) -> str | None:
    """spec._check_strided as it was: the lengths of every rank's piece (None: valid)."""
    from layout_prop.core.spec import _cut_indices

    mesh = layout.mesh
    for axis in layout.strided_axes():
        p = layout.placements[axis]
        if mesh.shape[axis] == 1:
            continue
        outer = [a for a in layout.cut_axes(p.dim) if a < axis]
        only = layout.with_placements([q if a in outer else Replicate() for a, q in enumerate(layout.placements)])
        try:
            sizes = {len(_cut_indices(shape[p.dim], only, p.dim, coords)) for coords in mesh.all_coords()}
        except ValueError:  # an outer strided shard that does not divide: reported before this one
            return "outer"
        bad = sorted(n for n in sizes if n % p.split_factor)
        if bad:
            return f"{bad[0]} elements"
    return None


def old_step_bytes(kind: str, src: TensorSpec, dst: TensorSpec, axis: int) -> int:
    """redistribute.step_bytes as it was: every group, every rank."""
    mesh = src.mesh
    n = mesh.shape[axis]
    if kind in ("local-slice", "local-partial") or n == 1:
        return 0
    item = src.itemsize
    worst = 0
    for group in mesh.groups(axis):
        if kind == "all-gather":
            blocks = [src.local_nbytes(r) for r in group]
            sent = sum(blocks) - min(blocks)
        elif kind == "reduce-scatter":
            blocks = [dst.local_nbytes(r) for r in group]
            sent = src.local_nbytes(group[0]) - min(blocks)
        elif kind == "all-reduce":
            numel = src.local_nbytes(group[0]) // item
            smallest = min(b - a for a, b in chunk_bounds(numel, n))
            sent = 2 * (numel - smallest) * item
        else:
            sent = max(src.local_nbytes(r) - overlap(src, dst, r) * item for r in group)
        worst = max(worst, sent)
    return int(worst)


def overlap(a: TensorSpec, b: TensorSpec, rank: int) -> int:
    coords = a.mesh.coords(rank)
    return math.prod(len(np.intersect1d(a.dim_indices(d, coords), b.dim_indices(d, coords))) for d in range(a.ndim))


def old_memory(graph, states: int = 0) -> list[tuple[int, int, int, int]]:
    """Memory.run as it was: the bytes of every spec on every rank, a walk per class."""
    params = [n for n in graph.inputs() if n.attrs.get("requires_grad") and not n.name.startswith("cotangent/")]
    persistent = {n.name for n in params} | {n.name for n in graph.nodes if n.meta.get("grad_of")}
    lowerable = not any(n.meta.get("violations") for n in graph.nodes)
    walk, _ = _walk(graph, graph.nodes, persistent, lowerable)
    keys = [walk.key(n.meta["specs"][0]) for n in params]
    specs = list(walk.specs.values())
    out = []
    for rank in range(graph.mesh.size):
        nbytes = tuple(spec.local_nbytes(rank) for spec in specs)
        p = sum(nbytes[k] for k in keys)
        out.append((p, p, states * p, walk.peak(nbytes)))
    return out


def old_kernel_check(graph, backend: str) -> list[tuple[str, str, str]]:
    """KernelCheck.run as it was: every rank's local shapes, the first that breaks a limit."""
    from layout_prop.core.registry import get_rule
    from layout_prop.passes.propagate import value_spec

    found = []
    for node in graph.topo_order():
        if node.is_input or node.meta.get("violations"):
            continue
        rule = get_rule(node.op)
        specs = []
        for value, want in zip(node.inputs, node.meta.get("wants", ())):
            spec = value_spec(graph, value)
            specs.append(spec if want is None else TensorSpec(spec.shape, spec.dtype, want))
        seen = set()
        stop = False
        for rank in range(graph.mesh.size):
            shapes = tuple(s.local_shape(rank) for s in specs)
            if shapes in seen:
                continue
            seen.add(shapes)
            for v in rule.check_kernel(backend, shapes, tuple(specs), node.meta["attrs"]):
                found.append((node.name, v.code, f"rank {rank}: {v.message}"))
                stop = True
                break
            if stop:
                break
    return found


# ----------------------------------------------------------------------------- tests
def test_chunk_classes_are_the_runs_of_chunk_bounds():
    for n in range(0, 40):
        for k in range(1, 13):
            sizes = [b - a for a, b in chunk_bounds(n, k)]
            runs = [(i, s) for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
            assert list(chunk_classes(n, k)) == runs, (n, k)


def test_chunk_bounds_of_many_pieces_are_not_remembered():
    assert chunk_bounds(5, 2000) == tuple((min(i * 1, 5), min(i + 1, 5)) for i in range(2000))
    assert chunk_bounds(10, 4) is chunk_bounds(10, 4)  # a few pieces: remembered, one object


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_ranks_of_a_class_hold_alike_pieces(mesh, data):
    specs = [data.draw(uneven_specs(mesh)) for _ in range(data.draw(st.integers(1, 3)))]
    starts = rank_classes(specs, mesh)
    index = class_of_rank(starts, mesh)
    reps = class_ranks(starts, mesh)
    assert len(index) == mesh.size and index.max() == len(reps) - 1
    for rank in range(mesh.size):
        rep = reps[index[rank]]
        assert rep <= rank  # the class's first rank is its lowest
        for spec in specs:
            assert spec.local_shape(rank) == spec.local_shape(rep), (spec, rank, rep)
            assert spec.local_nbytes(rank) == spec.local_nbytes(rep)
    assert reps == sorted(reps) and all(index[r] == i for i, r in enumerate(reps))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_strided_check_matches_every_rank(mesh, data):
    ndim = data.draw(st.integers(1, 2))
    shape = tuple(data.draw(st.lists(st.integers(1, 16), min_size=ndim, max_size=ndim)))
    placements = [data.draw(st.sampled_from([Replicate(), Shard(0), StridedShard(0, 2), StridedShard(ndim - 1, 3),
                                             StridedShard(0, 4)])) for _ in range(mesh.ndim)]
    try:
        layout = Layout(mesh, placements, ndim)
    except LayoutError:
        return
    expected = old_check_strided(shape, layout)
    try:
        TensorSpec(shape, "float32", layout)
        got = None
    except LayoutError as err:
        if err.code != "invalid-layout" or "blocks" not in err.message:
            return  # refused for another reason (a size-1 dim sharded), before the strided check
        got = err.message
    if expected is None:
        assert got is None
    else:
        assert got is not None and (expected == "outer" or expected in got), (got, expected)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_step_bytes_match_every_group(mesh, data):
    src = data.draw(uneven_specs(mesh))
    dst = data.draw(uneven_specs(mesh, src.shape))
    try:
        plans = enumerate_plans(src, dst.layout)
    except LayoutError:
        return
    for plan in plans[:6]:
        for step in plan.steps:
            assert step.bytes_per_rank == old_step_bytes(step.kind, step.src, step.dst, step.mesh_axis), step


@pytest.mark.parametrize("mesh", MESHES[1:3], ids=str)
def test_step_bytes_of_every_single_axis_change(mesh):
    """Every step kind on every axis of a few uneven shapes, and the steps no plan makes (an
    all-to-all whose pieces do not nest) that fall back to every rank."""
    checked = 0
    for shape in [(5, 7), (2, 9), (13, 3)]:
        choices = [Replicate(), Shard(0), Shard(1), Partial("sum")]
        for placements in product(choices, repeat=mesh.ndim):
            try:
                src = TensorSpec(shape, "float32", Layout(mesh, placements, 2))
            except LayoutError:
                continue
            for axis in range(mesh.ndim):
                for new in choices:
                    try:
                        dst = src.with_layout(src.layout.with_placement(axis, new))
                    except LayoutError:
                        continue
                    old = placements[axis]
                    kind = ("all-reduce" if isinstance(new, Replicate) else "reduce-scatter") \
                        if isinstance(old, Partial) else "all-gather" if isinstance(new, Replicate) \
                        else "all-to-all" if isinstance(new, Shard) and isinstance(old, Shard) and old != new else None
                    if kind is None:
                        continue
                    assert step_bytes(kind, src, dst, axis) == old_step_bytes(kind, src, dst, axis), \
                        (kind, src, dst, axis)
                    checked += 1
    assert checked > 50


def _graphs():
    yield "uneven llama", llama_spec(2, (("dp", 3), ("sp", 2), ("tp", 5)), batch=4, seq=7, hidden=30, heads=5, ffn=22)
    yield "(4,2,2) llama", llama_spec(1, (("dp", 4), ("sp", 2), ("tp", 2)), batch=5, seq=6, hidden=32, heads=4, ffn=48)
    yield "(3,) matmul", """
mesh: {shape: [3], names: [dp]}
inputs:
  x: {shape: [10, 7], placements: ["S(0)"], requires_grad: false}
  w: {shape: [7, 5], placements: ["S(1)"]}
nodes:
  - {name: y, op: matmul, inputs: [x, w]}
"""


@pytest.mark.parametrize("name,spec", list(_graphs()), ids=lambda v: v if len(v) < 20 else "")
@pytest.mark.parametrize("reshard,backward", [(False, False), (True, True)])
def test_memory_matches_every_rank(name, spec, reshard, backward):
    graph = analyze(load_spec(spec), reshard=reshard, backward=backward).graph
    report = Memory(optimizer="adam").run(graph)
    expected = old_memory(graph, states=2)
    assert [r.figures() for r in report.ranks] == expected
    assert [r.rank for r in report.ranks] == list(range(graph.mesh.size))
    best = max(range(len(expected)), key=lambda r: (sum(expected[r]), -r))
    assert report.max.rank == best and report.max.figures() == expected[best]
    data = report.to_dict()
    assert ("per_rank" in data) == (len(set(expected)) > 1)
    if "per_rank" in data:
        assert [(d["rank"], d["parameters"], d["activations"], d["total"]) for d in data["per_rank"]] == \
            [(r, *e[:1], e[3], sum(e)) for r, e in enumerate(expected)]


RPE = """
mesh: {{shape: {mesh}, names: {names}}}
inputs:
  x:   {{shape: {shape}, placements: {placements}}}
  cos: {{shape: [1, 1, {s}, {d}]}}
  sin: {{shape: [1, 1, {s}, {d}]}}
nodes:
  - {{name: y, op: rope, inputs: [x, cos, sin], attrs: {{mode: {mode}}}}}
"""


@pytest.mark.parametrize("mesh,names,shape,placements,mode", [
    ([3], ["tp"], [2, 5, 7, 8], ["S(1)"], 0),
    ([2, 3], ["dp", "tp"], [3, 7, 5, 64], ["S(0)", "S(1)"], 1),
    ([4, 2, 2], ["dp", "sp", "tp"], [5, 3, 9, 16], ["S(0)", "S(2)", "S(2)"], 0),
    ([4, 2, 2], ["dp", "sp", "tp"], [5, 3, 9, 128], ["S(1)", "S(3)", "S(0)"], 1),
    ([2, 3], ["dp", "tp"], [2, 2, 4, 8], ["S(0)", "R"], 2),
])
def test_kernel_check_matches_every_rank(mesh, names, shape, placements, mode):
    text = RPE.format(mesh=mesh, names=names, shape=shape, placements=[str(p) for p in placements],
                      s=shape[2], d=shape[3], mode=mode)
    graph = analyze(load_spec(text), reshard=True, backward=True).graph
    got = [(v.node, v.code, v.message) for v in KernelCheck("cann").run(graph)]
    assert got == old_kernel_check(graph, "cann")


def test_big_mesh_analysis_visits_classes_not_ranks():
    """65,536 ranks and a dim cut 4,096 ways unevenly: check --backward's passes in seconds."""
    spec = """
mesh: {shape: [16, 16, 256], names: [dp, sp, tp]}
inputs:
  x: {shape: [16, 250, 1000], placements: ["S(0)", "S(1)", "S(1)"]}
  w: {shape: [1000, 1000], placements: [R, R, "S(0)"]}
nodes:
  - {name: y, op: linear, inputs: [x, w]}
  - {name: z, op: softmax, inputs: [y]}
"""
    start = time.perf_counter()
    analysis = analyze(load_spec(spec), reshard=True, backward=True)
    report = analysis.memory()
    assert len(report.classes) < 50 and report.rank_class.shape == (65536,)
    KernelCheck("cann").run(analysis.graph)
    assert time.perf_counter() - start < 20  # (was minutes, rank by rank)


RPE_65536 = """
mesh: {shape: [16, 16, 256], names: [dp, tp, sp]}
inputs:
  x:   {shape: [16, 16, 256, 64], placements: ["S(0)", "S(1)", "S(2)"]}
  cos: {shape: [1, 1, 256, 64], placements: [R, R, "S(2)"]}
  sin: {shape: [1, 1, 256, 64], placements: [R, R, "S(2)"]}
nodes:
  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}
"""


def test_run_refuses_what_it_cannot_finish_at_once():
    """One RoPE with its backward on 65,536 ranks: minutes of simulation (the gradients of cos
    and sin reduced over dp and tp), refused before anything is lowered or allocated."""
    from layout_prop.runner import DEFAULT_MAX_TIME, run_graph

    start = time.perf_counter()
    with pytest.raises(ExecutionError) as err:
        run_graph(load_spec(RPE_65536), backward=True)
    assert time.perf_counter() - start < 2
    message = err.value.message
    assert err.value.code == "run-too-large" and "--max-time" in err.value.hint and "fewer ranks" in err.value.hint
    assert "estimated for 65536 ranks" in message and f"over the default limit of {DEFAULT_MAX_TIME:g} s" in message


def test_max_time_sets_the_bound(tmp_path, capsys):
    from layout_prop.cli import main

    spec = tmp_path / "rpe.yaml"
    spec.write_text((EXAMPLES / "rpe" / "dp_tp_sp.yaml").read_text())
    assert main(["run", str(spec), "--backward", "--max-time", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "run-too-large" in err and "over the --max-time limit of 0.001 s" in err
    assert main(["run", str(spec), "--backward", "--max-time", "60"]) == 0
    big = tmp_path / "big.yaml"
    big.write_text(RPE_65536)
    capsys.readouterr()
    assert main(["run", str(big), "--max-time", "1e9"]) == 2  # over a week: not a number of seconds we take
    assert "--max-time" in capsys.readouterr().err
    assert main(["run", str(spec), "--engine", "mindspore", "--max-time", "60"]) == 2
    assert "bad-usage" in capsys.readouterr().err


def test_the_examples_are_estimated_well_under_the_default():
    from layout_prop.runner import DEFAULT_MAX_TIME, estimate_run_time

    for path in ["llama_block.yaml", "rpe/dp_tp_sp.yaml", "rpe/tp_n.yaml"]:
        graph = analyze(load_spec((EXAMPLES / path).read_text()), reshard=True, backward=True).graph
        estimate = estimate_run_time(graph)
        assert 0 < estimate.seconds < DEFAULT_MAX_TIME / 100, (path, estimate)
        assert estimate.seconds == pytest.approx(sum(estimate.parts().values()))


def test_help_gives_the_default_bound():
    import subprocess
    import sys

    from layout_prop.runner import DEFAULT_MAX_TIME

    out = subprocess.run([sys.executable, "-m", "layout_prop.cli", "run", "--help"], capture_output=True, text=True,
                         env={"COLUMNS": "200", "PATH": ""}).stdout
    assert f"(default {DEFAULT_MAX_TIME:g}," in " ".join(out.split())


def test_the_calibration_benchmark_prints_its_table():
    """benchmarks/run_estimate.py, tiny sizes (no timing asserted: it only must not rot)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "run_estimate.py", "--quick", "--ranks", "64", "--groups", "16", "32",
                           "--repeat", "1"], cwd=EXAMPLES.parent / "benchmarks", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for heading in ("kernels", "slices and collectives", "buffer donation", "inputs and outputs", "whole runs"):
        assert heading in out
    assert "llama block (8 ranks)" in out.splitlines()[-2]
