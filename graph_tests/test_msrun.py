"""The MindSpore msrun engine: upstream scenarios on real worker processes, failures, emulations.

msrun is slow (a 2-rank run takes about 15 s, 8 ranks on 2 cores about 30 s), so only
a few tests launch it:

- three upstream scenarios forward and backward (2, 4 and 8 ranks, modes 0, 1, 3), each
  extended by one node whose redistribution needs a collective that mccl on CPU lacks
  (all-to-all, all-gather on a sub-group, reduce-scatter), so that every run goes
  through an AllReduce-based emulation as well as the native all-reduce of the backward;
  the 4-rank one also by the lowered ``local`` ops (a ``local-partial``, a local slice to a
  strided shard) and a gather of a strided shard (their exactness against the simulator,
  without msrun: ``test_msrun_local_ops.py``);
- a worker failing on purpose (``LAYOUT_PROP_FAIL_RANK``) and a timeout: typed errors,
  within the time bound, no process left behind (killed workers, signals and a hostile
  temp folder: ``test_msrun_safety.py``).

The rest runs without msrun: the emulations' buffer arithmetic against the simulated
collectives (bit for bit, uneven shards), the kernel tables against the numpy table,
the cann backend refusing to start without Ascend, and msrun missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

mindspore = pytest.importorskip("mindspore")

from layout_prop.api import analyze  # noqa: E402
from layout_prop.core.errors import ExecutionError  # noqa: E402
from layout_prop.engines import collectives  # noqa: E402
from layout_prop.engines import msrun_engine  # noqa: E402
from layout_prop.kernels.mindspore_backend import CANN_KERNELS, KERNELS as MS_KERNELS, to_numpy  # noqa: E402
from layout_prop.engines.msrun_engine import MsrunEngine, check_cann_program  # noqa: E402
from layout_prop.engines.msrun_worker import (  # noqa: E402
    FAIL_RANK_ENV,
    chunk,
    error_path,
    gather_buffer,
    gather_result,
    terms_buffer,
    terms_result,
)
from layout_prop.kernels.numpy_backend import KERNELS as NUMPY_KERNELS  # noqa: E402
from layout_prop.kernels.rpe_cann import cann_available  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.passes.lower import Lower  # noqa: E402
from layout_prop.runner import random_inputs, run_graph  # noqa: E402

from .kernel_samples import family_samples  # noqa: E402
from .msrun_support import TAG_ENV, new_tag, wait_until_none_left  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "rpe"
TIMEOUT = 120.0  # seconds; every msrun test below finishes in well under half of it


def scenario(name: str, mode: int, extra_nodes=(), extra_inputs=None, dtype: str | None = None):
    """An upstream example spec with its rotary mode set, extra nodes / inputs, every node an output."""
    data = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    data["nodes"][0]["attrs"]["mode"] = mode
    data["nodes"] += list(extra_nodes)
    data["inputs"].update(extra_inputs or {})
    if dtype:
        for entry in data["inputs"].values():
            entry["dtype"] = dtype
    data["outputs"] = [node["name"] for node in data["nodes"]]
    return load_spec(yaml.safe_dump(data))




def emulated_kinds(report) -> set[str]:
    return {c["kind"] for c in report.extra["emulated_collectives"]}


def native_kinds(report) -> set[str]:
    return {c["kind"] for c in report.extra["collective_impls"] if not c["emulated"]}


def check_run(report, ranks: int, runs_root: Path) -> None:
    """A run that matches one device, with the engine's report filled in and its folder removed."""
    assert report.ok, report.mismatches
    assert report.ranks == ranks
    assert sorted(report.grads) == ["cos", "sin", "x"]
    assert len(report.extra["per_rank_seconds"]) == ranks
    assert all(r["total"] > 0 and r["kernel"] > 0 for r in report.extra["per_rank_seconds"])
    assert report.extra["run_dir"] is None and list(runs_root.iterdir()) == []
    assert "all-reduce" in native_kinds(report)  # the backward's gradient all-reduce, native on mccl


