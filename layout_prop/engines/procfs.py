"""What Linux's ``/proc`` says of a process: its ``stat`` fields, environment, command line,
start time, the parent links of every process, and the boot id.

The msrun launcher reads these to find msrun's workers (:mod:`.msrun_watch`), to kill a run's
whole process tree (:mod:`.msrun_signals`) and to tell a dead launcher from a live one
(:mod:`.msrun_run_folders`).  Every reader returns an empty answer (None, ``{}``) for a
process that is gone or unreadable, and never raises.

>>> import os
>>> proc_stat(os.getpid())[0] in "RSD"  # this process's state: running, sleeping or in disk wait
True
>>> start_time(os.getpid()) == start_time(os.getpid())
True
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["proc_stat", "proc_environ", "proc_cmdline", "parents", "descendants", "start_time", "boot_id"]


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def proc_environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with (``/proc/PID/environ``), or ``{}`` if unreadable."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def proc_cmdline(pid: int) -> bytes | None:
    """``/proc/PID/cmdline`` (arguments separated by NUL bytes), or None if unreadable."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if fields is not None and len(fields) > 1:
                found[int(entry.name)] = int(fields[1])
    return found


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children, ...), by parent links in /proc."""
    children: dict[int, list[int]] = {}
    for child, parent in parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field 22), or None."""
    fields = proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def boot_id() -> str | None:
    """This boot's random id (``/proc/sys/kernel/random/boot_id``), or None where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None
