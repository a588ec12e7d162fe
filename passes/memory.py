"""memory: the bytes every rank holds for one training step.

An analysis pass over a propagated graph (with or without its backward part).  Per rank:

- ``parameters``: the local pieces of the graph inputs that require a gradient (a spec
  does not tell weights from data that asks for its gradient: both count);
- ``gradients``: one gradient per parameter, in the parameter's own layout (the
  backward pass's ``grad/NAME``), held for the optimizer step;
- ``optimizer_states``: with ``optimizer="adam"``, two states per parameter element (the
  first and second moments, in the parameter's dtype and layout); ``sgd`` or none: 0;
- ``activations``: the most bytes of every other value (inputs without a gradient, op
  outputs, cotangents, intermediate gradients, the buffers of redistributions) alive at
  one time, walking the lowered program of the rank in order: a value is alive from the
  op that makes it to its last use (graph outputs to the end), as the simulator keeps it.

When the graph can be lowered (no violation left) the walk is over the lowered program
(the local slices and each collective's buffer included); otherwise over the graph's
nodes.  Without the backward part the activations are the forward's only
(``includes_backward`` is false).  The estimate counts every value as its own buffer: a
kernel that returns a view (reshape, transpose) shares memory with its input, which the
estimate does not see (it is an upper bound there).

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.api import analyze
>>> g = analyze(load_spec('''
... mesh: {shape: [2], names: [dp]}
... inputs:
...   x: {shape: [8, 4], placements: ["S(0)"], requires_grad: false}
...   w: {shape: [4, 4]}
... nodes:
...   - {name: y, op: matmul, inputs: [x, w]}
... '''), reshard=True, backward=True).graph
>>> report = Memory(optimizer="adam").run(g)
>>> m = report.max
>>> m.parameters, m.gradients, m.optimizer_states
(64, 64, 128)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from itertools import compress, repeat
from typing import Any

import numpy as np

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, SpecError
from layout_prop.core.graph import Graph
from layout_prop.core.spec import class_of_rank, class_ranks, rank_classes

__all__ = ["Memory", "MemoryReport", "RankMemory", "OPTIMIZERS", "optimizer_states_per_parameter"]

OPTIMIZERS = ("sgd", "adam")


def optimizer_states_per_parameter(optimizer: str | None) -> int:
    """How many parameter-sized states ``optimizer`` keeps (adam 2, sgd and none 0).

    >>> optimizer_states_per_parameter("adam"), optimizer_states_per_parameter(None)
    (2, 0)
    """
    if optimizer is None or optimizer == "sgd":
        return 0
    if optimizer == "adam":
        return 2
    raise SpecError("bad-value", f"unknown optimizer {optimizer!r}", hint=f"use one of {', '.join(OPTIMIZERS)}")


@dataclass(frozen=True)
class RankMemory:
    """The bytes one rank holds, by kind."""

    rank: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations

    def figures(self) -> tuple[int, int, int, int]:
        return self.parameters, self.gradients, self.optimizer_states, self.activations

    def to_dict(self) -> dict[str, int]:
        return {"rank": self.rank, "parameters": self.parameters, "gradients": self.gradients,
                "optimizer_states": self.optimizer_states, "activations": self.activations, "total": self.total}


@dataclass(frozen=True, eq=False)
class MemoryReport:
    """Every rank's memory, held as classes of alike ranks; ``max`` is the rank holding the
    most (the lowest such rank).

    ``classes``: the figures of each class, each as the :class:`RankMemory` of its lowest rank,
    in increasing rank order; ``rank_class``: per rank, the index of its class.  ``ranks``
    (one :class:`RankMemory` per rank) is made from them when asked for.
    """

    classes: tuple[RankMemory, ...]
    rank_class: np.ndarray
    optimizer: str | None
    includes_backward: bool
    lowered: bool

    @cached_property
    def ranks(self) -> tuple[RankMemory, ...]:
        """Every rank's memory, in rank order."""
        figures = [c.figures() for c in self.classes]
        return tuple(RankMemory(rank, *figures[c]) for rank, c in enumerate(self.rank_class.tolist()))

    @property
    def max(self) -> RankMemory:
        return max(self.classes, key=lambda r: (r.total, -r.rank))

    @property
    def differ(self) -> bool:
        """Whether some ranks hold other figures than others."""
        return len({c.figures() for c in self.classes}) > 1

    def to_dict(self) -> dict[str, Any]:
        """The ``memory_per_rank`` object of ``check --json``: the largest rank, and every rank
        when they differ."""
        out: dict[str, Any] = self.max.to_dict()
        out["optimizer"] = self.optimizer
        out["includes_backward"] = self.includes_backward
        if self.differ:
            dicts = [c.to_dict() for c in self.classes]
            out["per_rank"] = [{**dicts[c], "rank": rank} for rank, c in enumerate(self.rank_class.tolist())]
        return out

    def format(self) -> str:
        """One line a person reads: the largest rank's figures."""
        m = self.max
        scope = "forward and backward" if self.includes_backward else "forward only"
        differ = "" if not self.differ else f" (rank {m.rank}, the largest)"
        return (f"memory per rank{differ}: {format_bytes(m.total)} = parameters {format_bytes(m.parameters)}"
                f" + gradients {format_bytes(m.gradients)} + optimizer states {format_bytes(m.optimizer_states)}"
                f" + activations {format_bytes(m.activations)} at the peak ({scope})")


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; below 1 KiB in bytes.

    >>> format_bytes(100), format_bytes(1536), format_bytes(3 * 2**30)
    ('100 B', '1.5 KiB', '3 GiB')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.4g} {unit}"


