"""The parent side of the audit's worker process: start it, talk to it, bound it, read it with suspicion.

An audited checkout's rules run in :mod:`.audit_worker`, a separate clean interpreter
(``python -I -S``) with resource limits (address space, CPU seconds, file size), in a
session of its own, with stdin closed and its stdout and stderr sent to a scratch file:
the protocol is a pair of private pipes.  Every reply is read with a time limit and a size
limit, parsed as JSON, and its values decoded with checks (arrays of plain numeric dtypes
and bounded size, read without pickle).  Whatever goes wrong on the worker's side (it exits,
hangs, answers what is not the protocol) is a :class:`WorkerFailure` naming the kind:
``crashed``, ``timeout`` or ``bad-answer``; the audit then marks that op failed and starts a
fresh worker for the next.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import io
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layout_prop.core.errors import printable

__all__ = ["Limits", "WorkerFailure", "Worker", "decode_value", "encode_value", "remote_describe"]

WORKER_SCRIPT = Path(__file__).resolve().parent / "audit_worker.py"
#: the longest reply line read (bytes), the largest array (elements) and the deepest value decoded
MAX_LINE = 8 << 20
MAX_ELEMENTS = 1 << 22
MAX_DEPTH = 10
FAILURE_KINDS = ("crashed", "timeout", "bad-answer", "load-failed")


@dataclass(frozen=True)
class Limits:
    """What one worker may take.

    Parameters
    ----------
    call_seconds : float
        Wall time for one call of the checkout's code (one ``infer_layout``, one expansion,
        loading one op).
    start_seconds : float
        Wall time to start the worker and import the checkout's base modules.
    memory_bytes : int
        The worker's address-space limit (``RLIMIT_AS``).
    cpu_seconds : int
        The worker's CPU-time limit (``RLIMIT_CPU``), for its whole life.
    """

    call_seconds: float = 10.0
    start_seconds: float = 60.0
    memory_bytes: int = 4 << 30
    cpu_seconds: int = 1800


class WorkerFailure(Exception):
    """The worker crashed, timed out or answered what is not the protocol (``kind``, ``message``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def remote_describe(pair: Any, limit: int = 300) -> str:
    """``TypeName: message`` of an exception the worker reported as ``[type, message]`` (as ``describe``)."""
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
        raise WorkerFailure("bad-answer", "an exception report that is not [type, message]")
    name = printable(pair[0])[:100]
    if not pair[1]:
        return name
    text = printable(pair[1][:limit * 4])
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{name}: {text}"


# --------------------------------------------------------------------------- values
def encode_value(value: Any) -> Any:
    """Tuples and arrays as the worker's tags; lists, dicts and scalars as they are."""
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(value), allow_pickle=False)
        return {"__nd__": base64.b64encode(buffer.getvalue()).decode("ascii")}
    if isinstance(value, np.generic):
        return value.item()
    return value


class Other:
    """A value the worker could only name (``<a Foo>``)."""

    def __init__(self, name: str) -> None:
        self.name = printable(name)[:100]

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Other) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def decode_array(text: Any) -> np.ndarray:
    """An array the worker sent, read without pickle; plain numeric or bool dtypes of bounded size only."""
    if not isinstance(text, str) or len(text) > MAX_LINE:
        raise WorkerFailure("bad-answer", "an array that is not base64 text")
    try:
        data = io.BytesIO(base64.b64decode(text, validate=True))
        version = np.lib.format.read_magic(data)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(data)  # the size, before any allocation
        if int(np.prod(shape, dtype=np.float64)) > MAX_ELEMENTS or dtype.kind not in "biufc":
            raise WorkerFailure("bad-answer", "an array that is not a plain numeric array of bounded size")
        data.seek(0)
        array = np.load(data, allow_pickle=False)
    except WorkerFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - anything the worker sent that numpy cannot read
        raise WorkerFailure("bad-answer", f"an array numpy cannot read ({type(exc).__name__})") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "biufc" or array.size > MAX_ELEMENTS:
        raise WorkerFailure("bad-answer", "an array that is not a plain numeric array of bounded size")
    return array


