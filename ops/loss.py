"""Rules of the loss op family: cross entropy (whole and vocabulary-parallel), dropout, multinomial.

The ops
-------
``cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0)``
    The class dim is the LAST dim of ``logits`` (``[..., vocab]``, as language models and
    Megatron's vocab-parallel cross entropy hold it; torch's functional form takes
    ``(N, C, ...)`` instead).  ``target`` is an integer tensor of ``logits.shape[:-1]``.
    Per token ``loss = (1 - eps) * (lse - x[t]) + eps * (lse - mean(x))`` with ``lse`` the
    log-sum-exp over the classes and ``eps`` the label smoothing (torch's formula); tokens
    whose target is ``ignore_index`` give 0.  ``reduction`` ``none`` keeps one loss per
    token, ``sum`` adds them, ``mean`` divides the sum by the number of tokens that are not
    ignored (NaN when there is none, as torch).  Aliases ``CrossEntropyLoss``,
    ``SoftmaxCrossEntropyLoss`` and ``aten.cross_entropy_loss``: those two take the classes in
    dim 1 (``(N, C, d1, ...)``), which is this op's layout only for 2-D logits; for more dims,
    move the classes last first (``transpose``), else the target's shape does not match
    (``invalid-target``) unless ``C`` happens to equal the last dim.
    Layout rule: the class dim is whole on every rank (``sharded-class-dim``); the rule then
    wants the mesh axis that cut the classes to cut a token dim instead (the one the target
    is sharded on there, else the largest unsharded one: an all-to-all, which moves 1/n of
    what an all-gather moves; an all-gather when no token dim is left).  For vocabulary-
    sharded logits, the three-op vocab-parallel form below moves no logits at all, and
    ``check --reshard`` and ``run`` write the node as that form by themselves where it moves
    fewer bytes than the logits' move (the rule's ``expand`` hook, ``passes/expand.py``).  Nothing
    is Partial (``partial-input``: not linear).  Token dims shard freely; the target
    shards like the logits' token dims (a Replicate logits follows a sharded target by a
    free local slice).  A sharded token dim leaves ``Shard``
    in a ``none`` loss and ``P(sum)`` in a ``sum`` or ``mean``.  The ``mean`` needs the
    global count of the tokens that are not ignored, which depends on the data: the rule
    wants the whole target on every rank (a small all-gather of the integer target, never
    of the logits), and each rank picks its tokens' targets (the localised attr
    ``token_slices``) and divides its local sum by the global count.
    Gradient ``cross_entropy_grad(dy, logits, target)``: ``dy * (softmax - (1 - eps) *
    onehot(t) - eps / C)`` (divided by the count for ``mean``; 0 on ignored tokens), in the
    logits' layout.  A target outside ``[0, C)`` other than ``ignore_index`` is an
    ``ExecutionError`` (``target-out-of-range``) when the kernel runs.

Vocabulary-parallel cross entropy (Megatron), three nodes::

    m     = max(logits, dims=[-1])                                  # P(max) on the vocab axis
    parts = cross_entropy_parts(logits, target, m)                  # [..., 3], P(sum)
    loss  = cross_entropy_combine(parts, m, target, num_classes=C)  # as cross_entropy

``cross_entropy_parts`` wants ``m`` Replicate (the all-reduce of the max) and gives, per
token, ``[sum(exp(x - m)), x[t], sum(x)]`` over the rank's own classes: ``P(sum)`` on a
mesh axis that shards the class dim (the target logit is picked by the rank holding it:
the localised attr ``vocab_start``).  ``cross_entropy_combine`` wants ``parts`` Replicate
(the all-reduce of the sums, three numbers a token) and computes the loss as
``cross_entropy`` does (same attrs, same reductions and layout rule for the token dims).
The only communication is the all-reduce of ``m`` and of ``parts``: the logits never
move.  A layout-prop node runs one kernel, which cannot communicate, so one node cannot
hold both all-reduces: that is why the vocab-parallel form is three nodes.  Gradients:
``cross_entropy_parts_grad`` and ``cross_entropy_combine_grad``; the two paths through
``m`` cancel in exact arithmetic (the loss does not depend on the shift), but each op's
gradient is its own, so the backward all-reduces the max's (near zero) cotangent once
more, a number a token, where Megatron treats the max as a constant.

``dropout(x, p=0.5, seed=0, training=True)`` and ``multinomial(probs, num_samples,
replacement=False, seed=0)`` draw from ``counter_uniform(seed, global element index)``
(:mod:`layout_prop.kernels.loss_numpy`), so that a sharded run draws exactly what one
device draws: ``localize`` gives each rank the global offsets of its piece.

Violation codes: ``partial-input``, ``sharded-class-dim``, ``sharding-mismatch``.
Unusable input is an ``OpError`` (exit 2): a float or wrongly shaped target
(``invalid-target``), a logits of rank 0 or without classes (``invalid-shape``), attrs out
of range (``bad-attr``).
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np

from layout_prop.core.errors import OpError
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.registry import InputDomain, OpRule, RuleResult, register_op
from layout_prop.core.spec import TensorSpec, is_float_dtype, numpy_dtype

from .nn import _move_violations

__all__ = ["CrossEntropy", "CrossEntropyGrad", "CrossEntropyParts", "CrossEntropyPartsGrad", "CrossEntropyCombine",
           "CrossEntropyCombineGrad", "Dropout", "Multinomial", "token_analysis"]

REDUCTIONS = ("none", "sum", "mean")
CE_CODES = ("partial-input", "sharded-class-dim", "sharding-mismatch")
CE_DEFAULTS = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0}
PARTS = 3  # sum of exponentials, target logit, sum of logits


# ---------------------------------------------------------------------- attrs and shapes
def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_ce_attrs(op: str, attrs: dict, node: str | None) -> dict:
    """The cross entropy attrs, checked (``bad-attr`` otherwise)."""
    if not _is_int(attrs["ignore_index"]):
        raise OpError("bad-attr", f"{op}: ignore_index must be an integer, got {attrs['ignore_index']!r}", node=node,
                      hint="give ignore_index as an integer (torch's default is -100)")
    if attrs["reduction"] not in REDUCTIONS:
        raise OpError("bad-attr", f"{op}: reduction must be one of {list(REDUCTIONS)}, got {attrs['reduction']!r}",
                      node=node, hint="give reduction as none, sum or mean")
    eps = attrs["label_smoothing"]
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 <= eps <= 1.0:
        raise OpError("bad-attr", f"{op}: label_smoothing must be a number in [0, 1], got {eps!r}", node=node,
                      hint="give label_smoothing in [0, 1] (0 for none)")
    return attrs


def check_target(op: str, target: TensorSpec, token_shape: Sequence[int], what: str) -> None:
    """An integer target of ``token_shape`` (``invalid-target`` otherwise)."""
    if not np.issubdtype(np.dtype(target.dtype), np.integer):
        raise OpError("invalid-target", f"{op}: target has dtype {target.dtype}; it holds class indices",
                      hint="give target an integer dtype (int64 or int32)")
    if tuple(target.shape) != tuple(token_shape):
        raise OpError("invalid-target", f"{op}: target has shape {list(target.shape)} but {what} "
                      f"{list(token_shape)}", hint="give target one class index per token")


def _check_logits(op: str, logits: TensorSpec, name: str = "logits") -> None:
    if logits.ndim == 0 or not is_float_dtype(numpy_dtype(logits.dtype)):
        raise OpError("invalid-shape", f"{op}: {name} is {logits.dtype}{list(logits.shape)}; it must be a floating "
                      "tensor of at least one dim, the classes last", hint=f"give {name} the shape [..., classes]")


# ---------------------------------------------------------------------- the layout rule
def token_analysis(op: str, x: TensorSpec, target: TensorSpec, name: str, vocab_ok: bool, whole_target: bool):
    """The token-dim rule shared by the cross entropy ops.

    ``x`` holds the tokens in its leading dims and something per token in its last dim
    (classes, or the three parts); ``vocab_ok`` lets the last dim be sharded (the vocab
    axes of ``cross_entropy_parts``); ``whole_target`` wants the target Replicate (a
    ``mean``: every rank counts the tokens that are not ignored).

    Returns ``(x_want, target_want, token_axes, violations)``: ``token_axes`` maps each mesh
    axis that shards a token dim to that dim.
    """
    last = x.ndim - 1
    x_ps, t_ps, x_issues, t_issues, token_axes = [], [], [], [], {}
    for axis, (p, q) in enumerate(zip(x.layout.placements, target.layout.placements)):
        ax = repr(x.mesh.names[axis])
        if isinstance(p, Partial):
            x_issues.append(("partial-input", f"{name} is {p} on mesh axis {ax} ({name} is {x.layout}); {op} is not "
                             f"linear in it, so every rank needs whole values", f"reduce {name} on {ax} first"))
            p = Replicate()
        elif isinstance(p, Shard) and p.dim == last and not vocab_ok:
            p = _token_dim_for(x, q, whole_target)
            move = (f"all-to-all {name} on {ax} to shard its dim {p.dim} instead" if isinstance(p, Shard) else
                    f"all-gather {name} on {ax}")
            x_issues.append(("sharded-class-dim", f"{name} dim {last} (the classes, size {x.shape[last]}) is "
                             f"sharded on mesh axis {ax} ({name} is {x.layout}), but {op} takes whole rows",
                             f"{move}, or write the vocab-parallel form (max, cross_entropy_parts, "
                             "cross_entropy_combine), which moves no logits"))
        elif isinstance(p, Replicate) and isinstance(q, Shard) and not whole_target:
            p = Shard(q.dim)  # follow the sharded target: a free local slice of x
        x_ps.append(p)
        if isinstance(p, Shard) and p.dim < last:
            token_axes[axis] = p.dim
        want_q = Shard(p.dim) if axis in token_axes and not whole_target else Replicate()
        t_ps.append(want_q)
        if q != want_q and not isinstance(q, Replicate):
            code = "partial-input" if isinstance(q, Partial) else "sharding-mismatch"
            why = ("the mean counts the tokens that are not ignored over the whole target" if whole_target else
                   f"the target shards like {name}'s token dims ({name} is {x.layout})")
            t_issues.append((code, f"target is {q} on mesh axis {ax} but {op} needs it {want_q} there: {why}",
                             f"give target the layout {want_q} on {ax} (an all-gather of the integer target)"))
    x_want = Layout(x.mesh, x_ps, x.ndim)
    t_want = Layout(target.mesh, t_ps, target.ndim)
    violations = _move_violations(x, x_want, name, x_issues) + _move_violations(target, t_want, "target", t_issues)
    return x_want, t_want, token_axes, violations


def _token_dim_for(x: TensorSpec, q, whole_target: bool):
    """Where a mesh axis that shards the classes moves instead: the token dim the target is sharded on there,
    else x's largest token dim that no mesh axis shards (an all-to-all, which moves 1/n of what an all-gather
    moves), else nowhere (Replicate: an all-gather)."""
    if isinstance(q, Shard) and not whole_target:
        return Shard(q.dim)
    cut = {p.dim for p in x.layout.placements if isinstance(p, Shard)}
    free = [d for d in range(x.ndim - 1) if d not in cut and x.shape[d] > 1]
    if not free:
        return Replicate()
    return Shard(max(free, key=lambda d: (x.shape[d], -d)))


def _loss_spec(x: TensorSpec, token_axes: dict, reduction: str, dtype: str) -> TensorSpec:
    """The loss: one per token (``none``, sharded like the tokens) or a scalar (``P(sum)`` on token axes)."""
    mesh = x.mesh
    if reduction == "none":
        ps = [Shard(token_axes[a]) if a in token_axes else Replicate() for a in range(mesh.ndim)]
        return TensorSpec(x.shape[:-1], dtype, Layout(mesh, ps, x.ndim - 1))
    ps = [Partial("sum") if a in token_axes else Replicate() for a in range(mesh.ndim)]
    return TensorSpec((), dtype, Layout(mesh, ps, 0))


def _dy_layout(x_want: Layout, token_axes: dict, reduction: str, ndim: int) -> Layout:
    """The layout the loss's cotangent is read in: the loss's own, Partial axes Replicate."""
    if reduction == "none":
        return Layout(x_want.mesh, [Shard(token_axes[a]) if a in token_axes else Replicate()
                                    for a in range(x_want.mesh.ndim)], ndim)
    return Layout(x_want.mesh, [Replicate()] * x_want.mesh.ndim, 0)


def _want(layout: Layout, spec: TensorSpec) -> Layout | None:
    return None if layout == spec.layout else layout


def _check_dy(op: str, dy: TensorSpec, reduction: str, token_shape: Sequence[int]) -> None:
    shape = tuple(token_shape) if reduction == "none" else ()
    if tuple(dy.shape) != shape:
        raise OpError("invalid-shape", f"{op}: dy has shape {list(dy.shape)} but the loss has shape {list(shape)}",
                      hint="give dy the loss's shape")


def _token_slices(attrs: dict, x: TensorSpec, rank: int) -> dict:
    """A ``mean`` reads the whole target: each rank's kernel gets the token ranges of its piece of ``x``."""
    if attrs.get("reduction") != "mean":
        return dict(attrs)
    return {**attrs, "token_slices": [list(s) for s in x.local_slices(rank)[:-1]]}


