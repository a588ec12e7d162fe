"""Rules of the copying op family: expand, stack, unbind, full_like (zeros_like, ones_like, new_ones), pad,
repeat_interleave.

These ops copy, place or create elements without arithmetic on them, so a Partial value
passes through wherever each output element is one input element (or a constant the
reduction keeps: a pad value passes ``P(max)``, ``P(min)`` and ``P(avg)``, and ``P(sum)``
only when it is 0).  Attr names follow torch.

The ops
-------
``expand(x, shape)``
    ``torch.Tensor.expand``: ``shape`` aligned to x's dims from the right, new leading dims
    allowed, ``-1`` keeps x's size, a dim of size 1 may grow.  Shards of kept dims move
    with them (renumbered); a grown dim is Replicate (x's size-1 dim cannot be sharded).
    Any Partial passes through.  Localized attr: ``shape`` becomes the rank's local
    output shape.  vjp: ``sum_to`` x's shape.  Aliases ``Expand`` (ONNX, hyper-parallel),
    ``broadcast_to``, ``BroadcastTo``, ``aten.expand``.  A shape x cannot expand to is an
    ``OpError`` (``invalid-shape``, exit 2).
``stack(x, x1, ..., dim=0)``
    Variadic; the operands have one shape.  They must be laid out alike: per mesh axis the
    output takes the first operand's Shard or Partial there (a Replicate operand is sliced,
    or made terms, for free); any other difference is ``sharding-mismatch`` (a Partial
    beside a different placement: ``partial-input``).  Shards at or after ``dim`` move one
    dim on.  vjp: one ``slice`` and ``squeeze`` per operand.  Aliases ``Stack``, ``Pack``,
    ``aten.stack``.
``unbind(x, dim=0)`` (aliases ``Unbind``, ``aten.unbind``, ``torch.unbind``)
    torch's ``unbind``: one output per slice along ``dim``, as many as its size (worked out
    when the graph is built; a dim of size 1 makes one output, named like the node).  The
    unbound dim is unsharded (``sharded-unbind-dim``, fixed by an all-gather); other shards
    move back one dim when after it.  vjp: ``stack`` of the cotangents (zeros for an unused
    output).  ``unbind2`` ... ``unbind8`` are the same op with a fixed number of outputs
    (x's ``dim`` must have that size), kept for specs written before ``unbind``: deprecated.
``full_like(x, fill_value=0, dtype=None, shape=None)``
    A tensor of ``fill_value``: of x's shape and layout (``shape`` null; a Partial axis
    becomes Replicate: every rank holds the constant), or of ``shape`` (torch's
    ``new_full``), Replicate.  ``dtype`` null keeps x's.  Not differentiable (the output
    does not depend on x's values).  Subclasses with other defaults: ``zeros_like``
    (``ZerosLike``, ``aten.zeros_like``), ``ones_like`` (``OnesLike``, ``aten.ones_like``)
    and ``new_ones`` (fill 1, ``shape`` required; ``NewOnes``, ``aten.new_ones``).
    Aliases of ``full_like``: ``FullLike``, ``aten.full_like``, ``new_full``.
``pad(x, pad, mode="constant", value=0)``
    ``torch.nn.functional.pad``: ``pad`` holds ``2k`` ints, (before, after) for the last dim
    first, then the one before it...; a negative amount crops.  Constant mode only
    (``bad-attr`` for another).  A padded or cropped dim is unsharded (``sharded-pad-dim``,
    fixed by an all-gather); other dims keep their shards.  Partials pass as said above,
    else ``partial-input``.  vjp: ``pad`` of the cotangent by the negated amounts (a crop
    of what was padded, zeros where x was cropped).  Aliases ``Pad`` (ONNX, MindSpore),
    ``PadV3``, ``aten.pad``, ``aten.constant_pad_nd``.  A crop larger than the dim is an
    ``OpError`` (``invalid-pad``, exit 2).
``repeat_interleave(x, repeats, dim=None)``
    ``torch.repeat_interleave``: each element of ``dim`` repeated ``repeats`` times (an
    int, or a list of one count per element); ``dim`` null flattens x first.  The
    repeated dim may stay sharded when the repeats are one int and every rank's piece,
    repeated, is exactly its ``torch.chunk`` piece of the output (10 on 2 ranks repeated
    3 times: 5 + 5 -> 15 + 15); else it is unsharded (``sharded-repeat-dim``, an
    all-gather).  With ``dim`` null, dim 0 may stay sharded on the same condition (a
    piece of whole rows flattens to a contiguous block), the other dims are unsharded.  Other dims keep their shards; any
    Partial passes through.  vjp: ``repeat_interleave_grad`` (the sum of each element's
    copies), in x's layout.  Aliases ``RepeatInterleave``, ``aten.repeat_interleave``.

Violation codes: ``sharding-mismatch``, ``partial-input``, ``sharded-unbind-dim``,
``sharded-pad-dim``, ``sharded-repeat-dim``.  Unusable attrs and shapes are ``OpError``
(``bad-attr``, ``invalid-shape``, ``invalid-pad``, ``invalid-dim``), exit 2.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> x = TensorSpec((4, 1, 6), "float32", Layout(mesh, ["S(0)", "S(2)"], 3))
>>> str(get_rule("Expand").infer_layout((x,), {"shape": [3, -1, 5, 6]}).outputs[0])
'float32[3, 4, 5, 6] (S(1), S(3))'
>>> res = get_rule("pad").infer_layout((x,), get_rule("pad").normalize_attrs({"pad": [1, 1]}))
>>> str(res.outputs[0]), [v.code for v in res.violations]
('float32[4, 1, 8] (S(0), R)', ['sharded-pad-dim'])
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np

from layout_prop.core.errors import OpError
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import DTYPES, TensorSpec

from .nn import _move_violations
from .shape import shard_blocks

__all__ = ["Expand", "Stack", "UNBIND_VARIANTS", "Unbind", "FullLike", "ZerosLike", "OnesLike", "NewOnes", "Pad",
           "RepeatInterleave", "RepeatInterleaveGrad", "get_rule"]

UNBIND_COUNTS = range(2, 9)  # unbindN for N in 2..8, as splitN


# ---------------------------------------------------------------------- helpers
def _is_int(value) -> bool:
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool)


def _dim(op: str, value, ndim: int, node=None, attr: str = "dim") -> int:
    """``value`` as a dim in ``0..ndim-1`` (``invalid-dim`` otherwise)."""
    if not _is_int(value) or not -ndim <= value < ndim:
        raise OpError("invalid-dim", f"{op}: {attr}={value!r} is not a dim of a tensor of rank {ndim}", node=node,
                      hint=f"give {attr} as an integer in {-ndim}..{ndim - 1}" if ndim else "x has no dims")
    return int(value) % ndim


def _want(layout: Layout, spec: TensorSpec) -> Layout | None:
    return None if layout == spec.layout else layout


def _shifted(p, dim: int, by: int):
    """A shard ``p`` of a dim at or after ``dim`` moved by ``by``; anything else as it is."""
    if isinstance(p, Shard) and p.dim >= dim:
        return Shard(p.dim + by)
    return p


def _unsharded(op: str, x: TensorSpec, dims: Sequence[int], code: str, why: str, partial_ok) -> tuple:
    """x's layout with ``dims`` unsharded and the Partials ``partial_ok`` refuses reduced, and the violations."""
    ps, issues = [], []
    for axis, p in enumerate(x.layout.placements):
        ax = repr(x.mesh.names[axis])
        if isinstance(p, Shard) and p.dim in dims:
            issues.append((code, f"x dim {p.dim} (size {x.shape[p.dim]}) is sharded on mesh axis {ax} (x is "
                           f"{x.layout}), but {op} {why}", f"all-gather x on {ax}"))
            p = Replicate()
        elif isinstance(p, Partial) and not partial_ok(p):
            issues.append(("partial-input", f"x is {p} on mesh axis {ax} (x is {x.layout}); {op} does not pass "
                           f"{p} through", f"reduce x on {ax} first"))
            p = Replicate()
        ps.append(p)
    want = Layout(x.mesh, ps, x.ndim)
    return want, _move_violations(x, want, "x", issues)