class Memory:
    """The memory pass.

    Parameters
    ----------
    optimizer : str, optional
        ``"adam"`` (two states per parameter) or ``"sgd"``/None (none).
    """

    name = "memory"

    def __init__(self, optimizer: str | None = None, zero=None) -> None:
        self.states = optimizer_states_per_parameter(optimizer)
        self.optimizer = optimizer
        self.zero = zero  # a passes.zero.ZeroConfig: the ZeRO paper's mixed-precision figures (zero_figures)

    def run(self, graph: Graph) -> MemoryReport:
        """Every rank's memory for ``graph`` (propagated; resharded if it is to be lowered)."""
        params = [n for n in graph.inputs() if n.attrs.get("requires_grad") and not _is_cotangent(n.name)]
        nodes = graph.nodes
        metas = [n.meta for n in nodes]  # (each read below with map in C, not a Python loop per node)
        grads = {n.name for n in compress(nodes, map(dict.get, metas, repeat(meta.GRAD_OF)))}
        persistent = {n.name for n in params} | grads
        lowerable = not any(map(dict.get, metas, repeat(meta.VIOLATIONS)))
        walk, lowered = _walk(graph, nodes, persistent, lowerable)
        # ranks whose pieces have the same bytes in every spec have the same memory: walk the
        # program once per such class of ranks (once in all when every shard is even).  The
        # classes are found per mesh axis (rank_classes: a rank's pieces depend only on which run
        # of equal chunk sizes its coordinate falls in on each axis), not by visiting every rank.
        # Specs are keyed by identity (uniqued specs are mostly one object; equal ones have
        # equal bytes)
        param_keys = [walk.key(n.meta[meta.SPECS][0]) for n in params]
        zero_keys = None if self.zero is None else _zero_keys(graph, params, walk, self.zero)
        specs = list(walk.specs.values())
        mesh = graph.mesh
        starts = rank_classes(specs, mesh)
        merged: dict[tuple, int] = {}  # the bytes of every spec -> the index of its class
        lookup = []  # per class of the product of starts, the index of its class in merged
        classes: list[RankMemory] = []
        for rank in class_ranks(starts, mesh):  # lowest ranks first: a class's first is its lowest
            nbytes = tuple(spec.local_nbytes(rank) for spec in specs)
            index = merged.get(nbytes)
            if index is None:
                index = merged[nbytes] = len(classes)
                if zero_keys is None:
                    p = sum(nbytes[k] for k in param_keys)
                    classes.append(RankMemory(rank, p, p, self.states * p, walk.peak(nbytes)))
                else:
                    figures = zero_figures(nbytes, zero_keys, self.zero.stage, self.states)
                    classes.append(RankMemory(rank, *figures, walk.peak(nbytes)))
            lookup.append(index)
        rank_class = np.asarray(lookup, dtype=np.int64)[class_of_rank(starts, mesh)]
        backward = "backward" in map(dict.get, metas, repeat(meta.INSERTED_BY))
        return MemoryReport(tuple(classes), rank_class, self.optimizer, backward, lowered)


