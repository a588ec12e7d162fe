"""Run folders of the msrun launcher: where they may be made, how they are made, and which are stale.

- :func:`check_runs_root` refuses a folder to make run folders in that another user could
  tamper with (:func:`runs_root` is that folder, the system temp folder by default).
- :func:`new_run_folder` makes a private ``layout-prop-run-<timestamp>-<random>`` folder
  (mode 0700) there, recording its launcher in :data:`LAUNCHER_FILE`.
- :func:`remove_stale_runs` removes the folders whose launcher died without ending its run
  (SIGKILL, the OOM killer, a power cut): stale-run detection, by the launcher's pid, start
  time and boot id (:mod:`.procfs`).  :func:`forget_launcher` is what a launcher that ends
  its run itself does, so that a failed run's folder, kept for the user, is never stale.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterable

from layout_prop.core.errors import ExecutionError

from . import msrun_worker as worker
from .procfs import boot_id, start_time

__all__ = ["RUN_PREFIX", "LAUNCHER_FILE", "check_runs_root", "runs_root", "new_run_folder", "forget_launcher",
           "remove_stale_runs"]

RUN_PREFIX = "layout-prop-run-"
"""Run folders are ``<system temp dir or run_dir>/layout-prop-run-<timestamp>-<random>``."""

LAUNCHER_FILE = "launcher.json"
"""In a run folder while its launcher runs: the launcher's pid, start time and boot id.  The
launcher removes it whenever it ends a run itself (success, failure, a signal); a folder
that still has it after its launcher died (SIGKILL, the OOM killer, a power cut) is stale,
and the next run of the same user in the same runs root removes it
(:func:`remove_stale_runs`)."""


def check_runs_root(root: Path, user_given: bool = True) -> None:
    """Refuse a folder to make run folders in that another user could tamper with.

    A folder given by the user must be a real folder (not a symbolic link), owned by this
    user, and not writable by group or others.  The system temp folder (``user_given``
    False) may be owned by root and writable by all if it has the sticky bit, as ``/tmp``
    has: :func:`tempfile.mkdtemp` then makes a folder there that only we can use.  Either
    way, no folder above it may let another user move it and put theirs in its place
    (:func:`_unsafe_ancestor`: owned by this user or root, writable by others only with
    the sticky bit), as ssh's StrictModes requires of the folders above ``~/.ssh``.  The
    workers do not repeat this: they check their own run folder (ours, mode 0700) and the
    job's HMAC, which another user cannot forge.

    Raises
    ------
    ExecutionError
        ``unsafe-run-dir`` naming the folder, its owner or mode; ``run-folder-failed`` if
        it cannot be read.
    """
    try:
        info = os.lstat(root)
    except OSError as exc:
        raise ExecutionError("run-folder-failed", f"cannot use {str(root)!r} for run folders: {exc.strerror}",
                             hint="give a folder that exists, or set TMPDIR") from None
    mode = stat.S_IMODE(info.st_mode)
    others_write = bool(mode & 0o022)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif user_given and info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif user_given and others_write:
        problem = f"has mode {mode:o}: group or others can write to it"
    elif not user_given and info.st_uid not in (os.geteuid(), 0):
        problem = f"is owned by uid {info.st_uid}, neither this user nor root"
    elif not user_given and others_write and not mode & stat.S_ISVTX:
        problem = f"has mode {mode:o}: others can write to it and it has no sticky bit"
    if problem:
        raise ExecutionError("unsafe-run-dir", f"refusing to make run folders in {str(root)!r}: it {problem}",
                             hint="use a private folder of yours (chmod 700), or the default temp folder")
    problem = _unsafe_ancestor(root)
    if problem:
        raise ExecutionError("unsafe-run-dir", f"refusing to make run folders in {str(root)!r}: {problem}, so "
                             "others could move it and put their own folder in its place",
                             hint="use a folder whose every parent is owned by you or root and writable by others "
                             "only with the sticky bit (as /tmp), or the default temp folder")


def runs_root(user_root: Path | None) -> Path:
    """The checked folder to make run folders in: ``user_root`` (made, mode 0700, if missing) or
    the system temp folder (:func:`check_runs_root`)."""
    if user_root is None:
        root = Path(os.path.realpath(tempfile.gettempdir()))
        check_runs_root(root, user_given=False)
        return root
    if not os.path.lexists(user_root):
        try:
            user_root.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            raise ExecutionError("run-folder-failed", f"cannot create {str(user_root)!r}: {exc.strerror}",
                                 hint="give a folder that exists and is writable") from None
    check_runs_root(user_root, user_given=True)
    return user_root


def new_run_folder(root: Path) -> Path:
    """A new private run folder in ``root`` recording this launcher, after removing the stale ones.

    Raises
    ------
    ExecutionError
        ``run-folder-failed`` if it cannot be made or written (it is then removed).
    """
    remove_stale_runs(root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        run = Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{stamp}-", dir=root))  # new, random, mode 0700
    except OSError as exc:
        raise ExecutionError("run-folder-failed", f"cannot create a run folder in {str(root)!r}: {exc.strerror}",
                             hint="set TMPDIR to a writable folder with free space") from None
    worker.check_private_folder(run)
    try:
        _write_launcher_file(run)
    except OSError as exc:
        shutil.rmtree(run, ignore_errors=True)
        raise ExecutionError("run-folder-failed", f"cannot write the run folder {str(run)!r}: "
                             f"{exc.strerror or exc} (removed it)",
                             hint="free some space, or set TMPDIR to a writable folder with free space") from None
    return run


def _write_launcher_file(run: Path) -> None:
    """Record this launcher in its new run folder (a new file of ours, never a followed link)."""
    record = {"pid": os.getpid(), "start": start_time(os.getpid()), "boot": boot_id()}
    fd = os.open(run / LAUNCHER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)


def forget_launcher(runs: Iterable[Path]) -> None:
    """Remove the launcher record of each run folder: this launcher ended the run itself."""
    for run in runs:
        try:
            (run / LAUNCHER_FILE).unlink()
        except OSError:
            pass


def _launcher_alive(record: dict) -> bool:
    """Whether the launcher a run folder records still runs (the same boot, pid and start time)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True  # not a record we wrote: keep the folder
    boot = boot_id()
    if record.get("boot") and boot and record["boot"] != boot:
        return False  # the machine restarted since
    if Path("/proc/self/stat").exists():
        start = start_time(pid)
        return start is not None and (record.get("start") is None or start == record["start"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_runs(root: Path) -> list[Path]:
    """Remove the run folders in ``root`` whose launcher died without ending its run (SIGKILL).

    Only folders that are clearly ours are touched: named ``layout-prop-run-*``, a real
    folder (not a link) owned by this user with mode 0700 (as :func:`tempfile.mkdtemp`
    makes it), holding :data:`LAUNCHER_FILE` (a regular file of ours) that names a launcher
    that no longer runs.  A folder kept by a failed run has no such file and stays, as does
    every folder of another user or of a launcher still running.  Returns what was removed;
    never raises.
    """
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    me = os.geteuid()
    for entry in entries:
        if not entry.name.startswith(RUN_PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != me or stat.S_IMODE(info.st_mode) & 0o077:
                continue
            fd = os.open(os.path.join(entry.path, LAUNCHER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                marker = os.fstat(fd)
                if not stat.S_ISREG(marker.st_mode) or marker.st_uid != me:
                    continue
                record = json.loads(os.read(fd, 4096) or b"{}")
            finally:
                os.close(fd)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and not _launcher_alive(record):
            shutil.rmtree(entry.path, ignore_errors=True)  # never follows links inside (fd-based on Linux)
            removed.append(Path(entry.path))
    return removed


def _unsafe_ancestor(root: Path) -> str | None:
    """Why a folder above ``root`` lets another user swap ``root`` (None if none does), as ssh's
    StrictModes checks the folders above ``~/.ssh``.

    Every folder from ``/`` down to ``root``'s parent (the real folders, and every symbolic
    link on the way as written) must be owned by this user or root; a folder may be writable
    by others only with the sticky bit (``/tmp``), and by its group only with the sticky bit
    or when the group is this user's own (a user private group).
    """
    me = os.geteuid()
    absolute = Path(os.path.abspath(root))
    for link in absolute.parents:  # a link on the way: only its folder's owner could have made it, or anyone in /tmp
        try:
            info = os.lstat(link)
        except OSError:
            continue
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (me, 0):
            return f"the symbolic link {str(link)!r} above it belongs to uid {info.st_uid}"
    real = Path(os.path.realpath(absolute.parent))
    for folder in (real, *real.parents):
        try:
            info = os.stat(folder)
        except OSError as exc:
            return f"the folder {str(folder)!r} above it cannot be read ({exc.strerror})"
        mode = stat.S_IMODE(info.st_mode)
        sticky = bool(mode & stat.S_ISVTX)
        if info.st_uid not in (me, 0):
            return f"the folder {str(folder)!r} above it belongs to uid {info.st_uid}"
        if mode & stat.S_IWOTH and not sticky:
            return f"the folder {str(folder)!r} above it has mode {mode:o}: others can write to it (no sticky bit)"
        if mode & stat.S_IWGRP and not sticky and info.st_gid != os.getegid():
            return (f"the folder {str(folder)!r} above it has mode {mode:o}: group {info.st_gid} can write to it "
                    "(no sticky bit)")
    return None
