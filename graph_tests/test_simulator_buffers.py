"""The simulator's buffers: ``wanted`` drops dead values, reductions reuse dying buffers.

Donation (a reduction accumulating into the buffer of an input that dies at the step)
must never change a result, never write memory that a live value, a kernel or the caller
can still see, and must really happen where it is safe.  Small programs are built by
hand here (inputs, kernels of a test table, planned redistribution steps) so that every
aliasing case is explicit; the Llama block checks the real thing end to end.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from layout_prop import DeviceMesh, ExecutionError, Layout, TensorSpec
from layout_prop.api import analyze
from layout_prop.engines import simulator
from layout_prop.engines.collectives import apply_step, may_overlap_itself, reduce_terms
from layout_prop.engines.simulator import Simulator
from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec
from layout_prop.passes.lower import LocalOp, Lower, Program
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.runner import random_inputs, run_graph

try:  # numpy's exact (exponential-time) self-overlap test, a private helper of its own test suite
    from numpy.core._multiarray_tests import internal_overlap
except ImportError:  # pragma: no cover - other numpy layouts
    internal_overlap = None


# --------------------------------------------------------------------------- hand-built programs
CACHE: list[np.ndarray] = []  # what the "keep" kernel remembers
BORN: list[tuple[int, int]] = []  # (id, data address) of every array the "fresh" kernel made


def _fresh(x):
    out = np.array(x, copy=True)
    BORN.append((id(out), out.__array_interface__["data"][0]))
    return out


def _keep(x):
    out = np.array(x, copy=True)
    CACHE.append(out)
    return out


KERNELS = {
    "fresh": _fresh,  # a new buffer of its own
    "view": lambda x: x[...],  # a view of its input's buffer
    "same": lambda x: x,  # the input object itself
    "keep": _keep,  # a new buffer that the kernel also keeps
    "add": np.add,
}


@pytest.fixture(autouse=True)
def _clear_records():
    CACHE.clear()
    BORN.clear()
    yield
    CACHE.clear()
    BORN.clear()


class Build:
    """A lowered program written by hand: inputs, kernels of :data:`KERNELS`, planned moves."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...] = ("tp",)) -> None:
        self.mesh = DeviceMesh(shape, names)
        self.program = Program(self.mesh)

    def spec(self, value: str) -> TensorSpec:
        return self.program.specs[value]

    def input(self, name: str, shape: tuple[int, ...], placements, dtype: str = "float64") -> str:
        spec = TensorSpec(shape, dtype, Layout(self.mesh, placements, len(shape)))
        self.program.add(LocalOp(name, "input", "input", (), (name,), (spec,), source=name))
        return name

    def kernel(self, op: str, out: str, *inputs: str) -> str:
        attrs = tuple({} for _ in range(self.mesh.size))
        self.program.add(LocalOp(out, "kernel", op, inputs, (out,), (self.spec(inputs[0]),), attrs, source=out))
        return out

    def move(self, value: str, out: str, placements) -> str:
        """The planned redistribution of ``value`` to ``placements``, its last step named ``out``."""
        src = self.spec(value)
        steps = plan_redistribution(src, Layout(self.mesh, placements, len(src.shape))).steps
        assert steps, "the move must communicate"
        current = value
        for k, step in enumerate(steps):
            name = out if k == len(steps) - 1 else f"{out}#{k}"
            kind = "slice" if step.kind == "local-slice" else "collective"
            self.program.add(LocalOp(name, kind, step.kind, (current,), (name,), (step.dst,), step=step, source=out))
            current = name
        return out


def _terms_program(reduce_to: str = "R") -> Build:
    """x (Partial sum over tp=2) -> t = fresh(x) -> r = t moved to ``reduce_to``."""
    b = Build((2,))
    b.kernel("fresh", "t", b.input("x", (4,), ["P(sum)"]))
    b.move("t", "r", [reduce_to])
    return b


def _bits(locals_: list[np.ndarray]) -> list[tuple[str, tuple, bytes]]:
    return [(str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes()) for a in locals_]