# --------------------------------------------------------------------------- msrun runs
def test_dp_b_mode0_on_2_ranks(tmp_path):
    """Scenario 2 (B on dp) forward and backward; y moved S(0) -> S(2) needs an all-to-all (emulated)."""
    graph = scenario("dp_b", 0, [{"name": "y_s2", "op": "redistribute", "inputs": ["y"],
                                  "attrs": {"placements": ["S(2)"]}}])
    states = []
    report = run_graph(graph, engine="mindspore", backend="mindspore", backward=True, timeout=TIMEOUT,
                       run_dir=tmp_path, keep=True, progress=states.append)
    assert report.ok, report.mismatches
    assert report.ranks == 2 and sorted(report.grads) == ["cos", "sin", "x"] and "all-reduce" in native_kinds(report)
    # the progress line's states, polled while msrun ran: the ranks joined, then finished
    counts = [tuple(map(int, re.match(r"2 ranks: (\d) joined, (\d) done, \d+s \(timeout 2m 00s\)$", s).groups()))
              for s in states]
    assert counts[0] == (0, 0) and max(counts)[0] == 2 and counts == sorted(counts)
    assert set(report.outputs) == {"y", "y_s2"}
    assert emulated_kinds(report) == {"all-to-all"}
    run = Path(report.extra["run_dir"])  # kept on request: the logs and results are there
    assert run.parent == tmp_path and run.stat().st_mode & 0o777 == 0o700
    assert (run / "rank0.npz").exists() and (run / "logs" / "worker_1.log").exists()


def test_dp_sp_mode1_float64_on_4_ranks(tmp_path):
    """Scenario 5 (dp x sp) in float64: the all-reduce of float64 (no mccl kernel) and an
    all-gather on the dp sub-groups (mccl gathers on the world group only) are emulated.

    Also the lowered ``local`` ops and a strided gather: y (B, N, S, D) with S on sp, viewed
    as (B, N*S, D), is the strided shard ``_S(1,4)``; a replicated g is sliced to it locally,
    the product gathered on the sp sub-groups; cos, added to a partial sum over dp, becomes
    its terms by a ``local-partial`` (and its gradient too, in the backward)."""
    extra = [{"name": "y_rep", "op": "redistribute", "inputs": ["y"], "attrs": {"placements": ["R", "S(2)"]}},
             {"name": "m", "op": "reshape", "inputs": ["y"], "attrs": {"shape": [4, 64, 64]}},
             {"name": "s", "op": "mul", "inputs": ["m", "g"]},
             {"name": "s_rows", "op": "redistribute", "inputs": ["s"], "attrs": {"placements": ["S(0)", "R"]}},
             {"name": "c", "op": "add", "inputs": ["cos", "bias"]}]
    inputs = {"g": {"shape": [1, 64, 64], "placements": ["R", "R"], "requires_grad": False},
              "bias": {"shape": [1, 1, 16, 64], "placements": ["P(sum)", "S(2)"], "requires_grad": False}}
    graph = scenario("dp_sp", 1, extra, inputs, dtype="float64")
    program = Lower().run(analyze(graph, backward=True, reshard=True).graph).program
    local = {(op.op, str(op.specs[0].layout)) for op in program.ops if op.kind == "local"}
    assert {("local-slice", "(R, _S(1,4))"), ("local-partial", "(P(sum), S(2))")} <= local
    report = run_graph(graph, engine="mindspore", backend="mindspore", backward=True, timeout=TIMEOUT,
                       run_dir=tmp_path)
    assert report.ok, report.mismatches
    assert sorted(report.grads) == ["cos", "sin", "x"]
    assert set(report.outputs) == {"y", "y_rep", "m", "s", "s_rows", "c"}
    assert list(tmp_path.iterdir()) == []  # removed after success
    assert emulated_kinds(report) == {"all-gather", "all-reduce"}
    gathers = [c for c in report.extra["emulated_collectives"] if c["kind"] == "all-gather"]
    assert sorted(gathers[0]["groups"]) == [[0, 2], [1, 3]]
    strided = next(c for c in report.extra["emulated_collectives"] if c["value"] == "s_rows")
    assert sorted(strided["groups"]) == [[0, 1], [2, 3]]
    assert strided["impl"].endswith(", then the 4 blocks of each piece put in block order")
    assert all("local" in seconds for seconds in report.extra["per_rank_seconds"])
    errors = [report.grads["cos"]] + [report.outputs[name] for name in ("y_rep", "s_rows", "c")]
    assert all(e["max_rel_err"] < 1e-12 for e in errors), errors


