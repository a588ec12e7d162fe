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
the master address at ``master_port + 1`` (:class:`NodeLink`: a line a second each way, and
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

import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from layout_prop.core.errors import ExecutionError, LayoutPropError, cut, describe, one_line
from layout_prop.io.progress import format_seconds

from . import msrun_worker as worker
from .collectives import scatter_global
from .msrun_link import LINK_PORT_OFFSET, NodeLink
from .msrun_ports import MSRUN_DEFAULT_PORT, check_master_addr, check_port_free, choose_port, local_addresses
from .msrun_run_folders import (LAUNCHER_FILE, RUN_PREFIX, check_runs_root, forget_launcher, new_run_folder,
                                remove_stale_runs, runs_root)
from .msrun_signals import Terminated, end_like_the_signal, kill_run, signal_name, signals_end_the_run
from .msrun_watch import RunWatch, log_hint, read_errors

# the names of the run folders', the ports' and the link's modules are re-exported: code written
# against msrun_engine keeps working
__all__ = ["MsrunEngine", "node_map", "format_node_map", "MSRUN_DEFAULT_PORT", "RUN_PREFIX", "RPE_OPS", "BACKENDS",
           "MAX_TIMEOUT_SECONDS", "MAX_LOCAL_WORKERS", "LAUNCHER_FILE", "check_timeout", "remove_stale_runs",
           "check_runs_root", "check_cann_program", "check_kernels", "check_port_free", "check_master_addr",
           "local_addresses", "LINK_PORT_OFFSET"]

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
    watch: "RunWatch | None" = None


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
        self._link: NodeLink | None = None
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
                    with signals_end_the_run():
                        self._launch_and_wait(runs)
                except Terminated as stop:
                    forget_launcher(r.run for r in runs)  # the folder is kept for the user, not stale: before this process ends
                    self._finish_link(ExecutionError("terminated", f"stopped by {signal_name(stop.signum)}"))
                    end_like_the_signal(stop.signum, ", ".join(str(r.run) for r in runs))
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
                forget_launcher(r.run for r in runs)
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
        """The scheduler's port (:func:`~.msrun_ports.choose_port`)."""
        return choose_port(self.master_port, self.nodes, self.emulated, self.node_rank, self.master_addr)

    def _open_link(self, port: int) -> "NodeLink | None":
        """Across machines: the launchers' heartbeat (:class:`NodeLink`), listening on node 0 from now on."""
        if self.nodes == 1 or self.emulated:
            return None

        def name(node: int) -> str:
            ranks = self._extra["nodes"][node]["ranks"]
            return f"node {node} (rank {ranks[0]})" if len(ranks) == 1 else (f"node {node} (ranks {ranks[0]}-"
                                                                             f"{ranks[-1]})")

        size = self._extra["nodes"][-1]["ranks"][-1] + 1
        link = NodeLink(self.node_rank, self.nodes, size, self.master_addr, port + LINK_PORT_OFFSET, name)
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

    def _new_run_folder(self) -> Path:
        """A new private run folder in the checked runs root (:mod:`.msrun_run_folders`)."""
        return new_run_folder(runs_root(self.user_runs_root))

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
                                f"({one_line(lost)[:200]}): {self._other_nodes_text()} died or stalled (its "
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
        """Another node's launcher lost, failed or refusing this one (:class:`NodeLink`): kill this node's run
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
        node_run.watch = RunWatch(node_run.process.pid, run, node_run.ranks, launched)

    def _failure(self, node_run: _NodeRun, name_node: bool) -> str | None:
        """What went wrong on this node, in words (``node K: ...`` when several run here), or None."""
        where = f"node {node_run.node}: " if name_node else ""
        returncode = node_run.process.poll()
        if returncode is not None and returncode < 0:  # its workers die with it (parent-death signal)
            return (f"{where}msrun (pid {node_run.process.pid}) was killed by {signal_name(-returncode)}; its "
                    "scheduler and workers were killed with it")
        failure = node_run.watch.failure()
        return f"{where}{failure}" if failure is not None else None

    def _check_finished(self, node_run: _NodeRun, name_node: bool) -> None:
        """msrun ended by itself: every rank's error record, or msrun's exit code, or nothing to say."""
        run, returncode = node_run.run, node_run.process.returncode
        where = f"node {node_run.node}: " if name_node else ""
        errors = read_errors(run)
        if errors:
            first = min(errors, key=lambda e: (e.get("time", 0.0), str(e.get("rank"))))
            others = sorted({str(e.get("rank")) for e in errors} - {str(first.get("rank"))})
            also = f" (ranks {', '.join(others)} failed too)" if others else ""
            raise ExecutionError("worker-failed", f"{where}rank {first.get('rank')} failed at {first.get('op')}: "
                                 f"{one_line(first.get('message', ''))}{also}; run folder {run}",
                                 hint="read the rank's error file and worker log in the run folder")
        if returncode is not None and returncode < 0:  # killed: said as the watch loop says it, whichever saw it
            raise ExecutionError("worker-failed", f"{where}msrun (pid {node_run.process.pid}) was killed by "
                                 f"{signal_name(-returncode)}; its scheduler and workers were killed with it; "
                                 f"run folder {run}", hint="read msrun.log and the worker logs in the run folder")
        if returncode != 0:
            missing = [r for r in node_run.ranks if not worker.done_path(run, r).exists()]
            raise ExecutionError("worker-failed", f"{where}msrun exited with code {returncode}; ranks {missing} did "
                                 f"not finish{log_hint(run)}; run folder {run}",
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
                kill_run(node_run.process, node_run.run, node_run.watch.live_pids)

    def _collect(self, node_run: _NodeRun, size: int, wanted: list[str],
                 record: bool = True) -> dict[str, list[np.ndarray]]:
        """Every rank's wanted local outputs from one node's run folder (and, if ``record``, the timings)."""
        run = node_run.run
        missing = _unfinished_ranks(run, size)
        if missing:
            raise ExecutionError("worker-failed", f"msrun exited but ranks {missing} wrote no result"
                                 f"{log_hint(run)}; run folder {run}",
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


def _same_arrays(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def _unfinished_ranks(run: Path, size: int) -> list[int]:
    return [rank for rank in range(size) if not worker.result_info_path(run, rank).exists()]