X_TERMS = [np.array([1.0, 2.0, 3.0, 4.0]), np.array([10.0, 20.0, 30.0, 40.0])]


# --------------------------------------------------------------------------- the Llama block
@pytest.fixture(scope="module")
def llama_block():
    g = analyze(load_spec(llama_spec(1)), backward=True, reshard=True).graph
    return g, Lower().run(g).program


def test_llama_block_donated_results_are_bit_identical(llama_block):
    g, program = llama_block
    inputs = random_inputs(g, 0)
    before = {name: _bits([a]) for name, a in inputs.items()}
    reference = Simulator(donate=False).execute(program, inputs, np.random.default_rng(1))
    sim = Simulator()
    got = sim.execute(program, inputs, np.random.default_rng(1), wanted=list(g.outputs))
    assert list(got) == list(g.outputs)
    for value in g.outputs:
        assert _bits(got[value]) == _bits(reference[value]), value
    assert {name: _bits([a]) for name, a in inputs.items()} == before  # the caller's arrays are untouched
    # the weight gradients reduce over dp (into the kernels' buffers) and then over sp; the
    # sp groups of the dp-results repeat across dp, run once, and take the dp-result's buffer
    producer = {v: op for op in program.ops for v in op.outputs}
    reduced_twice = [v for v in sim.donated if producer[producer[v].inputs[0]].kind == "collective"]
    assert len(sim.donated) >= 10 and reduced_twice


def test_llama_block_runs_and_matches_one_device():
    rep = run_graph(load_spec(llama_spec(1)), backward=True, seed=2)
    assert rep.ok, rep.mismatches


# --------------------------------------------------------------------------- donation happens
def test_all_reduce_accumulates_into_the_dying_kernel_buffer():
    b = _terms_program("R")
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["r"])
    born_rank0 = BORN[0]
    assert out["r"][0] is out["r"][1]
    assert (id(out["r"][0]), out["r"][0].__array_interface__["data"][0]) == born_rank0
    assert out["r"][0].tolist() == [11.0, 22.0, 33.0, 44.0]
    assert not out["r"][0].flags.writeable  # a shared result stays read-only
    assert sim.donated == {"r": (0,)}


def test_reduce_scatter_pieces_are_views_of_the_dying_buffer():
    b = _terms_program("S(0)")
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["r"])
    address = BORN[0][1]
    assert [piece.tolist() for piece in out["r"]] == [[11.0, 22.0], [33.0, 44.0]]
    assert [piece.__array_interface__["data"][0] for piece in out["r"]] == [address, address + 16]
    assert sim.donated == {"r": (0,)}


def test_without_wanted_nothing_is_dropped_nor_donated():
    b = _terms_program("R")
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]})
    assert sorted(out) == ["r", "t", "x"]
    assert [t.tolist() for t in out["t"]] == [t.tolist() for t in X_TERMS]
    assert out["r"][0] is not out["t"][0] and sim.donated == {}


def test_donate_false_allocates():
    b = _terms_program("R")
    sim = Simulator(KERNELS, donate=False)
    out = sim.execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["r"])
    assert id(out["r"][0]) != BORN[0][0] and sim.donated == {}
    assert out["r"][0].tolist() == [11.0, 22.0, 33.0, 44.0]


# --------------------------------------------------------------------------- donation is refused
def test_a_dying_buffer_that_a_live_value_views_is_not_written():
    b = Build((2,))
    b.kernel("fresh", "t", b.input("x", (4,), ["P(sum)"]))
    b.kernel("view", "v", "t")  # v views t's buffer ...
    b.move("t", "r", ["R"])  # ... when t dies here ...
    b.kernel("fresh", "w", "v")  # ... and is read after
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["r", "w"])
    assert out["r"][0].tolist() == [11.0, 22.0, 33.0, 44.0]
    assert [w.tolist() for w in out["w"]] == [t.tolist() for t in X_TERMS]
    assert sim.donated == {}


