"""The msrun worker's op loop against the simulator, without msrun: local ops and strided gathers.

Every rank runs :func:`layout_prop.engines.msrun_worker.run_rank` in a thread of this
process, with the worker's own :class:`~layout_prop.engines.msrun_worker.Communicator`
(its native-or-emulated choices, its buffer arithmetic, its strided block order) whose
two MindSpore primitives, the native AllReduce and AllGather, are replaced by an
exchange between the threads (:class:`ThreadCommunicator`).  Kernels are the numpy
table, so MindSpore is not needed.  Every value of every rank must equal the
simulator's bit for bit: ``local-partial`` steps, local slices to strided shards
``_S(d,k)`` and all-gathers of strided shards, on meshes with size-1 axes, uneven and
empty pieces.  One real msrun run of the same ops is in ``test_msrun.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.api import analyze
from layout_prop.core.errors import ExecutionError
from layout_prop.engines.collectives import reduce_terms
from layout_prop.engines.msrun_engine import _scatter_inputs
from layout_prop.engines.msrun_worker import CPU_CAPS, Communicator, plan_groups, run_rank
from layout_prop.engines.simulator import Simulator
from layout_prop.io.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.runner import random_inputs

WAIT = 20.0  # seconds a thread waits for the other ranks of its group before giving up


class Exchange:
    """Where the threads playing the ranks meet: the k-th call of every member of a group
    gets the k-th arrays of all members, in group order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls: dict[tuple, dict[int, np.ndarray]] = {}
        self._counts: dict[tuple, int] = {}

    def share(self, ranks: tuple[int, ...], rank: int, array: np.ndarray) -> list[np.ndarray]:
        with self._cond:
            seq = self._counts.get((ranks, rank), 0)
            self._counts[(ranks, rank)] = seq + 1
            slot = self._calls.setdefault((ranks, seq), {})
            slot[rank] = np.array(array, copy=True)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(slot) == len(ranks), WAIT):
                raise TimeoutError(f"rank {rank}: call {seq} on group {list(ranks)} saw only ranks {sorted(slot)}")
            return [slot[r] for r in ranks]


class ThreadCommunicator(Communicator):
    """The worker's communicator for one thread-rank; MindSpore's primitives become an :class:`Exchange`."""

    def __init__(self, program, rank: int, exchange: Exchange) -> None:  # no MindSpore: no super().__init__
        self.rank = rank
        self.caps = CPU_CAPS  # native all-gather on the world group only, for even float32/float64/int32
        self.mesh = program.mesh
        self.groups = plan_groups(program, rank, "world")
        self.exchange = exchange
        self.native_calls: list[str] = []

    def _native_all_reduce(self, array: np.ndarray, op: str, group) -> np.ndarray:
        if array.size == 0:  # as the real primitive's caller: every member skips an empty all-reduce
            return array.copy()
        self.native_calls.append(f"all_reduce({op})")
        return reduce_terms(self.exchange.share(group.ranks, self.rank, array), op)

    def _native_all_gather(self, array: np.ndarray, dim: int, group) -> np.ndarray:
        self.native_calls.append("AllGather")
        return np.concatenate(self.exchange.share(group.ranks, self.rank, array), axis=dim)