# ---------------------------------------------------------------------- expand
def expand_shape(op: str, shape_in: Sequence[int], target, node=None) -> tuple[int, ...]:
    """The expanded shape of ``shape_in`` to ``target`` (torch's rules), or ``invalid-shape``.

    >>> expand_shape("expand", (4, 1), [2, -1, 3])
    (2, 4, 3)
    """
    if not isinstance(target, (list, tuple)) or not all(_is_int(s) for s in target):
        raise OpError("bad-attr", f"{op}: shape must be a list of integers, got {target!r}", node=node,
                      hint="give shape as a list such as [2, -1, 8]")
    lead = len(target) - len(shape_in)
    if lead < 0:
        raise OpError("invalid-shape", f"{op}: cannot expand shape {list(shape_in)} to {list(target)}, which has "
                      "fewer dims", node=node, hint=f"give at least {len(shape_in)} sizes")
    out = []
    for i, s in enumerate(target):
        have = shape_in[i - lead] if i >= lead else None
        if s == -1 and have is not None:
            s = have
        if s < 0 or (have is not None and have != 1 and s != have):
            raise OpError("invalid-shape", f"{op}: cannot expand shape {list(shape_in)} to {list(target)}: target "
                          f"dim {i} is {target[i]} where x has {have if have is not None else 'no dim'}", node=node,
                          hint="a dim of size 1 may grow, others keep their size (-1 keeps it); new dims lead")
        out.append(int(s))
    return tuple(out)