def test_a_wanted_view_of_a_dying_buffer_keeps_its_values():
    b = Build((2,))
    b.kernel("fresh", "t", b.input("x", (4,), ["P(sum)"]))
    b.kernel("view", "v", "t")  # wanted: lives on after t dies at the move
    b.move("t", "r", ["R"])
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["v", "r"])
    assert [v.tolist() for v in out["v"]] == [t.tolist() for t in X_TERMS]
    assert sim.donated == {}


def test_a_buffer_that_a_kernel_keeps_is_not_written():
    b = Build((2,))
    b.kernel("keep", "t", b.input("x", (4,), ["P(sum)"]))
    b.move("t", "r", ["R"])
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["r"])
    assert [c.tolist() for c in CACHE] == [t.tolist() for t in X_TERMS]
    assert out["r"][0].tolist() == [11.0, 22.0, 33.0, 44.0] and sim.donated == {}


@pytest.mark.parametrize("through", ["input", "same"])
def test_arrays_the_caller_passed_are_never_written(through):
    b = Build((2,))
    x = b.input("x", (4,), ["P(sum)"])
    b.move(x if through == "input" else b.kernel("same", "t", x), "r", ["R"])
    pieces = [t.copy() for t in X_TERMS]
    scattered = {"x": pieces}
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {}, scattered=scattered, wanted=["r"])
    assert [p.tolist() for p in pieces] == [t.tolist() for t in X_TERMS] and scattered == {"x": pieces}
    assert out["r"][0].tolist() == [11.0, 22.0, 33.0, 44.0] and sim.donated == {}


def test_global_inputs_are_never_written():
    b = Build((2, 2), ("dp", "tp"))
    b.move(b.input("x", (4,), ["P(sum)", "P(max)"]), "r", ["R", "R"])
    x = np.arange(4.0)
    sim = Simulator(KERNELS)
    out = sim.execute(b.program, {"x": x}, np.random.default_rng(0), wanted=["r"])
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert all(r.tolist() == [0.0, 1.0, 2.0, 3.0] for r in out["r"])
    assert sim.donated  # the pieces cut from x are the simulator's own: those may be reused


# --------------------------------------------------------------------------- wanted
def test_wanted_returns_only_the_wanted_values_in_order():
    b = _terms_program("R")
    b.kernel("fresh", "u", "t")
    out = Simulator(KERNELS).execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["u", "r"])
    assert list(out) == ["u", "r"]


def test_values_are_dropped_right_after_their_last_use():
    freed: list[str] = []
    seen: dict[str, list[str]] = {}

    def tracked(x):
        out = np.array(x, copy=True)
        weakref.finalize(out, freed.append, "t")
        return out

    def probe(x):
        seen.setdefault("at probe", []).append(",".join(freed))
        return np.array(x, copy=True)

    kernels = dict(KERNELS, tracked=tracked, probe=probe)
    b = Build((2,))
    b.kernel("tracked", "t", b.input("x", (4,), ["R"]))
    b.kernel("fresh", "u", "t")  # t's last use
    b.kernel("probe", "w", "u")
    Simulator(kernels).execute(b.program, {"x": np.zeros(4)}, wanted=["w"])
    assert seen["at probe"] == ["t,t", "t,t"]  # both ranks' t were gone before w was made
    freed.clear()
    seen.clear()
    Simulator(kernels).execute(b.program, {"x": np.zeros(4)})
    assert seen["at probe"] == ["", ""]


def test_a_wanted_value_that_the_program_does_not_make_is_an_error():
    b = _terms_program("R")
    with pytest.raises(ExecutionError) as info:
        Simulator(KERNELS).execute(b.program, {}, scattered={"x": [t.copy() for t in X_TERMS]}, wanted=["r", "nope"])
    assert info.value.code == "missing-output" and "'nope'" in info.value.message


# --------------------------------------------------------------------------- the reference count check
def test_the_counting_code_own_references_are_pinned():
    """On CPython 3.11 the argument of ``sys.getrefcount`` is the counting code's one
    reference, for the array and for a view's base.  An interpreter that counts
    differently must be looked at: the calibration follows it, this test says so."""
    assert (simulator._OWN_REFERENCES, simulator._OWN_BASE_REFERENCES) == (1, 1), sys.version
    counts = {simulator._outside_references([np.empty(1)], 0) for _ in range(2000)}  # after specialisation too
    counts |= {simulator._outside_base_references([np.empty(2)[1:]], 0) for _ in range(2000)}
    assert counts == {0}


