"""The MindSpore engine: run a lowered program on ``msrun`` workers, one process per rank.

:class:`MsrunEngine` is what ``layout-prop run SPEC --engine mindspore`` uses.  For each
:meth:`MsrunEngine.execute` it

1. checks the backend (``cann`` needs an Ascend device, and every rank's local shapes
   must pass the CANN kernel's constraints) before launching anything;
2. makes a private run folder with :func:`tempfile.mkdtemp` (mode 0700, a new random name
   each run) directly in the system temp folder, or in ``run_dir``, which must be a real
   folder owned by this user that nobody else can write to (:func:`check_runs_root`);
   it holds the job (pickled after its HMAC-SHA256 under a fresh secret that only reaches
   the workers through msrun's environment, :data:`~layout_prop.engines.msrun_worker.JOB_KEY_ENV`)
   and, per rank, the rank's local inputs as plain ``.npz`` (read without pickles), cut by
   :func:`layout_prop.engines.collectives.scatter_global` with the caller's random
   generator exactly as the simulator cuts them (so Partial inputs get the same random
   terms).  A folder that cannot be written (full or read-only filesystem) is removed and
   reported as ``run-folder-failed``;
3. starts ``msrun --worker_num=N --local_worker_num=N --master_port=P --join=True
   --tail_worker_log=-2 --log_dir=<run>/logs python -m layout_prop.engines.msrun_worker <run>``
   (N = mesh size, P a free port, the running interpreter first on ``PATH``, since msrun
   starts the ``python`` found there; ``--tail_worker_log=-2`` matches no rank, so msrun
   starts no ``tail -f``) through :mod:`layout_prop.engines.msrun_guard`, so that msrun,
   its scheduler and its workers are killed by the kernel if their parent dies;
4. watches every worker (found as msrun's children, their rank read from the
   ``RANK_ID`` msrun gives them) ten times a second: a worker that dies is named with its
   rank and its signal or exit code as soon as it dies, and the whole run is killed;
5. reads every rank's wanted outputs and timings back, and removes the run folder unless
   ``keep`` (failed runs are always kept, and their folder named in the error).

Several machines (``nodes``, ``node_rank``, ``master_addr``, ``master_port``,
``local_workers``): every node runs the same command; its launcher starts its own
``msrun --worker_num=N*W --local_worker_num=W --master_addr=HOST --node_rank=K`` in its own
private folder, and since no filesystem is shared, the workers send every rank's results to
every node over the collective backend (:func:`~layout_prop.engines.msrun_worker.share_results`),
where the node's first worker writes them; each node then compares on its own.  The
launchers watch each other over one TCP connection from every node to node 0's launcher, on
the master address at ``master_port + 1`` (:class:`_NodeLink`: a line a second each way, and
a last word, ``done`` or ``fail`` with the one-line error): a launcher killed, a node's run
failing, or a node silent for 6 s ends every other node within a poll or two, naming the node
(``node-lost``).  Node 0 checks first that ``master_addr`` is one of its own addresses
(:func:`check_master_addr`).
``emulate_nodes=N`` starts the N nodes' msruns from this one launcher on this machine
(master 127.0.0.1; the scheduler command of nodes other than 0 returns at once, as msrun
starts no scheduler on a real non-master node) and watches them all.

While it runs, SIGTERM and SIGHUP (and Ctrl-C) kill every process of the run before
``layout-prop`` ends with the same signal; a SIGKILL of ``layout-prop`` reaches msrun and
its workers through the parent-death signal.

Failures are typed :class:`~layout_prop.core.errors.ExecutionError`\\ s, one line each:
``engine-unavailable`` (no msrun), ``backend-unavailable`` (cann without Ascend),
``bad-timeout``, ``bad-nodes``, ``bad-node-rank``, ``bad-port``, ``too-many-workers`` (over
:data:`MAX_LOCAL_WORKERS` processes on this machine), ``port-in-use`` (a listener on the master
port or the link's, on node 0), ``bad-master-addr`` (not an address of node 0), ``node-lost``
(another node's launcher lost, or its run failed),
``unsafe-run-dir``, ``run-folder-failed``, ``engine-timeout`` (the
processes are killed; names the ranks that did not finish), ``worker-failed`` (the
failing rank, its op and error or its signal, the run folder).  The engine never waits
longer than the timeout (plus a few seconds to kill).

Examples
--------
>>> engine = MsrunEngine(timeout=60)
>>> engine.backend, engine.timeout, engine.keep
('mindspore', 60.0, False)
>>> MsrunEngine(backend="torch")
Traceback (most recent call last):
    ...
layout_prop.core.errors.ExecutionError: backend-unavailable: the mindspore engine has no kernel backend 'torch' (hint: use --backend mindspore, cann or numpy)
>>> MsrunEngine(timeout=float("inf"))
Traceback (most recent call last):
    ...
layout_prop.core.errors.ExecutionError: bad-timeout: the timeout must be a number of seconds in (0, 604800], got inf (hint: pass --timeout 300, for example)
"""

from __future__ import annotations

import errno
import ipaddress
import json
import math
import os
import re
import secrets
import selectors
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from layout_prop.core.errors import ExecutionError, LayoutPropError, cut, describe, printable
from layout_prop.io.progress import format_seconds

from . import msrun_worker as worker
from .collectives import scatter_global

__all__ = ["MsrunEngine", "node_map", "format_node_map", "MSRUN_DEFAULT_PORT", "RUN_PREFIX", "RPE_OPS", "BACKENDS", "MAX_TIMEOUT_SECONDS", "MAX_LOCAL_WORKERS", "LAUNCHER_FILE", "check_timeout", "remove_stale_runs",
           "check_runs_root", "check_cann_program", "check_kernels", "check_port_free", "check_master_addr",
           "local_addresses", "LINK_PORT_OFFSET"]

RUN_PREFIX = "layout-prop-run-"
"""Run folders are ``<system temp dir or run_dir>/layout-prop-run-<timestamp>-<random>``."""

LAUNCHER_FILE = "launcher.json"
"""In a run folder while its launcher runs: the launcher's pid, start time and boot id.  The
launcher removes it whenever it ends a run itself (success, failure, a signal); a folder
that still has it after its launcher died (SIGKILL, the OOM killer, a power cut) is stale,
and the next run of the same user in the same runs root removes it
(:func:`remove_stale_runs`)."""

RPE_OPS = ("rotary_position_embedding", "rotary_position_embedding_grad")

BACKENDS = ("mindspore", "cann", "numpy")
"""Kernel backends of the workers; ``numpy`` runs the numpy reference kernels in the
workers (MindSpore collectives, numpy kernels: separates collective from kernel problems)."""

MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
"""The longest timeout accepted (a week)."""

MAX_LOCAL_WORKERS = 256
"""The most msrun workers one launcher starts on its machine (every node's, when emulated):
one process per rank, each importing MindSpore (a few hundred MiB), so a 65,536-rank mesh
would otherwise start 65,536 processes.  An Ascend server holds 8 or 16 NPUs; larger meshes
span machines (``--nodes``), or run on the simulator."""

_POLL_SECONDS = 0.1
#: A worker that vanished (msrun reaped it) without a result gets this long for msrun's log line.
_VANISHED_GRACE_SECONDS = 1.0
_WORKER_MODULE = b"layout_prop.engines.msrun_worker"
_WORKER_DEATH = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
#: MindSpore's scheduler, when a node (worker) of the cluster stops sending heartbeats
_NODE_TIMED_OUT = re.compile(r"The node: \S+ is timed out[^\n]*")