def run_workers(program, per_rank: list[dict[str, np.ndarray]]) -> tuple[list[dict], list[list[dict]]]:
    """Every rank's worker op loop in a thread: ``(env per rank, collective records per rank)``."""
    exchange = Exchange()
    envs: list = [None] * program.mesh.size
    records: list = [None] * program.mesh.size
    errors: dict[int, BaseException] = {}

    def work(rank: int) -> None:
        try:
            comm = ThreadCommunicator(program, rank, exchange)
            envs[rank], _, records[rank] = run_rank(program, rank, per_rank[rank], "numpy", comm, {})
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors[rank] = exc

    threads = [threading.Thread(target=work, args=(r,)) for r in range(program.mesh.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3 * WAIT)
    if errors:  # the first real error, not the time-outs it caused on the other ranks
        first = next((e for e in errors.values() if not isinstance(e, TimeoutError)), next(iter(errors.values())))
        raise first
    return envs, records


def lowered(spec: dict):
    graph = analyze(load_spec(spec), reshard=True).graph
    return graph, Lower().run(graph).program


def assert_worker_matches_simulator(spec: dict, seed: int = 0):
    """Run ``spec`` on the thread-workers and on the simulator from the same local pieces;
    every value of every rank must be the same bits.  Returns the program and the records.

    Except after an all-reduce by ``avg``: the worker's native one is ``sum / n``, the
    simulator's ``t0 + sum(t_k - t0) / n`` (:func:`~layout_prop.engines.collectives.reduce_terms`),
    equal up to rounding only; those values (and the values computed from them) are compared
    within a float tolerance.
    """
    graph, program = lowered(spec)
    per_rank = _scatter_inputs(program, random_inputs(graph, seed), np.random.default_rng(seed))
    scattered = {name: [pieces[name] for pieces in per_rank] for name in per_rank[0]}
    want = Simulator().execute(program, {}, scattered=scattered)
    envs, records = run_workers(program, per_rank)
    rounded: set[str] = set()  # values that an avg all-reduce made, or that were computed from one
    for op in program.ops:
        if (op.kind == "collective" and op.step.reduce_op == "avg") or rounded & set(op.inputs):
            rounded.update(op.outputs)
        for value in op.outputs:
            for rank, env in enumerate(envs):
                got, expected = env[value], np.asarray(want[value][rank])
                assert got.dtype == expected.dtype and got.shape == expected.shape, (op.op, value, rank)
                if value in rounded:
                    tolerance = 1e-2 if got.dtype == np.float16 else 1e-5
                    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
                else:
                    assert got.tobytes() == expected.tobytes(), (op.op, value, rank, got, expected)
    return program, records


def kinds(program) -> set[tuple[str, str]]:
    return {(op.kind, op.op) for op in program.ops}


def strided_spec(mesh: tuple[int, ...], a: int, b: int, c: int, outer: str, dtype: str) -> dict:
    """x (a, b, c) with b on the last mesh axis, merged into (a*b, c): a strided shard ``_S(0,a)``
    there; multiplied by a replicated g (sliced to it locally), then gathered to Replicate."""
    names = ["dp", "tp"][-len(mesh):]
    x_placements = ([outer] if len(mesh) == 2 else []) + ["S(1)"]
    g_placements = ["R"] * len(mesh)
    return {"mesh": {"shape": list(mesh), "names": names},
            "inputs": {"x": {"shape": [a, b, c], "placements": x_placements, "dtype": dtype},
                       "g": {"shape": [a * b, c], "placements": g_placements, "dtype": dtype}},
            "nodes": [{"name": "y", "op": "reshape", "inputs": ["x"], "attrs": {"shape": [a * b, c]}},
                      {"name": "s", "op": "mul", "inputs": ["y", "g"]},
                      {"name": "out", "op": "redistribute", "inputs": ["s"], "attrs": {"placements": g_placements}}],
            "outputs": ["out"]}


def partial_spec(mesh: tuple[int, ...], rows: int, cols: int, op: str, other: str, dtype: str) -> dict:
    """A replicated y (cols,) made terms of a P(op) on the last mesh axis by local-partial
    steps: asked for (``t``, then reduced back to Replicate) and, for ``sum`` and ``avg``,
    as the operand of an add with x (rows, cols), a P(op) there (``z``, then reduced)."""
    names = ["dp", "tp"][-len(mesh):]
    x_placements = ([other] if len(mesh) == 2 else []) + [f"P({op})"]
    replicate = ["R"] * len(mesh)
    terms = replicate[:-1] + [f"P({op})"]
    nodes = [{"name": "t", "op": "redistribute", "inputs": ["y"], "attrs": {"placements": terms}},
             {"name": "t_back", "op": "redistribute", "inputs": ["t"], "attrs": {"placements": replicate}}]
    if op in ("sum", "avg"):  # add is linear in a sum or a mean of its terms, not in a max or a min
        nodes += [{"name": "z", "op": "add", "inputs": ["x", "y"]},
                  {"name": "z_back", "op": "redistribute", "inputs": ["z"], "attrs": {"placements": replicate}}]
    return {"mesh": {"shape": list(mesh), "names": names},
            "inputs": {"x": {"shape": [rows, cols], "placements": x_placements, "dtype": dtype},
                       "y": {"shape": [cols], "placements": replicate, "dtype": dtype}},
            "nodes": nodes, "outputs": [node["name"] for node in nodes]}


# --------------------------------------------------------------------------- fixed examples
def test_strided_slice_and_gather_run_as_on_the_simulator():
    """10 rows on 4 ranks (3, 3, 3, 1) in 2 blocks: uneven pieces, so the gather is emulated."""
    program, records = assert_worker_matches_simulator(strided_spec((4,), 2, 10, 3, "R", "float32"))
    assert {("local", "local-slice"), ("collective", "all-gather")} <= kinds(program)
    gathers = [r for r in records[0] if r["kind"] == "all-gather"]
    assert len(gathers) == 1 and gathers[0]["emulated"]
    assert gathers[0]["impl"].endswith("then the 2 blocks of each piece put in block order")


def test_even_strided_gather_on_the_world_group_is_native():
    program, records = assert_worker_matches_simulator(strided_spec((2,), 3, 4, 2, "R", "float32"))
    gathers = [r for r in records[1] if r["kind"] == "all-gather"]
    assert len(gathers) == 1 and not gathers[0]["emulated"]
    assert gathers[0]["impl"] == "native AllGather, then the 3 blocks of each piece put in block order"


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_local_partial_runs_as_on_the_simulator(op):
    program, _ = assert_worker_matches_simulator(partial_spec((2, 3), 5, 4, op, "S(0)", "float32"))
    assert ("local", "local-partial") in kinds(program)


def test_local_partial_sum_leaves_zeros_beside_the_first_rank():
    graph, program = lowered(partial_spec((3,), 2, 2, "sum", "R", "float64"))
    per_rank = _scatter_inputs(program, {"x": np.ones((2, 2)), "y": np.array([5.0, -0.0])}, None)
    envs, _ = run_workers(program, per_rank)
    made = [op.outputs[0] for op in program.ops if op.op == "local-partial"]
    assert len(made) == 2  # t, and y beside x in the add
    for value in made:
        assert [env[value].tolist() for env in envs] == [[5.0, -0.0], [0.0, 0.0], [0.0, 0.0]]
    assert [env["z_back"].tolist() for env in envs] == [[[6.0, 1.0], [6.0, 1.0]]] * 3


def test_a_local_op_of_unknown_step_is_refused():
    """A ``local`` op carries a step that needs no communication; anything else is an error, not a guess."""
    from dataclasses import replace

    graph, program = lowered(strided_spec((2,), 2, 4, 2, "R", "float32"))
    index = next(k for k, op in enumerate(program.ops) if op.kind == "collective")
    program.ops[index] = replace(program.ops[index], kind="local")  # an all-gather posing as a local op
    per_rank = _scatter_inputs(program, random_inputs(graph, 0), None)
    with pytest.raises(ExecutionError) as info:
        run_workers(program, per_rank)
    assert info.value.code == "unknown-step"
    assert "'all-gather' is not a local step" in info.value.message


# --------------------------------------------------------------------------- properties
MESHES = st.sampled_from([(1,), (2,), (3,), (4,), (1, 3), (2, 1), (2, 2), (3, 2)])
DTYPES = st.sampled_from(["float32", "float64", "int32", "float16"])


@settings(max_examples=40, deadline=None)
@given(mesh=MESHES, a=st.integers(2, 3), b=st.integers(2, 7), c=st.integers(1, 3),
       outer=st.sampled_from(["R", "S(1)", "S(2)"]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_strided_shards_on_the_worker_equal_the_simulator(mesh, a, b, c, outer, dtype, seed):
    if outer == "S(2)" and c == 1 and mesh[0] > 1:
        outer = "R"  # a size-1 dim cannot be sharded over several devices
    program, _ = assert_worker_matches_simulator(strided_spec(mesh, a, b, c, outer, dtype), seed)
    if mesh[-1] > 1:  # the cases this test is for really are in the program
        assert {("local", "local-slice"), ("collective", "all-gather")} <= kinds(program)


@settings(max_examples=40, deadline=None)
@given(mesh=MESHES, rows=st.integers(1, 6), cols=st.integers(1, 4), op=st.sampled_from(["sum", "avg", "max", "min"]),
       other=st.sampled_from(["R", "S(0)", "P(sum)"]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_local_partials_on_the_worker_equal_the_simulator(mesh, rows, cols, op, other, dtype, seed):
    if other == "S(0)" and rows == 1:
        other = "R"  # a size-1 dim cannot be sharded over several devices
    program, _ = assert_worker_matches_simulator(partial_spec(mesh, rows, cols, op, other, dtype), seed)
    if mesh[-1] > 1:
        assert ("local", "local-partial") in kinds(program)
