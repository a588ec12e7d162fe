"""Eager dispatch on simulated DTensors, in hyper-parallel's shape: ``preprocess`` then ``infer_layout``.

:class:`DistributedOp` wraps a registered op.  ``preprocess(args, kwargs)`` takes DTensors
(a plain array counts as Replicate), returns each rank's local arguments (already sliced
where the rule wants a free local slice: a Replicate cos on a dim that x shards gets the
rank's slice, where upstream hands the kernel the whole cos), the local kwargs and the
cache values; ``infer_layout(cache_values)`` returns ``((out_layout, ...), None)``,
cached on the layouts, shapes and attrs.  Calling the op runs both, then the kernel on
every rank, and wraps the outputs as DTensors.  A layout the rule rejects raises
:class:`~layout_prop.core.errors.OpError` with the violation's code; eager mode does not
redistribute behind your back.

Examples
--------
>>> import numpy as np
>>> from layout_prop import DeviceMesh
>>> from layout_prop.engines.dtensor import distribute
>>> mesh = DeviceMesh((2, 2), ("dp", "sp"))
>>> rng = np.random.default_rng(0)
>>> x = distribute(rng.standard_normal((2, 2, 4, 8)), mesh, ["S(0)", "S(2)"])
>>> cos = rng.standard_normal((1, 1, 4, 8))      # a plain array: Replicate
>>> y = rotary_position_embedding(x, cos, cos, rotary_mode="interleave")
>>> y.placements, y.to_local(3).shape
((Shard(dim=0), Shard(dim=2)), (1, 2, 2, 8))
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .dtensor import DTensor
from layout_prop.core.errors import OpError
from layout_prop.core.graph import attrs_key, freeze_attrs
from layout_prop.core.layout import Layout
from layout_prop.core.registry import apply_rule, get_rule
from layout_prop.core.spec import TensorSpec

__all__ = ["DistributedOp", "rotary_position_embedding", "rotary_position_embedding_grad", "RPE_ROTARY_MODES"]

#: torch_npu's ``rotary_mode`` names
RPE_ROTARY_MODES = {"half": 0, "interleave": 1, None: 0}


def _rpe_attrs(extra_args: tuple, kwargs: dict) -> dict:
    """RotaryPositionEmbedding's mode: positional or keyword ``mode``, or torch_npu's ``rotary_mode``."""
    kwargs = dict(kwargs)
    if "rotary_mode" in kwargs:
        if "mode" in kwargs or extra_args:
            raise OpError("invalid-mode", "both mode and rotary_mode are given", hint="give one of them")
        rotary = kwargs.pop("rotary_mode")
        if rotary not in RPE_ROTARY_MODES:
            raise OpError("invalid-mode", f"rotary_mode {rotary!r} is not one of 'half', 'interleave' or None",
                          hint="use rotary_mode='half' (mode 0) or 'interleave' (mode 1), or mode=0..3")
        kwargs["mode"] = RPE_ROTARY_MODES[rotary]
    if extra_args:
        if len(extra_args) > 1 or "mode" in kwargs:
            raise OpError("bad-arity", f"unexpected positional arguments {extra_args!r}",
                          hint="call rotary_position_embedding(x, cos, sin, mode)")
        kwargs["mode"] = extra_args[0]
    return kwargs


ATTR_PARSERS: dict[str, Callable[[tuple, dict], dict]] = {
    "rotary_position_embedding": _rpe_attrs,
    "rotary_position_embedding_grad": _rpe_attrs,
}


def _as_dtensor(value, mesh) -> DTensor:
    if isinstance(value, DTensor):
        if value.mesh != mesh:
            raise OpError("mesh-mismatch", f"operands live on different meshes: {value.mesh} and {mesh}",
                          hint="distribute every operand on the same mesh")
        return value
    array = np.asarray(value)
    spec = TensorSpec(array.shape, str(array.dtype), Layout.replicated(mesh, array.ndim))
    return DTensor([array] * mesh.size, spec)


class DistributedOp:
    """hyper-parallel style distributed dispatch of one registered op."""

    def __init__(self, op: str, kernels: dict | None = None) -> None:
        self.rule = get_rule(op)
        self.kernels = kernels
        self._cache: dict = {}

    def _result(self, cache_values):
        result = self._cache.get(cache_values)
        if result is None:
            specs, frozen, _ = cache_values
            result = apply_rule(self.rule, specs, dict(frozen))
            self._cache[cache_values] = result
        return result

    def preprocess(self, args: tuple, kwargs: dict) -> tuple[list[tuple], list[dict], tuple]:
        """``(local_args per rank, local_kwargs per rank, cache_values)``."""
        low, high = self.rule.arity()
        n = low
        while n < len(args) and (high is None or n < high) and isinstance(args[n], (DTensor, np.ndarray)):
            n += 1  # optional or variadic operands: the leading arrays
        if len(args) < low:
            raise OpError("bad-arity", f"{self.rule.name} takes operands {list(self.rule.operands)}, got {len(args)}",
                          hint=f"call {self.rule.name}({', '.join(self.rule.operands)}, ...)")
        operands, extra = args[:n], tuple(args[n:])
        parser = ATTR_PARSERS.get(self.rule.name)
        if parser is not None:
            attrs = parser(extra, kwargs)
        elif extra:
            raise OpError("bad-arity", f"unexpected positional arguments {extra!r}", hint="pass attrs by keyword")
        else:
            attrs = dict(kwargs)
        attrs = self.rule.normalize_attrs(attrs)
        mesh = next((a.mesh for a in operands if isinstance(a, DTensor)), None)
        if mesh is None:
            raise OpError("no-dtensor", f"{self.rule.name} got no DTensor operand", hint="distribute() an input first")
        tensors = [_as_dtensor(a, mesh) for a in operands]
        # the attrs' key tells 1 from True (equal in Python); the frozen attrs give them back
        cache_values = (tuple(t.spec for t in tensors), freeze_attrs(attrs), attrs_key(attrs))
        result = self._result(cache_values)
        if result.violations:
            first = result.violations[0]
            raise OpError(first.code, "; ".join(v.message for v in result.violations), hint=first.hint,
                          input=first.operand)
        moved = [self._move(t, want) for t, want in zip(tensors, tuple(result.wants) + (None,) * n)]
        outputs = result.outputs
        local_args = [tuple(t.to_local(r) for t in moved) for r in range(mesh.size)]
        local_kwargs = [self.rule.localize(attrs, tuple(t.spec for t in moved), outputs, r) for r in range(mesh.size)]
        return local_args, local_kwargs, cache_values

    @staticmethod
    def _move(t: DTensor, want: Layout | None) -> DTensor:
        """Apply a free local slice the rule wants (anything costlier was a violation)."""
        if want is None or want == t.layout:
            return t
        return t.redistribute(want.placements)

    def infer_layout(self, cache_values) -> tuple[tuple[Layout, ...], None]:
        """hyper-parallel's contract: the output layouts (and no extra cache)."""
        return tuple(o.layout for o in self._result(cache_values).outputs), None

    def __call__(self, *args, **kwargs):
        from layout_prop.kernels.numpy_backend import KERNELS, get_kernel

        local_args, local_kwargs, cache_values = self.preprocess(args, kwargs)
        outputs = self._result(cache_values).outputs  # what infer_layout(cache_values) reports, with shapes
        kernel = get_kernel(self.rule.name, self.kernels or KERNELS)
        results = [kernel(*a, **k) for a, k in zip(local_args, local_kwargs)]
        if self.rule.num_outputs == 1:
            return DTensor([np.asarray(r) for r in results], outputs[0])
        return tuple(DTensor([np.asarray(r[i]) for r in results], spec) for i, spec in enumerate(outputs))


_RPE = DistributedOp("rotary_position_embedding")
_RPE_GRAD = DistributedOp("rotary_position_embedding_grad")


def rotary_position_embedding(x, cos, sin, *args: Any, **kwargs: Any) -> DTensor:
    """RotaryPositionEmbedding on DTensors (mode positional or keyword, or torch_npu's rotary_mode)."""
    return _RPE(x, cos, sin, *args, **kwargs)


def rotary_position_embedding_grad(dy, x, cos, sin, *args: Any, **kwargs: Any) -> tuple[DTensor, DTensor, DTensor]:
    """``(dx, dcos, dsin)`` as computed on each rank: dcos/dsin may be partial sums (``P(sum)``)."""
    return _RPE_GRAD(dy, x, cos, sin, *args, **kwargs)