@register_op
class Expand(OpRule):
    """``expand(x, shape)``: x broadcast to ``shape`` (torch's ``expand``)."""

    name = "expand"
    operands = ("x",)
    aliases = ("Expand", "broadcast_to", "BroadcastTo", "aten.expand")
    attr_defaults = {"shape": None}
    required_attrs = ("shape",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        shape = expand_shape(self.name, x.shape, attrs["shape"])
        lead = len(shape) - x.ndim
        ps = []
        for p in x.layout.placements:
            if isinstance(p, Shard):
                p = Shard(p.dim + lead) if shape[p.dim + lead] == x.shape[p.dim] else Replicate()
            ps.append(p)
        return RuleResult((TensorSpec(shape, x.dtype, Layout(x.mesh, ps, len(shape))),))

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, "shape": list(outputs[0].local_shape(rank))}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        shape = g.spec(inputs[0]).shape
        if tuple(g.spec(cotangents[0]).shape) == tuple(shape):
            return (cotangents[0],)
        return (g.op("sum_to", [cotangents[0]], {"shape": list(shape)}),)


# ---------------------------------------------------------------------- stack
@register_op
class Stack(OpRule):
    """``stack(x, x1, ..., dim=0)``: the operands stacked along a new dim ``dim``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> a = TensorSpec((5, 3), "float32", Layout(mesh, ["S(1)"], 2))
    >>> b = TensorSpec((5, 3), "float32", Layout(mesh, ["R"], 2))
    >>> res = Stack().infer_layout((a, b), {"dim": 1})
    >>> str(res.outputs[0]), res.violations, str(res.wants[1])
    ('float32[5, 2, 3] (S(2))', (), '(S(1))')
    """

    name = "stack"
    operands = ("x",)
    variadic = True
    aliases = ("Stack", "Pack", "aten.stack")
    attr_defaults = {"dim": 0}
    violation_codes = ("sharding-mismatch", "partial-input")

    def infer_layout(self, inputs, attrs):
        first = inputs[0]
        for i, t in enumerate(inputs):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise OpError("invalid-shape", f"stack: operand {i} is {t.dtype}{list(t.shape)} but operand 0 is "
                              f"{first.dtype}{list(first.shape)}", hint="stack tensors of one shape and dtype")
        dim = _dim(self.name, attrs["dim"], first.ndim + 1)
        target = []
        for axis in range(first.mesh.ndim):
            held = [t.layout.placements[axis] for t in inputs if not isinstance(t.layout.placements[axis], Replicate)]
            target.append(held[0] if held else Replicate())
        violations, wants = [], []
        for i, t in enumerate(inputs):
            want = Layout(t.mesh, target, t.ndim)
            issues = []
            for axis, (have, goal) in enumerate(zip(t.layout.placements, target)):
                if have != goal and not isinstance(have, Replicate):
                    ax = repr(t.mesh.names[axis])
                    code = "partial-input" if isinstance(have, Partial) or isinstance(goal, Partial) else \
                        "sharding-mismatch"
                    issues.append((code, f"operand {i} is {have} on mesh axis {ax} but operand 0 of the stack sets "
                                   f"{goal} there (operand {i} is {t.layout})",
                                   f"give every operand the layout {want}"))
            violations += _move_violations(t, want, self.operand_name(i), issues)
            wants.append(_want(want, t))
        out_ps = [_shifted(p, dim, 1) for p in target]
        shape = first.shape[:dim] + (len(inputs),) + first.shape[dim:]
        return RuleResult((TensorSpec(shape, first.dtype, Layout(first.mesh, out_ps, len(shape))),),
                          tuple(violations), tuple(wants))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None,) * len(inputs)
        dim = _dim(self.name, attrs["dim"], g.spec(inputs[0]).ndim + 1)
        grads = []
        for i, need in enumerate(needs):
            if not need:
                grads.append(None)
                continue
            piece = g.op("slice", [dy], {"axis": dim, "start": i, "stop": i + 1})
            grads.append(g.op("squeeze", [piece], {"dim": dim}))
        return tuple(grads)