def check_timeout(value: Any) -> float:
    """The timeout in seconds as a float: a number in (0, :data:`MAX_TIMEOUT_SECONDS`].

    Raises
    ------
    ExecutionError
        ``bad-timeout`` for anything else (nan, inf, zero, negative, not a number).

    >>> check_timeout("90")
    90.0
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_SECONDS):
        raise ExecutionError("bad-timeout", f"the timeout must be a number of seconds in "
                             f"(0, {MAX_TIMEOUT_SECONDS:.0f}], got {value}", hint="pass --timeout 300, for example")
    return seconds


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


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field 22), or None."""
    fields = _proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _write_launcher_file(run: Path) -> None:
    """Record this launcher in its new run folder (a new file of ours, never a followed link)."""
    record = {"pid": os.getpid(), "start": _start_time(os.getpid()), "boot": _boot_id()}
    fd = os.open(run / LAUNCHER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)


def _forget_launcher(runs) -> None:
    for node_run in runs:
        try:
            (node_run.run / LAUNCHER_FILE).unlink()
        except OSError:
            pass


def _launcher_alive(record: dict) -> bool:
    """Whether the launcher a run folder records still runs (the same boot, pid and start time)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True  # not a record we wrote: keep the folder
    boot = _boot_id()
    if record.get("boot") and boot and record["boot"] != boot:
        return False  # the machine restarted since
    if Path("/proc/self/stat").exists():
        start = _start_time(pid)
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


MSRUN_DEFAULT_PORT = 8118
"""msrun's own default ``--master_port``, used on real clusters when none is given."""


def node_map(mesh, nodes: int, local_workers: int) -> list[dict[str, Any]]:
    """Which ranks, and which mesh coordinates, each node holds (msrun's numbering).

    msrun gives node ``k`` the ranks ``k*W .. k*W + W - 1`` (W workers a node); ranks are
    row-major mesh coordinates, so the innermost mesh axes vary inside a node and their
    collectives stay on the node's own links.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> for entry in node_map(DeviceMesh((2, 2, 2), ("dp", "sp", "tp")), 2, 4):
    ...     print(entry)
    {'node': 0, 'ranks': [0, 1, 2, 3], 'coords': {'dp': [0], 'sp': [0, 1], 'tp': [0, 1]}}
    {'node': 1, 'ranks': [4, 5, 6, 7], 'coords': {'dp': [1], 'sp': [0, 1], 'tp': [0, 1]}}
    """
    entries = []
    for node in range(nodes):
        ranks = list(range(node * local_workers, (node + 1) * local_workers))
        coords = [np.unravel_index(rank, mesh.shape) for rank in ranks]
        entries.append({"node": node, "ranks": ranks,
                        "coords": {name: sorted({int(c[axis]) for c in coords}) for axis, name in enumerate(mesh.names)}})
    return entries


def format_node_map(entries: list[dict[str, Any]]) -> list[str]:
    """One line per node, e.g. ``node 1: ranks 4-7 (dp=1, sp=0..1, tp=0..1)``."""
    def span(values: list[int]) -> str:
        return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"

    return [f"node {e['node']}: ranks {e['ranks'][0]}-{e['ranks'][-1]} ("
            + ", ".join(f"{name}={span(values)}" for name, values in e["coords"].items()) + ")" for e in entries]


@dataclass
class _NodeRun:
    """One node's msrun: its private folder, its command, its process and watch once started."""

    node: int
    ranks: list[int]
    run: Path
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    watch: "_RunWatch | None" = None


#: what the report says of a run holding bfloat16 values (MindSpore's CPU MatMul, among others, takes no bfloat16)
BFLOAT16_NOTE = ("bfloat16 is computed in float32: the kernels take float32 copies and each output is rounded to "
                 "bfloat16 (nearest even), as the simulator does; its collectives move the bfloat16 bits (emulated)")