class _CrossEntropyBase(OpRule):
    attr_defaults = dict(CE_DEFAULTS)
    violation_codes = CE_CODES

    def normalize_attrs(self, attrs, node=None):
        return check_ce_attrs(self.name, super().normalize_attrs(attrs, node), node)


# ---------------------------------------------------------------------- cross_entropy
@register_op
class CrossEntropy(_CrossEntropyBase):
    """``cross_entropy(logits, target, ignore_index, reduction, label_smoothing)``, classes last.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> logits = TensorSpec((4, 6, 10), "float32", Layout(mesh, ["S(0)", "R"], 3))
    >>> target = TensorSpec((4, 6), "int64", Layout(mesh, ["S(0)", "R"], 2))
    >>> rule = CrossEntropy()
    >>> res = rule.infer_layout((logits, target), rule.normalize_attrs({"reduction": "sum"}))
    >>> str(res.outputs[0]), res.violations
    ('float32[] (P(sum), R)', ())
    >>> vocab = TensorSpec((4, 6, 10), "float32", Layout(mesh, ["R", "S(2)"], 3))
    >>> [v.code for v in rule.infer_layout((vocab, target), rule.normalize_attrs({})).violations]
    ['sharded-class-dim', 'sharding-mismatch']
    """

    name = "cross_entropy"
    operands = ("logits", "target")
    aliases = ("CrossEntropyLoss", "SoftmaxCrossEntropyLoss", "aten.cross_entropy_loss")

    def infer_layout(self, inputs, attrs):
        logits, target = inputs
        _check_logits(self.name, logits)
        check_target(self.name, target, logits.shape[:-1], "the logits' token dims are")
        if logits.shape[-1] == 0:
            raise OpError("invalid-shape", f"{self.name}: logits has no classes (shape {list(logits.shape)})",
                          hint="give logits at least one class")
        mean = attrs["reduction"] == "mean"
        x_want, t_want, token_axes, violations = token_analysis(self.name, logits, target, "logits", False, mean)
        out = _loss_spec(logits.with_layout(x_want), token_axes, attrs["reduction"], logits.dtype)
        return RuleResult((out,), tuple(violations), (_want(x_want, logits), _want(t_want, target)))

    def localize(self, attrs, inputs, outputs, rank):
        return _token_slices(attrs, inputs[0], rank)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not needs[0]:
            return (None, None)
        return (g.op("cross_entropy_grad", [cotangents[0], inputs[0], inputs[1]], attrs), None)

    def expand(self, b, inputs, attrs, specs):
        """The vocabulary-parallel form where a mesh axis shards the classes: ``max``, ``cross_entropy_parts``
        and ``cross_entropy_combine`` (nodes ``NAME/max``, ``NAME/parts``, then ``NAME``), which move a max
        and three parts per token instead of the logits; None where no mesh axis shards the classes."""
        logits = specs[0]
        last = logits.ndim - 1
        if not any(type(p) is Shard and p.dim == last for p in logits.layout.placements):
            return None
        m = b.op("max", [inputs[0]], {"dims": [-1]}, name="max")
        parts = b.op("cross_entropy_parts", [inputs[0], inputs[1], m], {"ignore_index": attrs["ignore_index"]},
                     name="parts")
        combine = {name: attrs[name] for name in CE_DEFAULTS}
        return b.result("cross_entropy_combine", [parts, m, inputs[1]], {**combine, "num_classes": logits.shape[-1]})


