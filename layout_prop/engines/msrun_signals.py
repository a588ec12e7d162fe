"""Signals and process-group cleanup of an msrun run: how the launcher ends a run it started.

- While a run goes, SIGTERM and SIGHUP become :class:`Terminated` in the main thread
  (:func:`signals_end_the_run`; a signal the caller ignores stays ignored), so the launcher
  kills the run and then ends by the same signal (:func:`end_like_the_signal`).
- :func:`kill_run` SIGKILLs msrun's process group, every process below msrun, the workers
  the watch saw and those the run folder's pid files name, each by id (a worker runs in its
  own session), with SIGTERM, SIGHUP and SIGINT blocked meanwhile, and waits until they are
  gone.
- :func:`describe_status` and :func:`signal_name` say a wait status or a signal in words.

>>> describe_status(9), describe_status(3 << 8), signal_name(15)
('was killed by SIGKILL (signal 9)', 'exited with code 3', 'SIGTERM')
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .procfs import descendants, proc_cmdline, proc_stat

__all__ = ["Terminated", "STOP_SIGNALS", "signals_end_the_run", "end_like_the_signal", "signal_name",
           "describe_status", "kill_run", "pid_file_workers"]


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM or SIGHUP while a run is going."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that end a run (Ctrl-C's SIGINT is Python's KeyboardInterrupt already)."""


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_status(status: int | None) -> str:
    """A wait status (as ``waitpid`` gives it) in words."""
    if status is None:
        return "ended without a result (its exit status was not seen)"
    if status & 0x7F:
        return f"was killed by {signal_name(status & 0x7F)} (signal {status & 0x7F})"
    return f"exited with code {(status >> 8) & 0xFF}"


@contextmanager
def signals_end_the_run() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into :class:`Terminated` (main thread only; ignored signals stay ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def stop(signum, frame):
        raise Terminated(signum)

    for signum in STOP_SIGNALS:
        handler = signal.getsignal(signum)
        if handler is signal.SIG_IGN:
            continue  # nohup and friends: keep ignoring
        previous[signum] = handler
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def end_like_the_signal(signum: int, run: str) -> None:
    """After the run is killed: say so in one line and end by the same signal (its previous handler now)."""
    print(f"layout-prop: {signal_name(signum)} received: every process of the msrun run was killed; "
          f"run folder {run}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signum)


def kill_run(process: subprocess.Popen, run: Path, live_pids: Callable[[], set[int]]) -> None:
    """SIGKILL msrun, its scheduler, every worker and their children, each by id; wait until they are gone.

    Parameters
    ----------
    process : subprocess.Popen
        msrun (through the guard), the leader of its own session and process group.
    run : Path
        The run folder, whose ``pids/`` name the workers (:func:`pid_file_workers`).
    live_pids : callable
        The workers and scheduler the watch saw that still run, asked once signals are blocked.
    """
    blocked = _block_signals()
    try:
        pids = descendants(process.pid) | live_pids() | pid_file_workers(run)
        _signal_group(process.pid)  # msrun and its scheduler (msrun's session and group)
        for pid in pids:
            _signal_group(pid, only_if_leader=True)  # a worker's own session and group
            _signal_pid(pid)
        process.wait()
        _wait_until_gone(pids, 5.0)
    finally:
        _unblock_signals(blocked)


def pid_file_workers(run: Path) -> set[int]:
    """Workers named by their pid files that are still workers of this run (their command line names it)."""
    pids = set()
    for pid_file in (run / "pids").glob("*.pid"):
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        cmdline = proc_cmdline(pid)
        if cmdline and str(run).encode() in cmdline.split(b"\0"):
            pids.add(pid)
    return pids


def _signal_group(pid: int, only_if_leader: bool = False) -> None:
    try:
        if not only_if_leader or os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_until_gone(pids: set[int], limit: float) -> None:
    """Wait (at most ``limit`` seconds) until every pid is dead (gone or a zombie)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all((fields := proc_stat(pid)) is None or fields[0] in "ZX" for pid in pids):
            return
        time.sleep(0.02)


def _block_signals() -> set | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGINT})


def _unblock_signals(previous: set | None) -> None:
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