class MsrunEngine:
    """Executes a lowered :class:`~layout_prop.passes.lower.Program` on MindSpore ``msrun``.

    Parameters
    ----------
    backend : {'mindspore', 'cann', 'numpy'}
        The workers' kernel table: MindSpore ops on CPU (mccl), the CANN RPE kernel on
        Ascend (HCCL), or the numpy reference kernels on CPU (mccl collectives only).
    timeout : float
        Seconds before the run is killed (``engine-timeout``); see :func:`check_timeout`.
    run_dir : path, optional
        The folder in which each execution makes its own private run folder (default: the
        system temp folder); see :func:`check_runs_root`.
    keep : bool
        Keep the run folder (worker logs, inputs, results) after a successful run; a
        failed run's folder is always kept.
    nodes, node_rank : int
        Run as node ``node_rank`` of ``nodes`` machines (msrun's ``--node_rank``): the same
        command on every node; the mesh's ranks are laid out as :func:`node_map` says.
    master_addr : str, optional
        The host of msrun's scheduler (``--master_addr``); needed with ``nodes > 1``.
    master_port : int, optional
        Its port (default: a free one on one machine, msrun's 8118 across machines).
    local_workers : int, optional
        Workers a node (default: the mesh size over ``nodes``; ``nodes * local_workers``
        must be the mesh size).
    emulate_nodes : int, optional
        Start that many nodes on this machine, each through its own msrun (master
        127.0.0.1, a free port), as that many machines would: for tests.
    progress : callable, optional
        Called with a one-line state (``8 ranks: 8 joined, 3 done, 14s (timeout 5m
        00s)``) on every poll while msrun runs; the command line draws it on a terminal.
    """

    name = "mindspore"

    def __init__(self, backend: str = "mindspore", timeout: float = 300.0, run_dir: str | os.PathLike | None = None,
                 keep: bool = False, nodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                 master_port: int | None = None, local_workers: int | None = None,
                 emulate_nodes: int | None = None, progress: Callable[[str], None] | None = None) -> None:
        if backend not in BACKENDS:
            raise ExecutionError("backend-unavailable", f"the mindspore engine has no kernel backend {backend!r}",
                                 hint="use --backend mindspore, cann or numpy")
        self.backend = backend
        self.timeout = check_timeout(timeout)
        self.user_runs_root = Path(run_dir) if run_dir is not None else None
        self.keep = keep
        if emulate_nodes is not None:
            if nodes not in (1, emulate_nodes) or node_rank != 0 or master_addr is not None:
                raise ExecutionError("bad-nodes", "--emulate-nodes runs every node here: it takes no --nodes, "
                                     "--node-rank or --master-addr", hint="drop those, or drop --emulate-nodes")
            nodes = emulate_nodes
        if int(nodes) < 1:
            raise ExecutionError("bad-nodes", f"the node count must be at least 1, got {cut(nodes)}", hint="--nodes 2")
        if not 0 <= int(node_rank) < int(nodes):
            raise ExecutionError("bad-node-rank", f"--node-rank {cut(node_rank)} is not a node of {cut(nodes)} "
                                 f"(0 to {cut(int(nodes) - 1)})", hint="number the nodes 0, 1, ... nodes - 1")
        if nodes > 1 and emulate_nodes is None and not master_addr:
            raise ExecutionError("bad-nodes", f"{cut(nodes)} nodes need --master-addr (the host of msrun's scheduler)",
                                 hint="give the same --master-addr HOST on every node")
        linked = int(nodes) > 1 and emulate_nodes is None  # launchers on several machines: they watch each other
        if master_port is not None and not 1024 <= int(master_port) <= 65535 - linked:
            raise ExecutionError("bad-port", f"--master-port {cut(master_port)} is not in 1024..{65535 - linked}"
                                 + (" (the launchers' link takes the next port)" if linked else ""),
                                 hint="msrun's default is 8118")
        if local_workers is not None and int(local_workers) < 1:
            raise ExecutionError("bad-nodes", f"--local-workers must be at least 1, got {cut(local_workers)}",
                                 hint="the workers a node starts, e.g. 8")
        if linked and int(node_rank) == 0:
            check_master_addr(master_addr)  # node 0 runs msrun's scheduler there: before anything starts
        self.nodes = int(nodes)
        self.node_rank = int(node_rank)
        self.emulated = emulate_nodes is not None
        self.master_addr = "127.0.0.1" if self.emulated or not master_addr else master_addr
        self.master_port = master_port
        self.local_workers = local_workers
        self.run_dir: Path | None = None
        self.progress = progress
        self._link: _NodeLink | None = None
        self._extra: dict[str, Any] = {}

    # ------------------------------------------------------------------ public API
    def execute(self, program, global_inputs: dict[str, np.ndarray], rng: np.random.Generator | None = None,
                wanted: Sequence[str] | None = None) -> dict[str, list[np.ndarray]]:
        """Run ``program`` on one msrun worker per rank (this node's workers, or every node's if emulated).

        Parameters
        ----------
        program : layout_prop.passes.lower.Program
            The lowered program.
        global_inputs : dict of str to numpy.ndarray
            A global array for every graph input.
        rng : numpy.random.Generator, optional
            Randomises Partial inputs' terms (as the simulator does, same draws).
        wanted : sequence of str, optional
            The global values to bring back (default: the program's outputs).

        Returns
        -------
        dict of str to list of numpy.ndarray
            ``{value: [local array of rank 0, rank 1, ...]}`` for every wanted value (of
            every rank, on every node: the workers share them over the collective backend).

        Raises
        ------
        ExecutionError
            ``backend-unavailable``, ``kernel-constraint`` / ``no-backward-kernel`` (cann),
            ``no-kernel``, ``missing-input``, ``engine-unavailable``, ``bad-nodes``, ``bad-node-rank``,
            ``port-in-use``, ``unsafe-run-dir``, ``run-folder-failed``, ``engine-timeout``,
            ``worker-failed``, ``node-lost``.
        """
        started = time.perf_counter()
        wanted = list(program.outputs) if wanted is None else list(wanted)
        device_target = "CPU"
        if self.backend == "cann":
            _require_cann()
            check_cann_program(program)
            device_target = "Ascend"
        check_kernels(program, self.backend)
        size = program.mesh.size
        workers = self.check_workers(size)
        search_path = _search_path()
        msrun = shutil.which("msrun", path=os.pathsep.join(search_path))
        if msrun is None:
            raise ExecutionError("engine-unavailable", "msrun (MindSpore's launcher) is not on PATH nor next to "
                                 f"{sys.executable}", hint="pip install 'layout-prop[mindspore]'")
        port = self._port()
        local_inputs = _scatter_inputs(program, global_inputs, rng)
        input_names = [op.name for op in program.ops if op.kind == "input"]
        key = secrets.token_bytes(32)
        here = range(self.nodes) if self.emulated else [self.node_rank]
        self._extra = {"backend": self.backend, "run_dir": None}
        if any(spec.dtype == "bfloat16" for spec in program.specs.values()):
            self._extra["compute_notes"] = [BFLOAT16_NOTE]
        if self.nodes > 1:
            self._extra.update({"nodes": node_map(program.mesh, self.nodes, workers), "node_rank": self.node_rank,
                                "emulated_nodes": self.emulated})
            self._extra["node_map"] = format_node_map(self._extra["nodes"])
        self._link = self._open_link(port)  # across machines: node 0 listens from now on
        try:
            runs: list[_NodeRun] = []
            try:
                for node in here:
                    runs.append(self._prepare_node(node, workers, size, port, msrun, search_path, key, program, wanted,
                                                   device_target, local_inputs, input_names))
            except BaseException:
                for made in runs:
                    shutil.rmtree(made.run, ignore_errors=True)
                raise
            report = runs[0]  # node 0 when emulated, else this node: every node's collector has every rank's results
            self.run_dir = report.run
            self._extra.update({"run_dir": str(report.run), "run_dirs": [str(r.run) for r in runs]})
            try:
                try:
                    with _signals_end_the_run():
                        self._launch_and_wait(runs)
                except _Terminated as stop:
                    _forget_launcher(runs)  # the folder is kept for the user, not stale: before this process ends
                    self._finish_link(ExecutionError("terminated", f"stopped by {_signal_name(stop.signum)}"))
                    _end_like_the_signal(stop.signum, ", ".join(str(r.run) for r in runs))
                    raise ExecutionError("terminated", f"stopped by {signal.Signals(stop.signum).name}; every "
                                         f"process of the run was killed; run folder {report.run}",
                                         hint="run it again") from None
                results = self._collect(report, size, wanted)
                for other in runs[1:]:  # emulated nodes: each node's collector received the same results
                    theirs = self._collect(other, size, wanted, record=False)
                    if any(not _same_arrays(results[v], theirs[v]) for v in wanted):
                        raise ExecutionError("internal-error", f"node {other.node} received other results than node "
                                             f"{report.node}; run folders {report.run}, {other.run}",
                                             hint="please report this: the collective gather of the results is wrong")
            finally:  # a run this launcher ends itself, well or not, is never stale (a failed run's folder is kept)
                _forget_launcher(runs)
        except BaseException as error:  # the other nodes' launchers hear how this one ended
            self._finish_link(error)
            raise
        self._finish_link(None)
        self._extra["launcher_seconds"] = time.perf_counter() - started
        if not self.keep:
            for made in runs:
                shutil.rmtree(made.run, ignore_errors=True)
            self._extra.update({"run_dir": None, "run_dirs": []})
            self.run_dir = None
        return results

    def report_extra(self) -> dict[str, Any]:
        """What the JSON report adds for this engine: ``run_dir`` (None once removed after
        success), ``backend``, ``per_rank_seconds`` (per rank: seconds per op kind,
        ``setup`` and ``total``), ``emulated_collectives`` (every collective built from
        all-reduce instead of a native primitive, with the groups it ran on and how),
        ``collective_impls`` (how each collective ran) and ``launcher_seconds`` (wall time
        of :meth:`execute`); on several nodes also ``nodes`` (:func:`node_map`),
        ``node_map`` (its lines), ``node_rank``, ``emulated_nodes`` and ``run_dirs``."""
        return {"run_dir": str(self.run_dir) if self.run_dir else None, "backend": self.backend, "per_rank_seconds": [],
                "emulated_collectives": [], "collective_impls": [], "launcher_seconds": None, **self._extra}

    # ------------------------------------------------------------------ steps
    def check_workers(self, size: int) -> int:
        """The workers each node starts for a mesh of ``size`` ranks, checked before anything starts.

        Raises
        ------
        ExecutionError
            ``bad-nodes`` when nodes x workers is not the mesh size; ``too-many-workers``
            when this launcher would start more than :data:`MAX_LOCAL_WORKERS` processes.
        """
        workers = self.local_workers if self.local_workers is not None else max(size // self.nodes, 1)
        if self.nodes * workers != size:
            raise ExecutionError("bad-nodes", f"{cut(self.nodes)} node(s) x {cut(workers)} worker(s) = "
                                 f"{cut(self.nodes * workers)} ranks, but the mesh has {size}",
                                 hint="choose --nodes and --local-workers whose product is the mesh size")
        here = workers * (self.nodes if self.emulated else 1)
        if here > MAX_LOCAL_WORKERS:
            where = f"{self.nodes} emulated nodes x {workers} workers" if self.emulated else f"{workers} workers"
            raise ExecutionError("too-many-workers", f"the run would start {here} msrun worker processes on this "
                                 f"machine ({where}), over the limit {MAX_LOCAL_WORKERS}",
                                 hint=f"span machines with --nodes N (at most {MAX_LOCAL_WORKERS} workers each), "
                                 "or run the mesh on the simulator (--engine sim)")
        return workers

    def _port(self) -> int:
        """The scheduler's port; node 0 refuses one that a socket listens on (:func:`check_port_free`)."""
        if self.master_port is None and (self.nodes == 1 or self.emulated):
            return _free_port()
        port = self.master_port if self.master_port is not None else MSRUN_DEFAULT_PORT
        if self.node_rank != 0:
            return port  # node 0's scheduler may hold it already
        check_port_free(self.master_addr, port)
        return port

    def _open_link(self, port: int) -> "_NodeLink | None":
        """Across machines: the launchers' heartbeat (:class:`_NodeLink`), listening on node 0 from now on."""
        if self.nodes == 1 or self.emulated:
            return None

        def name(node: int) -> str:
            ranks = self._extra["nodes"][node]["ranks"]
            return f"node {node} (rank {ranks[0]})" if len(ranks) == 1 else (f"node {node} (ranks {ranks[0]}-"
                                                                             f"{ranks[-1]})")

        size = self._extra["nodes"][-1]["ranks"][-1] + 1
        link = _NodeLink(self.node_rank, self.nodes, size, self.master_addr, port + LINK_PORT_OFFSET, name)
        link.open()
        return link

    def _finish_link(self, error: BaseException | None) -> None:
        """Tell the other nodes' launchers how this node's run ended (once)."""
        link, self._link = self._link, None
        if link is None:
            return
        if error is None or isinstance(error, LayoutPropError):
            text = None if error is None else str(error)
        elif isinstance(error, KeyboardInterrupt):
            text = "interrupted (Ctrl-C)"
        else:
            text = describe(error)
        link.finish(text)

    def _prepare_node(self, node: int, workers: int, size: int, port: int, msrun: str, search_path: list[str],
                      key: bytes, program, wanted: list[str], device_target: str,
                      local_inputs: list[dict[str, np.ndarray]], input_names: list[str]) -> _NodeRun:
        run = self._new_run_folder()
        ranks = list(range(node * workers, (node + 1) * workers))
        msrun_args = [msrun, f"--worker_num={size}", f"--local_worker_num={workers}", f"--master_port={port}"]
        if self.nodes > 1:
            msrun_args += [f"--master_addr={self.master_addr}", f"--node_rank={node}"]
        msrun_args += ["--join=True", "--tail_worker_log=-2", f"--log_dir={run / 'logs'}",
                       f"--cluster_time_out={int(self.timeout) + 10}",  # our timeout comes first
                       "python", "-m", "layout_prop.engines.msrun_worker", str(run)]
        job = {"program": program, "wanted": wanted, "backend": self.backend, "device_target": device_target,
               "input_names": input_names, "nodes": self.nodes, "collector": ranks[0]}
        env = self._prepare_run(run, job, key, {r: local_inputs[r] for r in ranks}, input_names, search_path,
                                msrun_args)
        env[worker.NODE_RANK_ENV] = str(node)
        command = [sys.executable, "-m", "layout_prop.engines.msrun_guard", str(os.getpid())] + msrun_args
        return _NodeRun(node, ranks, run, command, env)

    def _runs_root(self) -> Path:
        if self.user_runs_root is None:
            root = Path(os.path.realpath(tempfile.gettempdir()))
            check_runs_root(root, user_given=False)
            return root
        root = self.user_runs_root
        if not os.path.lexists(root):
            try:
                root.mkdir(mode=0o700, parents=True)
            except OSError as exc:
                raise ExecutionError("run-folder-failed", f"cannot create {str(root)!r}: {exc.strerror}",
                                     hint="give a folder that exists and is writable") from None
        check_runs_root(root, user_given=True)
        return root

    def _new_run_folder(self) -> Path:
        root = self._runs_root()
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

    def _prepare_run(self, run: Path, job: dict, key: bytes, local_inputs: dict[int, dict[str, np.ndarray]],
                     input_names: list[str], search_path: list[str], msrun_args: list[str]) -> dict[str, str]:
        """Write the run folder; remove it and raise ``run-folder-failed`` if the disk refuses."""
        try:
            for folder in ("inputs", "logs", "pids"):
                (run / folder).mkdir(mode=0o700)
            env = _worker_environment(run, search_path)
            env[worker.JOB_KEY_ENV] = key.hex()
            worker.write_job(run, job, key)
            for rank, arrays in local_inputs.items():
                worker.write_inputs(run, rank, [arrays[name] for name in input_names])
            (run / "command.txt").write_text(shlex.join(msrun_args) + "\n")
        except OSError as exc:
            shutil.rmtree(run, ignore_errors=True)
            raise ExecutionError("run-folder-failed", f"cannot write the run folder {str(run)!r}: "
                                 f"{exc.strerror or exc} (removed it)",
                                 hint="free some space, or set TMPDIR to a writable folder with free space") from None
        except BaseException:
            shutil.rmtree(run, ignore_errors=True)
            raise
        return env

    def _launch_and_wait(self, runs: list[_NodeRun]) -> None:
        """Start every node's msrun in its own session; wait for all to finish, a failure, or the timeout."""
        launched = time.monotonic()
        deadline = launched + self.timeout
        folders = ", ".join(str(r.run) for r in runs)
        try:
            for node_run in runs:
                self._start(node_run, launched)
            while True:
                self._check_link(runs, launched, folders)
                for node_run in runs:
                    failure = self._failure(node_run, len(runs) > 1)
                    if failure is not None:
                        self._kill_all(runs)
                        lost = self._lost_node_line(runs)
                        if lost is not None:
                            raise ExecutionError(
                                "node-lost", f"msrun's scheduler lost a worker of another node "
                                f"({_one_line(lost)[:200]}): {self._other_nodes_text()} died or stalled (its "
                                f"launcher names the rank); MindSpore then ended this node's workers ({failure}); "
                                f"every other process of the run was killed; run folder {folders}",
                                hint="read the other node's error line, or its run folder's logs/")
                        raise ExecutionError("worker-failed", f"{failure}; every other process of the run was "
                                             f"killed; run folder {folders}",
                                             hint="read the rank's worker log (and error file) in the run folder's "
                                             "logs/")
                if all(r.process.poll() is not None for r in runs):
                    for node_run in runs:
                        self._check_finished(node_run, len(runs) > 1)
                    return
                if time.monotonic() > deadline:
                    self._kill_all(runs)
                    raise ExecutionError("engine-timeout", f"msrun did not finish within the timeout of "
                                         f"{self.timeout:g} s; {self._unfinished_text(runs)} (killed); "
                                         f"run folder {folders}",
                                         hint="raise --timeout, or read the worker logs in the run folder's logs/")
                if self.progress is not None:
                    self.progress(self._progress_text(runs, launched))
                time.sleep(_POLL_SECONDS)
        finally:
            if any(r.process is not None and (r.process.poll() is None or r.watch.live_pids()) for r in runs):
                self._kill_all(runs)  # an interrupt or an unexpected error: never leave processes

    def _check_link(self, runs: list[_NodeRun], launched: float, folders: str) -> None:
        """Another node's launcher lost, failed or refusing this one (:class:`_NodeLink`): kill this node's run
        and say so (``node-lost``, ``bad-nodes``, ``bad-node-rank``)."""
        problem = self._link.problem() if self._link is not None else None
        if problem is None:
            return
        self._kill_all(runs)
        raise ExecutionError(problem.code, f"{problem.what} {max(problem.when - launched, 0.0):.1f} s after the "
                             f"launch: {problem.why}; every process of this node's run was killed; run folder "
                             f"{folders}", hint=problem.hint)

    def _progress_text(self, runs: list[_NodeRun], launched: float) -> str:
        """``8 ranks: 8 joined, 3 done, 14s (timeout 5m 00s)``: how far this launcher's ranks are."""
        ranks = [(r.run, rank) for r in runs for rank in r.ranks]
        joined = sum(worker.joined_path(run, rank).exists() for run, rank in ranks)
        done = sum(worker.done_path(run, rank).exists() for run, rank in ranks)
        return (f"{len(ranks)} ranks: {joined} joined, {done} done, {format_seconds(time.monotonic() - launched)} "
                f"(timeout {format_seconds(self.timeout)})")

    def _start(self, node_run: _NodeRun, launched: float) -> None:
        run = node_run.run
        try:
            with open(run / "msrun.log", "wb") as log:
                node_run.process = subprocess.Popen(node_run.command, env=node_run.env, stdout=log,
                                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    start_new_session=True)
        except OSError as exc:
            raise ExecutionError("engine-unavailable", f"cannot start msrun: {exc.strerror or exc}; run folder {run}",
                                 hint="check the MindSpore installation") from None
        node_run.watch = _RunWatch(node_run.process.pid, run, node_run.ranks, launched)

    def _failure(self, node_run: _NodeRun, name_node: bool) -> str | None:
        """What went wrong on this node, in words (``node K: ...`` when several run here), or None."""
        where = f"node {node_run.node}: " if name_node else ""
        returncode = node_run.process.poll()
        if returncode is not None and returncode < 0:  # its workers die with it (parent-death signal)
            return (f"{where}msrun (pid {node_run.process.pid}) was killed by {_signal_name(-returncode)}; its "
                    "scheduler and workers were killed with it")
        failure = node_run.watch.failure()
        return f"{where}{failure}" if failure is not None else None

    def _check_finished(self, node_run: _NodeRun, name_node: bool) -> None:
        """msrun ended by itself: every rank's error record, or msrun's exit code, or nothing to say."""
        run, returncode = node_run.run, node_run.process.returncode
        where = f"node {node_run.node}: " if name_node else ""
        errors = _read_errors(run)
        if errors:
            first = min(errors, key=lambda e: (e.get("time", 0.0), str(e.get("rank"))))
            others = sorted({str(e.get("rank")) for e in errors} - {str(first.get("rank"))})
            also = f" (ranks {', '.join(others)} failed too)" if others else ""
            raise ExecutionError("worker-failed", f"{where}rank {first.get('rank')} failed at {first.get('op')}: "
                                 f"{_one_line(first.get('message', ''))}{also}; run folder {run}",
                                 hint="read the rank's error file and worker log in the run folder")
        if returncode is not None and returncode < 0:  # killed: said as the watch loop says it, whichever saw it
            raise ExecutionError("worker-failed", f"{where}msrun (pid {node_run.process.pid}) was killed by "
                                 f"{_signal_name(-returncode)}; its scheduler and workers were killed with it; "
                                 f"run folder {run}", hint="read msrun.log and the worker logs in the run folder")
        if returncode != 0:
            missing = [r for r in node_run.ranks if not worker.done_path(run, r).exists()]
            raise ExecutionError("worker-failed", f"{where}msrun exited with code {returncode}; ranks {missing} did "
                                 f"not finish{_log_hint(run)}; run folder {run}",
                                 hint="read msrun.log and the worker logs in the run folder")

    def _unfinished_text(self, runs: list[_NodeRun]) -> str:
        """Which ranks did not finish; on a real cluster, which other nodes this node waited for."""
        parts = []
        for node_run in runs:
            missing = [r for r in node_run.ranks if not worker.done_path(node_run.run, r).exists()]
            where = f" (node {node_run.node})" if self.nodes > 1 else ""
            if missing:
                parts.append(f"ranks {missing}{where} did not finish")
        if self.nodes > 1 and not self.emulated:
            node_run = runs[0]
            names = self._other_nodes_text()
            if not any(worker.joined_path(node_run.run, r).exists() for r in node_run.ranks):
                parts.append(f"the cluster never formed: {names} never joined {self.master_addr}")
            else:
                parts.append(f"they waited for the other nodes: {names} died or stalled (its launcher names the "
                             "rank)")
        return "; ".join(parts) or "every rank finished but msrun did not exit"

    def _other_nodes_text(self) -> str:
        """``node 1 (ranks 2-3)``, or ``one or more of node 1 (...), node 2 (...)``: the nodes not run here."""
        others = [e for e in self._extra["nodes"] if e["node"] != self.node_rank]
        names = ", ".join(f"node {e['node']} (ranks {e['ranks'][0]}-{e['ranks'][-1]})" for e in others)
        return names if len(others) == 1 else f"one or more of {names}"

    def _lost_node_line(self, runs: list[_NodeRun]) -> str | None:
        """On node 0 of a real cluster: the scheduler's log line saying a worker timed out, if it has one.

        When a worker of another node dies, MindSpore's scheduler (on node 0) notices its
        missing heartbeats about 30 s later, and this node's workers are then ended with
        SIGTERM: what this launcher sees first is that SIGTERM, not its cause.
        """
        if self.nodes == 1 or self.emulated:
            return None
        for node_run in runs:
            try:
                text = (node_run.run / "logs" / "scheduler.log").read_text(errors="replace")
            except OSError:
                continue
            found = _NODE_TIMED_OUT.search(text)
            if found:
                return found.group(0)
        return None

    def _kill_all(self, runs: list[_NodeRun]) -> None:
        for node_run in runs:
            if node_run.process is not None:
                self._kill_run(node_run.process, node_run.run, node_run.watch)

    @staticmethod
    def _kill_run(process: subprocess.Popen, run: Path, watch: "_RunWatch") -> None:
        """SIGKILL msrun, its scheduler, every worker and their children, each by id; wait until they are gone."""
        blocked = _block_signals()
        try:
            pids = _descendants(process.pid) | watch.live_pids() | _pid_file_workers(run)
            _signal_group(process.pid)  # msrun and its scheduler (msrun's session and group)
            for pid in pids:
                _signal_group(pid, only_if_leader=True)  # a worker's own session and group
                _signal_pid(pid)
            process.wait()
            _wait_until_gone(pids, 5.0)
        finally:
            _unblock_signals(blocked)

    def _collect(self, node_run: _NodeRun, size: int, wanted: list[str],
                 record: bool = True) -> dict[str, list[np.ndarray]]:
        """Every rank's wanted local outputs from one node's run folder (and, if ``record``, the timings)."""
        run = node_run.run
        missing = _unfinished_ranks(run, size)
        if missing:
            raise ExecutionError("worker-failed", f"msrun exited but ranks {missing} wrote no result"
                                 f"{_log_hint(run)}; run folder {run}",
                                 hint="read msrun.log and the worker logs in the run folder")
        results: dict[str, list[np.ndarray]] = {value: [] for value in wanted}
        per_rank, impls, emulated = [], {}, {}
        for rank in range(size):
            info = json.loads(worker.result_info_path(run, rank).read_text())
            with np.load(worker.result_arrays_path(run, rank), allow_pickle=False) as arrays:
                for k, value in enumerate(info["outputs"]):
                    if value in results:
                        results[value].append(worker.restore_dtype(np.array(arrays[f"v{k}"])))
            per_rank.append(info["seconds"])
            for record in info["collectives"]:
                key = record["value"]
                entry = impls.setdefault(key, {"value": key, "source": record["source"], "kind": record["kind"],
                                               "mesh_axis": record["mesh_axis"], "emulated": record["emulated"],
                                               "impl": record["impl"], "groups": []})
                if record["group"] not in entry["groups"]:
                    entry["groups"].append(record["group"])
                entry["emulated"] = entry["emulated"] or record["emulated"]
                if record["emulated"]:
                    emulated[key] = entry
        for value, locals_ in results.items():
            if len(locals_) != size:
                raise ExecutionError("worker-failed", f"the workers returned no value {value!r}; run folder {run}",
                                     hint="ask only for the program's outputs")
        if not record:
            return results
        self._extra.update({"per_rank_seconds": per_rank, "emulated_collectives": list(emulated.values()),
                            "collective_impls": list(impls.values())})
        return results


# --------------------------------------------------------------------------- watching msrun's processes
def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_status(status: int | None) -> str:
    """A wait status (as ``waitpid`` gives it) in words."""
    if status is None:
        return "ended without a result (its exit status was not seen)"
    if status & 0x7F:
        return f"was killed by {_signal_name(status & 0x7F)} (signal {status & 0x7F})"
    return f"exited with code {(status >> 8) & 0xFF}"


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _proc_cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _proc_stat(int(entry.name))
            if fields is not None and len(fields) > 1:
                parents[int(entry.name)] = int(fields[1])
    return parents


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children, ...), by parent links in /proc."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@dataclass
class _Child:
    """A process msrun started: a worker of a rank, or the scheduler."""

    pid: int
    start: str  # /proc start time: a reused pid is not this process
    role: str  # "worker" or "scheduler"
    rank: int | None