@register_op
class CrossEntropyGrad(_CrossEntropyBase):
    """``cross_entropy_grad(dy, logits, target, ...)``: the logits' gradient, in the logits' layout.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> dy = TensorSpec((4,), "float32", Layout(mesh, ["S(0)"], 1))
    >>> logits = TensorSpec((4, 10), "float32", Layout(mesh, ["S(0)"], 2))
    >>> target = TensorSpec((4,), "int64", Layout(mesh, ["S(0)"], 1))
    >>> rule = CrossEntropyGrad()
    >>> str(rule.infer_layout((dy, logits, target), rule.normalize_attrs({"reduction": "none"})).outputs[0])
    'float32[4, 10] (S(0))'
    """

    name = "cross_entropy_grad"
    operands = ("dy", "logits", "target")
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, logits, target = inputs
        _check_logits(self.name, logits)
        check_target(self.name, target, logits.shape[:-1], "the logits' token dims are")
        _check_dy(self.name, dy, attrs["reduction"], logits.shape[:-1])
        mean = attrs["reduction"] == "mean"
        x_want, t_want, token_axes, violations = token_analysis(self.name, logits, target, "logits", False, mean)
        dy_want = _dy_layout(x_want, token_axes, attrs["reduction"], dy.ndim)
        violations += _move_violations(dy, dy_want, "dy", [])
        out = TensorSpec(logits.shape, logits.dtype, x_want)
        return RuleResult((out,), tuple(violations), (_want(dy_want, dy), _want(x_want, logits), _want(t_want, target)))

    def localize(self, attrs, inputs, outputs, rank):
        return _token_slices(attrs, inputs[1], rank)