def _closure_over(array):
    return lambda: array


def _holders():
    """(case, locals_, what keeps it alive, expected) for :func:`simulator._exclusively_held`."""
    def fresh():
        return np.arange(6.0)

    cases = []
    cases.append(("fresh", [fresh()], None, True))
    cases.append(("view of an unreferenced buffer", [fresh().reshape(2, 3).T], None, True))
    a = fresh()
    a.flags.writeable = False
    cases.append(("read-only, but nobody else has it", [a], None, True))
    a = fresh()
    cases.append(("also in two slots of its own list", [a, a], None, True))
    a = fresh()
    cases.append(("held by another list", [a], [a], False))
    a = fresh()
    cases.append(("held by a dict", [a], {"k": a}, False))
    a = fresh()
    cases.append(("viewed by a live view", [a], a[1:], False))
    a = fresh()
    cases.append(("exported as a memoryview", [a], memoryview(a), False))
    a = fresh()
    cases.append(("read by np.frombuffer", [a], np.frombuffer(a), False))
    a = fresh()
    cases.append(("weakly referenced", [a], weakref.ref(a), False))
    a = fresh()
    cases.append(("in a closure", [a], _closure_over(a), False))
    a = fresh()
    cases.append(("a view whose buffer has another view", [a[1:]], a[:2], False))
    base = fresh()
    middle = base[1:]
    cases.append(("a view of a view that is alive", [middle[1:]], middle, False))
    cases.append(("a broadcast view", [np.broadcast_to(fresh(), (2, 6))], None, False))
    cases.append(("a stride trick", [np.lib.stride_tricks.as_strided(fresh(), (3,), (0,))], None, False))
    ro = fresh()
    ro.flags.writeable = False
    cases.append(("a view of a read-only buffer", [ro[1:]], None, False))
    cases.append(("memory of another object", [np.frombuffer(bytearray(48))], None, False))
    cases.append(("a subclass", [fresh().view(np.recarray)], None, False))
    return cases


@pytest.mark.parametrize("case,locals_,holder,expected", _holders(), ids=[c[0] for c in _holders()])
def test_exclusively_held_sees_every_holder(case, locals_, holder, expected):
    assert simulator._exclusively_held(locals_, 0) is expected


# --------------------------------------------------------------------------- apply_step's structural check
def _sum_step() -> tuple:
    mesh = DeviceMesh((2, 2), ("dp", "tp"))
    src = TensorSpec((3,), "float64", Layout(mesh, ["R", "P(sum)"], 1))
    return plan_redistribution(src, Layout(mesh, ["R", "R"], 1)).steps[0]  # groups (0, 1), (2, 3)


@settings(max_examples=150, deadline=None)
@given(holders=st.lists(st.integers(0, 3), min_size=4, max_size=4), donatable=st.sets(st.integers(0, 3)),
       op=st.sampled_from(["sum", "max", "min", "avg"]))
def test_apply_step_writes_only_a_buffer_that_every_holder_reads_first(holders, donatable, op):
    step = _sum_step()
    step = dataclasses.replace(step, reduce_op=op)
    pool = [np.array([1.5, -2.0, 3.25]) * (k + 1) + k for k in range(4)]
    before = [p.copy() for p in pool]
    expected = apply_step(step, [before[h].copy() for h in holders])
    got = apply_step(step, [pool[h] for h in holders], donatable)
    assert _bits(got) == _bits(expected)
    for k, (p, b) in enumerate(zip(pool, before)):
        if not np.array_equal(p, b):  # written: donated by a rank that holds it, first of every group reading it
            slots = [r for r, h in enumerate(holders) if h == k]
            groups = [(0, 1) if r < 2 else (2, 3) for r in slots]
            terms = {tuple(holders[r] for r in g) for g in groups}
            assert op != "avg" and set(slots) & donatable and all(r in (0, 2) for r in slots) and len(terms) == 1