class _RunWatch:
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
        self.children: dict[int, _Child] = {}
        self.ended: dict[int, int | None] = {}  # pid -> wait status (None: not known)
        self._vanished: dict[int, float] = {}

    def live_pids(self) -> set[int]:
        alive = set()
        for pid, child in self.children.items():
            fields = _proc_stat(pid)
            if fields is not None and fields[19] == child.start and fields[0] not in "ZX":
                alive.add(pid)
        return alive

    def _discover(self) -> None:
        if sum(c.role == "worker" for c in self.children.values()) >= self.workers:
            return
        msrun_cmdline = _proc_cmdline(self.msrun_pid)
        for pid, parent in _parents().items():
            if parent != self.msrun_pid or pid in self.children:
                continue
            cmdline, fields = _proc_cmdline(pid), _proc_stat(pid)
            if fields is None or not cmdline or cmdline == msrun_cmdline:
                continue  # gone, or forked but not yet running Python: its environment is not final
            if _WORKER_MODULE not in cmdline.split(b"\0"):
                continue  # a helper msrun runs (not ours to watch; killed with the rest at the end)
            env = _proc_environ(pid)
            roles = {"MS_WORKER": "worker", "MS_SCHED": "scheduler"}
            if env.get("MS_ROLE") not in roles:
                continue
            role = roles[env["MS_ROLE"]]
            rank_id = env.get("RANK_ID", "")
            rank = int(rank_id) if role == "worker" and rank_id.isdigit() else None
            self.children[pid] = _Child(pid, fields[19], role, rank)

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

    def _unseen_deaths(self) -> list[tuple[_Child, int | None]]:
        """Workers msrun logged as failed that were never seen running Python."""
        deaths = []
        for pid, status in self._msrun_log_deaths().items():
            if pid in self.children:
                continue
            seen = {c.rank for c in self.children.values() if c.role == "worker"}
            unseen = [r for r in self.ranks if r not in seen]
            child = _Child(pid, "", "worker", unseen[0] if len(unseen) == 1 else None)
            self.children[pid] = child
            self.ended[pid] = status
            deaths.append((child, status))
        return deaths

    def _poll_deaths(self) -> list[tuple[_Child, int | None]]:
        deaths = []
        now = time.monotonic()
        for pid, child in self.children.items():
            if pid in self.ended:
                continue
            fields = _proc_stat(pid)
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
        errors = _read_errors(self.run)
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
            text = f"{_who(child)} {_describe_status(status)} {seconds:.1f} s after the launch"
            return text + _also(others, child.rank)
        if errors:
            first = min(errors, key=lambda e: (e.get("time", 0.0), str(e.get("rank"))))
            text = f"rank {first.get('rank')} failed at {first.get('op')}: {_one_line(first.get('message', ''))}"
            return text + _also(others, first.get("rank"))
        worker_deaths = sorted(((c.rank if c.rank is not None else -1, c.pid, s) for c, s in deaths
                                if c.role == "worker"))
        if worker_deaths:
            rank, pid, status = worker_deaths[0]
            text = f"{_who(self.children[pid])} {_describe_status(status)}{_log_hint(self.run)}"
            return text + _also(others, rank)
        for child, status in deaths:
            return f"msrun's scheduler (pid {child.pid}) {_describe_status(status)}{_log_hint(self.run)}"
        return None