# ---------------------------------------------------------------------- vocab-parallel cross entropy
def _token_image(x_want: Layout, token_axes: dict, ndim: int, partial_axes: Sequence[int] = ()) -> Layout:
    """A per-token value's layout: ``Shard`` on the token axes, ``P(sum)`` on ``partial_axes``, else Replicate."""
    ps = [Shard(token_axes[a]) if a in token_axes else Partial("sum") if a in partial_axes else Replicate()
          for a in range(x_want.mesh.ndim)]
    return Layout(x_want.mesh, ps, ndim)


def _per_token_want(op: str, name: str, spec: TensorSpec, want: Layout, why: str):
    """Violations of a per-token operand (the max, the parts) that must be ``want``."""
    issues = []
    for axis, (have, target) in enumerate(zip(spec.layout.placements, want.placements)):
        if have != target and not isinstance(have, Replicate):
            ax = repr(spec.mesh.names[axis])
            code = "partial-input" if isinstance(have, Partial) else "sharding-mismatch"
            issues.append((code, f"{name} is {have} on mesh axis {ax} but {op} needs it {target} there: {why} "
                           f"({name} is {spec.layout})", f"all-reduce {name} on {ax}" if code == "partial-input"
                           else f"give {name} the layout {want}"))
    return _move_violations(spec, want, name, issues)


