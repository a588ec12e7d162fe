"""Session-wide guards for the test suite, and the ``fast`` marker of the inner loop (``pytest -m fast``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def _mindspore_mode():
    """MindSpore's execution mode, or None when no test has imported MindSpore yet."""
    mindspore = sys.modules.get("mindspore")
    return None if mindspore is None else mindspore.get_context("mode")


@pytest.fixture(scope="module", autouse=True)
def _mindspore_mode_is_restored(request):
    """A module that changes MindSpore's global mode must set it back.

    A leaked GRAPH_MODE made later modules' ``mindspore.grad`` compile the RPE kernels'
    shape checks (which raise ``OpError``, a type MindSpore's graph parser refuses): the
    failure showed up far from its cause, and only in the whole suite.
    """
    before = _mindspore_mode()
    yield
    after = _mindspore_mode()
    if before is None:
        before = 1  # MindSpore's default, PYNATIVE_MODE
    if after is not None and after != before:
        mindspore = sys.modules["mindspore"]
        mindspore.set_context(mode=before)
        pytest.fail(f"{request.module.__name__} left MindSpore's mode at {after} (was {before}); "
                    "set it inside a context manager that restores it", pytrace=False)


# --------------------------------------------------------------------------- the fast subset
#: per-test times recorded from one whole-suite run (``python benchmarks/suite.py --record``): CPU seconds of
#: each test and the processes it waited for (setup and teardown included), and the threshold of the subset
DURATIONS = Path(__file__).with_name("durations.json")
#: a test file's cheapest test joins the subset when it is at most this (every file, so every package, is
#: exercised by the inner loop)
FILE_CAP_SECONDS = 3.0
#: a test that took longer than this on the clock is never fast, whatever its CPU time: it waits (a timeout,
#: a sleep, a worker process it does not reap itself)
WALL_CAP_SECONDS = 20.0


def recorded_durations(path: Path = DURATIONS) -> tuple[float, dict[str, float], dict[str, float]]:
    """The threshold, ``{test node id: CPU seconds}`` and ``{test node id: wall seconds}`` as recorded;
    ``(0.0, {}, {})`` when there is no record."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return 0.0, {}, {}
    return float(data["fast_seconds"]), data["cpu_seconds"], data["wall_seconds"]


def fast_tests(threshold: float, cpu: dict[str, float], wall: dict[str, float],
               file_cap: float = FILE_CAP_SECONDS, wall_cap: float = WALL_CAP_SECONDS) -> set[str]:
    """The fast subset: every test recorded at most ``threshold`` CPU seconds, and each file's cheapest test
    when it is at most ``file_cap``; never a test over ``wall_cap`` seconds on the clock.

    >>> cpu = {"a.py::x": 0.05, "a.py::y": 0.5, "b.py::z": 2.0, "c.py::w": 9.0, "d.py::v": 0.01}
    >>> sorted(fast_tests(0.1, cpu, {**cpu, "d.py::v": 30.0}))
    ['a.py::x', 'b.py::z']
    """
    cheapest: dict[str, tuple[float, str]] = {}
    for name, s in cpu.items():
        path = name.split("::", 1)[0]
        if path not in cheapest or (s, name) < cheapest[path]:
            cheapest[path] = (s, name)
    chosen = {name for name, s in cpu.items() if s <= threshold}
    chosen.update(name for s, name in cheapest.values() if s <= file_cap)
    return {name for name in chosen if wall.get(name, 0.0) <= wall_cap}


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the inner loop, about 2 minutes on 2 cores (pytest -m fast): the "
                            "tests graph_tests/durations.json records as cheap")


def pytest_collection_modifyitems(config, items):
    """Mark ``fast`` the tests :func:`fast_tests` picks from the record.  A test with no record (new, or
    renamed: a parameter's id changed) is not fast until the next recording, so the subset's time stays
    bounded as tests are added; ``benchmarks/suite.py`` counts the tests that wait for a recording."""
    fast = fast_tests(*recorded_durations())
    for item in items:
        if item.nodeid in fast:
            item.add_marker(pytest.mark.fast)


def pytest_report_header(config):
    if config.getoption("markexpr", "") == "fast":
        return ("fast subset: the tests graph_tests/durations.json records as cheap; tests not yet recorded run "
                "in the whole suite only (python benchmarks/suite.py --record)")
    return []