def _who(child: _Child) -> str:
    if child.rank is None:
        return f"a worker (pid {child.pid}; its rank is not known: it died before it started Python)"
    return f"rank {child.rank} (pid {child.pid})"


def _also(ranks: list[int], blamed: Any) -> str:
    rest = [r for r in ranks if r != blamed]
    return f" (ranks {', '.join(map(str, rest))} ended too)" if rest else ""


def _pid_file_workers(run: Path) -> set[int]:
    """Workers named by their pid files that are still workers of this run (their command line names it)."""
    pids = set()
    for pid_file in (run / "pids").glob("*.pid"):
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        cmdline = _proc_cmdline(pid)
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
        if all((fields := _proc_stat(pid)) is None or fields[0] in "ZX" for pid in pids):
            return
        time.sleep(0.02)


# --------------------------------------------------------------------------- signals
class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM or SIGHUP while a run is going."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into :class:`_Terminated` (main thread only; ignored signals stay ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def stop(signum, frame):
        raise _Terminated(signum)

    for signum in _STOP_SIGNALS:
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


def _end_like_the_signal(signum: int, run: str) -> None:
    """After the run is killed: say so in one line and end by the same signal (its previous handler now)."""
    print(f"layout-prop: {_signal_name(signum)} received: every process of the msrun run was killed; "
          f"run folder {run}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signum)


def _block_signals() -> set | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGINT})


