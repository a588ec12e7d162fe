"""Watching an msrun run's processes: which worker is which rank, and which died first, how.

:class:`RunWatch` finds msrun's scheduler and workers among its children in ``/proc``
(:mod:`.procfs`; a worker's rank is the ``RANK_ID`` msrun gives it) and, on every poll of the
engine, says what went wrong first (:meth:`RunWatch.failure`): a worker killed by a signal,
a rank's error record (:func:`read_errors`), a worker's exit code, or the scheduler's end,
with the last error line of the worker logs (:func:`log_hint`).
"""

from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layout_prop.core.errors import one_line

from . import msrun_worker as worker
from .msrun_signals import describe_status
from .procfs import parents, proc_cmdline, proc_environ, proc_stat

__all__ = ["Child", "RunWatch", "read_errors", "log_hint"]

#: A worker that vanished (msrun reaped it) without a result gets this long for msrun's log line.
_VANISHED_GRACE_SECONDS = 1.0
_WORKER_MODULE = b"layout_prop.engines.msrun_worker"
_WORKER_DEATH = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


@dataclass
class Child:
    """A process msrun started: a worker of a rank, or the scheduler."""

    pid: int
    start: str  # /proc start time: a reused pid is not this process
    role: str  # "worker" or "scheduler"
    rank: int | None