def _check_per_token(op: str, spec: TensorSpec, name: str, shape: Sequence[int]) -> None:
    if tuple(spec.shape) != tuple(shape) or not is_float_dtype(numpy_dtype(spec.dtype)):
        raise OpError("invalid-shape", f"{op}: {name} is {spec.dtype}{list(spec.shape)} but must be a floating "
                      f"tensor of shape {list(shape)}", hint=f"give {name} one value per token")


def _vocab_axes(x_want: Layout, last: int) -> list[int]:
    return [a for a, p in enumerate(x_want.placements) if isinstance(p, Shard) and p.dim == last]


def _parts_analysis(op: str, logits: TensorSpec, target: TensorSpec, m: TensorSpec):
    _check_logits(op, logits)
    check_target(op, target, logits.shape[:-1], "the logits' token dims are")
    _check_per_token(op, m, "logits_max", logits.shape[:-1])
    x_want, t_want, token_axes, violations = token_analysis(op, logits, target, "logits", True, False)
    m_want = _token_image(x_want, token_axes, m.ndim)
    violations += _per_token_want(op, "logits_max", m, m_want, "every rank shifts its exponentials by the "
                                  "global max (the all-reduce of the max)")
    return x_want, t_want, m_want, token_axes, _vocab_axes(x_want, logits.ndim - 1), violations


class _PartsBase(OpRule):
    attr_defaults = {"ignore_index": -100}
    violation_codes = CE_CODES

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        if not _is_int(out["ignore_index"]):
            raise OpError("bad-attr", f"{self.name}: ignore_index must be an integer, got {out['ignore_index']!r}",
                          node=node, hint="give ignore_index as an integer")
        return out

    logits_index = 0  # where the logits are among the operands

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, "vocab_start": inputs[self.logits_index].local_slices(rank)[-1][0]}


@register_op
class CrossEntropyParts(_PartsBase):
    """``cross_entropy_parts(logits, target, logits_max, ignore_index)``: per token
    ``[sum(exp(x - m)), x[t], sum(x)]`` over the rank's classes; ``P(sum)`` where the classes are sharded.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> logits = TensorSpec((4, 10), "float32", Layout(mesh, ["S(1)"], 2))
    >>> target = TensorSpec((4,), "int64", Layout(mesh, ["R"], 1))
    >>> m = TensorSpec((4,), "float32", Layout(mesh, ["R"], 1))
    >>> rule = CrossEntropyParts()
    >>> res = rule.infer_layout((logits, target, m), rule.normalize_attrs({}))
    >>> str(res.outputs[0]), [rule.localize({}, (logits, target, m), res.outputs, r)["vocab_start"] for r in (0, 1)]
    ('float32[4, 3] (P(sum))', [0, 5])
    """

    name = "cross_entropy_parts"
    operands = ("logits", "target", "logits_max")
    aliases = ("VocabParallelCrossEntropyParts",)

    def infer_layout(self, inputs, attrs):
        logits, target, m = inputs
        x_want, t_want, m_want, token_axes, vocab, violations = _parts_analysis(self.name, logits, target, m)
        out = TensorSpec(logits.shape[:-1] + (PARTS,), logits.dtype,
                         _token_image(x_want, token_axes, logits.ndim, vocab))
        return RuleResult((out,), tuple(violations), (_want(x_want, logits), _want(t_want, target), _want(m_want, m)))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not (needs[0] or needs[2]):
            return (None, None, None)
        dx, dm = g.op("cross_entropy_parts_grad", [cotangents[0], *inputs], attrs, num_outputs=2)
        return (dx, None, dm)