def _walk(graph: Graph, nodes: list, persistent: set[str], lowerable: bool) -> tuple["_Walk", bool]:
    """The program memory is counted over, and whether it is the lowered program (the ops
    of :func:`~layout_prop.passes.lower.local_ops`, not built: when the graph lowers) or the
    graph's ``nodes`` (its nodes in order, listed once by the caller); a graph with
    violations is not ``lowerable``."""
    from .lower import local_ops

    if lowerable:
        try:
            return _Walk(map(_VALUES_AND_SPECS, local_ops(graph)), persistent, graph.outputs), True
        except LayoutPropError:
            pass
    ops = ((n.inputs, n.outputs, n.meta.get(meta.SPECS, ())) for n in nodes)
    return _Walk(ops, persistent, graph.outputs), False


#: (inputs, outputs, specs) of an op of :func:`~layout_prop.passes.lower.local_ops`
_VALUES_AND_SPECS = operator.itemgetter(3, 4, 5)


class _Walk:
    """The values of a program that count as activations, from one pass over its ops.

    ``ops`` are ``(inputs, outputs, specs)`` in order.  A value counts unless it is in
    ``persistent`` or has no spec; it is alive from the op that makes it (``born``) to the
    last op that reads it (``last``; the end, ``len(ops)``, for the graph's ``outputs``,
    which stay), as the simulator keeps it.  ``spec`` is the index of its spec in
    ``specs`` (distinct specs by identity, in order of first use).
    """

    def __init__(self, ops, persistent: set[str], outputs: list[str]) -> None:
        born: list[int] = []
        values: list[str] = []
        objs: list = []  # the spec of each counted value
        read: dict[str, int] = {}  # value -> the last op that reads it
        index = -1
        for index, (inputs, made, specs) in enumerate(ops):
            for value in inputs:
                read[value] = index
            if len(made) == 1:  # the common op: one value
                if specs[0] is not None and made[0] not in persistent:
                    born.append(index)
                    values.append(made[0])
                    objs.append(specs[0])
                continue
            for value, spec in zip(made, specs):
                if spec is not None and value not in persistent:
                    born.append(index)
                    values.append(value)
                    objs.append(spec)
        end = index + 1
        kept = set(outputs)
        ids = list(map(id, objs))
        self._keys = {key: k for k, key in enumerate(dict.fromkeys(ids))}  # id of a spec -> its index in specs
        self.specs: dict[int, Any] = dict(zip(ids, objs))  # id of a spec -> the spec, in that order
        self.born = born
        self.last = [end if value in kept else read.get(value, made_at) for value, made_at in zip(values, born)]
        self.spec = list(map(self._keys.__getitem__, ids))

    def key(self, spec) -> int:
        """The index of ``spec`` in ``specs`` (added when no value of the walk has it)."""
        k = self._keys.get(id(spec))
        if k is None:
            k = self._keys[id(spec)] = len(self._keys)
            self.specs[id(spec)] = spec
        return k

    def peak(self, nbytes: tuple[int, ...]) -> int:
        """The most bytes alive at once when spec ``k``'s values take ``nbytes[k]`` bytes.

        The bytes alive at op ``i``, after it makes its values, are those of the values
        made at or before ``i`` and last used at or after ``i``: the values made up to
        ``i`` minus those last used before ``i``.  Only ops that make a value can be a
        peak.  Counted in int64 with numpy when the total fits, in Python otherwise.

        >>> w = _Walk([((), ("a",), ("A",)), (("a",), ("b",), ("B",)), (("b",), ("c",), ("A",))], set(), ["c"])
        >>> w.peak((10, 1)), w.peak((1, 10)), w.peak((0, 0))
        (11, 11, 0)
        """
        if not self.born:
            return 0
        if max(nbytes) * len(self.born) >= 2 ** 62:  # int64 could overflow: Python's integers
            return _peak_python(self.born, self.last, [nbytes[k] for k in self.spec])
        born = np.asarray(self.born, dtype=np.int64)
        sizes = np.asarray(nbytes, dtype=np.int64)[np.asarray(self.spec, dtype=np.intp)]
        last = np.asarray(self.last, dtype=np.int64)
        steps = np.unique(born)  # (born is in order)
        made = np.cumsum(sizes)[np.searchsorted(born, steps, side="right") - 1]
        order = np.argsort(last, kind="stable")
        dead = np.concatenate(([0], np.cumsum(sizes[order])))[np.searchsorted(last[order], steps, side="left")]
        return max(0, int((made - dead).max()))


