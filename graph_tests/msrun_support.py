"""Helpers of the msrun tests: find every process of a run by an environment tag, kill one worker.

Every process msrun starts inherits the launcher's environment, whatever session or
process group it makes for itself, so a random tag set in the environment before a run
finds them all (msrun, its scheduler, its workers, anything they start), even after
their parents died.  Zombies are dead and not counted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

TAG_ENV = "LAYOUT_PROP_TEST_TAG"
WORKER_MODULE = b"layout_prop.engines.msrun_worker"


def new_tag() -> str:
    return uuid.uuid4().hex


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def is_alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] not in "ZX"


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries ``TAG_ENV=tag`` (this test process excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if environ(pid).get(TAG_ENV) == tag and is_alive(pid):
                found.append(pid)
    return found


def wait_until_none_left(tag: str, limit: float = 3.0) -> list[int]:
    """The tagged processes still alive after waiting up to ``limit`` seconds for them to end."""
    deadline = time.monotonic() + limit
    while True:
        left = tagged_processes(tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def worker_pid(tag: str, rank: int) -> int | None:
    """The pid of the running msrun worker of ``rank`` (started Python, MS_ROLE=MS_WORKER)."""
    for pid in tagged_processes(tag):
        env = environ(pid)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if env.get("MS_ROLE") == "MS_WORKER" and env.get("RANK_ID") == str(rank) and argv[1:3] == [b"-m",
                                                                                                     WORKER_MODULE]:
            return pid
    return None


class WorkerKiller(threading.Thread):
    """Kills the worker of ``rank`` with SIGKILL once ``ready()`` holds after it started (then ``delay`` s).

    ``killed_at`` is the ``time.monotonic()`` of the kill (None if the worker never appeared).
    """

    def __init__(self, tag: str, rank: int, delay: float = 0.0, ready=lambda: True, limit: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.tag, self.rank, self.delay, self.ready, self.limit = tag, rank, delay, ready, limit
        self.killed_at: float | None = None
        self.pid: int | None = None

    def run(self) -> None:
        deadline = time.monotonic() + self.limit
        while time.monotonic() < deadline:
            pid = worker_pid(self.tag, self.rank)
            if pid is not None and self.ready():
                time.sleep(self.delay)
                os.kill(pid, signal.SIGKILL)
                self.pid, self.killed_at = pid, time.monotonic()
                return
            time.sleep(0.05)
