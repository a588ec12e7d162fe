"""benchmarks/suite.py's record of the test times and the fast subset it picks (no suite is run here)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_suite_benchmark_picks_the_fast_subset_within_its_budget(tmp_path):
    """benchmarks/suite.py --from-logs: the threshold is the largest whose subset (conftest.fast_tests: each
    file's cheapest test too, never a test that waited long) adds up to the budget."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import suite
    finally:
        sys.path.remove(str(BENCHMARKS))
    (tmp_path / "times-gw0.tsv").write_text(
        "graph_tests/a.py::x\t0.2\t0.1\ngraph_tests/a.py::y\t0.4\t0.3\ngraph_tests/b.py::z\t2.5\t2.0\n"
        "graph_tests/b.py::w\t3.5\t3.0\ngraph_tests/c.py::sleeps\t40.0\t0.01\nnot_a_test\t1\t1\n")
    cpu, wall = suite.read_logs(tmp_path)
    assert cpu == {"graph_tests/a.py::x": 0.1, "graph_tests/a.py::y": 0.3, "graph_tests/b.py::z": 2.0,
                   "graph_tests/b.py::w": 3.0, "graph_tests/c.py::sleeps": 0.01}
    fast_tests = suite._fast_tests()
    # budget 2.5: 0.1 + 0.3 + b's cheapest 2.0 = 2.4 at threshold 0.3; 2.0 would add nothing, 3.0 is over
    assert suite.choose_threshold(cpu, wall, 2.5) == 2.0
    assert fast_tests(2.0, cpu, wall) == {"graph_tests/a.py::x", "graph_tests/a.py::y", "graph_tests/b.py::z"}
    assert suite.choose_threshold(cpu, wall, 2.3) == 0.1  # 0.3 would make 2.4
    assert fast_tests(0.1, cpu, wall) == {"graph_tests/a.py::x", "graph_tests/b.py::z"}
