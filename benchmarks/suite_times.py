"""A pytest plugin (``-p suite_times``, benchmarks/ on the path) that logs each test's wall and CPU seconds.

``benchmarks/suite.py --record`` loads it: each test's line (node id, wall seconds, CPU seconds of the test
and of the processes it waited for, setup and teardown included) is appended, as the test ends, to
``times-<xdist worker>.tsv`` in the folder ``$LAYOUT_PROP_SUITE_TIMES`` names, so a run stopped early still
leaves the times of the tests it ran.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

#: the environment variable naming the folder of the logs
LOG_ENV = "LAYOUT_PROP_SUITE_TIMES"


def cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.environ.get(LOG_ENV)
    wall, cpu = time.perf_counter(), cpu_seconds()
    yield
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"times-{worker}.tsv", "a") as log:
            log.write(f"{item.nodeid}\t{time.perf_counter() - wall:.4f}\t{cpu_seconds() - cpu:.4f}\n")
