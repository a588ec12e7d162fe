"""The benchmark scripts still run and print their tables (tiny sizes; no timing is asserted).

Speed is measured by running the scripts by hand (docs/performance.md); these tests only
keep them from rotting: each runs in a subprocess from ``benchmarks/`` as docs/performance.md says.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)


def test_propagate_benchmark_prints_sizes_and_the_ratio():
    for graph in ("llama", "rpe"):
        done = _run("propagate.py", "--graph", graph, "--sizes", "60", "600", "--repeat", "1")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == f"graph: {graph}"
        assert "cold us/node" in lines[1]
        assert lines[-1].startswith("time(600)/time(60): cold ")


def test_simulate_benchmark_prints_one_row_per_graph():
    done = _run("simulate.py", "--size", "small", "--blocks", "1", "--repeat", "1")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("small", "1", "False"), ("small", "1", "True")]
    assert all(float(r[6]) > 0 for r in rows)  # the ratio column


def test_rpe_kernel_benchmark_reports_every_mode_and_its_verdict():
    done = _run("rpe_kernel.py", "--size-mib", "1", "--repeat", "1", "--min-ratio", "0")
    assert done.returncode == 0, done.stderr
    assert "np.copyto" in done.stdout
    for mode in ("mode 0 (half)", "mode 1 (interleave)", "mode 2 (quarter)", "mode 3 (interleave-half)"):
        assert done.stdout.count(mode) == 2  # a table for D=64 and one for D=128
    assert ", 64) = " in done.stdout and ", 128) = " in done.stdout
    last = done.stdout.rstrip().splitlines()[-1]
    assert re.fullmatch(r"OK: mode 0 reaches \d\.\d\d at D=64, \d\.\d\d at D=128 of the copy bandwidth \(>= 0\.0\)",
                        last), last
    failing = _run("rpe_kernel.py", "--size-mib", "1", "--repeat", "1", "--min-ratio", "1000")
    assert failing.returncode == 1 and "FAIL: mode 0 reaches" in failing.stderr


def test_cli_benchmark_prints_every_input_and_output_format():
    done = _run("cli.py", "--sizes", "30", "300", "--repeat", "1", "--large", "--large-layers", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("start-up: --help ")
    rows = [line.split() for line in lines[4:8]]  # after the start-up line, a blank line, header, rule
    assert [(r[0], r[1]) for r in rows] == [("json", "text"), ("json", "json"), ("yaml", "text"), ("yaml", "json")]
    # the ratio column: a positive number, or n/a when 30 nodes take no measurable time past the start-up;
    # then the cost of one more node from 30 to 300 (a number; noise can make it negative at these sizes)
    assert all(r[-2] == "n/a" or float(r[-2]) > 0 for r in rows), rows
    marginal = [float(r[-1]) for r in rows]  # (float raises on anything but a number)
    assert len(marginal) == 4
    assert lines[-1].startswith("gen llama --layers 2 (") and "peak memory" in lines[-1]


def test_ranks_benchmark_prints_one_row_per_mesh_and_the_ratios():
    done = _run("ranks.py", "--ranks", "64", "256", "--repeat", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["ranks", "seconds", "us/rank"]
    assert [line.split()[0] for line in lines[1:3]] == ["64", "256"]
    assert lines[3].startswith("time(256)/time(64): ") and "ranks ratio 4.00" in lines[3]


def test_megatron_estimate_benchmark_prints_every_row_without_pipelines():
    done = _run("estimate_megatron.py", "--fit", "none", "--layers", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("published: Narayanan et al., SC'21") and "capped at 2 layers" in lines[0]
    rows = [line.split() for line in lines[2:6]]
    assert [r[0] for r in rows] == ["1.7B", "3.6B", "7.5B", "18.4B"]
    assert all(float(r[6]) > 0 for r in rows)  # the predicted column
    assert lines[-1].startswith("largest error on the rows not fitted: ")


def test_published_benchmark_is_the_calibration_the_commands_state():
    """benchmarks/published.py prices every published row; its summary is the model error estimate and plan
    --search print (layout_prop/perf/calibration.py): a model change that moves it must update the constant."""
    from layout_prop.perf.calibration import CALIBRATION

    done = _run("published.py")
    assert done.returncode == 0, done.stderr
    summary = next(line for line in done.stdout.splitlines() if " rows: mean absolute error " in line)
    found = re.fullmatch(r"(\d+) rows: mean absolute error ([\d.]+)%, max ([\d.]+)%, mean signed error ([-+][\d.]+)%; "
                         r"(\d+) of (\d+) fit their device in the model", summary)
    assert found, summary
    rows, mae, worst, signed = int(found[1]), float(found[2]), float(found[3]), float(found[4])
    assert rows == CALIBRATION.rows
    assert (mae, worst, signed) == pytest.approx((100 * CALIBRATION.mae, 100 * CALIBRATION.max_error,
                                                  100 * CALIBRATION.signed), abs=0.1)
    assert done.stdout.count("Narayanan et al. SC'21") == 10 and done.stdout.count("mindformers") + \
        done.stdout.count("MindFormers") == 4