def _unblock_signals(previous: set | None) -> None:
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# --------------------------------------------------------------------------- helpers
def _require_cann() -> None:
    """``backend-unavailable`` unless the CANN kernel can run here."""
    from layout_prop.kernels.rpe_cann import cann_available

    if not cann_available():
        raise ExecutionError("backend-unavailable", "the cann backend needs an Ascend device with MindSpore's "
                             "Ascend package; none is available here",
                             hint="use --backend mindspore (MindSpore CPU kernels) or --engine sim")


def check_cann_program(program) -> None:
    """Check every rank's LOCAL shapes of every RPE op against the CANN kernel's constraints.

    Gradient ops are checked first, then forward ops, each on every rank; the chip is
    taken to be Atlas A2/A3 (the default of
    :func:`layout_prop.kernels.rpe_cann.check_cann_constraints`).

    Raises
    ------
    ExecutionError
        ``no-backward-kernel`` (modes 2 and 3 have no CANN backward) or
        ``kernel-constraint``, naming the node and the rank.
    """
    from layout_prop.kernels.rpe_cann import check_cann_constraints

    rpe_ops = [op for op in program.ops if op.kind == "kernel" and op.op in RPE_OPS]
    # gradients first: a missing backward kernel is the more basic limit (no chip has it)
    rpe_ops.sort(key=lambda op: op.op != "rotary_position_embedding_grad")
    for op in rpe_ops:
        backward = op.op == "rotary_position_embedding_grad"
        x_value, cos_value = (op.inputs[1], op.inputs[2]) if backward else (op.inputs[0], op.inputs[1])
        x_spec = program.specs[x_value]
        for rank in range(program.mesh.size):
            attrs = op.attrs[rank] if op.attrs else {}
            layout = attrs.get("input_layout") or "BNSD"
            try:
                check_cann_constraints(tuple(x_spec.local_shape(rank)),
                                       tuple(program.specs[cos_value].local_shape(rank)), attrs.get("mode", 0),
                                       layout, backward=backward, need_dcos=backward, dtype=x_spec.dtype)
            except LayoutPropError as err:
                raise ExecutionError(err.code, f"rank {rank}: {err.message}", node=op.source,
                                     hint=err.hint) from None


def check_kernels(program, backend: str) -> None:
    """``no-kernel`` before launching when the backend's table lacks a kernel the program runs."""
    from layout_prop.kernels.numpy_backend import KERNELS as NUMPY_KERNELS, get_kernel

    if backend == "numpy":
        table = NUMPY_KERNELS
    else:
        from layout_prop.kernels.mindspore_backend import get_table

        table = get_table(backend)
    for op in program.ops:
        if op.kind == "kernel":
            get_kernel(op.op, table, backend)


def _scatter_inputs(program, global_inputs: dict[str, np.ndarray],
                    rng: np.random.Generator | None) -> list[dict[str, np.ndarray]]:
    """Every rank's local input pieces, cut in program order with ``rng`` (as the simulator does)."""
    per_rank: list[dict[str, np.ndarray]] = [{} for _ in range(program.mesh.size)]
    for op in program.ops:
        if op.kind != "input":
            continue
        if op.name not in global_inputs:
            raise ExecutionError("missing-input", f"no value given for graph input {op.name!r}", input=op.name,
                                 hint="give every graph input an array")
        pieces = scatter_global(np.asarray(global_inputs[op.name]), op.specs[0], rng)
        for rank, piece in enumerate(pieces):
            per_rank[rank][op.name] = piece
    return per_rank