# ---------------------------------------------------------------------- unbind
class UnbindRule(OpRule):
    """``unbindN(x, dim=0)``: the N slices of x along ``dim`` (whose size must be N)."""

    operands = ("x",)
    attr_defaults = {"dim": 0}
    violation_codes = ("sharded-unbind-dim", "partial-input")

    def sample_inputs(self):
        from layout_prop.core.registry import OpSample

        n = self.num_outputs
        return [OpSample([(3, n)], {"dim": 1}), OpSample([(n, 5)], {"dim": 0})]

    def output_count(self, attrs, shapes):
        """The size of ``dim`` (``num_outputs`` for the fixed variants ``unbindN``)."""
        if not self.variadic_outputs:
            return self.num_outputs
        dim = _dim(self.name, attrs["dim"], len(shapes[0]))
        if shapes[0][dim] == 0:
            raise OpError("invalid-shape", f"{self.name}: x dim {dim} has size 0, which makes no outputs",
                          hint="a node has at least one output: unbind a dim of size 1 or more")
        return shapes[0][dim]

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dim = _dim(self.name, attrs["dim"], x.ndim)
        count = self.output_count(attrs, (x.shape,))
        if x.shape[dim] != count:
            raise OpError("invalid-shape", f"{self.name}: x dim {dim} has size {x.shape[dim]}, but {self.name} "
                          f"makes {self.num_outputs} outputs", hint=f"use unbind{x.shape[dim]}" if
                          x.shape[dim] in UNBIND_COUNTS else "use splitN or slice for this size")
        want, violations = _unsharded(self.name, x, (dim,), "sharded-unbind-dim", "takes it apart", lambda p: True)
        ps = [_shifted(p, dim + 1, -1) for p in want.placements]
        out = TensorSpec(x.shape[:dim] + x.shape[dim + 1:], x.dtype, Layout(x.mesh, ps, x.ndim - 1))
        return RuleResult((out,) * count, tuple(violations), (_want(want, x),))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        present = [c for c in cotangents if c is not None]
        if not present:
            return (None,)
        dim = _dim(self.name, attrs["dim"], g.spec(inputs[0]).ndim)
        parts = [c if c is not None else g.op("zeros_like", [present[0]]) for c in cotangents]
        return (g.op("stack", parts, {"dim": dim}),)


UNBIND_VARIANTS: dict[str, type[OpRule]] = {}
for _n in UNBIND_COUNTS:
    _cls = type(f"Unbind{_n}", (UnbindRule,), {
        "__doc__": f"``unbind{_n}(x, dim=0)``: {_n} outputs; see :class:`UnbindRule`.",
        "name": f"unbind{_n}", "num_outputs": _n, "__module__": __name__})
    UNBIND_VARIANTS[_cls.name] = register_op(_cls)
del _n, _cls


@register_op
class Unbind(UnbindRule):
    """``unbind(x, dim=0)``: torch's ``unbind``, one output per slice along ``dim`` (as many as its size,
    worked out when the graph is built)."""

    name = "unbind"
    aliases = ("Unbind", "aten.unbind", "torch.unbind")
    variadic_outputs = True
    violation_codes = ("sharded-unbind-dim", "partial-input")

    def sample_inputs(self):
        from layout_prop.core.registry import OpSample

        return [OpSample([(3, 5)], {"dim": 0}), OpSample([(2, 1, 4)], {"dim": -1}), OpSample([(5, 2)], {"dim": 1}),
                OpSample([(1, 3)], {})]


