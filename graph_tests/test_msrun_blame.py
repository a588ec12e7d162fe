"""Which dead worker the msrun engine blames, when one poll sees several deaths (no msrun run).

msrun logs the first failed worker it finds, then SIGKILLs every other worker; on a loaded
machine a single poll of the launcher can see those SIGKILLs next to the death that caused
them (seen in CI: rank 2 killed, rank 1 blamed).
"""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("mindspore")

from layout_prop.engines.msrun_watch import Child, RunWatch  # noqa: E402

PIDS = {1: 4101, 2: 4102, 4: 4104}  # rank -> pid of a worker that is not running


def watch_seeing(tmp_path, statuses: dict[int, int], msrun_log: str) -> RunWatch:
    """A watch of 8 ranks whose next poll finds the workers of ``statuses`` (rank -> wait status) dead."""
    (tmp_path / "msrun.log").write_text(msrun_log)
    watch = RunWatch(msrun_pid=-1, run=tmp_path, ranks=list(range(8)), launched=time.monotonic())
    children = {rank: Child(PIDS[rank], "1", "worker", rank) for rank in statuses}
    watch.children = {child.pid: child for child in children.values()}
    watch._discover = lambda: None
    watch._poll_deaths = lambda: [(children[rank], status) for rank, status in statuses.items()]
    return watch


def test_the_worker_msrun_logged_first_is_blamed_not_the_lowest_rank(tmp_path):
    log = (f"[ERROR] Worker process {PIDS[2]} exit with exception. Error code: -9.\n"
           "[WARNING] There's worker exits with exception, kill all other workers.\n")
    watch = watch_seeing(tmp_path, {1: signal.SIGKILL, 2: signal.SIGKILL, 4: signal.SIGKILL}, log)
    text = watch.failure()
    assert text.startswith(f"rank 2 (pid {PIDS[2]}) was killed by SIGKILL (signal 9) "), text
    assert text.endswith("(ranks 1, 4 ended too)"), text


def test_without_msruns_line_an_outside_kill_comes_before_an_abort(tmp_path):
    abort = 1 << 8  # exit status 1, no signal
    watch = watch_seeing(tmp_path, {1: signal.SIGABRT, 4: signal.SIGKILL, 2: abort}, "")
    text = watch.failure()
    assert text.startswith(f"rank 4 (pid {PIDS[4]}) was killed by SIGKILL (signal 9) "), text
