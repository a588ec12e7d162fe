"""Elementwise ops with numpy broadcasting, and their Partial linearity.

The rule picks an output placement per mesh axis, then asks each input for the layout
that placement implies (a broadcast dim stays Replicate).  Reaching a wanted layout by a
free local slice is fine; anything that needs communication is a violation that
``--reshard`` can fix.  Partial values pass through only where the op is linear:

- ``add``/``sub``: operands ``P(sum)`` (or ``P(avg)``), the others Replicate on that
  axis, give the same Partial; a Replicate operand becomes terms of it by a free
  ``local-partial`` step (its value on one rank of the group and zeros elsewhere for a
  sum, its value everywhere for an average), as DTensor does.
- ``mul``: one operand ``P(sum|avg)``, the others Replicate on that axis; ``div``: the
  numerator only.
- ``neg``, ``scale``, ``identity`` keep ``P(sum|avg)`` (``identity`` keeps any Partial).
- anything else (``exp``...) needs the reduction first: ``partial-input``.

Violation codes: ``broadcast-shape``, ``partial-input``, ``sharding-mismatch``.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2,), ("tp",))
>>> a = TensorSpec((4, 6), "float32", Layout(mesh, ["P(sum)"], 2))
>>> r = get_rule("add").infer_layout((a, a), {})
>>> str(r.outputs[0].layout), r.violations
('(P(sum))', ())
>>> b = TensorSpec((6,), "float32", Layout(mesh, ["R"], 1))
>>> r = get_rule("add").infer_layout((a, b), {})
>>> str(r.outputs[0].layout), r.violations, str(r.wants[1])
('(P(sum))', (), '(P(sum))')
>>> c = TensorSpec((4, 6), "float32", Layout(mesh, ["S(0)"], 2))
>>> [v.code for v in get_rule("add").infer_layout((a, c), {}).violations]
['partial-input']
"""

from __future__ import annotations

import numpy as np

from layout_prop.core.errors import LayoutError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard, StridedShard
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec

from .common import free_or_violation

__all__ = ["ElementwiseRule", "broadcast_shapes"]


