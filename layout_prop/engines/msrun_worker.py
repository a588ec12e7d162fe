"""What each ``msrun`` worker runs: one rank's local program on MindSpore.

Started by :class:`layout_prop.engines.msrun_engine.MsrunEngine` as
``python -m layout_prop.engines.msrun_worker RUN_FOLDER`` under ``msrun``, which also
starts the same command once as the cluster's scheduler (``MS_ROLE=MS_SCHED``); the
scheduler only runs :func:`mindspore.communication.init` and leaves.

A worker first asks to be killed with its parent (msrun, see
:mod:`layout_prop.engines.msrun_guard`), checks that the run folder is private
(:func:`check_private_folder`: owned by this user, a real folder, no access for group or
others), reads the job (:func:`read_job`: unpickled only after its HMAC-SHA256, keyed by
a secret the launcher passes in the environment variable :data:`JOB_KEY_ENV`, checks),
calls ``mindspore.communication.init()``, takes its rank from ``get_rank()`` (which must
equal msrun's ``RANK_ID``), creates one communication group per mesh axis its
collectives use, and runs the program's ops in order (SPMD: every rank runs every op):

- ``input``: the rank's local piece, cut by the launcher and saved as plain ``.npz``
  (read with ``allow_pickle=False``; partial inputs with the launcher's random terms,
  exactly as the simulator cuts them);
- ``kernel``: the backend's MindSpore kernel table
  (:mod:`layout_prop.kernels.mindspore_backend`) on MindSpore tensors, with the rank's
  localised attrs ``op.attrs[rank]`` (backend ``numpy``: the numpy reference table);
- ``slice`` and ``local``: the steps that need no communication, on the rank's own array
  (:func:`layout_prop.engines.collectives.local_step`, the simulator's own arithmetic): a
  ``torch.chunk`` piece, a chunk of each block for a strided shard ``_S(d,k)``, or a
  ``local-partial`` (zeros on every rank of the group but its first for ``P(sum)``);
- ``collective``: :class:`Communicator`, on the rank's group of the step's mesh axis.

It writes ``rank<R>.npz`` (the wanted local outputs) and ``rank<R>.json`` (timings in
seconds per op kind and in total, and how every collective ran, emulated or native).
On several nodes (no shared filesystem assumed) every rank's outputs and records travel
instead over the collective backend (:func:`share_results`: one world all-reduce of
int32 words, the only collective mccl has everywhere) and the node's first worker (the
job's ``collector``) writes them all in its node's run folder.  Every worker writes
``rank<R>.done`` last.
On any exception it writes ``rank<R>.error.json`` (rank, op, the one-line error, the
traceback) and exits non-zero.

Collectives on CPU (mccl, MindSpore 2.10, measured)
---------------------------------------------------
``mindspore.ops.communication.all_reduce`` reduces ``sum``/``max``/``min``/``prod`` on the
world group and on sub-groups for float32, float16, int32 and int64 (not float64, not
bool); the older ``ops.AllReduce`` primitive only sums, float32/float16 only.
``ops.AllGather`` works on the world group only (float32, float64 and int32 tried);
ReduceScatter and AlltoAll (old primitives and new ``mindspore.ops.communication``
functions) have no CPU kernel, nor does the new ``all_gather_into_tensor``.  So on CPU:

- all-reduce: native for those dtypes (``avg`` on floats is the native sum over ``n``);
  otherwise *emulated*: every rank writes its term, as int32 words, into its slot of a
  zero buffer, one native int32 sum-all-reduce gathers all terms bit-exactly, and each
  rank reduces them locally in group order (:func:`terms_buffer`, :func:`terms_result`);
- all-gather: native ``AllGather`` on the world group when all pieces have one shape;
  otherwise *emulated*: each rank writes its piece, as int32 words, at its ``torch.chunk``
  offset into a zero buffer of the gathered shape and a native int32 sum-all-reduce
  completes it (:func:`gather_buffer`, :func:`gather_result`), bit-exact for uneven and
  empty pieces and any dtype; a strided shard ``_S(d,k)`` is gathered so too, then each
  rank's piece is cut into its k blocks and put in block order
  (:func:`layout_prop.engines.collectives.gathered`, as the simulator does);
- reduce-scatter: *emulated*: an all-reduce (as above) then the rank's chunk;
- all-to-all: *emulated*: an all-gather along the concat dim, then the rank's chunk
  along the split dim (:func:`chunk`);
- permute (point-to-point, a pipeline's send/recv or a ring's shift): *emulated*: MindSpore's
  send/receive primitives are not used on CPU (whether mccl runs them was not measured; the
  all-reduce above is what is known to work), so every member writes its piece, as int32
  words, into its slot of a zero buffer, one native int32 sum-all-reduce over the axis's group
  brings all pieces, and each rank keeps its sender's (zeros where it has none):
  bit-exact, and ``n`` times the bytes of a real send (:meth:`Communicator.permute`).

On Ascend (HCCL) the native AllGather, ReduceScatter and AlltoAll primitives are used
where shapes are even (:data:`ASCEND_CAPS`; not exercised on a machine without Ascend).

Test hooks
----------
If the environment variable ``LAYOUT_PROP_FAIL_RANK`` is set to a rank ``r``
(:data:`FAIL_RANK_ENV`), worker ``r`` raises a clear error right after ``init()``,
before running any op, so that tests can check how the launcher reports a failed
worker and that it does not hang.  If ``LAYOUT_PROP_PAUSE_AFTER_INIT`` is set to a
number of seconds (:data:`PAUSE_ENV`), every worker writes ``rank<R>.paused`` after
``init()`` and sleeps that long, so that tests can kill a worker of a running cluster.

Examples
--------
The buffer arithmetic of the emulations is plain numpy; summing the per-rank buffers is
what the AllReduce does:

>>> import numpy as np
>>> pieces = [np.array([1.5, 2.5]), np.array([-0.0])]           # uneven shards of 3
>>> sizes = [len(p) for p in pieces]
>>> summed = sum(gather_buffer(p, k, sizes, 0) for k, p in enumerate(pieces))
>>> gather_result(summed, np.float64)
array([ 1.5,  2.5, -0. ])
>>> chunk(np.arange(10), 0, 4, 3)
array([9])
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import stat
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from layout_prop.core.errors import ExecutionError

from .collectives import gathered, local_step, reduce_terms, step_split_factor
from .msrun_guard import MSRUN_PID_ENV, die_with_parent

__all__ = [
    "FAIL_RANK_ENV",
    "PAUSE_ENV",
    "NODE_RANK_ENV",
    "JOB_KEY_ENV",
    "JOB_FILE",
    "check_private_folder",
    "write_job",
    "read_job",
    "write_inputs",
    "read_inputs",
    "inputs_path",
    "result_arrays_path",
    "result_info_path",
    "error_path",
    "pid_path",
    "joined_path",
    "done_path",
    "share_results",
    "group_name",
    "encode_words",
    "decode_words",
    "chunk",
    "chunk_offsets",
    "gather_buffer",
    "gather_result",
    "terms_buffer",
    "terms_result",
    "DeviceCaps",
    "CPU_CAPS",
    "ASCEND_CAPS",
    "GroupInfo",
    "plan_groups",
    "Communicator",
    "main",
]

FAIL_RANK_ENV = "LAYOUT_PROP_FAIL_RANK"
"""Test hook: the rank named here fails on purpose right after ``init()``."""

PAUSE_ENV = "LAYOUT_PROP_PAUSE_AFTER_INIT"
"""Test hook: every worker sleeps this many seconds after ``init()`` (after writing ``rank<R>.paused``)."""

NODE_RANK_ENV = "LAYOUT_PROP_NODE_RANK"
"""The node rank of an msrun started by the launcher; msrun's scheduler command returns at
once on a node other than 0 (several nodes emulated on one host: node 0's scheduler serves them)."""

JOB_KEY_ENV = "LAYOUT_PROP_JOB_KEY"
"""The hex secret that keys the job's HMAC; set by the launcher in msrun's environment only."""

JOB_FILE = "job.pkl"
"""The job: the 32-byte HMAC-SHA256 of the rest, then the pickled ``{"program", "wanted",
"backend", "device_target", "input_names"}``."""

_MAC_BYTES = 32


# --------------------------------------------------------------------------- run-folder layout
def inputs_path(run_dir: Path, rank: int) -> Path:
    """The local inputs of ``rank`` (npz, keys ``v0, v1, ...`` in the job's ``input_names`` order)."""
    return Path(run_dir) / "inputs" / f"rank{rank}.npz"


def result_arrays_path(run_dir: Path, rank: int) -> Path:
    """The wanted local outputs of ``rank`` (npz, keys ``v0, v1, ...`` in ``rank<R>.json`` order)."""
    return Path(run_dir) / f"rank{rank}.npz"


def result_info_path(run_dir: Path, rank: int) -> Path:
    """Timings and collective records of ``rank``; written last, so it marks a finished rank."""
    return Path(run_dir) / f"rank{rank}.json"


def error_path(run_dir: Path, rank: int | str) -> Path:
    """The error record of a failed rank."""
    return Path(run_dir) / f"rank{rank}.error.json"


def pid_path(run_dir: Path, pid: int) -> Path:
    """A started worker's pid file (the launcher kills workers by these ids on timeout)."""
    return Path(run_dir) / "pids" / f"{pid}.pid"


def joined_path(run_dir: Path, rank: int) -> Path:
    """Written by a worker once ``init()`` returned, i.e. once every node of the cluster joined."""
    return Path(run_dir) / f"rank{rank}.joined"


def done_path(run_dir: Path, rank: int) -> Path:
    """Written by every worker when it has nothing left to do (on a node, the results may be another rank's)."""
    return Path(run_dir) / f"rank{rank}.done"


def group_name(axis_name: str, ranks: Sequence[int]) -> str:
    """The deterministic communication-group name of one group of a mesh axis.

    >>> group_name("dp", (1, 3))
    'lp_dp_1_3'
    """
    return f"lp_{axis_name}_{'_'.join(str(r) for r in ranks)}"


# --------------------------------------------------------------------------- trusting the run folder
def check_private_folder(folder: Path) -> None:
    """Refuse a run folder that another user could have written to.

    It must be a real folder (not a symbolic link), owned by this process's effective
    user, with no permission at all for group or others (``mkdtemp`` makes it so).

    Raises
    ------
    ExecutionError
        ``unsafe-run-folder``, naming the folder, its owner and its mode.
    """
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise ExecutionError("unsafe-run-folder", f"cannot read the run folder {str(folder)!r}: {exc.strerror}",
                             hint="the launcher makes the run folder; do not start workers by hand") from None
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):o}, open to group or others"
    if problem:
        raise ExecutionError("unsafe-run-folder", f"the run folder {str(folder)!r} {problem}; nothing in it is read",
                             hint="someone else may have prepared it: use a fresh private folder (the default)")