def decode_value(value: Any, depth: int = 0) -> Any:
    """The worker's tagged JSON value, checked: tuples, arrays and named others restored."""
    if depth > MAX_DEPTH:
        raise WorkerFailure("bad-answer", "a value nested too deep")
    if isinstance(value, list):
        return [decode_value(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(decode_value(v, depth + 1) for v in value["__tuple__"])
        if set(value) == {"__nd__"}:
            return decode_array(value["__nd__"])
        if set(value) == {"__other__"} and isinstance(value["__other__"], str):
            return Other(value["__other__"])
        raise WorkerFailure("bad-answer", "a value with an unknown tag")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise WorkerFailure("bad-answer", "a value of an unknown kind")


# --------------------------------------------------------------------------- the process
def _private_numpy() -> str:
    """A folder holding only numpy (links to the installed package): the worker's path beside the checkout."""
    home = Path(np.__file__).resolve().parent
    folder = Path(tempfile.mkdtemp(prefix="layout-prop-audit-"))
    links = []
    for name in (home.name, home.name + ".libs"):
        source = home.parent / name
        if source.exists():
            os.symlink(source, folder / name)
            links.append(folder / name)

    def remove() -> None:  # the links, then the folder (never what they point to)
        for link in links:
            with contextlib.suppress(OSError):
                link.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()

    atexit.register(remove)
    return str(folder)


_NUMPY_FOLDER: str | None = None


def _worker_paths(platform: bool) -> list[str]:
    global _NUMPY_FOLDER
    if platform:  # the platform layer (MindSpore, torch) is in the interpreter's installed packages
        return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    if _NUMPY_FOLDER is None or not Path(_NUMPY_FOLDER).is_dir():
        _NUMPY_FOLDER = _private_numpy()
    return [_NUMPY_FOLDER]


class Worker:
    """One worker process for a checkout; :meth:`request` sends a command and reads its replies."""

    def __init__(self, root: Path, platform: bool, limits: Limits) -> None:
        self.root = root
        self.platform = platform
        self.limits = limits
        self.proc: subprocess.Popen | None = None
        self._buffer = b""

    # ----------------------------------------------------------------------- life
    def start(self) -> None:
        """Start the process and wait for its first line (the checkout's base modules imported)."""
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        limits = self.limits

        def confine() -> None:  # in the child, before exec
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            try:  # Linux: the worker ends with the audit, even when the audit is killed
                import ctypes

                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            except (OSError, AttributeError):
                pass

        self._scratch = tempfile.TemporaryFile()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OPENBLAS_NUM_THREADS": "1",
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LC_ALL": "C.UTF-8"}
        command = [sys.executable, "-I", "-S", str(WORKER_SCRIPT), str(to_worker_r), str(from_worker_w),
                   str(self.root), json.dumps(_worker_paths(self.platform)), "1" if self.platform else "0"]
        try:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._scratch,
                                         stderr=self._scratch, pass_fds=(to_worker_r, from_worker_w), env=env,
                                         cwd=tempfile.gettempdir(), start_new_session=True, preexec_fn=confine,
                                         close_fds=True)
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self._out = os.fdopen(to_worker_w, "wb", buffering=0)
        self._in = from_worker_r
        os.set_blocking(self._in, False)
        self._buffer = b""
        first = self.read(self.limits.start_seconds, "starting")
        if "error" in first or "fatal" in first:
            self.stop()
            raise WorkerFailure("load-failed", remote_describe(first.get("error") or first.get("fatal")))
        if first != {"ok": True}:
            self.stop()
            raise WorkerFailure("bad-answer", "the worker's first line is not the protocol's")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End the worker (its whole session) and close the pipes."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process ends
            pass
        for close in (self._out.close, lambda: os.close(self._in), self._scratch.close):
            try:
                close()
            except OSError:
                pass
        self.proc = None

    # ----------------------------------------------------------------------- protocol
    def send(self, message: dict) -> None:
        try:
            self._out.write(json.dumps(message, separators=(",", ":")).encode("utf-8") + b"\n")
        except (BrokenPipeError, OSError):
            raise self._exited("while reading a request") from None

    def _exited(self, doing: str) -> WorkerFailure:
        try:
            code = self.proc.wait(timeout=2) if self.proc is not None else None
        except subprocess.TimeoutExpired:  # it closed its end of the protocol and lives on
            self.stop()
            return WorkerFailure("crashed", f"the worker closed its answer pipe {doing}")
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
            if -code == signal.SIGXCPU:
                how += " (its CPU-time limit)"
        else:
            how = f"exited with code {code}"
        return WorkerFailure("crashed", f"the worker {how} {doing}")

    def read(self, seconds: float, doing: str) -> dict:
        """The next reply (one JSON object), within ``seconds``; a WorkerFailure otherwise."""
        deadline = time.monotonic() + seconds
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise WorkerFailure("timeout", f"no answer within {seconds:g} s {doing}")
            ready, _, _ = select.select([self._in], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self._in, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                failure = self._exited(doing)
                self.stop()
                raise failure
            self._buffer += chunk
            if len(self._buffer) > MAX_LINE and b"\n" not in self._buffer:
                self.stop()
                raise WorkerFailure("bad-answer", f"a reply longer than {MAX_LINE} bytes {doing}")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            self.stop()
            raise WorkerFailure("bad-answer", f"a reply that is not JSON {doing}") from None
        if not isinstance(reply, dict):
            self.stop()
            raise WorkerFailure("bad-answer", f"a reply that is not an object {doing}")
        if "fatal" in reply:
            self.stop()
            raise WorkerFailure("crashed", f"the checkout's code raised {remote_describe(reply['fatal'])} {doing}")
        return reply