def test_apply_step_runs_groups_with_the_same_terms_once():
    step = _sum_step()
    a, b = np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0])
    out = apply_step(step, [a, b, a, b], donatable={0, 2})
    assert all(r is a for r in out) and a.tolist() == [5.0, 7.0, 9.0] and b.tolist() == [4.0, 5.0, 6.0]


# --------------------------------------------------------------------------- reduce_terms in place
@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(["float64", "float32", "float16", "int64", "int32", "bool"]),
       op=st.sampled_from(["sum", "max", "min", "avg"]), n=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_reducing_into_the_first_term_is_bit_identical(dtype, op, n, seed):
    rng = np.random.default_rng(seed)
    terms = [(rng.standard_normal(7) * 1e3).astype(dtype) for _ in range(n)]
    expected = reduce_terms([t.copy() for t in terms], op)
    first = terms[0]
    got = reduce_terms(terms, op, into_first=True)
    assert _bits([got]) == _bits([expected])
    assert (got is first) == (op != "avg" or dtype == "bool")  # a bool mean is a logical or


def test_reducing_into_a_first_term_that_cannot_take_it_is_an_error():
    a = np.ones(3)
    cases = {"read-only-buffer": [np.ones(3)], "aliased-buffer": [a, a[::-1]]}
    cases["read-only-buffer"][0].flags.writeable = False
    broadcast = np.lib.stride_tricks.as_strided(np.ones(3), (3,), (0,))
    for code, terms in [*cases.items(), ("aliased-buffer", [broadcast, np.ones(3)])]:
        with pytest.raises(ExecutionError) as info:
            reduce_terms(terms + [np.ones(3)], "sum", into_first=True)
        assert info.value.code == code


@pytest.mark.skipif(internal_overlap is None, reason="numpy's internal_overlap helper is not there")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       strides=st.lists(st.integers(-3, 3), min_size=3, max_size=3), itemsize=st.sampled_from([1, 2, 8]))
def test_may_overlap_itself_never_misses_an_overlap(shape, strides, itemsize):
    dtype = {1: np.uint8, 2: np.float16, 8: np.float64}[itemsize]
    buffer = np.zeros(200, dtype)
    view = np.lib.stride_tricks.as_strided(buffer[100:], shape, [s * itemsize for s in strides[:len(shape)]])
    if internal_overlap(view):
        assert may_overlap_itself(view)


# --------------------------------------------------------------------------- end to end, random moves
PLACEMENTS = ["R", "S(0)", "P(sum)", "P(max)", "P(min)", "P(avg)"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=st.lists(st.sampled_from(PLACEMENTS), min_size=2, max_size=2),
       dst=st.lists(st.sampled_from(["R", "S(0)"]), min_size=2, max_size=2),
       dtype=st.sampled_from(["float64", "float32", "int64"]), size=st.integers(3, 6),
       first=st.sampled_from(["fresh", "view", "keep", "same"]), viewer=st.booleans(), seed=st.integers(0, 99))
def test_random_moves_give_the_same_bits_with_and_without_donation(src, dst, dtype, size, first, viewer, seed):
    b = Build((2, 2), ("dp", "tp"))
    t = b.kernel(first, "t", b.input("x", (size,), src, dtype))
    if viewer:
        b.kernel("view", "v", t)
    try:
        b.move(t, "r", dst)
    except AssertionError:  # no communication needed: nothing to donate
        return
    if viewer:
        b.kernel("add", "w", "v", "v")  # reads t's buffer after the move
    wanted = ["r", "w"] if viewer else ["r"]
    x = (np.random.default_rng(seed).standard_normal(size) * 100).astype(dtype)
    reference = Simulator(KERNELS, donate=False).execute(b.program, {"x": x}, np.random.default_rng(seed))
    sim = Simulator(KERNELS)
    got = sim.execute(b.program, {"x": x}, np.random.default_rng(seed), wanted=wanted)
    event(f"buffers donated: {len(sim.donated)}")
    for value in wanted:
        assert _bits(got[value]) == _bits(reference[value]), value
