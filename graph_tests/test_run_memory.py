"""``run`` estimates its memory before allocating anything (issue 14).

A run whose estimate exceeds the available memory (or ``--max-memory``) is refused with
``run-too-large``: exit 2, one line naming what is needed, what is available and the
biggest tensors, in seconds rather than a numpy traceback or the kernel's OOM killer.
The estimate is checked against the peak that tracemalloc (which sees numpy's
allocations) measures on real runs: never below it.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.commands.flags import memory_size_arg as _memory_size
from layout_prop.core.errors import ExecutionError
from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec, parse_mesh_arg
from layout_prop.passes.lower import Lower
from layout_prop.runner import available_memory, check_run_memory, estimate_run_memory, run_graph

HUGE = """\
mesh: {shape: [2]}
inputs: {x: {shape: [100000, 100000, 10]}}
nodes:
  - {name: y, op: neg, inputs: [x]}
"""


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("layout-prop: error: ")
    return lines[0]


def test_a_run_that_cannot_be_allocated_is_refused_before_allocating(tmp_path, capsys):
    spec = tmp_path / "huge.yaml"
    spec.write_text(HUGE)
    start = time.perf_counter()
    rc = main(["run", str(spec)])
    assert time.perf_counter() - start < 10
    out, err = capsys.readouterr()
    line = one_error_line(err)
    assert rc == 2 and out == ""
    assert "run-too-large" in line and "needs about" in line and "available" in line
    assert "x [100000, 100000, 10] float32" in line  # the biggest tensors, by name
    assert "--max-memory" in line


def test_a_32_layer_llama_at_hidden_4096_is_refused_in_seconds(tmp_path, capsys):
    spec = llama_spec(32, parse_mesh_arg("dp=2,sp=2,tp=2"), batch=4, seq=2048, hidden=4096, heads=32, ffn=11008)
    graph = load_spec(spec)
    start = time.perf_counter()
    with pytest.raises(ExecutionError) as excinfo:
        run_graph(graph, backward=True, max_memory=64 * 2 ** 30)
    assert time.perf_counter() - start < 60
    assert excinfo.value.code == "run-too-large" and "64.0 GiB" in excinfo.value.message


def test_max_memory_overrides_the_limit(tmp_path, capsys):
    spec = tmp_path / "rpe.yaml"
    spec.write_text("""\
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x:   {shape: [4, 4, 16, 64], placements: ["S(0)", "S(1)"]}
  cos: {shape: [1, 1, 16, 64]}
  sin: {shape: [1, 1, 16, 64]}
nodes:
  - {name: y, op: rope, inputs: [x, cos, sin]}
""")
    assert main(["run", str(spec), "--backward", "--max-memory", "10K"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "run-too-large" in line and "--max-memory limit of 10.0 KiB" in line
    assert main(["run", str(spec), "--backward", "--max-memory", "1G"]) == 0
    assert "matches one device" in capsys.readouterr().out


# KB is a power of 1000, KiB and K alone of 1024 (layout_prop.io.sizes, one grammar with plan --memory-per-rank)
@pytest.mark.parametrize("text,size", [("4096", 4096), ("512M", 512 * 2 ** 20), ("8g", 8 * 2 ** 30),
                                       ("1.5T", int(1.5 * 2 ** 40)), ("2GiB", 2 * 2 ** 30), ("64KB", 64_000)])
def test_memory_sizes(text, size):
    assert _memory_size(text) == size


@pytest.mark.parametrize("text", ["1Q", "-5", "0", "lots", ""])
def test_bad_memory_sizes_are_bad_usage(text, capsys):
    assert main(["run", "spec.yaml", "--max-memory", text]) == 2
    assert "bad-usage" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("mesh,hidden,backward", [
    ("dp=2,sp=2,tp=2", 128, False), ("dp=2,sp=2,tp=2", 128, True), ("dp=1,sp=1,tp=8", 128, True),
    ("dp=8,sp=1,tp=1", 128, True), ("dp=1,sp=8,tp=1", 256, False),
])
def test_the_estimate_is_never_below_the_measured_peak(mesh, hidden, backward):
    spec = llama_spec(1, parse_mesh_arg(mesh), batch=4, seq=64, hidden=hidden, heads=4, ffn=2 * hidden)
    graph = analyze(load_spec(spec), reshard=True, backward=backward).graph
    estimate = estimate_run_memory(graph, Lower().run(graph).program)
    tracemalloc.start()
    try:
        report = run_graph(load_spec(spec), backward=backward, seed=0, check_memory=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok
    assert peak <= estimate.needed <= 3 * peak, (peak, estimate.needed)


def test_available_memory_is_known_here():
    available = available_memory()
    assert available is None or available > 0


def test_a_memory_error_that_slips_through_is_one_line(monkeypatch, capsys):
    def exhausted(args):
        raise MemoryError()

    monkeypatch.setattr("layout_prop.commands.demo.run", exhausted)
    assert main(["demo"]) == 2
    assert "out-of-memory" in one_error_line(capsys.readouterr().err)


def test_the_check_names_the_biggest_tensors_in_user_terms():
    spec = """\
mesh: {shape: [2]}
inputs: {x: {shape: [64, 64], placements: ["S(0)"]}, w: {shape: [64, 64]}}
nodes:
  - {name: y, op: matmul, inputs: [x, w]}
"""
    graph = analyze(load_spec(spec), reshard=True, backward=True).graph
    with pytest.raises(ExecutionError) as excinfo:
        check_run_memory(graph, Lower().run(graph).program, max_memory=1000)
    message = excinfo.value.message
    assert "cotangent" not in message and "grad/" not in message
    assert "biggest tensors" in message
