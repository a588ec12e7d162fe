"""The MindSpore engine: run a lowered program on ``msrun`` workers, one process per rank.

:class:`MsrunEngine` is what ``layout-prop run SPEC --engine mindspore`` uses.  For each
:meth:`MsrunEngine.execute` it

1. checks the backend (``cann`` needs an Ascend device, and every rank's local shapes
   must pass the CANN kernel's constraints) before launching anything;
2. writes a fresh run folder (``<temp>/layout-prop-runs/run-<timestamp>-<pid>-<random>``
   by default; never a previous one) holding the pickled job and, per rank, the rank's
   local inputs, cut by :func:`layout_prop.kernels.collectives.scatter_global` with the
   caller's random generator exactly as the simulator cuts them (so Partial inputs get
   the same random terms);
3. starts ``msrun --worker_num=N --local_worker_num=N --master_port=P --join=True
   --log_dir=<run>/logs python -m layout_prop.kernels.msrun_worker <run>`` (N = mesh
   size, P a free port, the running interpreter first on ``PATH``, since msrun starts
   the ``python`` found there) and waits at most ``timeout`` seconds;
4. reads every rank's wanted outputs and timings back.

Failures are typed :class:`~layout_prop.errors.ExecutionError`\\ s, one line each:
``engine-unavailable`` (no msrun), ``backend-unavailable`` (cann without Ascend),
``engine-timeout`` (the processes are killed; names the ranks that did not finish),
``worker-failed`` (the failing rank, its op and error, the run folder).  The engine never
waits longer than the timeout (plus a few seconds to kill).

Examples
--------
>>> engine = MsrunEngine(timeout=60)
>>> engine.backend, engine.timeout
('mindspore', 60.0)
>>> MsrunEngine(backend="torch")
Traceback (most recent call last):
    ...
layout_prop.errors.ExecutionError: backend-unavailable: the mindspore engine has no kernel backend 'torch' (hint: use --backend mindspore, cann or numpy)
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from layout_prop.errors import ExecutionError, LayoutPropError

from . import msrun_worker as worker
from .collectives import scatter_global

__all__ = ["MsrunEngine", "RUNS_FOLDER_NAME", "RPE_OPS", "BACKENDS", "check_cann_program", "check_kernels"]

RUNS_FOLDER_NAME = "layout-prop-runs"
"""Run folders go under ``<system temp dir>/layout-prop-runs`` unless ``run_dir`` says otherwise."""

RPE_OPS = ("rotary_position_embedding", "rotary_position_embedding_grad")

BACKENDS = ("mindspore", "cann", "numpy")
"""Kernel backends of the workers; ``numpy`` runs the numpy reference kernels in the
workers (MindSpore collectives, numpy kernels: separates collective from kernel problems)."""

#: After a worker reports an error, msrun gets this long to stop the others itself.
FAILURE_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.1


class MsrunEngine:
    """Executes a lowered :class:`~layout_prop.passes.lower.Program` on MindSpore ``msrun``.

    Parameters
    ----------
    backend : {'mindspore', 'cann', 'numpy'}
        The workers' kernel table: MindSpore ops on CPU (mccl), the CANN RPE kernel on
        Ascend (HCCL), or the numpy reference kernels on CPU (mccl collectives only).
    timeout : float
        Seconds before the run is killed (``engine-timeout``).
    run_dir : path, optional
        The folder under which each execution makes its own fresh run folder (default
        ``<system temp dir>/layout-prop-runs``).
    keep : bool
        Keep the run folder after a successful run (failed runs are always kept).
    """

    name = "mindspore"

    def __init__(self, backend: str = "mindspore", timeout: float = 300.0, run_dir: str | os.PathLike | None = None,
                 keep: bool = True) -> None:
        if backend not in BACKENDS:
            raise ExecutionError("backend-unavailable", f"the mindspore engine has no kernel backend {backend!r}",
                                 hint="use --backend mindspore, cann or numpy")
        timeout = float(timeout)
        if not timeout > 0:
            raise ExecutionError("bad-timeout", f"the timeout must be a positive number of seconds, got {timeout}",
                                 hint="pass --timeout 300, for example")
        self.backend = backend
        self.timeout = timeout
        self.runs_root = Path(run_dir) if run_dir is not None else Path(tempfile.gettempdir()) / RUNS_FOLDER_NAME
        self.keep = keep
        self.run_dir: Path | None = None
        self._extra: dict[str, Any] = {}

    # ------------------------------------------------------------------ public API
    def execute(self, program, global_inputs: dict[str, np.ndarray], rng: np.random.Generator | None = None,
                wanted: Sequence[str] | None = None) -> dict[str, list[np.ndarray]]:
        """Run ``program`` on one msrun worker per rank.

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
            ``{value: [local array of rank 0, rank 1, ...]}`` for every wanted value.

        Raises
        ------
        ExecutionError
            ``backend-unavailable``, ``kernel-constraint`` / ``no-backward-kernel`` (cann),
            ``no-kernel``, ``missing-input``, ``engine-unavailable``, ``engine-timeout``, ``worker-failed``.
        """
        started = time.perf_counter()
        wanted = list(program.outputs) if wanted is None else list(wanted)
        device_target = "CPU"
        if self.backend == "cann":
            _require_cann()
            check_cann_program(program)
            device_target = "Ascend"
        check_kernels(program, self.backend)
        env = _worker_environment()
        msrun = shutil.which("msrun", path=env["PATH"])
        if msrun is None:
            raise ExecutionError("engine-unavailable", "msrun (MindSpore's launcher) is not on PATH nor next to "
                                 f"{sys.executable}", hint="pip install 'layout-prop[mindspore]'")
        local_inputs = _scatter_inputs(program, global_inputs, rng)
        run = self._new_run_folder()
        self._write_job(run, {"program": program, "wanted": wanted, "backend": self.backend,
                              "device_target": device_target}, local_inputs)
        size = program.mesh.size
        command = [msrun, f"--worker_num={size}", f"--local_worker_num={size}", f"--master_port={_free_port()}",
                   "--join=True", f"--log_dir={run / 'logs'}", f"--cluster_time_out={max(int(self.timeout), 1)}",
                   "python", "-m", "layout_prop.kernels.msrun_worker", str(run)]
        (run / "command.txt").write_text(" ".join(command) + "\n")
        returncode = self._launch_and_wait(command, env, run, size)
        results = self._collect(run, size, wanted, returncode)
        self._extra["launcher_seconds"] = time.perf_counter() - started
        if not self.keep:
            shutil.rmtree(run, ignore_errors=True)
        return results

    def report_extra(self) -> dict[str, Any]:
        """What the JSON report adds for this engine: ``run_dir``, ``backend``, ``per_rank_seconds``
        (per rank: seconds per op kind, ``setup`` and ``total``), ``emulated_collectives``
        (every collective built from all-reduce instead of a native primitive, with the
        groups it ran on and how), ``collective_impls`` (how each collective ran) and
        ``launcher_seconds`` (wall time of :meth:`execute`)."""
        return {"run_dir": str(self.run_dir) if self.run_dir else None, "backend": self.backend, "per_rank_seconds": [],
                "emulated_collectives": [], "collective_impls": [], "launcher_seconds": None, **self._extra}

    # ------------------------------------------------------------------ steps
    def _new_run_folder(self) -> Path:
        self.runs_root.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run = Path(tempfile.mkdtemp(prefix=f"run-{stamp}-{os.getpid()}-", dir=self.runs_root))  # always a new folder
        self.run_dir = run
        self._extra = {"run_dir": str(run), "backend": self.backend}
        return run

    @staticmethod
    def _write_job(run: Path, job: dict[str, Any], local_inputs: list[dict[str, np.ndarray]]) -> None:
        (run / "inputs").mkdir()
        (run / "logs").mkdir()
        (run / "pids").mkdir()
        with open(run / worker.JOB_FILE, "wb") as handle:
            pickle.dump(job, handle, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, arrays in enumerate(local_inputs):
            with open(worker.inputs_path(run, rank), "wb") as handle:
                pickle.dump(arrays, handle, protocol=pickle.HIGHEST_PROTOCOL)

    def _launch_and_wait(self, command: list[str], env: dict[str, str], run: Path, size: int) -> int:
        """Start msrun in its own session; wait for it, a worker error or the timeout."""
        deadline = time.monotonic() + self.timeout
        with open(run / "msrun.log", "wb") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        error_seen_at: float | None = None
        try:
            while True:
                returncode = process.poll()
                if returncode is not None:
                    return returncode
                now = time.monotonic()
                if error_seen_at is None and any(run.glob("rank*.error.json")):
                    error_seen_at = now
                if error_seen_at is not None and now - error_seen_at > FAILURE_GRACE_SECONDS:
                    _kill_run(process, run)  # a worker failed and msrun did not stop the rest
                    return process.wait()
                if now > deadline:
                    _kill_run(process, run)
                    process.wait()
                    if any(run.glob("rank*.error.json")):
                        return -1
                    missing = _unfinished_ranks(run, size)
                    raise ExecutionError(
                        "engine-timeout", f"msrun did not finish within the timeout of {self.timeout:g} s; ranks "
                        f"{missing} did not finish (killed); run folder {run}",
                        hint="raise --timeout, or read the worker logs in the run folder's logs/")
                time.sleep(_POLL_SECONDS)
        finally:
            if process.poll() is None:  # an interrupt or an unexpected error: never leave processes behind
                _kill_run(process, run)
                process.wait()

    def _collect(self, run: Path, size: int, wanted: list[str], returncode: int) -> dict[str, list[np.ndarray]]:
        errors = _read_errors(run)
        if errors:
            first = min(errors, key=lambda e: (e.get("time", 0.0), str(e.get("rank"))))
            others = sorted({str(e.get("rank")) for e in errors} - {str(first.get("rank"))})
            also = f" (ranks {', '.join(others)} failed too)" if others else ""
            raise ExecutionError("worker-failed", f"rank {first.get('rank')} failed at {first.get('op')}: "
                                 f"{_one_line(first.get('message', ''))}{also}; run folder {run}",
                                 hint="read the rank's error file and worker log in the run folder")
        missing = _unfinished_ranks(run, size)
        if returncode != 0 or missing:
            detail = _log_hint(run)
            raise ExecutionError("worker-failed", f"msrun exited with code {returncode}; ranks {missing} wrote no "
                                 f"result{detail}; run folder {run}",
                                 hint="read msrun.log and the worker logs in the run folder")
        results: dict[str, list[np.ndarray]] = {value: [] for value in wanted}
        per_rank, impls, emulated = [], {}, {}
        for rank in range(size):
            info = json.loads(worker.result_info_path(run, rank).read_text())
            with np.load(worker.result_arrays_path(run, rank)) as arrays:
                for k, value in enumerate(info["outputs"]):
                    if value in results:
                        results[value].append(np.array(arrays[f"v{k}"]))
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
        self._extra.update({"per_rank_seconds": per_rank, "emulated_collectives": list(emulated.values()),
                            "collective_impls": list(impls.values())})
        return results


# --------------------------------------------------------------------------- helpers
def _require_cann() -> None:
    """``backend-unavailable`` unless the CANN kernel can run here."""
    from .rpe_cann import cann_available

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
    from .rpe_cann import check_cann_constraints

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
    from .numpy_backend import KERNELS as NUMPY_KERNELS, get_kernel

    if backend == "numpy":
        table = NUMPY_KERNELS
    else:
        from .mindspore_backend import get_table

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


def _worker_environment() -> dict[str, str]:
    """The environment for msrun: this interpreter's folder first on PATH, quiet MindSpore logs.

    msrun starts ``python`` from PATH; when this interpreter's folder has no ``python``
    that is this interpreter, a shim folder holding one goes first.
    """
    env = dict(os.environ)
    folder = str(Path(sys.executable).parent)
    path = [folder] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != folder]
    candidate = Path(folder) / "python"
    if not (candidate.exists() and os.path.samefile(candidate, sys.executable)):
        shim = Path(tempfile.gettempdir()) / RUNS_FOLDER_NAME / f"python-shim-{os.getpid()}"
        shim.mkdir(parents=True, exist_ok=True)
        script = shim / "python"
        script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
        script.chmod(0o755)
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


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _is_our_worker(pid: int, run: Path) -> bool:
    """Whether ``pid`` is still a worker of this run (its command line names the run folder)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(run).encode() in cmdline


def _kill_run(process: subprocess.Popen, run: Path) -> None:
    """Kill msrun's process group and every worker of this run, each by its id.

    msrun starts each worker in a session of its own, so killing msrun's group does not
    reach them: they are found as msrun's children and by the pid files they write.
    """
    worker_pids = set(_children(process.pid))
    for pid_file in (run / "pids").glob("*.pid"):
        try:
            worker_pids.add(int(pid_file.read_text().strip()))
        except (OSError, ValueError):
            continue
    worker_pids = {pid for pid in worker_pids if _is_our_worker(pid, run)}
    try:
        os.killpg(process.pid, signal.SIGKILL)  # msrun and the scheduler (started in msrun's group)
    except ProcessLookupError:
        pass
    for pid in worker_pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


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