def _job_mac(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()


def write_job(run_dir: Path, job: dict, key: bytes) -> None:
    """Write the job file: its HMAC-SHA256 under ``key``, then the pickle (a new file, never followed)."""
    payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    fd = os.open(Path(run_dir) / JOB_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(_job_mac(key, payload))
        handle.write(payload)


def read_job(run_dir: Path, key: bytes) -> dict:
    """Read the job that :func:`write_job` wrote; unpickle it only if its HMAC under ``key`` checks.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_job(folder, {"wanted": ["y"]}, b"k" * 32)
    >>> read_job(folder, b"k" * 32)
    {'wanted': ['y']}
    >>> read_job(folder, b"x" * 32)
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.ExecutionError: job-not-verified: the job file ... does not carry this run's HMAC; it was not unpickled (hint: the launcher writes the job and passes its key to msrun; do not start workers by hand)
    >>> import shutil; shutil.rmtree(folder)
    """
    path = Path(run_dir) / JOB_FILE
    check_private_folder(Path(run_dir))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise ExecutionError("job-not-verified", f"cannot read the job file {str(path)!r}: {exc.strerror}",
                             hint="the launcher writes the job; do not start workers by hand") from None
    mac, payload = data[:_MAC_BYTES], data[_MAC_BYTES:]
    if len(key) < 16 or not hmac.compare_digest(mac, _job_mac(key, payload)):
        raise ExecutionError("job-not-verified", f"the job file {str(path)!r} does not carry this run's HMAC; "
                             "it was not unpickled",
                             hint="the launcher writes the job and passes its key to msrun; do not start workers "
                             "by hand")
    return pickle.loads(payload)


def write_inputs(run_dir: Path, rank: int, arrays: Sequence[np.ndarray]) -> None:
    """Save ``rank``'s local inputs (in the job's ``input_names`` order) as a plain npz, no pickles."""
    buffer = io.BytesIO()  # built in memory: a failing disk then fails one plain write, not the zip writer
    np.savez(buffer, **{f"v{k}": np.asarray(a) for k, a in enumerate(arrays)})
    fd = os.open(inputs_path(run_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(buffer.getbuffer())


def read_inputs(run_dir: Path, rank: int, names: Sequence[str]) -> dict[str, np.ndarray]:
    """``{name: local array}`` of ``rank``, read with ``allow_pickle=False``."""
    with np.load(inputs_path(run_dir, rank), allow_pickle=False) as arrays:
        return {name: restore_dtype(np.array(arrays[f"v{k}"])) for k, name in enumerate(names)}


def restore_dtype(array: np.ndarray) -> np.ndarray:
    """An array read back from an npz: numpy stores a bfloat16 array (ml_dtypes' type, not one of
    numpy's) as 2-byte voids, which are its bits; every other dtype comes back as it was saved.

    >>> from layout_prop.core.spec import numpy_dtype
    >>> buffer = io.BytesIO()
    >>> np.savez(buffer, v0=np.array([1.5, -2.0], numpy_dtype("bfloat16")))
    >>> _ = buffer.seek(0)
    >>> restore_dtype(np.load(buffer)["v0"])
    array([1.5, -2], dtype=bfloat16)
    """
    if array.dtype.kind == "V" and array.dtype.itemsize == 2 and array.dtype.fields is None:
        from layout_prop.core.spec import numpy_dtype

        return array.view(numpy_dtype("bfloat16"))
    return array


def _write_atomic(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, mode) as handle:
        write(handle)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- emulation arithmetic (pure numpy)
def encode_words(array: np.ndarray) -> np.ndarray:
    """The bits of ``array`` as int32 words, shape ``array.shape + (k,)``.

    4- and 8-byte dtypes are reinterpreted (k = itemsize / 4); 2-byte dtypes widen each
    16-bit word and 1-byte dtypes (bool, int8) each byte to one int32.  A sum-all-reduce
    of buffers in which every position is nonzero on at most one rank is then exact for
    any dtype, bit for bit (``-0.0`` and NaN payloads included).

    >>> encode_words(np.array([1.0], np.float32))
    array([[1065353216]], dtype=int32)
    """
    array = np.ascontiguousarray(array)
    flat = array.reshape(-1)
    itemsize = array.dtype.itemsize
    if itemsize % 4 == 0:
        words = flat.view(np.int32)
        per_item = itemsize // 4
    elif itemsize == 2:
        words, per_item = flat.view(np.uint16).astype(np.int32), 1
    elif itemsize == 1:
        words, per_item = flat.view(np.uint8).astype(np.int32), 1
    else:
        raise ExecutionError("unsupported-dtype", f"cannot move dtype {array.dtype} as int32 words",
                             hint="use a dtype of 1, 2, 4, 8 or 16 bytes")
    return words.reshape(array.shape + (per_item,))


def decode_words(words: np.ndarray, dtype) -> np.ndarray:
    """Inverse of :func:`encode_words`: the array of ``dtype`` whose words are ``words``.

    >>> decode_words(encode_words(np.array([True, False])), bool)
    array([ True, False])
    """
    dtype = np.dtype(dtype)
    shape = words.shape[:-1]
    words = np.ascontiguousarray(words, dtype=np.int32)
    if dtype.itemsize % 4 == 0:
        flat = words.reshape(-1).view(dtype)
    elif dtype.itemsize == 2:
        flat = words.reshape(-1).astype(np.uint16).view(dtype)
    else:
        flat = words.reshape(-1).astype(np.uint8).view(dtype)
    return flat.reshape(shape).copy()


def chunk_offsets(sizes: Sequence[int]) -> list[int]:
    """Start offsets of pieces of the given sizes laid end to end.

    >>> chunk_offsets([3, 3, 3, 1])
    [0, 3, 6, 9]
    """
    offsets, start = [], 0
    for size in sizes:
        offsets.append(start)
        start += int(size)
    return offsets


def chunk(array: np.ndarray, dim: int, n: int, index: int) -> np.ndarray:
    """Piece ``index`` of ``torch.chunk(array, n, dim)`` (padded to ``n`` pieces, some maybe empty), a copy."""
    from layout_prop.core.spec import chunk_bounds

    lo, hi = chunk_bounds(array.shape[dim], n)[index]
    where = [slice(None)] * array.ndim
    where[dim] = slice(lo, hi)
    return np.array(array[tuple(where)], copy=True)


def gather_buffer(block: np.ndarray, index: int, sizes: Sequence[int], dim: int) -> np.ndarray:
    """Rank ``index``'s contribution to an emulated all-gather along ``dim``.

    A zero int32-word buffer of the gathered shape (``sizes`` are the pieces' sizes along
    ``dim``, in group order) with ``block``'s words at its offset.  The sum of all ranks'
    buffers, given to :func:`gather_result`, is the all-gather.
    """
    words = encode_words(block)
    shape = list(words.shape)
    shape[dim] = int(sum(sizes))
    buffer = np.zeros(shape, np.int32)
    start = chunk_offsets(sizes)[index]
    where = [slice(None)] * buffer.ndim
    where[dim] = slice(start, start + block.shape[dim])
    buffer[tuple(where)] = words
    return buffer


def gather_result(summed: np.ndarray, dtype) -> np.ndarray:
    """The gathered array from the sum of every rank's :func:`gather_buffer`."""
    return decode_words(summed, dtype)


def terms_buffer(term: np.ndarray, index: int, n: int) -> np.ndarray:
    """Rank ``index``'s contribution to an emulated all-reduce: its term's words in slot ``index`` of ``n``."""
    words = encode_words(term)
    buffer = np.zeros((n,) + words.shape, np.int32)
    buffer[index] = words
    return buffer


def terms_result(summed: np.ndarray, dtype, op: str) -> np.ndarray:
    """The all-reduce by ``op`` from the sum of every rank's :func:`terms_buffer`.

    The terms are reduced in group order by
    :func:`layout_prop.engines.collectives.reduce_terms`, so the result equals the
    simulator's bit for bit.
    """
    terms = decode_words(summed, dtype)
    return reduce_terms(list(terms), op)


# --------------------------------------------------------------------------- device capabilities
@dataclass(frozen=True)
class DeviceCaps:
    """Which collectives a device runs natively (the rest are emulated from all-reduce).

    ``all_reduce`` maps a numpy dtype name to the reduce ops the native all-reduce
    supports for it; ``all_gather_dtypes`` are the dtypes of the native all-gather,
    which needs equal pieces and, if ``all_gather_world_only``, the world group;
    ``reduce_scatter_dtypes`` / ``all_to_all_dtypes`` (native only for even shapes).
    """

    name: str
    all_reduce: dict
    all_gather_dtypes: frozenset
    all_gather_world_only: bool
    reduce_scatter_dtypes: frozenset
    all_to_all_dtypes: frozenset

    def native_all_reduce(self, dtype: np.dtype, op: str) -> bool:
        return op in self.all_reduce.get(np.dtype(dtype).name, ())


_SUM_MAX_MIN = ("sum", "max", "min")

CPU_CAPS = DeviceCaps(
    name="CPU (mccl)",
    all_reduce={"float32": _SUM_MAX_MIN, "float16": _SUM_MAX_MIN, "int32": _SUM_MAX_MIN, "int64": _SUM_MAX_MIN},
    all_gather_dtypes=frozenset({"float32", "float64", "int32"}),
    all_gather_world_only=True,
    reduce_scatter_dtypes=frozenset(),
    all_to_all_dtypes=frozenset(),
)
"""Measured with MindSpore 2.10 on CPU (see the module docstring)."""

_HCCL_DTYPES = frozenset({"float32", "float16", "int32", "int8"})
ASCEND_CAPS = DeviceCaps(
    name="Ascend (HCCL)",
    all_reduce={name: _SUM_MAX_MIN for name in _HCCL_DTYPES},
    all_gather_dtypes=_HCCL_DTYPES,
    all_gather_world_only=False,
    reduce_scatter_dtypes=_HCCL_DTYPES,
    all_to_all_dtypes=_HCCL_DTYPES,
)
"""HCCL's documented dtypes (conservative; not measured here: no Ascend device)."""


# --------------------------------------------------------------------------- the communicator
@dataclass(frozen=True)
class GroupInfo:
    """One rank's view of its group on a mesh axis."""

    name: str  # MindSpore group name (the world group's name when the group is every rank)
    ranks: tuple[int, ...]
    index: int  # this rank's position in ``ranks``
    is_world: bool

    @property
    def size(self) -> int:
        return len(self.ranks)


def plan_groups(program, rank: int, world_name: str) -> dict[int, GroupInfo]:
    """``rank``'s group on every mesh axis that a collective of ``program`` uses, by axis.

    The axes come in increasing order (every rank creates its groups in that order); a
    group of every rank is named ``world_name``, any other :func:`group_name`.

    >>> from layout_prop.io.loader import load_spec
    >>> from layout_prop.api import analyze
    >>> from layout_prop.passes.lower import Lower
    >>> g = analyze(load_spec('''
    ... mesh: {shape: [2, 2], names: [dp, tp]}
    ... inputs: {x: {shape: [4], placements: ["S(0)", "R"]}}
    ... nodes: [{name: y, op: redistribute, inputs: [x], attrs: {placements: [R, R]}}]
    ... ''')).graph
    >>> plan_groups(Lower().run(g).program, 3, "world")
    {0: GroupInfo(name='lp_dp_1_3', ranks=(1, 3), index=1, is_world=False)}
    """
    mesh = program.mesh
    world = tuple(range(mesh.size))
    groups: dict[int, GroupInfo] = {}
    for axis in sorted({op.step.mesh_axis for op in program.collectives}):
        ranks = tuple(int(r) for r in mesh.group(rank, axis))
        is_world = ranks == world
        name = world_name if is_world else group_name(mesh.names[axis], ranks)
        groups[axis] = GroupInfo(name, ranks, ranks.index(rank), is_world)
    return groups


class Communicator:
    """Runs planned collective steps for one rank with MindSpore, native or emulated.

    Parameters
    ----------
    program : layout_prop.passes.lower.Program
        The program (for the mesh and the collectives' axes).
    rank : int
        This process's rank.
    caps : DeviceCaps
        What the device runs natively.

    Every run returns the result and a record ``{"value", "kind", "mesh_axis", "group",
    "emulated", "impl", "seconds"}``.
    """

    def __init__(self, program, rank: int, caps: DeviceCaps) -> None:
        import mindspore
        from mindspore.communication import GlobalComm, create_group

        self.ms = mindspore
        self.rank = rank
        self.caps = caps
        self.mesh = program.mesh
        self.groups = plan_groups(program, rank, GlobalComm.WORLD_COMM_GROUP)
        for group in self.groups.values():  # the same order on every rank
            if not group.is_world and group.size > 1:
                create_group(group.name, list(group.ranks))

    # ---------------------------------------------------------------- native primitives
    def _tensor(self, array: np.ndarray):
        return self.ms.Tensor(np.ascontiguousarray(array))

    def _native_all_reduce(self, array: np.ndarray, op: str, group: GroupInfo) -> np.ndarray:
        from mindspore.ops import communication

        if array.size == 0:  # every member has the same (empty) shape: nothing to move
            return array.copy()
        tensor = self._tensor(array)
        communication.all_reduce(tensor, op, group.name)
        return np.array(tensor.asnumpy(), copy=True)

    def _native_all_gather(self, array: np.ndarray, dim: int, group: GroupInfo) -> np.ndarray:
        """Native AllGather (along dim 0 of the moved array): equal pieces only."""
        moved = np.ascontiguousarray(np.moveaxis(array, dim, 0))
        out = self.ms.ops.AllGather(group.name)(self._tensor(moved)).asnumpy()
        stacked = out.reshape((group.size,) + moved.shape)
        return np.concatenate([np.moveaxis(stacked[k], 0, dim) for k in range(group.size)], axis=dim)

    def _native_reduce_scatter(self, array: np.ndarray, op: str, dim: int, group: GroupInfo) -> np.ndarray:
        ops = self.ms.ops
        reduce_op = {"sum": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX, "min": ops.ReduceOp.MIN}[op]
        moved = np.ascontiguousarray(np.moveaxis(array, dim, 0))
        out = ops.ReduceScatter(reduce_op, group.name)(self._tensor(moved)).asnumpy()
        return np.ascontiguousarray(np.moveaxis(out, 0, dim))

    def _native_all_to_all(self, array: np.ndarray, split_dim: int, concat_dim: int, group: GroupInfo):
        op = self.ms.ops.AlltoAll(group.size, split_dim, concat_dim, group.name)
        return np.array(op(self._tensor(array)).asnumpy(), copy=True)

    def _sum_words(self, buffer: np.ndarray, group: GroupInfo) -> np.ndarray:
        return self._native_all_reduce(buffer, "sum", group)

    def world_sum(self, buffer: np.ndarray) -> np.ndarray:
        """A native sum-all-reduce of an int32 buffer over every rank."""
        from mindspore.communication import GlobalComm

        world = tuple(range(self.mesh.size))
        return self._sum_words(buffer, GroupInfo(GlobalComm.WORLD_COMM_GROUP, world, self.rank, True))

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, array: np.ndarray, op: str, group: GroupInfo) -> tuple[np.ndarray, bool, str]:
        """``(result, emulated, impl)`` of an all-reduce by ``op`` (sum, avg, max, min)."""
        if group.size == 1:
            return array.copy(), False, "group of one: copy"
        dtype = array.dtype
        is_float = np.issubdtype(dtype, np.floating)
        if op == "avg" and is_float and self.caps.native_all_reduce(dtype, "sum"):
            total = self._native_all_reduce(array, "sum", group)
            return (total / group.size).astype(dtype), False, "native all_reduce(sum) / n"
        if op != "avg" and self.caps.native_all_reduce(dtype, op):
            return self._native_all_reduce(array, op, group), False, f"native all_reduce({op})"
        summed = self._sum_words(terms_buffer(array, group.index, group.size), group)
        return terms_result(summed, dtype, op), True, "terms gathered by all_reduce(sum) of int32 words, reduced locally"

    def all_gather(self, array: np.ndarray, dim: int, sizes: Sequence[int], group: GroupInfo,
                   split_factor: int = 1):
        """``(result, emulated, impl)`` of an all-gather along ``dim``; ``sizes`` are the pieces' sizes.

        With ``split_factor`` k the pieces are strided shards ``_S(dim,k)``: once gathered
        in group order, they are put in block order (:func:`~layout_prop.engines.collectives.gathered`).
        """
        result, emulated, impl = self._gather_in_group_order(array, dim, sizes, group)
        if split_factor > 1 and group.size > 1:
            pieces = np.split(result, chunk_offsets(sizes)[1:], axis=dim)
            result = gathered(pieces, dim, split_factor)
            impl = f"{impl}, then the {split_factor} blocks of each piece put in block order"
        return result, emulated, impl

    def _gather_in_group_order(self, array: np.ndarray, dim: int, sizes: Sequence[int], group: GroupInfo):
        """``(result, emulated, impl)``: the pieces concatenated along ``dim`` in group order."""
        if group.size == 1:
            return array.copy(), False, "group of one: copy"
        gathered_shape = list(array.shape)
        gathered_shape[dim] = int(sum(sizes))
        if int(np.prod(gathered_shape)) == 0:  # every member knows the result is empty: nothing to move
            return np.empty(gathered_shape, array.dtype), False, "empty result: no communication"
        even = len(set(sizes)) == 1
        native = (even and array.dtype.name in self.caps.all_gather_dtypes
                  and (group.is_world or not self.caps.all_gather_world_only))
        if native:
            return self._native_all_gather(array, dim, group), False, "native AllGather"
        summed = self._sum_words(gather_buffer(array, group.index, sizes, dim), group)
        return gather_result(summed, array.dtype), True, "zero buffer + all_reduce(sum) of int32 words"

    def reduce_scatter(self, array: np.ndarray, op: str, dim: int, group: GroupInfo):
        if group.size == 1:
            return array.copy(), False, "group of one: copy"
        native = (array.dtype.name in self.caps.reduce_scatter_dtypes and op in _SUM_MAX_MIN
                  and array.shape[dim] % group.size == 0)
        if native:
            return self._native_reduce_scatter(array, op, dim, group), False, "native ReduceScatter"
        total, _, how = self.all_reduce(array, op, group)
        return chunk(total, dim, group.size, group.index), True, f"{how}, then the local chunk"

    def all_to_all(self, array: np.ndarray, split_dim: int, concat_dim: int, sizes: Sequence[int],
                   group: GroupInfo):
        if group.size == 1:
            return array.copy(), False, "group of one: copy"
        native = (array.dtype.name in self.caps.all_to_all_dtypes and len(set(sizes)) == 1
                  and array.shape[split_dim] % group.size == 0)
        if native:
            return self._native_all_to_all(array, split_dim, concat_dim, group), False, "native AlltoAll"
        gathered, _, how = self.all_gather(array, concat_dim, sizes, group)
        return chunk(gathered, split_dim, group.size, group.index), True, f"all-gather ({how}), then the local chunk"

    def permute(self, array: np.ndarray, shift: int, cyclic: bool, group: GroupInfo):
        """``(result, emulated, impl)``: the piece of group member ``index - shift`` (zeros if none)."""
        source = group.index - shift
        if cyclic:
            source %= group.size
        if group.size == 1:
            return (array.copy() if source == 0 else np.zeros_like(array)), False, "group of one: copy"
        summed = self._sum_words(terms_buffer(array, group.index, group.size), group)
        if not 0 <= source < group.size:
            return np.zeros_like(array), True, "pieces gathered by all_reduce(sum) of int32 words; no sender: zeros"
        piece = decode_words(summed[source], array.dtype)
        return piece, True, "pieces gathered by all_reduce(sum) of int32 words, the sender's kept"

    def run_step(self, op, array: np.ndarray) -> tuple[np.ndarray, dict]:
        """Run the collective ``op`` (a LocalOp of kind ``collective``) on this rank's ``array``."""
        step = op.step
        group = self.groups[step.mesh_axis]
        sizes = [step.src.local_shape(r)[step.dim] for r in group.ranks] if step.dim is not None else []
        start = time.perf_counter()
        if step.kind == "all-reduce":
            result, emulated, impl = self.all_reduce(array, step.reduce_op, group)
        elif step.kind == "all-gather":
            result, emulated, impl = self.all_gather(array, step.dim, sizes, group, step_split_factor(step))
        elif step.kind == "reduce-scatter":
            result, emulated, impl = self.reduce_scatter(array, step.reduce_op, step.dim, group)
        elif step.kind == "all-to-all":
            result, emulated, impl = self.all_to_all(array, step.dst_dim, step.dim, sizes, group)
        elif step.kind == "permute":
            result, emulated, impl = self.permute(array, step.shift, step.cyclic, group)
        else:
            raise ExecutionError("unknown-step", f"unknown collective kind {step.kind!r}",
                                 hint="collectives are all-gather, all-reduce, reduce-scatter, all-to-all, permute")
        record = {"value": op.outputs[0], "source": op.source, "kind": step.kind,
                  "mesh_axis": self.mesh.names[step.mesh_axis], "group": list(group.ranks),
                  "emulated": emulated, "impl": impl, "seconds": time.perf_counter() - start}
        return result, record


# --------------------------------------------------------------------------- running one rank
def _check_shape(value: str, array: np.ndarray, spec, rank: int, what: str) -> None:
    want = tuple(spec.local_shape(rank))
    if tuple(array.shape) != want:
        raise ExecutionError("internal-error", f"{what} left rank {rank} with shape {list(array.shape)} for "
                             f"{value!r}, expected {list(want)}", hint="please report this: the engine and "
                             "the program disagree on a local shape")


def _kernel_table(backend: str) -> tuple[dict, Callable, Callable]:
    """The backend's kernel table and its conversions from and to numpy."""
    if backend == "numpy":
        from layout_prop.kernels.numpy_backend import KERNELS

        return KERNELS, np.asarray, np.asarray
    from layout_prop.kernels.mindspore_backend import get_table, to_numpy, to_tensor

    return get_table(backend), to_tensor, to_numpy


def _run_kernel(op, rank: int, backend: str, env: dict[str, np.ndarray]) -> None:
    from layout_prop.kernels.numpy_backend import get_kernel

    table, to_backend, to_numpy = _kernel_table(backend)
    fn = get_kernel(op.op, table, backend)
    args = [env[v] for v in op.inputs]
    try:
        result = fn(*[to_backend(a) for a in args], **op.attrs[rank])
    except ExecutionError:
        raise
    except Exception as exc:
        shapes = [list(a.shape) for a in args]
        first = next((line for line in str(exc).splitlines() if line.strip().strip("-")), "")
        raise ExecutionError("kernel-failed", f"kernel {op.op!r} failed on rank {rank} with local shapes "
                             f"{shapes}: {type(exc).__name__}: {first}", node=op.source,
                             hint="the op's localize rule, its layout rule or the kernel is wrong") from exc
    results = [result] if len(op.outputs) == 1 else list(result)
    from layout_prop.core.spec import numpy_dtype

    for value, res, spec in zip(op.outputs, results, op.specs):
        # a bfloat16 output: the kernels compute in float32 (MindSpore's CPU kernels take no bfloat16), rounded here
        # to ml_dtypes' bfloat16 (np.dtype("bfloat16") is MindSpore's own type once MindSpore is imported)
        array = to_numpy(res).astype(numpy_dtype(spec.dtype), copy=False)
        _check_shape(value, array, spec, rank, f"kernel {op.op!r}")
        env[value] = array


def run_rank(program, rank: int, inputs: dict[str, np.ndarray], backend: str, comm: Communicator | None,
             progress: dict) -> tuple[dict[str, np.ndarray], dict[str, float], list[dict]]:
    """Run ``program``'s ops for ``rank``; ``(env, seconds per op kind, collective records)``.

    ``progress["op"]`` names the op being run, for the error report.
    """
    env: dict[str, np.ndarray] = {}
    seconds = {"input": 0.0, "kernel": 0.0, "slice": 0.0, "local": 0.0, "collective": 0.0}
    records: list[dict] = []
    ops = program.rank_ops(rank) if hasattr(program, "rank_ops") else program.ops  # a pipeline: each rank its own
    for op in ops:
        progress["op"] = f"{op.kind} {op.name!r} ({op.op})"
        start = time.perf_counter()
        if op.kind == "input":
            if op.name not in inputs:
                raise ExecutionError("missing-input", f"no local piece for graph input {op.name!r}",
                                     input=op.name, hint="the launcher must write every input of every rank")
            env[op.name] = np.asarray(inputs[op.name])
            _check_shape(op.name, env[op.name], op.specs[0], rank, "input")
        elif op.kind == "kernel":
            _run_kernel(op, rank, backend, env)
        elif op.kind in ("slice", "local"):  # no communication: the simulator's arithmetic on this rank's array
            index = list(program.mesh.group(rank, op.step.mesh_axis)).index(rank)
            env[op.outputs[0]] = np.array(local_step(op.step, env[op.inputs[0]], index), copy=True)
        elif op.kind == "collective":
            env[op.outputs[0]], record = comm.run_step(op, env[op.inputs[0]])
            records.append(record)
        else:
            raise ExecutionError("unknown-op-kind", f"unknown local op kind {op.kind!r}",
                                 hint="local ops are input, kernel, slice, local, collective")
        for value, spec in zip(op.outputs, op.specs):
            _check_shape(value, env[value], spec, rank, f"{op.kind} {op.name!r}")
        seconds[op.kind] += time.perf_counter() - start
    progress["op"] = "saving results"
    return env, seconds, records


def _fail_on_purpose(rank: int) -> None:
    wanted = os.environ.get(FAIL_RANK_ENV, "").strip()
    if wanted and wanted.lstrip("-").isdigit() and int(wanted) == rank:
        raise ExecutionError("injected-failure", f"rank {rank} fails on purpose ({FAIL_RANK_ENV}={wanted})",
                             hint=f"unset {FAIL_RANK_ENV}; it is a test hook")


def _pause_on_purpose(run_dir: Path, rank: int) -> None:
    seconds = os.environ.get(PAUSE_ENV, "").strip()
    if seconds:
        (Path(run_dir) / f"rank{rank}.paused").write_text(f"{os.getpid()}\n")
        time.sleep(float(seconds))


def _checked_rank(rank: int) -> int:
    """``rank`` from ``get_rank()``; it must be msrun's ``RANK_ID`` (the launcher names ranks by it)."""
    exported = os.environ.get("RANK_ID", "")
    if exported.isdigit() and int(exported) != rank:
        raise ExecutionError("rank-mismatch", f"get_rank() is {rank} but msrun exported RANK_ID={exported}",
                             hint="please report this: the launcher names failed ranks by RANK_ID")
    return rank


def _one_line(exc: BaseException) -> str:
    """The traceback's last line, kept to one line (MindSpore errors span many)."""
    if isinstance(exc, ExecutionError):
        return str(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip().strip("-")]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _wanted_locals(rank: int, env: dict, wanted: Sequence[str], outputs: dict) -> list[np.ndarray]:
    arrays = []
    for value in wanted:
        local = outputs.get(value, value)
        if local not in env:
            raise ExecutionError("missing-output", f"rank {rank} has no value {local!r} for output {value!r}",
                                 hint="ask only for the program's outputs")
        arrays.append(env[local])
    return arrays


def _save_results(run_dir: Path, rank: int, arrays: Sequence[np.ndarray], wanted: Sequence[str], info: dict) -> None:
    named = {f"v{k}": array for k, array in enumerate(arrays)}
    _write_atomic(result_arrays_path(run_dir, rank), lambda h: np.savez(h, **named), mode="wb")
    info = dict(info, outputs=list(wanted))
    _write_atomic(result_info_path(run_dir, rank), lambda h: json.dump(info, h, indent=1))


def share_results(program, rank: int, wanted: Sequence[str], arrays: Sequence[np.ndarray], info: dict,
                  world_sum: Callable[[np.ndarray], np.ndarray]) -> tuple[list[list[np.ndarray]], list[dict]]:
    """Every rank's wanted local outputs and info record, on every rank, through sum-all-reduces.

    Each rank knows every rank's local shapes from the program, so one int32 buffer holds
    every rank's pieces (as :func:`encode_words`) end to end, each rank filling only its
    own part; a first all-reduce shares the lengths of the JSON records, which go at the
    end of the same buffer, one byte a word.  ``world_sum`` is the all-reduce.

    Returns
    -------
    (pieces, infos)
        ``pieces[k][r]`` is rank r's local array of ``wanted[k]``; ``infos[r]`` rank r's record.
    """
    size = program.mesh.size
    record = np.frombuffer(json.dumps(info).encode(), np.uint8)
    lengths = np.zeros(size, np.int32)
    lengths[rank] = record.size
    lengths = world_sum(lengths)
    layout = []  # (k, r, start, shape, dtype, words per item)
    start = 0
    for k, value in enumerate(wanted):
        spec = program.specs[program.outputs.get(value, value)]
        from layout_prop.core.spec import numpy_dtype

        dtype = numpy_dtype(spec.dtype)
        per_item = encode_words(np.zeros(1, dtype)).shape[-1]
        for r in range(size):
            shape = tuple(int(n) for n in spec.local_shape(r))
            layout.append((k, r, start, shape, dtype, per_item))
            start += int(np.prod(shape, dtype=np.int64)) * per_item
    records_start = start
    buffer = np.zeros(records_start + int(lengths.sum()), np.int32)
    for k, r, begin, shape, dtype, per_item in layout:
        if r == rank:
            words = encode_words(np.asarray(arrays[k]).astype(dtype, copy=False)).reshape(-1)
            buffer[begin:begin + words.size] = words
    mine = records_start + int(lengths[:rank].sum())
    buffer[mine:mine + record.size] = record
    summed = world_sum(buffer) if buffer.size else buffer
    pieces: list[list[np.ndarray]] = [[] for _ in wanted]
    for k, r, begin, shape, dtype, per_item in layout:
        count = int(np.prod(shape, dtype=np.int64)) * per_item
        pieces[k].append(decode_words(summed[begin:begin + count].reshape(shape + (per_item,)), dtype))
    infos, at = [], records_start
    for r in range(size):
        infos.append(json.loads(summed[at:at + int(lengths[r])].astype(np.uint8).tobytes().decode()))
        at += int(lengths[r])
    return pieces, infos


def main(argv: Sequence[str] | None = None) -> int:
    """Run one msrun worker (or the scheduler); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m layout_prop.engines.msrun_worker RUN_FOLDER", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    msrun_pid = os.environ.get(MSRUN_PID_ENV, "")
    die_with_parent(int(msrun_pid) if msrun_pid.isdigit() else None)  # msrun gone: so are we
    started = time.perf_counter()
    check_private_folder(run_dir)  # before writing or reading anything in it
    import mindspore
    from mindspore.communication import get_rank, init

    if os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun runs the command once more as the scheduler
        if os.environ.get(NODE_RANK_ENV, "0") not in ("", "0"):
            return 0  # an emulated node on the master's host: node 0's msrun runs the scheduler
        init()
        return 0
    pid_path(run_dir, os.getpid()).write_text(f"{os.getpid()}\n")
    rank: int | str = os.environ.get("RANK_ID", f"unknown-{os.getpid()}")
    progress = {"op": "startup"}
    try:
        job = read_job(run_dir, bytes.fromhex(os.environ.get(JOB_KEY_ENV, "")))
        mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
        mindspore.set_device(job["device_target"])
        progress["op"] = "init"
        init()
        rank = _checked_rank(get_rank())
        joined_path(run_dir, rank).write_text("joined\n")  # the cluster formed: every node is there
        progress["op"] = "start"
        _pause_on_purpose(run_dir, rank)
        _fail_on_purpose(rank)
        program = job["program"]
        progress["op"] = "create groups"
        caps = ASCEND_CAPS if job["device_target"] == "Ascend" else CPU_CAPS
        comm = Communicator(program, rank, caps)
        inputs = read_inputs(run_dir, rank, job["input_names"])
        setup = time.perf_counter() - started
        env, seconds, records = run_rank(program, rank, inputs, job["backend"], comm, progress)
        seconds["setup"] = setup
        seconds["total"] = time.perf_counter() - started
        info = {"rank": rank, "pid": os.getpid(), "seconds": seconds, "collectives": records,
                "device": caps.name}
        wanted = job["wanted"]
        arrays = _wanted_locals(rank, env, wanted, program.outputs)
        if job.get("nodes", 1) == 1:
            _save_results(run_dir, rank, arrays, wanted, info)
        else:  # no shared filesystem: every rank's results reach every node over the collective backend
            progress["op"] = "sharing results"
            pieces, infos = share_results(program, rank, wanted, arrays, info, comm.world_sum)
            if rank == job["collector"]:
                for r, record in enumerate(infos):
                    _save_results(run_dir, r, [piece[r] for piece in pieces], wanted, record)
        done_path(run_dir, rank).write_text("done\n")
    except BaseException as exc:
        record = {"rank": rank, "op": progress["op"], "message": _one_line(exc), "time": time.time(),
                  "traceback": traceback.format_exc()}
        _write_atomic(error_path(run_dir, rank), lambda h: json.dump(record, h, indent=1))
        raise  # MindSpore's excepthook tells the cluster; the exit code is non-zero
    return 0


if __name__ == "__main__":
    sys.exit(main())