def broadcast_shapes(shapes) -> tuple[int, ...] | None:
    """numpy's broadcast shape, or None when the shapes do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


def _fits(shape, layout: Layout) -> bool:
    """Whether ``layout`` is a layout of a tensor of ``shape`` (strided pieces divide into blocks)."""
    try:
        TensorSpec(shape, "float32", layout)
    except LayoutError:
        return False
    return True


def _moved(p, dim: int):
    """The same kind of shard (``S`` or ``_S`` with its split factor) on another dim."""
    return StridedShard(dim, p.split_factor) if isinstance(p, StridedShard) else Shard(dim)


class ElementwiseRule(OpRule):
    """Shared rule of the elementwise family; subclasses set ``partial_mode``.

    ``partial_mode``: ``"all"`` (add/sub), ``"one"`` (mul), ``"first"`` (div, unary
    linear ops), ``"any"`` (identity: every Partial op passes), ``"none"``.  A strided
    shard ``_S(d,k)`` is a shard like any other here: the operands must hold the same
    elements, so a Replicate operand is sliced alike for free.
    """

    strided = True
    partial_mode = "none"
    bool_ok = True  # numpy has no bool subtract or negative
    violation_codes = ("broadcast-shape", "partial-input", "sharding-mismatch", "invalid-dtype")

    def sample_inputs(self):
        from layout_prop.core.registry import OpSample

        if len(self.operands) == 1:
            return [OpSample([(5, 3)]), OpSample([(2, 3, 4)])]
        return [OpSample([(4, 3), (3,)]), OpSample([(5, 1, 3), (5, 2, 3)]), OpSample([(3, 4), (3, 4)])]

    def _partial_out(self, ps) -> Partial | None:
        partials = [(i, p) for i, p in enumerate(ps) if isinstance(p, Partial)]
        if not partials:
            return None
        ops = {p.reduce_op for _, p in partials}
        if len(ops) != 1:
            return None
        op = ops.pop()
        mode = self.partial_mode
        if mode == "any":
            return partials[0][1]
        if op not in ("sum", "avg"):
            return None
        others_replicated = all(isinstance(p, Replicate) for i, p in enumerate(ps) if not isinstance(p, Partial))
        if mode == "all" and others_replicated:
            return Partial(op)  # the Replicate operands become terms too (a free local-partial)
        if mode == "one" and len(partials) == 1 and others_replicated:
            return Partial(op)
        if mode == "first" and len(partials) == 1 and partials[0][0] == 0 and others_replicated:
            return Partial(op)
        return None

    def infer_layout(self, inputs, attrs):
        if not self.bool_ok:
            bools = [i for i, t in enumerate(inputs) if t.dtype == "bool"]
            if bools:
                operand = self.operand_name(bools[0])
                v = Violation("invalid-dtype", f"{self.name} is not defined on bool values ({operand} is bool)",
                              f"cast {operand} to an integer or float type first, or use a logical op",
                              operand=operand)
                return RuleResult((None,) * self.num_outputs, (v,), ())
        shape = broadcast_shapes([t.shape for t in inputs])
        if shape is None:
            v = Violation("broadcast-shape", f"shapes {[list(t.shape) for t in inputs]} do not broadcast",
                          "make the shapes equal or 1 in every dim, aligned from the right",
                          operand=self.operand_name(len(inputs) - 1))
            return RuleResult((None,) * self.num_outputs, (v,), ())
        ndim = len(shape)
        mesh = inputs[0].mesh
        offsets = [ndim - t.ndim for t in inputs]
        out_ps = []
        for axis in range(mesh.ndim):
            ps = [t.layout.placements[axis] for t in inputs]
            partial = self._partial_out(ps)
            if partial is not None:
                out_ps.append(partial)
                continue
            shard = next((_moved(p, p.dim + off) for p, off in zip(ps, offsets)
                          if isinstance(p, (Shard, StridedShard))), None)
            out_ps.append(shard if shard is not None else Replicate())
        out_layout = Layout(mesh, out_ps, ndim)
        if out_layout.has_strided and not _fits(shape, out_layout):
            # a strided shard from one operand inside another's shard of the same dim: no layout holds both
            out_layout = Layout(mesh, [Replicate() if isinstance(p, StridedShard) else p for p in out_ps], ndim)
        wants, violations = [], []
        for i, (t, off) in enumerate(zip(inputs, offsets)):
            want = self._want_for(t, off, out_layout, shape, keep_replicate=self.partial_mode != "all")
            wants.append(want if want != t.layout else None)
            if want != t.layout:
                operand = self.operand_name(i)
                code = "partial-input" if t.layout.has_partial() and want.partial_axes() != t.layout.partial_axes() \
                    else "sharding-mismatch"
                v = free_or_violation(
                    t, want, operand, code,
                    f"{operand} is {t.layout} but {self.name} computes {out_layout} here, so {operand} must be {want}",
                    f"give {operand} the layout {want}" + (
                        " (reduce the partial sum first)" if code == "partial-input" else ""))
                if v is not None:
                    violations.append(v)
        dtype = self.out_dtype(inputs, attrs)
        return RuleResult((TensorSpec(shape, dtype, out_layout),), tuple(violations), tuple(wants))

    def out_dtype(self, inputs, attrs) -> str:
        return str(np.result_type(*[np.dtype(t.dtype) for t in inputs]))

    @staticmethod
    def _want_for(t: TensorSpec, off: int, out: Layout, shape, keep_replicate: bool = True) -> Layout:
        """The layout operand ``t`` (aligned ``off`` dims from the left) needs for ``out``.

        On a Partial axis an operand that is Replicate stays so when ``keep_replicate``
        (mul, div: a product with one sum of terms); otherwise (add, sub) it becomes
        the same Partial, by a free ``local-partial``.
        """
        ps = []
        for p in out.placements:
            if isinstance(p, (Shard, StridedShard)):
                d = p.dim - off
                ps.append(_moved(p, d) if d >= 0 and t.shape[d] == shape[p.dim] and shape[p.dim] != 1
                          else Replicate())
            elif isinstance(p, Partial):
                ps.append(p)
            else:
                ps.append(Replicate())
        if keep_replicate:  # an operand that is Replicate on a Partial axis stays Replicate (mul, div)
            own = t.layout.placements
            ps = [own[a] if isinstance(p, Partial) and isinstance(own[a], Replicate) else p
                  for a, p in enumerate(ps)]
        return Layout(t.mesh, ps, t.ndim)


def sum_to_shape(g, value: str, shape) -> str:
    """Reduce a broadcast cotangent back to ``shape`` (the value itself when it already has it).

    Shared by the vjp rules of every op family that broadcasts.
    """
    spec = g.spec(value)
    if spec is None or tuple(spec.shape) == tuple(shape):
        return value
    return g.op("sum_to", [value], {"shape": list(shape)})


@register_op
class Identity(ElementwiseRule):
    name = "identity"
    operands = ("x",)
    aliases = ("Identity",)
    partial_mode = "any"

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        return (cotangents[0],)


@register_op
class Add(ElementwiseRule):
    name = "add"
    operands = ("x", "y")
    aliases = ("Add", "aten.add")
    partial_mode = "all"

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        return tuple(sum_to_shape(g, dy, g.spec(v).shape) if need else None for v, need in zip(inputs, needs))


@register_op
class Sub(ElementwiseRule):
    name = "sub"
    operands = ("x", "y")
    aliases = ("Sub", "aten.sub")
    partial_mode = "all"
    bool_ok = False

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        dx = sum_to_shape(g, dy, g.spec(inputs[0]).shape) if needs[0] else None
        dyy = sum_to_shape(g, g.op("neg", [dy]), g.spec(inputs[1]).shape) if needs[1] else None
        return dx, dyy


@register_op
class Mul(ElementwiseRule):
    name = "mul"
    operands = ("x", "y")
    aliases = ("Mul", "aten.mul")
    partial_mode = "one"

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        x, y = inputs
        dx = sum_to_shape(g, g.op("mul", [dy, y]), g.spec(x).shape) if needs[0] else None
        dyy = sum_to_shape(g, g.op("mul", [dy, x]), g.spec(y).shape) if needs[1] else None
        return dx, dyy


@register_op
class Neg(ElementwiseRule):
    name = "neg"
    operands = ("x",)
    aliases = ("Neg", "aten.neg")
    partial_mode = "first"
    bool_ok = False

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        return (g.op("neg", [cotangents[0]]),)


@register_op
class SumTo(OpRule):
    """``sum_to(x, shape)``: sum a broadcast value back to ``shape`` (the vjp of broadcasting).

    A reduced dim that is sharded leaves ``P(sum)`` on its mesh axes.
    """

    name = "sum_to"
    operands = ("x",)
    attr_defaults = {"shape": None}
    required_attrs = ("shape",)
    differentiable = False
    strided = True  # a kept strided dim stays strided, a summed one leaves P(sum) like a shard

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        shape = tuple(attrs["shape"])
        off = x.ndim - len(shape)
        if off < 0 or any(s not in (1, x.shape[i + off]) for i, s in enumerate(shape)):
            v = Violation("broadcast-shape", f"cannot sum shape {list(x.shape)} to {list(shape)}",
                          "the target must broadcast to the input's shape", operand="x")
            return RuleResult((None,), (v,), ())
        # summing is linear in a sum or an average of terms; a max/min must be reduced first
        nonlinear = [a for a, p in enumerate(x.layout.placements)
                     if isinstance(p, Partial) and p.reduce_op not in ("sum", "avg")]
        want = x.layout.with_placements([Replicate() if a in nonlinear else p
                                         for a, p in enumerate(x.layout.placements)])
        violations = []
        if nonlinear:
            names = ", ".join(repr(x.mesh.names[a]) for a in nonlinear)
            v = free_or_violation(x, want, "x", "partial-input",
                                  f"x is {x.layout}: a sum of {x.layout.placements[nonlinear[0]]} terms on mesh "
                                  f"axis {names} is not the sum of the value",
                                  f"reduce x on {names} first (all-reduce)")
            if v is not None:  # None: the axes have size 1, a relabel
                violations.append(v)
        ps = []
        for p in want.placements:
            if isinstance(p, (Shard, StridedShard)):
                kept = p.dim >= off and shape[p.dim - off] == x.shape[p.dim] and x.shape[p.dim] != 1
                ps.append(_moved(p, p.dim - off) if kept else Partial("sum"))
            else:
                ps.append(p)
        out = TensorSpec(shape, x.dtype, Layout(x.mesh, ps, len(shape)))
        return RuleResult((out,), tuple(violations), (want if nonlinear else None,))

    def localize(self, attrs, inputs, outputs, rank):
        return {"shape": list(outputs[0].local_shape(rank))}


__all__ += ["Identity", "Add", "Sub", "Mul", "Neg", "SumTo", "get_rule", "sum_to_shape"]