# ---------------------------------------------------------------------- full_like
@register_op
class FullLike(OpRule):
    """``full_like(x, fill_value=0, dtype=None, shape=None)``: a constant of x's shape and layout, or of ``shape``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["S(0)", "P(sum)"], 2))
    >>> str(get_rule("ones_like").infer_layout((x,), get_rule("ones_like").normalize_attrs({})).outputs[0])
    'float32[4, 6] (S(0), R)'
    >>> str(get_rule("NewOnes").infer_layout((x,), get_rule("NewOnes").normalize_attrs({"shape": [3]})).outputs[0])
    'float32[3] (R, R)'
    """

    name = "full_like"
    operands = ("x",)
    aliases = ("FullLike", "aten.full_like", "new_full")
    attr_defaults = {"fill_value": 0, "dtype": None, "shape": None}
    differentiable = False

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        value = out["fill_value"]
        if not isinstance(value, (numbers.Real, bool)):
            raise OpError("bad-attr", f"{self.name}: fill_value must be a number, got {value!r}", node=node,
                          hint="give fill_value as a number")
        if out["dtype"] is not None and out["dtype"] not in DTYPES:
            raise OpError("bad-attr", f"{self.name}: dtype must be one of {list(DTYPES)}, got {out['dtype']!r}",
                          node=node, hint="give dtype as float32, int64... or null for x's")
        shape = out["shape"]
        if shape is not None and (not isinstance(shape, (list, tuple)) or not all(
                _is_int(s) and s >= 0 for s in shape)):
            raise OpError("bad-attr", f"{self.name}: shape must be a list of non-negative integers, got {shape!r}",
                          node=node, hint="give shape as a list such as [2, 8], or null for x's shape")
        return out

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dtype = attrs["dtype"] or x.dtype
        if attrs["shape"] is not None:
            shape = tuple(int(s) for s in attrs["shape"])
            return RuleResult((TensorSpec(shape, dtype, Layout.replicated(x.mesh, len(shape))),))
        ps = [Replicate() if p.is_partial() else p for p in x.layout.placements]
        return RuleResult((TensorSpec(x.shape, dtype, Layout(x.mesh, ps, x.ndim)),))

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, "shape": list(outputs[0].local_shape(rank)), "dtype": outputs[0].dtype}


@register_op
class ZerosLike(FullLike):
    """``zeros_like(x, dtype=None)``: ``full_like`` with ``fill_value`` 0."""

    name = "zeros_like"
    aliases = ("ZerosLike", "aten.zeros_like", "new_zeros")


@register_op
class OnesLike(FullLike):
    """``ones_like(x, dtype=None)``: ``full_like`` with ``fill_value`` 1."""

    name = "ones_like"
    aliases = ("OnesLike", "aten.ones_like")
    attr_defaults = {"fill_value": 1, "dtype": None, "shape": None}


@register_op
class NewOnes(FullLike):
    """``new_ones(x, shape, dtype=None)``: ones of ``shape`` (torch's ``x.new_ones(size)``), Replicate."""

    name = "new_ones"
    aliases = ("NewOnes", "aten.new_ones")
    attr_defaults = {"fill_value": 1, "dtype": None, "shape": None}
    required_attrs = ("shape",)