def _search_path() -> list[str]:
    """PATH with this interpreter's folder first (msrun starts the ``python`` found on PATH)."""
    folder = str(Path(sys.executable).parent)
    return [folder] + [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != folder]


def _worker_environment(run: Path, search_path: list[str]) -> dict[str, str]:
    """The environment for msrun: this interpreter first on PATH, quiet MindSpore logs.

    When this interpreter's folder has no ``python`` that is this interpreter, a shim
    ``python`` in the private run folder's ``bin/`` goes first.
    """
    env = dict(os.environ)
    path = list(search_path)
    candidate = Path(path[0]) / "python"
    if not (candidate.exists() and os.path.samefile(candidate, sys.executable)):
        shim = run / "bin"
        shim.mkdir(mode=0o700)
        script = shim / "python"
        script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
        script.chmod(0o700)
        path.insert(0, str(shim))
    env["PATH"] = os.pathsep.join(path)
    env.setdefault("GLOG_v", "3")  # MindSpore's C++ log level: errors only
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _same_arrays(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def _unfinished_ranks(run: Path, size: int) -> list[int]:
    return [rank for rank in range(size) if not worker.result_info_path(run, rank).exists()]


def _read_errors(run: Path) -> list[dict]:
    errors = []
    for path in sorted(run.glob("rank*.error.json")):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            errors.append({"rank": path.name.split(".")[0][4:], "op": "?", "message": f"unreadable {path.name}"})
    return errors


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _log_hint(run: Path) -> str:
    """The last error-looking line of the worker logs, as ``: <line>`` (or nothing)."""
    for log in sorted((run / "logs").glob("*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if "Error" in line and not line.startswith("[WARNING]"):
                return f" ({log.name}: {_one_line(line)[:300]})"
    return ""


# --------------------------------------------------------------------------- addresses and ports
def check_port_free(host: str, port: int) -> None:
    """Refuse a TCP port of this machine's address ``host`` that a socket listens on (``port-in-use``).

    The probe binds with ``SO_REUSEADDR``, as MindSpore's own bind does, so a port held only
    by TIME-WAIT sockets of an earlier run (the minute after it) is accepted, and one with a
    listener is still refused.  An address that is not this machine's, or cannot be resolved,
    is left to msrun (the scheduler runs elsewhere).

    Raises
    ------
    ExecutionError
        ``port-in-use`` naming the port and the address.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ExecutionError("port-in-use", f"port {port} of {host} is already in use",
                                     hint="choose another --master-port (the same on every node)") from None


def _is_local(family: int, address: tuple) -> bool:
    """Whether this machine can bind ``address`` (its own interface address), by binding a UDP socket to it."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((address[0], 0) + tuple(address[2:]))
        return True
    except OSError:
        return False


def local_addresses() -> list[str]:
    """This machine's own addresses, for messages: 127.0.0.0/8, then the IPv4 addresses of its
    interfaces (``/proc/net/fib_trie``), its IPv6 ones but link-local (``/proc/net/if_inet6``) and
    what its host name resolves to.  Never raises (an address found no way is simply not listed)."""
    found = ["127.0.0.0/8"]

    def add(text: str) -> None:
        if text not in found and not text.startswith("127.") and not text.lower().startswith("fe80"):
            found.append(text)

    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        for above, line in zip(lines, lines[1:]):
            if line.strip() == "/32 host LOCAL" and above.strip().startswith("|-- "):
                add(above.strip()[4:])
    except OSError:
        pass
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            digits = line.split()[0] if line.split() else ""
            if len(digits) == 32:
                add(str(ipaddress.IPv6Address(bytes.fromhex(digits))))
    except (OSError, ValueError):
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            add(str(info[4][0]))
    except (OSError, UnicodeError):
        pass
    return found


def check_master_addr(host: str) -> None:
    """On node 0 of several machines: ``host`` must be an address of this machine, since node 0
    runs msrun's scheduler (and the launchers' link) on it.  Checked by binding a UDP socket to
    each address ``host`` resolves to, before anything starts.

    Raises
    ------
    ExecutionError
        ``bad-master-addr`` naming the address (or the resolver's answer) and this machine's addresses.

    >>> check_master_addr("127.0.0.1")
    >>> check_master_addr("203.0.113.7")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.ExecutionError: bad-master-addr: --master-addr 203.0.113.7 is not an address of ...
    """
    shown = cut(host)[1:-1] if isinstance(host, str) else cut(host)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ExecutionError("bad-master-addr", f"--master-addr {shown} cannot be resolved on node 0 "
                             f"({_one_line(getattr(exc, 'strerror', None) or exc)}); this machine's addresses: "
                             f"{', '.join(local_addresses())}",
                             hint="on node 0, give one of its own addresses (the same --master-addr on every "
                             "node)") from None
    if any(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_unspecified for info in infos):
        raise ExecutionError("bad-master-addr", f"--master-addr {shown} is the wildcard address: the other nodes "
                             f"cannot connect to it; this machine's addresses: {', '.join(local_addresses())}",
                             hint="give node 0's address on the network the nodes share (the same on every node)")
    if any(_is_local(family, address) for family, _, _, _, address in infos):
        return
    resolved = sorted({str(info[4][0]) for info in infos} - {host})
    also = f" (it resolves to {', '.join(resolved)})" if resolved else ""
    raise ExecutionError("bad-master-addr", f"--master-addr {shown}{also} is not an address of this machine, "
                         f"which runs msrun's scheduler as node 0; this machine's addresses: "
                         f"{', '.join(local_addresses())}",
                         hint="on node 0, give one of its own addresses as --master-addr (the same on every node), "
                         "or run --node-rank 0 on the machine that has this address")


# --------------------------------------------------------------------------- the launchers' link
LINK_PORT_OFFSET = 1
"""The launchers of several machines watch each other over one TCP connection per node to node 0's
launcher, on the master address at ``master_port + LINK_PORT_OFFSET`` (8119 by default)."""

_LINK_BEAT_SECONDS = 1.0
#: a peer silent this long (its machine stopped, or the network between the nodes failed) is lost
_LINK_SILENCE_SECONDS = 6.0
#: a connection that has not said which node it is within this long is dropped
_LINK_HELLO_SECONDS = 10.0
_LINK_MAX_LINE = 4096
_LINK_MAX_STRANGERS = 32


@dataclass
class _LinkProblem:
    """What the link learnt: ``{what} {seconds} s after the launch: {why}``."""

    code: str  # node-lost, bad-nodes, bad-node-rank
    what: str  # node 1 (ranks 2-3) was lost
    why: str
    hint: str
    when: float  # time.monotonic()


@dataclass
class _Peer:
    """One connection of the link: another node's launcher (``node`` once known)."""

    sock: socket.socket
    address: str
    opened: float
    node: int | None = None
    heard: float = 0.0
    buffer: bytes = b""
    last_word: str | None = None  # "done" or "fail", once said


class _NodeLink:
    """The launchers' heartbeat across machines (no file is shared, and MindSpore's scheduler
    knows a node only once its workers joined).

    Node 0's launcher listens on the master address at ``port`` (``master_port + 1``) from
    before anything starts; every other launcher connects to it (again every half second until
    it is there) and says ``hello NODE NODES RANKS``.  Both ends then send ``beat`` every second
    and, when their run ends, a last word: ``done``, or ``fail`` and their one-line error.  A
    connection that closes without a last word (its ``layout-prop`` killed: the kernel closes its
    socket) or stays silent for :data:`_LINK_SILENCE_SECONDS` (a stopped machine, a cut network)
    is a lost node; a last word ``fail`` is a failed node.  Either is :meth:`problem`, which the
    launcher's poll turns into ``node-lost`` naming the node.  Node 0 also refuses a launcher that
    runs another number of nodes or ranks, or a node rank already connected (``refuse``).  A
    launcher that cannot reach the port is not watched (the run goes on, as before the link).
    Everything runs in one daemon thread; the protocol has no authentication, like msrun's own.
    """

    def __init__(self, node_rank: int, nodes: int, ranks: int, host: str, port: int,
                 describe: Callable[[int], str]) -> None:
        self.node_rank, self.nodes, self.ranks = node_rank, nodes, ranks
        self.host, self.port = host, port
        self.describe = describe
        self.peers: list[_Peer] = []
        self.joined: set[int] = set()
        self._problem: _LinkProblem | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the launcher's side
    def open(self) -> None:
        """Node 0: listen now (``port-in-use`` if taken); every node: start the link's thread."""
        if self.node_rank == 0:
            family, _, _, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(16)
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    raise ExecutionError("port-in-use", f"port {self.port} of {self.host} (the launchers' link, "
                                         f"--master-port + {LINK_PORT_OFFSET}) is already in use",
                                         hint="choose another --master-port (the same on every node)") from None
                raise ExecutionError("port-in-use", f"cannot listen on port {self.port} of {self.host} (the "
                                     f"launchers' link): {exc.strerror or exc}",
                                     hint="choose another --master-port (the same on every node)") from None
            sock.setblocking(False)
            self._listener = sock
            self._selector.register(sock, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="layout-prop-node-link", daemon=True)
        self._thread.start()

    def problem(self) -> _LinkProblem | None:
        with self._lock:
            return self._problem

    def finish(self, failure: str | None) -> None:
        """Tell every connected node how this run ended (``done`` or ``fail LINE``), then close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        word = "done" if failure is None else "fail " + _one_line(failure)[:1500]
        peers = [p for p in self.peers if p.node is not None and p.last_word is None]
        for peer in peers:
            try:
                peer.sock.setblocking(True)
                peer.sock.settimeout(1.0)
                peer.sock.sendall(word.encode("utf-8", "replace") + b"\n")
                peer.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0  # read until they close: closing with unread data would reset
        for peer in peers:  # the connection, and the peer could lose the last word
            try:
                while time.monotonic() < deadline:
                    peer.sock.settimeout(max(deadline - time.monotonic(), 0.01))
                    if not peer.sock.recv(4096):
                        break
            except OSError:
                pass
        for peer in self.peers:
            peer.sock.close()
        self.peers = []
        if self._listener is not None:
            self._listener.close()
        self._selector.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_beat = next_connect = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.node_rank != 0 and not self.peers and 0 not in self.joined and now >= next_connect:
                next_connect = now + 0.5
                self._connect()
            try:
                events = self._selector.select(timeout=0.2)
            except OSError:
                events = []
            for key, _ in events:
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + _LINK_BEAT_SECONDS
                for peer in list(self.peers):
                    if peer.node is not None:
                        self._send(peer, "beat")
            for peer in list(self.peers):
                if peer.node is None and now - peer.opened > _LINK_HELLO_SECONDS:
                    self._drop(peer)
                elif peer.node is not None and now - peer.heard > _LINK_SILENCE_SECONDS:
                    self._lost(peer, f"its launcher sent no heartbeat for {_LINK_SILENCE_SECONDS:g} s (its machine "
                               "stopped, or the network between the nodes failed)")

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=1.0)
        except (OSError, UnicodeError):
            return  # node 0's launcher is not listening yet: try again
        sock.setblocking(False)
        now = time.monotonic()
        peer = _Peer(sock, f"{self.host}:{self.port}", now)  # node 0 once it answers hello
        self.peers.append(peer)
        self._selector.register(sock, selectors.EVENT_READ, peer)
        self._send(peer, f"hello {self.node_rank} {self.nodes} {self.ranks}")

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError:
            return
        if sum(p.node is None for p in self.peers) >= _LINK_MAX_STRANGERS:
            sock.close()
            return
        sock.setblocking(False)
        peer = _Peer(sock, f"{address[0]}:{address[1]}", time.monotonic())
        self.peers.append(peer)
        self._selector.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer) -> None:
        if peer not in self.peers:
            return
        try:
            data = peer.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # reset: closed without a word
        if not data:
            self._closed(peer)
            return
        peer.heard = time.monotonic()
        peer.buffer += data
        while b"\n" in peer.buffer and peer in self.peers:
            line, peer.buffer = peer.buffer.split(b"\n", 1)
            self._line(peer, printable(line.decode("utf-8", "replace")).strip())
        if len(peer.buffer) > _LINK_MAX_LINE and peer in self.peers:
            self._closed(peer)

    def _line(self, peer: _Peer, line: str) -> None:
        word, _, rest = line.partition(" ")
        if peer.node is None:  # nothing but hello (and node 0's refusal) is read before hello
            if word == "hello" and self.node_rank == 0:
                self._hello(peer, rest.split())
            elif word == "hello" and rest.split()[:1] == ["0"]:  # node 0's launcher answered
                peer.node = 0
                self.joined.add(0)
            elif word == "refuse" and self.node_rank != 0:
                self._set(_LinkProblem("bad-nodes", f"node 0's launcher ({self.host}) refused this one",
                                       rest[:500], "run the same spec and flags on every node, each with "
                                       "its own --node-rank", time.monotonic()))
                self._drop(peer)
            return
        if word == "fail":
            peer.last_word = "fail"
            self._set(_LinkProblem("node-lost", f"{self.describe(peer.node)} failed", rest[:1500],
                                   f"read node {peer.node}'s own error line (and its run folder's logs/), then run "
                                   "again on every node", time.monotonic()))
            self._drop(peer)
        elif word == "done":
            peer.last_word = "done"
            self._drop(peer)

    def _hello(self, peer: _Peer, numbers: list[str]) -> None:
        """Node 0: a launcher says which node it is."""
        if len(numbers) != 3 or not all(n.isdigit() and len(n) < 10 for n in numbers):
            self._drop(peer)  # not a launcher of ours: ignored
            return
        node, nodes, ranks = (int(n) for n in numbers)
        refusal = code = None
        if nodes != self.nodes or ranks != self.ranks:
            code = "bad-nodes"
            refusal = f"it runs {nodes} nodes of {ranks} ranks, node 0 {self.nodes} nodes of {self.ranks} ranks"
        elif not 1 <= node < self.nodes:
            code = "bad-node-rank"
            refusal = f"it says it is node {node}, not one of the nodes 1 to {self.nodes - 1}"
        elif node in self.joined:
            code = "bad-node-rank"
            refusal = f"it says it is node {node}, as another launcher did before"
        if refusal is not None:
            self._send(peer, f"refuse {refusal}")
            self._set(_LinkProblem(code, f"node 0 refused the launcher at {peer.address}", refusal,
                                   "run the same spec and flags on every node, each with its own --node-rank",
                                   time.monotonic()))
            self._drop(peer)
            return
        peer.node = node
        self.joined.add(node)
        self._send(peer, f"hello 0 {self.nodes} {self.ranks}")

    def _send(self, peer: _Peer, line: str) -> None:
        try:
            peer.sock.send(line.encode("utf-8", "replace") + b"\n")
        except BlockingIOError:
            pass  # a peer that does not read: its silence is judged on its side
        except OSError:
            self._closed(peer)

    def _closed(self, peer: _Peer) -> None:
        """The peer's connection ended: a lost node unless it said its last word."""
        if peer.node is not None and peer.last_word is None:
            self._lost(peer, "its launcher's connection closed without a last word (its layout-prop was killed, "
                       "or its machine ended it)")
        else:
            self._drop(peer)

    def _lost(self, peer: _Peer, why: str) -> None:
        self._set(_LinkProblem("node-lost", f"{self.describe(peer.node)} was lost", why,
                               f"see what happened on node {peer.node} (its error line, or its run folder's logs/), "
                               "then run again on every node", time.monotonic()))
        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        if peer in self.peers:
            self.peers.remove(peer)
            try:
                self._selector.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            peer.sock.close()

    def _set(self, problem: _LinkProblem) -> None:
        with self._lock:
            if self._problem is None:
                self._problem = problem