@register_op
class CrossEntropyPartsGrad(_PartsBase):
    """``cross_entropy_parts_grad(dparts, logits, target, logits_max) -> (dlogits, dlogits_max)``;
    ``dlogits_max`` is ``P(sum)`` where the classes are sharded."""

    name = "cross_entropy_parts_grad"
    operands = ("dparts", "logits", "target", "logits_max")
    logits_index = 1
    num_outputs = 2
    differentiable = False

    def infer_layout(self, inputs, attrs):
        d, logits, target, m = inputs
        x_want, t_want, m_want, token_axes, vocab, violations = _parts_analysis(self.name, logits, target, m)
        if tuple(d.shape) != logits.shape[:-1] + (PARTS,):
            raise OpError("invalid-shape", f"{self.name}: dparts has shape {list(d.shape)}, not the parts' "
                          f"{list(logits.shape[:-1] + (PARTS,))}", hint="give dparts the parts' shape")
        d_want = _token_image(x_want, token_axes, d.ndim)
        violations += _per_token_want(self.name, "dparts", d, d_want, "the gradient reads the parts' cotangent")
        outs = (TensorSpec(logits.shape, logits.dtype, x_want),
                TensorSpec(m.shape, m.dtype, _token_image(x_want, token_axes, m.ndim, vocab)))
        return RuleResult(outs, tuple(violations), (_want(d_want, d), _want(x_want, logits), _want(t_want, target),
                                                    _want(m_want, m)))


def _combine_analysis(op: str, parts: TensorSpec, m: TensorSpec, target: TensorSpec, attrs: dict):
    if parts.ndim == 0 or parts.shape[-1] != PARTS or not is_float_dtype(numpy_dtype(parts.dtype)):
        raise OpError("invalid-shape", f"{op}: parts is {parts.dtype}{list(parts.shape)}; it must be the floating "
                      f"[..., {PARTS}] output of cross_entropy_parts", hint="give it cross_entropy_parts' output")
    check_target(op, target, parts.shape[:-1], "the parts' token dims are")
    _check_per_token(op, m, "logits_max", parts.shape[:-1])
    mean = attrs["reduction"] == "mean"
    x_want, t_want, token_axes, violations = token_analysis(op, parts, target, "parts", False, mean)
    m_want = _token_image(x_want, token_axes, m.ndim)
    violations += _per_token_want(op, "logits_max", m, m_want, "the loss adds back the global max")
    return x_want, t_want, m_want, token_axes, violations


class _CombineBase(_CrossEntropyBase):
    attr_defaults = {**CE_DEFAULTS, "num_classes": None}
    required_attrs = ("num_classes",)

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        if not _is_int(out["num_classes"]) or out["num_classes"] < 1:
            raise OpError("bad-attr", f"{self.name}: num_classes must be the logits' class count (a positive "
                          f"integer), got {out['num_classes']!r}", node=node, hint="give num_classes=C")
        return out

    parts_index = 0  # where the parts are among the operands

    def localize(self, attrs, inputs, outputs, rank):
        return _token_slices(attrs, inputs[self.parts_index], rank)


@register_op
class CrossEntropyCombine(_CombineBase):
    """``cross_entropy_combine(parts, logits_max, target, num_classes, ...)``: the loss from whole parts.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> parts = TensorSpec((4, 3), "float32", Layout(mesh, ["P(sum)"], 2))
    >>> m = TensorSpec((4,), "float32", Layout(mesh, ["R"], 1))
    >>> target = TensorSpec((4,), "int64", Layout(mesh, ["R"], 1))
    >>> rule = CrossEntropyCombine()
    >>> res = rule.infer_layout((parts, m, target), rule.normalize_attrs({"num_classes": 10}))
    >>> str(res.outputs[0]), [v.code for v in res.violations], str(res.wants[0])
    ('float32[] (R)', ['partial-input'], '(R)')
    """

    name = "cross_entropy_combine"
    operands = ("parts", "logits_max", "target")
    aliases = ("VocabParallelCrossEntropyCombine",)

    def sample_inputs(self):
        """For ``verify`` and the layout walks: random parts give a NaN loss where a sum of exponentials is drawn
        negative (alike on every rank); no op-database record, whose first sample the finite-difference test
        would take (``graph_tests/test_loss_ops.py`` checks this op's gradient on real parts)."""
        from layout_prop.core.registry import OpSample

        return [OpSample([(5, 3), (5,), (5,)], {"num_classes": 9, "reduction": "none"},
                         dtypes=["float32", "float32", "int64"], requires_grad=[True, True, False])]

    def infer_layout(self, inputs, attrs):
        parts, m, target = inputs
        x_want, t_want, m_want, token_axes, violations = _combine_analysis(self.name, parts, m, target, attrs)
        out = _loss_spec(parts.with_layout(x_want), token_axes, attrs["reduction"], parts.dtype)
        return RuleResult((out,), tuple(violations), (_want(x_want, parts), _want(m_want, m), _want(t_want, target)))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not (needs[0] or needs[1]):
            return (None, None, None)
        dparts, dm = g.op("cross_entropy_combine_grad", [cotangents[0], inputs[0], inputs[2]], attrs, num_outputs=2)
        return (dparts, dm, None)