def test_dp_tp_sp_mode3_on_8_ranks(tmp_path):
    """Scenario 8 (dp x tp x sp) forward and backward in mode 3, plus a bias that is a partial
    sum over dp and a partial max over tp: its reduce-scatters (no mccl kernel) are emulated."""
    graph = scenario("dp_tp_sp", 3, [{"name": "z", "op": "add", "inputs": ["y", "bias"]}],
                     {"bias": {"shape": [4, 4, 16, 64], "placements": ["P(sum)", "P(max)", "R"],
                               "requires_grad": False}})
    report = run_graph(graph, engine="mindspore", backend="mindspore", backward=True, timeout=TIMEOUT,
                       run_dir=tmp_path)
    check_run(report, 8, tmp_path)
    assert set(report.outputs) == {"y", "z"}
    assert emulated_kinds(report) == {"reduce-scatter"}
    ops = {(c["mesh_axis"], c["impl"].split(",")[0]) for c in report.extra["emulated_collectives"]}
    assert ops == {("tp", "native all_reduce(max)"), ("dp", "native all_reduce(sum)")}


def test_failing_worker_is_reported_within_the_timeout(tmp_path, monkeypatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_ENV, tag)
    monkeypatch.setenv(FAIL_RANK_ENV, "1")
    engine_timeout = 120.0
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        run_graph(load_spec(EXAMPLES / "dp_b.yaml"), engine="mindspore", backend="mindspore", timeout=engine_timeout,
                  run_dir=tmp_path)
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < engine_timeout
    assert err.code == "worker-failed"
    assert "\n" not in str(err)
    assert err.message.startswith("rank 1 failed at start: injected-failure: rank 1 fails on purpose")
    run_dir = next(tmp_path.iterdir())
    assert f"run folder {run_dir}" in err.message
    assert error_path(run_dir, 1).exists()
    assert wait_until_none_left(tag) == []


def test_timeout_kills_every_process(tmp_path, monkeypatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_ENV, tag)
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        run_graph(load_spec(EXAMPLES / "dp_b.yaml"), engine="mindspore", backend="mindspore", timeout=3,
                  run_dir=tmp_path)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.code == "engine-timeout"
    assert elapsed < 3 + 5  # the timeout, plus a little to kill and clean up
    run_dir = next(tmp_path.iterdir())
    assert "timeout of 3 s" in err.message and "ranks [0, 1] did not finish" in err.message
    assert f"run folder {run_dir}" in err.message
    assert wait_until_none_left(tag) == []


# --------------------------------------------------------------------------- refusals before launch
@pytest.mark.skipif(cann_available(), reason="an Ascend device is present")
def test_cann_backend_without_ascend_refuses_before_launch(tmp_path):
    graph = analyze(load_spec(EXAMPLES / "dp_b.yaml"), backward=True).graph
    program = Lower().run(graph).program
    engine = MsrunEngine(backend="cann", run_dir=tmp_path)
    with pytest.raises(ExecutionError) as info:
        engine.execute(program, random_inputs(graph, 0), np.random.default_rng(1), wanted=list(graph.outputs))
    assert info.value.code == "backend-unavailable"
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing launched