def _peak_python(born: list[int], last: list[int], sizes: list[int]) -> int:
    """:meth:`_Walk.peak` op by op in Python integers (for totals past int64)."""
    freed = [0] * (max(last) + 2)
    made: dict[int, int] = {}
    for step, end, size in zip(born, last, sizes):
        made[step] = made.get(step, 0) + size
        freed[end] += size
    live = peak = 0
    for index in range(len(freed)):
        live += made.get(index, 0)
        peak = max(peak, live)
        live -= freed[index]
    return peak


def _zero_keys(graph: Graph, params: list, walk: "_Walk", zero) -> list[tuple[int, int, int]]:
    """Per parameter, (key of its whole spec, key of its ZeRO shard's spec, itemsize) in ``walk``:
    the whole is the layout the ops read (the gathered copy's at stage 3), the shard the one its
    optimizer state lives in (:func:`~layout_prop.passes.zero.shard_layouts`; at stage 0 the whole)."""
    from layout_prop.core.spec import TensorSpec

    from .zero import ZeroConfig, shard_layouts, whole_layouts

    shards = shard_layouts(graph, zero if zero.stage else ZeroConfig(0, ()))
    wholes = whole_layouts(graph)
    keys = []
    for node in params:
        spec = node.meta[meta.SPECS][0]
        whole = TensorSpec(spec.shape, spec.dtype, wholes.get(node.name, spec.layout))
        shard = TensorSpec(spec.shape, spec.dtype, shards.get(node.name, spec.layout))
        keys.append((walk.key(whole), walk.key(shard), spec.itemsize))
    return keys


def zero_figures(nbytes: tuple[int, ...], keys: list[tuple[int, int, int]], stage: int,
                 adam_states: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) bytes of one rank under ZeRO ``stage``.

    The convention of the ZeRO paper (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
    Toward Training Trillion Parameter Models", section 3.1 and figure 1): parameters and
    gradients in the model's dtype (2 + 2 bytes an element in fp16/bf16), optimizer states
    K bytes an element: Adam's two fp32 moments (8), plus an fp32 master copy of the
    parameters when the model's dtype is 16-bit (4; K = 12 in the paper's mixed precision);
    SGD keeps no moment (K = 4 for the master copy in 16-bit, else 0).  Stage 1 shards the
    optimizer states, stage 2 the gradients too, stage 3 the parameters too: a sharded kind
    counts the shard's elements (``keys``' second spec), the others the whole piece's.
    """
    params = grads = states = 0
    for whole, shard, itemsize in keys:
        elements_whole, elements_shard = nbytes[whole] // itemsize, nbytes[shard] // itemsize
        k = (4 * adam_states) + (4 if itemsize < 4 else 0)
        params += itemsize * (elements_shard if stage >= 3 else elements_whole)
        grads += itemsize * (elements_shard if stage >= 2 else elements_whole)
        states += k * (elements_shard if stage >= 1 else elements_whole)
    return params, grads, states


def _is_cotangent(name: str) -> bool:
    from .backward import COTANGENT_PREFIX

    return name.startswith(COTANGENT_PREFIX)