class RunWatch:
    """Finds msrun's scheduler and workers and notices, within a poll, when one of them dies.

    A worker's rank is the ``RANK_ID`` msrun puts in its environment (read once it has
    started Python: its command line then differs from msrun's).  A dead worker stays a
    zombie until msrun's next poll (once a second), so its wait status is read from
    ``/proc/PID/stat``; if msrun reaped it first, from msrun's own log line, which also
    reveals a worker that died before it could be seen running Python (its rank is then
    the one rank not seen, if only one is missing).
    """

    def __init__(self, msrun_pid: int, run: Path, ranks: list[int], launched: float) -> None:
        self.msrun_pid = msrun_pid
        self.run = run
        self.ranks = list(ranks)
        self.workers = len(ranks)
        self.launched = launched
        self.children: dict[int, Child] = {}
        self.ended: dict[int, int | None] = {}  # pid -> wait status (None: not known)
        self._vanished: dict[int, float] = {}

    def live_pids(self) -> set[int]:
        alive = set()
        for pid, child in self.children.items():
            fields = proc_stat(pid)
            if fields is not None and fields[19] == child.start and fields[0] not in "ZX":
                alive.add(pid)
        return alive

    def _discover(self) -> None:
        if sum(c.role == "worker" for c in self.children.values()) >= self.workers:
            return
        msrun_cmdline = proc_cmdline(self.msrun_pid)
        for pid, parent in parents().items():
            if parent != self.msrun_pid or pid in self.children:
                continue
            cmdline, fields = proc_cmdline(pid), proc_stat(pid)
            if fields is None or not cmdline or cmdline == msrun_cmdline:
                continue  # gone, or forked but not yet running Python: its environment is not final
            if _WORKER_MODULE not in cmdline.split(b"\0"):
                continue  # a helper msrun runs (not ours to watch; killed with the rest at the end)
            env = proc_environ(pid)
            roles = {"MS_WORKER": "worker", "MS_SCHED": "scheduler"}
            if env.get("MS_ROLE") not in roles:
                continue
            role = roles[env["MS_ROLE"]]
            rank_id = env.get("RANK_ID", "")
            rank = int(rank_id) if role == "worker" and rank_id.isdigit() else None
            self.children[pid] = Child(pid, fields[19], role, rank)

    def _msrun_log_deaths(self) -> dict[int, int]:
        """``{pid: wait status}`` of the workers msrun logged as failed."""
        try:
            text = (self.run / "msrun.log").read_text(errors="replace")
        except OSError:
            return {}
        deaths = {}
        for match in _WORKER_DEATH.finditer(text):
            code = int(match.group(2))
            deaths[int(match.group(1))] = -code if code < 0 else code << 8  # as a wait status
        return deaths

    def _msrun_log_status(self, pid: int) -> int | None:
        return self._msrun_log_deaths().get(pid)

    def _unseen_deaths(self) -> list[tuple[Child, int | None]]:
        """Workers msrun logged as failed that were never seen running Python."""
        deaths = []
        for pid, status in self._msrun_log_deaths().items():
            if pid in self.children:
                continue
            seen = {c.rank for c in self.children.values() if c.role == "worker"}
            unseen = [r for r in self.ranks if r not in seen]
            child = Child(pid, "", "worker", unseen[0] if len(unseen) == 1 else None)
            self.children[pid] = child
            self.ended[pid] = status
            deaths.append((child, status))
        return deaths

    def _poll_deaths(self) -> list[tuple[Child, int | None]]:
        deaths = []
        now = time.monotonic()
        for pid, child in self.children.items():
            if pid in self.ended:
                continue
            fields = proc_stat(pid)
            if fields is not None and fields[19] == child.start:
                if fields[0] in "ZX":
                    self.ended[pid] = int(fields[-1])  # a zombie's exit_code field: its wait status
                    deaths.append((child, self.ended[pid]))
                continue
            status = self._msrun_log_status(pid)  # reaped by msrun already
            if status is None and child.rank is not None and (worker.done_path(self.run, child.rank).exists()
                                                               or worker.result_info_path(self.run, child.rank).exists()):
                status = 0
            if status is None and child.role == "scheduler":
                status = 0  # msrun logs a scheduler's failure only once every worker has ended: judged by them
            if status is None and now - self._vanished.setdefault(pid, now) < _VANISHED_GRACE_SECONDS:
                continue
            self.ended[pid] = status
            deaths.append((child, status))
        return deaths + self._unseen_deaths()

    def failure(self) -> str | None:
        """What went wrong first, in words, or None while all is well.

        The error files are read before the processes: a rank that fails because another
        died writes its error after that death, so the death is seen in the same poll, and
        a death by a signal is blamed before errors and exit codes seen with it.
        """
        errors = read_errors(self.run)
        self._discover()
        deaths = [(c, s) for c, s in self._poll_deaths() if s != 0]
        seconds = time.monotonic() - self.launched
        by_signal = sorted((c.rank if c.rank is not None else -1, c.pid, c, s) for c, s in deaths
                           if c.role == "worker" and s is not None and s & 0x7F)
        # The worker msrun logged as failed first: msrun logs the first dead worker it finds,
        # then SIGKILLs every other one, so on a loaded machine one poll can see the victims'
        # SIGKILLs next to the death that caused them.  Then an outside kill (SIGKILL,
        # SIGTERM, ...) before a rank's own abort seen in the same poll.
        first_logged = self._msrun_log_deaths() if len(by_signal) > 1 else {}
        by_signal.sort(key=lambda item: (item[1] not in first_logged,
                                         item[3] & 0x7F not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)))
        others = sorted({c.rank for c, _ in deaths if c.rank is not None}
                        | {e.get("rank") for e in errors if isinstance(e.get("rank"), int)})
        if by_signal:
            _, pid, child, status = by_signal[0]
            text = f"{_who(child)} {describe_status(status)} {seconds:.1f} s after the launch"
            return text + _also(others, child.rank)
        if errors:
            first = min(errors, key=lambda e: (e.get("time", 0.0), str(e.get("rank"))))
            text = f"rank {first.get('rank')} failed at {first.get('op')}: {one_line(first.get('message', ''))}"
            return text + _also(others, first.get("rank"))
        worker_deaths = sorted(((c.rank if c.rank is not None else -1, c.pid, s) for c, s in deaths
                                if c.role == "worker"))
        if worker_deaths:
            rank, pid, status = worker_deaths[0]
            text = f"{_who(self.children[pid])} {describe_status(status)}{log_hint(self.run)}"
            return text + _also(others, rank)
        for child, status in deaths:
            return f"msrun's scheduler (pid {child.pid}) {describe_status(status)}{log_hint(self.run)}"
        return None


def _who(child: Child) -> str:
    if child.rank is None:
        return f"a worker (pid {child.pid}; its rank is not known: it died before it started Python)"
    return f"rank {child.rank} (pid {child.pid})"


def _also(ranks: list[int], blamed: Any) -> str:
    rest = [r for r in ranks if r != blamed]
    return f" (ranks {', '.join(map(str, rest))} ended too)" if rest else ""


def read_errors(run: Path) -> list[dict]:
    """Every rank's error record in the run folder (``rank*.error.json``), an unreadable one named as such."""
    errors = []
    for path in sorted(run.glob("rank*.error.json")):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            errors.append({"rank": path.name.split(".")[0][4:], "op": "?", "message": f"unreadable {path.name}"})
    return errors


def log_hint(run: Path) -> str:
    """The last error-looking line of the worker logs, as ``: <line>`` (or nothing)."""
    for log in sorted((run / "logs").glob("*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if "Error" in line and not line.startswith("[WARNING]"):
                return f" ({log.name}: {one_line(line)[:300]})"
    return ""