@pytest.mark.skipif(cann_available(), reason="an Ascend device is present")
def test_cli_cann_backend_without_ascend_exits_2_with_one_line():
    spec = EXAMPLES / "dp_b.yaml"
    done = subprocess.run([sys.executable, "-m", "layout_prop.cli", "run", str(spec), "--engine", "mindspore",
                           "--backend", "cann"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("layout-prop: error: backend-unavailable: ")
    assert done.stdout == ""


def test_cann_constraints_are_checked_on_local_shapes():
    graph = analyze(scenario("dp_tp_sp", 3), backward=True).graph
    with pytest.raises(ExecutionError) as info:
        check_cann_program(Lower().run(graph).program)
    assert info.value.code == "no-backward-kernel"
    assert info.value.message.startswith("rank 0: ")
    assert "x shape (2, 2, 8, 64)" in info.value.message  # rank 0's local shape, not the global one


def test_missing_msrun_is_engine_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(msrun_engine.shutil, "which", lambda *args, **kwargs: None)
    graph = analyze(load_spec(EXAMPLES / "dp_b.yaml")).graph
    program = Lower().run(graph).program
    with pytest.raises(ExecutionError) as info:
        MsrunEngine(run_dir=tmp_path).execute(program, random_inputs(graph, 0), None)
    assert info.value.code == "engine-unavailable"
    assert "pip install 'layout-prop[mindspore]'" in info.value.hint
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- the emulations, without msrun
def summed(buffers) -> np.ndarray:
    """What a sum-all-reduce of int32 buffers returns on every rank."""
    return np.sum(np.stack(buffers), axis=0, dtype=np.int32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def sample(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values with the awkward cases: -0.0, inf, nan for floats."""
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, shape).astype(dtype)
    values = rng.standard_normal(shape).astype(dtype)
    flat = values.reshape(-1)
    for k, special in zip(range(0, flat.size, 3), (-0.0, np.inf, -np.inf, np.nan)):
        flat[k] = special
    return values


DTYPES = ["float32", "float64", "float16", "int64", "int32", "bool"]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), total=st.integers(0, 11), other=st.integers(0, 3), dim=st.integers(0, 1),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_emulated_all_gather_and_all_to_all_are_exact(n, total, other, dim, dtype, seed):
    rng = np.random.default_rng(seed)
    full_shape = [other + 1, other + 1]
    full_shape[dim] = total
    whole = sample(rng, tuple(full_shape), dtype)
    pieces = [chunk(whole, dim, n, k) for k in range(n)]  # torch.chunk pieces: uneven, maybe empty
    sizes = [p.shape[dim] for p in pieces]
    gathered = gather_result(summed([gather_buffer(p, k, sizes, dim) for k, p in enumerate(pieces)]), dtype)
    assert same_bits(gathered, collectives.all_gather(pieces, dim)[0])
    # all-to-all: gather along the concat dim, keep the rank's chunk of the split dim
    split_dim = 1 - dim
    expected = collectives.all_to_all(pieces, split_dim=split_dim, concat_dim=dim)
    for k in range(n):
        assert same_bits(chunk(gathered, split_dim, n, k), expected[k])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), rows=st.integers(0, 9), op=st.sampled_from(["sum", "avg", "max", "min"]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_emulated_all_reduce_and_reduce_scatter_are_exact(n, rows, op, dtype, seed):
    rng = np.random.default_rng(seed)
    terms = [sample(rng, (rows, 3), dtype) for _ in range(n)]
    with np.errstate(all="ignore"):
        reduced = terms_result(summed([terms_buffer(t, k, n) for k, t in enumerate(terms)]), dtype, op)
        assert same_bits(reduced, collectives.all_reduce(terms, op)[0])
        expected = collectives.reduce_scatter(terms, op, 0)
    for k in range(n):
        assert same_bits(chunk(reduced, 0, n, k), expected[k])


def test_gather_buffer_holds_only_the_ranks_own_block():
    pieces = [np.array([1.0, 2.0, 3.0], np.float32), np.array([4.0], np.float32)]
    own = gather_result(gather_buffer(pieces[1], 1, [3, 1], 0), np.float32)
    assert own.tolist() == [0.0, 0.0, 0.0, 4.0]  # zeros elsewhere: the all-reduce supplies the rest


# --------------------------------------------------------------------------- kernel tables
def test_kernel_tables_have_the_numpy_tables_keys():
    # a fresh interpreter: other tests register extra numpy kernels for their own ops
    done = subprocess.run([sys.executable, "-c", "from layout_prop.kernels.numpy_backend import KERNELS; "
                           "print(' '.join(sorted(KERNELS)))"], capture_output=True, text=True, timeout=60, check=True)
    builtin = set(done.stdout.split())
    assert set(MS_KERNELS) == builtin
    assert set(CANN_KERNELS) == builtin


def kernel_samples(rng) -> dict[str, list[tuple[tuple, dict]]]:
    """Sample arguments and attrs for every op of the tables (uneven pieces, broadcasts, int inputs)."""
    def f32(*shape):
        return (3 * rng.standard_normal(shape)).astype(np.float32)

    x, dy, cos, sin = f32(2, 3, 4, 8), f32(2, 3, 4, 8), f32(1, 1, 4, 8), f32(1, 1, 4, 8)
    ints = rng.integers(-3, 4, (2, 3, 4, 8)).astype(np.int32)
    ids = rng.integers(-1, 9, (2, 3)).astype(np.int64)  # some outside the table piece [2, 8)
    w, b, w2 = f32(8), f32(8), f32(4, 8)
    q, k, v = f32(2, 3, 4, 8), f32(2, 3, 5, 8), f32(2, 3, 5, 8)
    probs = NUMPY_KERNELS["softmax"](x, axis=-1)
    log_probs = NUMPY_KERNELS["log_softmax"](x, axis=1)
    samples = {
        "identity": [((x,), {})],
        "add": [((x, cos), {})],
        "sub": [((x, cos), {})],
        "mul": [((x, cos), {})],
        "neg": [((x,), {})],
        "sum_to": [((x,), {"shape": [1, 3, 1, 8]}), ((x,), {"shape": [4, 8]})],
        "redistribute": [((x,), {"placements": ["R"]})],
        "rotary_position_embedding": [((x, cos, sin), {"mode": m}) for m in range(4)],
        "rotary_position_embedding_grad": [((dy, x, cos, sin), {"mode": m}) for m in range(4)],
        # shape family
        "reshape": [((x,), {"shape": [6, -1]})],
        "transpose": [((x,), {"dims": [0, 2, 1, 3]}), ((x,), {"dim0": 1, "dim1": 3})],
        "slice": [((x,), {"axis": 2, "start": 1, "stop": 3}), ((x,), {"axis": -1, "start": 5})],
        "pad_slice": [((x,), {"axis": 2, "start": 1, "size": 7})],
        "concat": [((x, dy, x), {"axis": 1})],
        "unsqueeze": [((x,), {"dim": 1})],
        "squeeze": [((cos,), {"dim": [0, 1]}), ((cos,), {})],
        "sharding_constraint": [((x,), {"placements": ["S(0)"], "pattern": "y"}), ((x,), {"tensor_map": [0, -1]})],
        **{f"split{n}": [((x,), {"axis": 3})] for n in (2, 4, 8)},
        "split3": [((x,), {"axis": 3, "sizes": [2, 3, 3]})],
        "split5": [((x,), {"axis": 3, "sizes": [1, 1, 2, 2, 2]})],
        "split6": [((x,), {"axis": 3, "sizes": [1, 1, 1, 1, 2, 2]})],
        "split7": [((x,), {"axis": 3, "sizes": [1, 1, 1, 1, 1, 1, 2]})],
        **{f"chunk{n}": [((x,), {"axis": 3}), ((x,), {"axis": 1})] for n in range(2, 9)},
        # nn family
        "exp": [((x,), {}), ((ints,), {})],
        "silu": [((x,), {})],
        "silu_grad": [((dy, x), {})],
        "gelu": [((x,), {})],
        "gelu_grad": [((dy, x), {})],
        "cast": [((x,), {"dtype": "float64"}), ((ints,), {"dtype": "float32"})],
        "scale": [((x,), {"factor": 0.5}), ((ints,), {"factor": 2.0})],
        "div": [((x, np.abs(cos) + 1), {})],
        "silu_mul": [((x, dy), {})],
        "swiglu": [((x,), {"dim": -1})],
        "swiglu_grad": [((f32(2, 3, 4, 4), x), {"dim": -1})],
        "rms_norm": [((x, w), {"eps": 1e-6}), ((x, w2), {"normalized_ndim": 2})],
        "rms_norm_grad": [((dy, x, w), {}), ((dy, x, w2), {"normalized_ndim": 2})],
        "layer_norm": [((x, w, b), {"eps": 1e-5})],
        "layer_norm_grad": [((dy, x, w, b), {})],
        "softmax": [((x,), {"axis": -1})],
        "softmax_grad": [((dy, probs), {"axis": -1})],
        "log_softmax": [((x,), {"axis": 1})],
        "log_softmax_grad": [((dy, log_probs), {"axis": 1})],
        "scaled_dot_product_attention": [((q, k, v), {}), ((q, k, v), {"causal": True, "q_offset": 1}),
                                         ((q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                           v.transpose(0, 2, 1, 3)), {"layout": "BSND", "scale": 0.3})],
        "scaled_dot_product_attention_grad": [((dy, q, k, v), {"causal": True, "q_offset": 1})],
        # linalg family
        "einsum": [((f32(2, 3, 4), f32(4, 5)), {"equation": "bmk,kn->bmn"}),
                   ((f32(1, 3, 4), f32(2, 4, 5)), {"equation": "bmk,bkn->bmn"}),  # a size-1 letter broadcasts
                   ((f32(2, 3), f32(3, 4), f32(4, 2)), {"equation": "ij,jk,kl->il"}),
                   ((f32(2, 3), f32(4)), {"equation": "ij,k->ki"}),
                   ((f32(0, 3), f32(3, 2)), {"equation": "mk,kn->mn"})],
        "matmul": [((f32(2, 3, 4), f32(4, 5)), {}),
                   ((f32(2, 4, 3), f32(5, 4)), {"transpose_a": True, "transpose_b": True})],
        "batch_matmul": [((f32(2, 3, 4), f32(1, 4, 5)), {})],
        "linear": [((x, f32(5, 8), f32(5)), {}), ((x, f32(5, 8), f32(5)), {"add_bias": False}),
                   ((x, f32(5, 8)), {})],
        "embedding": [((ids, f32(6, 4)), {"vocab_start": 2})],
        "embedding_grad": [((f32(2, 3, 4), ids), {"num_embeddings": 6, "vocab_start": 2})],
        "sum": [((x,), {"dims": [1, 2]}), ((x,), {"dims": -1, "keepdim": True}), ((ints > 0,), {})],
        "mean": [((x,), {"dims": [0]}), ((x,), {"dims": [1], "count": 10}), ((ints,), {"dims": [3]})],
        "max": [((x,), {"dims": [1]}), ((x,), {"dims": 2, "keepdim": True}), ((f32(2, 0, 3),), {"dims": [1]})],
        "sum_grad": [((f32(2, 8),), {"shape": [2, 3, 4, 8], "dims": [1, 2], "scale": 0.5}),
                     ((f32(2, 1, 1, 8),), {"shape": [2, 3, 4, 8], "dims": [1, 2], "keepdim": True})],
        "max_grad": [((f32(2, 4, 8), x, NUMPY_KERNELS["max"](x, dims=[1])), {"dims": [1]})],
    }
    samples.update(family_samples(rng, f32))  # the newer op families, one module each
    return samples


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The runner's measure: the largest difference over the largest reference magnitude
    (non-finite values must agree exactly, and count as infinitely wrong otherwise)."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(got[~finite], want[~finite], equal_nan=True):
        return float("inf")
    if not finite.any():
        return 0.0
    diff = float(np.abs(got[finite] - want[finite]).max())
    scale = float(np.abs(want[finite]).max())
    return diff / scale if scale > 0 else diff


def test_mindspore_kernels_match_numpy():
    """Within the runner's float32 tolerance (MindSpore's own CPU float32 tanh would not be:
    see ``mindspore_backend._precise``)."""
    samples = kernel_samples(np.random.default_rng(0))
    assert set(samples) == set(MS_KERNELS), "give every kernel of the table a sample here"
    for op, cases in samples.items():
        for args, attrs in cases:
            want = NUMPY_KERNELS[op](*args, **attrs)
            got = MS_KERNELS[op](*args, **attrs)
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            assert len(got) == len(want), op
            for g, w in zip(got, want):
                g = to_numpy(g)
                assert g.shape == w.shape and g.dtype == w.dtype, (op, attrs, g.shape, w.shape, g.dtype, w.dtype)
                assert relative_error(g, w) <= 1e-5, (op, attrs, relative_error(g, w))


def test_llama_block_on_4_msrun_workers_forward_and_backward():
    """The Llama block (Megatron TP + SP, RPE, causal attention) on 4 MindSpore workers, dp=1 sp=2 tp=2."""
    from layout_prop.io.loader import load_spec
    from layout_prop.frontends.generate import llama_spec

    spec = llama_spec(1, mesh=(("dp", 1), ("sp", 2), ("tp", 2)))
    rep = run_graph(load_spec(spec), engine="mindspore", backward=True, seed=0, timeout=400)
    assert rep.ok, rep.mismatches
    assert rep.ranks == 4 and len(rep.grads) == 10
    # the sub-group all-gathers before the column-parallel matmuls are built from AllReduce on CPU
    assert any(c["kind"] == "all-gather" and c["emulated"] for c in rep.extra["emulated_collectives"])