@register_op
class CrossEntropyCombineGrad(_CombineBase):
    """``cross_entropy_combine_grad(dy, parts, target, ...) -> (dparts, dlogits_max)``."""

    name = "cross_entropy_combine_grad"
    operands = ("dy", "parts", "target")
    parts_index = 1
    num_outputs = 2
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, parts, target = inputs
        # the gradient reads no max: a Replicate stand-in of its shape for the shared analysis
        m = TensorSpec(parts.shape[:-1], parts.dtype, Layout(parts.mesh, [Replicate()] * parts.mesh.ndim,
                                                             parts.ndim - 1))
        x_want, t_want, m_want, token_axes, violations = _combine_analysis(self.name, parts, m, target, attrs)
        _check_dy(self.name, dy, attrs["reduction"], parts.shape[:-1])
        dy_want = _dy_layout(x_want, token_axes, attrs["reduction"], dy.ndim)
        violations += _move_violations(dy, dy_want, "dy", [])
        outs = (TensorSpec(parts.shape, parts.dtype, x_want), TensorSpec(m.shape, m.dtype, m_want))
        return RuleResult(outs, tuple(violations), (_want(dy_want, dy), _want(x_want, parts), _want(t_want, target)))


# ---------------------------------------------------------------------- random ops
def _offsets(spec: TensorSpec, rank: int, dims: int | None = None) -> dict:
    """Where rank ``rank``'s piece starts in the global tensor (its first ``dims`` dims): what a
    counter-based draw needs to key each element by its global index."""
    slices = spec.local_slices(rank)[:dims]
    return {"offsets": [lo for lo, _ in slices], "global_shape": list(spec.shape[:dims])}


def _check_seed(op: str, seed, node) -> None:
    if not _is_int(seed):
        raise OpError("bad-attr", f"{op}: seed must be an integer, got {seed!r}", node=node,
                      hint="give seed as an integer")


@register_op
class Dropout(OpRule):
    """``dropout(x, p=0.5, seed=0, training=True)``: each element kept with probability ``1 - p`` and
    scaled by ``1 / (1 - p)``, zeroed otherwise; the identity when not training.

    The draw of element ``i`` (its row-major index in the global tensor) is
    ``counter_uniform(seed, i)`` (:mod:`layout_prop.kernels.loss_numpy`: splitmix64), kept
    when it is at least ``p``: a pure function of the seed and the global index, so every
    layout draws what one device draws.  ``localize`` gives each rank its piece's
    ``offsets`` and the ``global_shape``.  Every layout passes through unchanged: the op
    multiplies each element by its own non-negative factor, so it is linear (``P(sum)``,
    ``P(avg)``) and monotone (``P(max)``, ``P(min)``) in x.  The gradient is the same
    dropout of the cotangent (the same mask and scale).  Aliases ``Dropout``,
    ``aten.dropout``, ``aten.native_dropout``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> x = TensorSpec((5, 4), "float32", Layout(mesh, ["S(0)"], 2))
    >>> rule = Dropout()
    >>> attrs = rule.normalize_attrs({"p": 0.1})
    >>> res = rule.infer_layout((x,), attrs)
    >>> str(res.outputs[0]), rule.localize(attrs, (x,), res.outputs, 1)["offsets"]
    ('float32[5, 4] (S(0))', [3, 0])
    """

    name = "dropout"
    operands = ("x",)
    aliases = ("Dropout", "aten.dropout", "aten.native_dropout")
    attr_defaults = {"p": 0.5, "seed": 0, "training": True}

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        p = out["p"]
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:
            raise OpError("bad-attr", f"dropout: p must be a probability in [0, 1), got {p!r}", node=node,
                          hint="give p in [0, 1) (p = 1 would drop everything and scale by 1/0)")
        _check_seed(self.name, out["seed"], node)
        if not isinstance(out["training"], bool):
            raise OpError("bad-attr", f"dropout: training must be true or false, got {out['training']!r}",
                          node=node, hint="give training as a boolean")
        return out

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        if not is_float_dtype(numpy_dtype(x.dtype)):
            raise OpError("invalid-dtype", f"dropout: x has dtype {x.dtype}; dropout scales floating values",
                          hint="cast x to a floating dtype first")
        return RuleResult((TensorSpec(x.shape, x.dtype, x.layout),))

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, **_offsets(inputs[0], rank)}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        return (g.op("dropout", [cotangents[0]], attrs),)