# ---------------------------------------------------------------------- pad
def pad_amounts(op: str, pad, shape: Sequence[int], node=None) -> list[tuple[int, int]]:
    """Per dim of ``shape``, the (before, after) amounts of torch's ``pad`` list (last dim first).

    >>> pad_amounts("pad", [1, 2], (3, 4))
    [(0, 0), (1, 2)]
    """
    if not isinstance(pad, (list, tuple)) or len(pad) % 2 or not all(_is_int(p) for p in pad):
        raise OpError("bad-attr", f"{op}: pad must be a list of an even number of integers, got {pad!r}", node=node,
                      hint="give pad as [before, after] for the last dim, then for the dim before it...")
    if len(pad) // 2 > len(shape):
        raise OpError("invalid-pad", f"{op}: pad {list(pad)} pads {len(pad) // 2} dims, but x has {len(shape)}",
                      node=node, hint=f"give at most {2 * len(shape)} amounts")
    out = [(0, 0)] * len(shape)
    for k in range(len(pad) // 2):
        d = len(shape) - 1 - k
        before, after = int(pad[2 * k]), int(pad[2 * k + 1])
        if shape[d] + before + after < 0 or -before > shape[d] or -after > shape[d]:
            raise OpError("invalid-pad", f"{op}: pad ({before}, {after}) of dim {d} crops more than its size "
                          f"{shape[d]}", node=node, hint="a negative amount crops at most the dim's size in all")
        out[d] = (before, after)
    return out


@register_op
class Pad(OpRule):
    """``pad(x, pad, mode="constant", value=0)``: torch's ``nn.functional.pad`` in constant mode."""

    name = "pad"
    operands = ("x",)
    aliases = ("Pad", "PadV3", "aten.pad", "aten.constant_pad_nd")
    attr_defaults = {"pad": None, "mode": "constant", "value": 0}
    required_attrs = ("pad",)
    violation_codes = ("sharded-pad-dim", "partial-input")

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        if out["mode"] != "constant":
            raise OpError("bad-attr", f"pad: mode {out['mode']!r} is not supported, only 'constant'", node=node,
                          hint="give mode: constant (reflect, replicate and circular are not implemented)")
        if isinstance(out["value"], bool) or not isinstance(out["value"], numbers.Real):
            raise OpError("bad-attr", f"pad: value must be a number, got {out['value']!r}", node=node,
                          hint="give value as a number")
        return out

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        amounts = pad_amounts(self.name, attrs["pad"], x.shape)
        dims = [d for d, (a, b) in enumerate(amounts) if a or b]
        zero = float(attrs["value"]) == 0.0

        def partial_ok(p):
            return p.reduce_op in ("max", "min", "avg") or zero

        want, violations = _unsharded(self.name, x, dims, "sharded-pad-dim", "pads or crops it", partial_ok)
        shape = tuple(n + a + b for n, (a, b) in zip(x.shape, amounts))
        return RuleResult((TensorSpec(shape, x.dtype, want),), tuple(violations), (_want(want, x),))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        return (g.op("pad", [cotangents[0]], {"pad": [-int(p) for p in attrs["pad"]], "value": 0}),)


# ---------------------------------------------------------------------- repeat_interleave
def _repeats(op: str, repeats, n: int) -> list[int] | int:
    if _is_int(repeats) and repeats >= 0:
        return int(repeats)
    if isinstance(repeats, (list, tuple)) and all(_is_int(r) and r >= 0 for r in repeats):
        if len(repeats) == 1:
            return int(repeats[0])
        if len(repeats) == n:
            return [int(r) for r in repeats]
        raise OpError("invalid-shape", f"{op}: {len(repeats)} repeats for a dim of size {n}",
                      hint=f"give one count per element ({n}), or one int")
    raise OpError("bad-attr", f"{op}: repeats must be a non-negative int or a list of them, got {repeats!r}",
                  hint="give repeats as an int or a list of ints")


def _repeat_analysis(op: str, x: TensorSpec, attrs: dict):
    """``(dim, repeats, want, output shape, violations)``; ``dim`` None: x of several dims is flattened."""
    if attrs["dim"] is None and x.ndim != 1:
        n = int(np.prod(x.shape))
        repeats = _repeats(op, attrs["repeats"], n)
        total = n * repeats if isinstance(repeats, int) else sum(repeats)
        # a piece of whole rows (only dim 0 cut) flattens to a contiguous block; it stays if the block repeated
        # is exactly the rank's torch.chunk piece of the output
        cut = [x.mesh.shape[a] for a in x.layout.dim_axes(0)] if x.ndim else []
        per_row = n // x.shape[0] * repeats if x.ndim and x.shape[0] and isinstance(repeats, int) else None
        keep = per_row is not None and [(a * per_row, b * per_row) for a, b in shard_blocks(x.shape[0], cut)] == \
            shard_blocks(total, cut)
        dims = tuple(range(1 if keep else 0, x.ndim))
        want, violations = _unsharded(op, x, dims, "sharded-repeat-dim", "flattens x first (dim null)",
                                      lambda p: True)
        return None, repeats, want, (total,), violations
    dim = 0 if attrs["dim"] is None else _dim(op, attrs["dim"], x.ndim)  # a 1-D x flattens to itself
    n = x.shape[dim]
    repeats = _repeats(op, attrs["repeats"], n)
    cut = [x.mesh.shape[a] for a in x.layout.dim_axes(dim)]
    lined_up = isinstance(repeats, int) and [(a * repeats, b * repeats) for a, b in shard_blocks(n, cut)] == \
        shard_blocks(n * repeats, cut)
    want, violations = _unsharded(op, x, () if lined_up else (dim,), "sharded-repeat-dim",
                                  "repeats its elements, and the repeated pieces are not the output's chunks",
                                  lambda p: True)
    total = n * repeats if isinstance(repeats, int) else sum(repeats)
    return dim, repeats, want, x.shape[:dim] + (total,) + x.shape[dim + 1:], violations


@register_op
class RepeatInterleave(OpRule):
    """``repeat_interleave(x, repeats, dim=None)``: each element of ``dim`` repeated (torch's op).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> x = TensorSpec((10, 3), "float32", Layout(mesh, ["S(0)"], 2))
    >>> rule = RepeatInterleave()
    >>> str(rule.infer_layout((x,), rule.normalize_attrs({"repeats": 3, "dim": 0})).outputs[0])
    'float32[30, 3] (S(0))'
    >>> y = TensorSpec((5, 3), "float32", Layout(mesh, ["S(0)"], 2))  # rows 3 + 2 would give 6 + 4, not 5 + 5
    >>> [v.code for v in rule.infer_layout((y,), rule.normalize_attrs({"repeats": 2, "dim": 0})).violations]
    ['sharded-repeat-dim']
    """

    name = "repeat_interleave"
    operands = ("x",)
    aliases = ("RepeatInterleave", "aten.repeat_interleave")
    attr_defaults = {"repeats": None, "dim": None}
    required_attrs = ("repeats",)
    violation_codes = ("sharded-repeat-dim",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dim, repeats, want, shape, violations = _repeat_analysis(self.name, x, attrs)
        out_layout = Layout(x.mesh, want.placements, len(shape))  # dim null: only dim 0 may stay cut
        return RuleResult((TensorSpec(shape, x.dtype, out_layout),), tuple(violations), (_want(want, x),))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        x = g.spec(inputs[0])
        return (g.op("repeat_interleave_grad", [cotangents[0]], {**attrs, "shape": list(x.shape),
                                                                   "placements": [str(p) for p in x.layout.placements]}),)


@register_op
class RepeatInterleaveGrad(OpRule):
    """``repeat_interleave_grad(dy, repeats, dim, shape, placements)``: the sum of each element's copies,
    of x's ``shape``, laid out as the forward read x (``placements``, Partial axes Replicate)."""

    name = "repeat_interleave_grad"
    operands = ("dy",)
    attr_defaults = {"repeats": None, "dim": None, "shape": None, "placements": None}
    required_attrs = ("repeats", "shape")
    violation_codes = ("sharded-repeat-dim", "sharding-mismatch", "partial-input")
    differentiable = False

    def infer_layout(self, inputs, attrs):
        (dy,) = inputs
        shape = tuple(attrs["shape"])
        placements = attrs["placements"] or ["R"] * dy.mesh.ndim
        x = TensorSpec(shape, dy.dtype, Layout(dy.mesh, placements, len(shape)))
        _, _, want, out_shape, _ = _repeat_analysis("repeat_interleave", x, attrs)
        if tuple(dy.shape) != tuple(out_shape):
            raise OpError("invalid-shape", f"{self.name}: dy has shape {list(dy.shape)}, not the forward output's "
                          f"{list(out_shape)}", hint="give dy the forward output's shape")
        x_layout = Layout(dy.mesh, [Replicate() if p.is_partial() else p for p in want.placements], len(shape))
        dy_want = Layout(dy.mesh, x_layout.placements, dy.ndim)  # the output's layout (dim null: dim 0's cut)
        violations = _move_violations(dy, dy_want, "dy", [])
        return RuleResult((TensorSpec(shape, dy.dtype, x_layout),), tuple(violations), (_want(dy_want, dy),))

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, "shape": list(outputs[0].local_shape(rank))}
