"""The in-process SPMD simulator: every rank's local program, collectives exact.

Ranks advance in lockstep through the program (SPMD: the same ops everywhere): a
``kernel`` op runs the backend's kernel on each rank's local arrays with that rank's
localised attrs; a ``slice`` or ``collective`` op runs the planned step on every group
of its mesh axis at once (:func:`layout_prop.engines.collectives.apply_step`), uneven
shards included.

Buffers
-------
When the caller names the ``wanted`` values, every other value leaves the environment
right after its last use, and a reduction (all-reduce, reduce-scatter) whose input dies
at that step accumulates into the input's buffer instead of a fresh array, when that
buffer is provably nobody else's (:func:`_exclusively_held`).  On the Llama backward
this is where most of the simulator's fresh memory went: the data-parallel weight
gradients, reduced over dp and then sp.  Results are bit-identical either way.

bfloat16
--------
numpy has no bfloat16 arithmetic of its own (``ml_dtypes`` gives the type and casts): every
kernel that reads or writes a bfloat16 value computes in float32 and rounds each bfloat16
output once, to nearest even (:func:`call_kernel`, which the one-device reference calls
too), and a collective on bfloat16 pieces reduces them in float32 and rounds the result
once, as a kernel's output.  So every op's output is what a bfloat16 device stores; the
sharded run and one device then differ by where that rounding falls (a partial sum is
rounded before it is reduced), which the dtype's tolerance covers
(:data:`layout_prop.runner.TOLERANCES`).

Examples
--------
>>> import numpy as np
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.api import analyze
>>> from layout_prop.passes.lower import Lower
>>> g = analyze(load_spec('''
... mesh: {shape: [2], names: [tp]}
... inputs: {a: {shape: [3], placements: ["P(sum)"]}, b: {shape: [3], placements: ["S(0)"]}}
... nodes: [{name: c, op: add, inputs: [a, b]}]
... '''), reshard=True).graph
>>> prog = Lower().run(g).program
>>> [op.op for op in prog.collectives]
['reduce-scatter']
>>> out = Simulator().execute(prog, {"a": np.arange(3.0), "b": np.ones(3)}, np.random.default_rng(0))
>>> [local.tolist() for local in out["c"]]
[[1.0, 2.0], [3.0]]
>>> out = Simulator().execute(prog, {"a": np.arange(3.0), "b": np.ones(3)}, wanted=["c"])
>>> sorted(out)
['c']
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable, Sequence

import numpy as np

from layout_prop.core.errors import ExecutionError
from layout_prop.core.graph import last_uses
from layout_prop.core.spec import TensorSpec, numpy_dtype

from .collectives import DONATING_STEPS, apply_step, may_overlap_itself, scatter_global
from layout_prop.kernels.numpy_backend import KERNELS, get_kernel

__all__ = ["Simulator", "call_kernel"]


class Simulator:
    """Runs a lowered :class:`~layout_prop.passes.lower.Program` on all ranks in one process.

    Parameters
    ----------
    kernels : dict of str to callable, optional
        The kernel table (default: the numpy kernels).
    backend : str
        The backend name used to look kernels up.
    donate : bool
        Let reductions reuse the buffers of values that die at them (only when
        :meth:`execute` is given ``wanted``; ``False`` always allocates, for comparison).

    Attributes
    ----------
    donated : dict of str to tuple of int
        After :meth:`execute`: for each reduced value whose input buffers were reused, the
        ranks whose buffer now holds the result.
    """

    name = "sim"

    def __init__(self, kernels: dict[str, Callable] | None = None, backend: str = "numpy",
                 donate: bool = True) -> None:
        self.kernels = KERNELS if kernels is None else kernels
        self.backend = backend
        self.donate = donate
        self.donated: dict[str, tuple[int, ...]] = {}

    def execute(self, program, global_inputs: dict[str, np.ndarray],
                rng: np.random.Generator | None = None,
                scattered: dict[str, list[np.ndarray]] | None = None,
                wanted: Sequence[str] | None = None) -> dict[str, list[np.ndarray]]:
        """Run every rank of ``program``; ``{value: [array of rank 0, array of rank 1, ...]}``.

        Parameters
        ----------
        program : layout_prop.passes.lower.Program
            The lowered program.
        global_inputs : dict of str to numpy.ndarray
            Global arrays of the graph inputs, cut with ``scatter_global`` (``rng``
            randomises the terms of Partial inputs).  Never written.
        rng : numpy.random.Generator, optional
            Passed to ``scatter_global``.
        scattered : dict of str to list of numpy.ndarray, optional
            Inputs already cut into per-rank pieces (``rng`` is not used for them).  Never
            written.
        wanted : sequence of str, optional
            The values to return (the program's output names or any local value).  Every
            other value is dropped after its last use, and reductions may reuse dying
            buffers.  Default: return every value, drop nothing.

        Returns
        -------
        dict of str to list of numpy.ndarray
            Every value, or the wanted ones in ``wanted`` order.

        Raises
        ------
        ExecutionError
            ``missing-output`` (a wanted value that no op makes), ``missing-input``,
            ``kernel-failed``, and the collectives' errors.
        """
        self.donated = {}
        locals_of = None if wanted is None else _wanted_locals(program, wanted)
        dying = {} if locals_of is None else last_uses(program.ops, set(locals_of.values()))
        env: dict[str, list[np.ndarray]] = {}
        caller_owned = set()  # values whose arrays the caller passed in: never donated
        for index, op in enumerate(program.ops):
            if op.kind == "input":
                env[op.name] = _cut_input(op, global_inputs, rng, scattered)
                if scattered is not None and op.name in scattered:
                    caller_owned.add(op.name)
            elif op.kind == "kernel":
                env.update(self._run_kernel(op, env, program.mesh.size))
            else:
                gives_up = self.donate and op.inputs[0] in dying.get(index, ()) and op.inputs[0] not in caller_owned
                self._run_step(op, env, gives_up)
            for value in dying.get(index, ()):
                env.pop(value, None)
        if locals_of is None:
            return env
        return {name: env[local] for name, local in locals_of.items()}

    def run_op(self, op, env: dict[str, list[np.ndarray]], ranks: int) -> None:
        """Run one kernel, slice or collective op of a program on every rank, reading and writing
        ``env`` (value -> one array per rank); nothing is donated.  The pipeline executor
        (:mod:`layout_prop.engines.pipeline`) runs a stage's tasks with it."""
        if op.kind == "kernel":
            env.update(self._run_kernel(op, env, ranks))
        else:
            self._run_step(op, env, False)

    def _run_kernel(self, op, env: dict[str, list[np.ndarray]], ranks: int) -> dict[str, list[np.ndarray]]:
        """The kernel's outputs on every rank, by value name."""
        fn = get_kernel(op.op, self.kernels, self.backend)
        dtypes = tuple(spec.dtype for spec in op.specs)
        results = [_call_kernel(fn, op, [env[v][r] for v in op.inputs], r, dtypes) for r in range(ranks)]
        if len(op.outputs) == 1:
            return {op.outputs[0]: [np.asarray(res) for res in results]}
        return {value: [np.asarray(res[k]) for res in results] for k, value in enumerate(op.outputs)}

    def _run_step(self, op, env: dict[str, list[np.ndarray]], gives_up: bool) -> None:
        """Run a slice or collective; with ``gives_up`` its input dies here and may be donated."""
        value, result = op.inputs[0], op.outputs[0]
        if _is_bfloat16(env[value][0]):
            env[result] = _bfloat16_step(op.step, env[value])
            return
        if not (gives_up and op.step.kind in DONATING_STEPS):
            env[result] = apply_step(op.step, env[value])
            return
        locals_ = env.pop(value)  # from here on the environment holds no reference to the input
        donatable = [rank for rank in range(len(locals_)) if _exclusively_held(locals_, rank)]
        for rank in donatable:
            locals_[rank].flags.writeable = True  # a shared result is read-only; nobody else holds it now
        env[result] = apply_step(op.step, locals_, donatable)
        reused = tuple(r for r in donatable if np.may_share_memory(env[result][r], locals_[r]))
        if reused:
            self.donated[result] = reused


def _is_bfloat16(array) -> bool:
    return getattr(array, "dtype", None) is not None and array.dtype.name == "bfloat16"


def call_kernel(fn: Callable, args: Sequence, attrs: dict, out_dtypes: Sequence[str | None]):
    """``fn(*args, **attrs)``, through float32 where bfloat16 is involved (module docstring).

    When an argument is bfloat16, or an output's dtype (``out_dtypes``, from the output specs)
    is, the bfloat16 arguments are passed as float32 (exactly: every bfloat16 is a float32),
    an attr ``"bfloat16"`` (a cast's target dtype) as ``"float32"``, and each output whose
    dtype is bfloat16 is rounded to bfloat16 once; the kernels never see a bfloat16 array.
    Otherwise the kernel is called as it is.

    >>> import numpy as np
    >>> from layout_prop.core.spec import numpy_dtype
    >>> x = np.array([1.0, 1.0 + 2 ** -8], np.float32).astype(numpy_dtype("bfloat16"))  # 1 + 2^-8 rounds to 1
    >>> y = call_kernel(lambda a, b: a + b, [x, x], {}, ["bfloat16"])
    >>> y.dtype.name, y.tolist()
    ('bfloat16', [2.0, 2.0])
    >>> call_kernel(lambda a: a * 3, [np.float32(1.0)], {}, ["float32"])
    3.0
    """
    if not any(_is_bfloat16(a) for a in args) and "bfloat16" not in out_dtypes:
        return fn(*args, **attrs)
    args = [np.asarray(a, dtype=np.float32) if _is_bfloat16(a) else a for a in args]
    attrs = {k: "float32" if isinstance(v, str) and v == "bfloat16" else v for k, v in attrs.items()}
    result = fn(*args, **attrs)
    if len(out_dtypes) == 1:
        return _rounded(result, out_dtypes[0])
    return tuple(_rounded(r, dtype) for r, dtype in zip(result, out_dtypes))


def _rounded(result, dtype: str | None):
    """A kernel's output, rounded to bfloat16 when its dtype is bfloat16 (else as it is)."""
    if dtype != "bfloat16":
        return result
    return np.asarray(result).astype(numpy_dtype("bfloat16"))


def _bfloat16_step(step, pieces: list[np.ndarray]) -> list[np.ndarray]:
    """A slice or collective on bfloat16 pieces: run on their float32 values, each resulting
    piece rounded once to bfloat16 (a result shared by several ranks stays one array)."""
    widened = [np.asarray(p, dtype=np.float32) for p in pieces]
    rounded: dict[int, np.ndarray] = {}
    out = []
    for piece in apply_step(step, widened):
        if id(piece) not in rounded:
            rounded[id(piece)] = piece.astype(numpy_dtype("bfloat16"))
        out.append(rounded[id(piece)])
    return out


def _call_kernel(fn: Callable, op, args: list[np.ndarray], rank: int, out_dtypes: Sequence[str] = ()):
    try:
        return call_kernel(fn, args, op.attrs[rank], out_dtypes)
    except ExecutionError:
        raise
    except Exception as exc:  # a kernel failing on a rank's local shapes is reported, not hidden
        shapes = [list(a.shape) for a in args]
        raise ExecutionError("kernel-failed", f"kernel {op.op!r} failed on rank {rank} with local "
                             f"shapes {shapes}: {type(exc).__name__}: {exc}", node=op.source,
                             hint="the op's localize rule or its layout rule is wrong") from exc


def _cut_input(op, global_inputs: dict[str, np.ndarray], rng: np.random.Generator | None,
               scattered: dict[str, list[np.ndarray]] | None) -> list[np.ndarray]:
    """Every rank's piece of the input ``op``: the caller's pieces (a list of our own), or cut."""
    if scattered is not None and op.name in scattered:
        return list(scattered[op.name])  # our list: dropping the value never touches the caller's
    if op.name not in global_inputs:
        raise ExecutionError("missing-input", f"no value given for graph input {op.name!r}",
                             input=op.name, hint="give every graph input an array")
    spec = op.specs[0]
    if spec.dtype != "bfloat16":
        return scatter_global(np.asarray(global_inputs[op.name]), spec, rng)
    return _cut_bfloat16(np.asarray(global_inputs[op.name], dtype=np.float32), spec, rng)


def _cut_bfloat16(value: np.ndarray, spec, rng: np.random.Generator | None) -> list[np.ndarray]:
    """Every rank's bfloat16 piece of the float32 ``value`` (whose elements are bfloat16 values).

    Cut in float32 (:func:`scatter_global`).  The random terms of a Partial input are exact in
    float32 but not always in bfloat16 (a residual ``0.001 - 1.75``): an element where any
    rank's term would round keeps the plain split instead on every rank (the value on the
    first term of each Partial axis, the reduction's identity elsewhere), which is exact.  So
    the terms reduce to the value exactly, as they do in float32.
    """
    bf16 = numpy_dtype("bfloat16")
    wide = TensorSpec(spec.shape, "float32", spec.layout)
    pieces = scatter_global(value, wide, rng)
    if rng is None or not spec.layout.partial_axes():
        return [piece.astype(bf16) for piece in pieces]
    rounded = [piece.astype(bf16).astype(np.float32) for piece in pieces]
    inexact = np.zeros(spec.shape, dtype=bool)
    for rank, (piece, back) in enumerate(zip(pieces, rounded)):
        with np.errstate(invalid="ignore"):
            inexact[spec.local_index(rank)] |= ~((back == piece) | (np.isnan(back) & np.isnan(piece)))
    if not inexact.any():
        return [back.astype(bf16) for back in rounded]
    plain = scatter_global(value, wide, None)
    return [np.where(inexact[spec.local_index(rank)], plain[rank], back).astype(bf16)
            for rank, back in enumerate(rounded)]


def _wanted_locals(program, wanted: Sequence[str]) -> dict[str, str]:
    """Each wanted name and the local value that holds it (``program.outputs`` maps names).

    >>> from types import SimpleNamespace as NS
    >>> prog = NS(outputs={"y": "y"}, ops=[NS(outputs=("x",)), NS(outputs=("y",))])
    >>> _wanted_locals(prog, ["y", "x"])
    {'y': 'y', 'x': 'x'}
    >>> _wanted_locals(prog, ["z"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.ExecutionError: missing-output: the program makes no value 'z' (hint: ... outputs y)
    """
    made = {value for op in program.ops for value in op.outputs}
    out = {}
    for name in wanted:
        local = program.outputs.get(name, name)
        if local not in made:
            raise ExecutionError("missing-output", f"the program makes no value {name!r}",
                                 hint=f"ask only for values of the program, such as its outputs "
                                      f"{', '.join(program.outputs)}")
        out[name] = local
    return out


# --------------------------------------------------------------------------- donation safety
# A reduction may overwrite the buffer of a dying input only if no one else can ever see
# that memory again.  Liveness alone cannot tell: kernels may return views of their
# inputs (reshape, transpose), a collective's result is one object for several ranks,
# and a kernel (or the caller) may keep an array of its own.  The check therefore asks
# CPython who refers to the array: after the environment has let go of the dying value,
# the only references must be the slots of its own per-rank list.  Every numpy view holds
# a reference to the array owning its memory (``base``, collapsed to the owner), so a
# live view anywhere (another value, a kernel's cache, the caller) shows up as one more
# reference, to the array or to its owner; weak references are refused as well.  This
# sees holders that an alias analysis over the program's ops (``np.may_share_memory``
# between each op's inputs and outputs) cannot: caches and caller-held arrays outside the
# program.  What it cannot see is memory reached without any reference (a raw pointer
# kept by C code): no kernel of this project does that.
#
# The references that the counting code itself adds depend on the interpreter, so they
# are measured once, through the same functions, on a fresh array held by one list slot
# (``_OWN_REFERENCES``, ``_OWN_BASE_REFERENCES``); graph_tests/test_simulator_buffers.py
# pins their values on CPython so that a change is noticed.

def _exclusively_held(locals_: list, rank: int) -> bool:
    """Only ``locals_`` refers to ``locals_[rank]`` and its memory: it may be overwritten.

    Its memory must be its own (or its owner's, referred to by this view alone), each
    element at its own address, and nothing but slots of ``locals_`` may refer to it.  It
    may be read-only (the collectives mark their shared results so): nobody is left to
    read it.  No local variable here holds the array while its references are counted.

    >>> _exclusively_held([np.zeros(3)], 0)
    True
    >>> keep = np.zeros(3)
    >>> _exclusively_held([keep], 0)
    False
    >>> _exclusively_held([np.zeros(4)[1:]], 0), _exclusively_held([keep[1:]], 0)
    (True, False)
    """
    return (_owned_memory(locals_[rank])
            and _outside_references(locals_, rank) == 0
            and _outside_base_references(locals_, rank) == 0)


def _owned_memory(array) -> bool:
    """A plain ndarray owning its memory, or a view of a writeable one; no element aliases
    another, no weak reference to either."""
    if type(array) is not np.ndarray or weakref.getweakrefcount(array) or may_overlap_itself(array):
        return False
    base = array.base
    if base is None:
        return bool(array.flags.owndata)
    return (type(base) is np.ndarray and bool(base.flags.owndata) and bool(base.flags.writeable)
            and not weakref.getweakrefcount(base))


def _slots(locals_: list, rank: int) -> int:
    """How many slots of ``locals_`` hold the very object ``locals_[rank]``."""
    target = id(locals_[rank])
    return sum(1 for other in locals_ if id(other) == target)


def _outside_references(locals_: list, rank: int) -> int:
    """References to ``locals_[rank]`` besides ``locals_``'s slots (and this call's own)."""
    return sys.getrefcount(locals_[rank]) - _slots(locals_, rank) - _OWN_REFERENCES


def _outside_base_references(locals_: list, rank: int) -> int:
    """References to the owner of a view ``locals_[rank]`` besides the view's (0 if no view)."""
    if locals_[rank].base is None:
        return 0
    return sys.getrefcount(locals_[rank].base) - 1 - _OWN_BASE_REFERENCES


_OWN_REFERENCES = 0
_OWN_REFERENCES = _outside_references([np.empty(1)], 0)
_OWN_BASE_REFERENCES = 0
_OWN_BASE_REFERENCES = _outside_base_references([np.empty(2)[1:]], 0)