@register_op
class Multinomial(OpRule):
    """``multinomial(probs, num_samples, replacement=False, seed=0)``: ``num_samples`` class
    indices (int64) per row of ``probs`` (``[classes]`` or ``[rows, classes]``, as torch takes;
    non-negative weights that need not sum to one), as ``torch.multinomial``; integer weights
    (counts) are taken too.

    Draws come from ``counter_uniform`` keyed by global indices, so every layout draws what
    one device draws: with replacement, draw ``j`` of row ``r`` (the row's row-major index)
    uses index ``r * num_samples + j`` and inverts the row's cumulative weights; without
    replacement, class ``c`` of row ``r`` gets the key ``log(u) / w`` with ``u`` drawn at
    ``r * classes + c`` (Efraimidis and Spirakis 2006) and the ``num_samples`` largest keys
    are the samples, in order.  The class dim is whole on every rank
    (``sharded-class-dim``: the mesh axis moves to the largest unsharded row dim, an
    all-to-all, else it is gathered), probs is not Partial (``partial-input``); the rows
    shard freely, and the samples shard like them.  Not differentiable.  A row whose weights
    are negative, not finite, or too few positive for the draws is an ``ExecutionError``
    (``invalid-probs``) when the kernel runs.  Aliases ``Multinomial``, ``aten.multinomial``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> probs = TensorSpec((6, 10), "float32", Layout(mesh, ["S(0)", "S(1)"], 2))
    >>> rule = Multinomial()
    >>> res = rule.infer_layout((probs,), rule.normalize_attrs({"num_samples": 3}))
    >>> str(res.outputs[0]), [v.code for v in res.violations]
    ('int64[6, 3] (S(0), R)', ['sharded-class-dim'])
    """

    name = "multinomial"
    operands = ("probs",)
    aliases = ("Multinomial", "aten.multinomial")
    attr_defaults = {"num_samples": None, "replacement": False, "seed": 0}
    required_attrs = ("num_samples",)
    violation_codes = ("partial-input", "sharded-class-dim")
    differentiable = False

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        if not _is_int(out["num_samples"]) or out["num_samples"] < 1:
            raise OpError("bad-attr", f"multinomial: num_samples must be a positive integer, got "
                          f"{out['num_samples']!r}", node=node, hint="give num_samples >= 1")
        if not isinstance(out["replacement"], bool):
            raise OpError("bad-attr", f"multinomial: replacement must be true or false, got {out['replacement']!r}",
                          node=node, hint="give replacement as a boolean")
        _check_seed(self.name, out["seed"], node)
        return out

    def infer_layout(self, inputs, attrs):
        (probs,) = inputs
        if probs.ndim not in (1, 2) or probs.dtype == "bool":
            raise OpError("invalid-shape", f"multinomial: probs is {probs.dtype}{list(probs.shape)}; it must be a "
                          "numeric tensor of one or two dims, the classes last (as torch.multinomial)",
                          hint="give probs [classes] or [rows, classes]; reshape more row dims into one first")
        classes = probs.shape[-1]
        if not attrs["replacement"] and attrs["num_samples"] > classes:
            raise OpError("bad-attr", f"multinomial: {attrs['num_samples']} samples without replacement from "
                          f"{classes} classes", hint=f"give num_samples <= {classes}, or replacement: true")
        last = probs.ndim - 1
        ps, issues = [], []
        for axis, p in enumerate(probs.layout.placements):
            ax = repr(probs.mesh.names[axis])
            if isinstance(p, Partial):
                issues.append(("partial-input", f"probs is {p} on mesh axis {ax} (probs is {probs.layout}); "
                               "sampling is not linear in the weights", f"reduce probs on {ax} first"))
                p = Replicate()
            elif isinstance(p, Shard) and p.dim == last:
                p = _token_dim_for(probs, Replicate(), True)  # a row dim instead (an all-to-all), else gathered
                move = f"all-to-all probs on {ax} to shard its dim {p.dim}" if isinstance(p, Shard) else \
                    f"all-gather probs on {ax}"
                issues.append(("sharded-class-dim", f"probs dim {last} (the classes, size {classes}) is sharded on "
                               f"mesh axis {ax} (probs is {probs.layout}); a draw needs the row's whole weights",
                               move))
            ps.append(p)
        want = Layout(probs.mesh, ps, probs.ndim)
        shape = probs.shape[:-1] + (attrs["num_samples"],)
        out = TensorSpec(shape, "int64", want)
        return RuleResult((out,), tuple(_move_violations(probs, want, "probs", issues)), (_want(want, probs),))

    def input_domain(self, index, inputs, attrs):
        """Weights a draw can take: positive (every class possible, so any number of draws without
        replacement up to the classes), of one order of magnitude."""
        return InputDomain(1, 8)

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, **_offsets(inputs[0], rank, inputs[0].ndim - 1)}
