"""RotaryPositionEmbedding: ``y = x*cos + rotate(x)*sin``, its layout rule and gradient rule.

The rotation happens inside the last dim D, so D is never sharded.  B, N, S (or T) shard
freely.  cos and sin broadcast against x (numpy rules, aligned from the right); a cos dim
that is full size may be sharded only exactly like x's aligned dim; a Replicate full-size
cos dim that x shards is sliced locally for free.  Unlike upstream, the rule looks at the
shapes: the gradient of a cos that broadcasts along a dim x shards is a partial sum.

Violation codes: ``partial-input``, ``sharded-rotation-dim``, ``broadcast-shape``,
``sharding-mismatch``, ``invalid-mode``, ``invalid-head-dim``, ``invalid-rank``,
``invalid-input-layout``.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2, 2), ("dp", "sp"))
>>> x = TensorSpec((4, 4, 16, 64), "float32", Layout(mesh, ["S(0)", "S(2)"], 4))
>>> cos = TensorSpec((1, 1, 16, 64), "float32", Layout(mesh, ["R", "R"], 4))
>>> res = RotaryPositionEmbedding().infer_layout((x, cos, cos), {"mode": 0, "input_layout": "BNSD"})
>>> str(res.outputs[0].layout), res.violations
('(S(0), S(2))', ())
>>> [str(w) for w in res.wants]
['None', '(R, S(2))', '(R, S(2))']
"""

from __future__ import annotations

from layout_prop.core.errors import Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.registry import OpRule, RuleResult, register_op
from layout_prop.core.spec import FLOAT_DTYPES, TensorSpec

from .common import axes_label, free_or_violation, without_partial

__all__ = ["RotaryPositionEmbedding", "RotaryPositionEmbeddingGrad", "MODES", "rpe_layout_analysis"]

MODES = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}
INPUT_LAYOUTS = {4: ("BNSD", "BSND", "SBND"), 3: ("TND",)}
OPERANDS = ("x", "cos", "sin")
VIOLATION_CODES = ("partial-input", "sharded-rotation-dim", "broadcast-shape", "sharding-mismatch", "invalid-mode",
                   "invalid-head-dim", "invalid-rank", "invalid-input-layout", "invalid-dtype")


def _check_attrs(x: TensorSpec, attrs: dict) -> list[Violation]:
    out = []
    mode = attrs.get("mode")
    if isinstance(mode, bool) or mode not in MODES:
        out.append(Violation(
            "invalid-mode", f"mode {mode!r} is not a rotation mode; modes are "
            + ", ".join(f"{k} ({v})" for k, v in MODES.items()),
            "use mode 0 (half), 1 (interleave), 2 (quarter) or 3 (interleave-half)", operand="x"))
    if x.ndim not in INPUT_LAYOUTS:
        out.append(Violation("invalid-rank", f"x has rank {x.ndim} (shape {list(x.shape)}); "
                             "RotaryPositionEmbedding takes 4-D BNSD/BSND/SBND or 3-D TND x",
                             "reshape x to 4-D (B, N, S, D) or 3-D (T, N, D)", operand="x"))
        return out
    layout_name = attrs.get("input_layout")
    allowed = INPUT_LAYOUTS[x.ndim]
    if layout_name is not None and layout_name not in allowed:
        out.append(Violation("invalid-input-layout",
                             f"input_layout {layout_name!r} does not fit a {x.ndim}-D x; expected one of {list(allowed)}",
                             f"set input_layout to one of {list(allowed)} or leave it out", operand="x"))
    d = x.shape[-1]
    if mode in MODES:
        divisor = 4 if mode == 2 else 2
        if d % divisor:
            out.append(Violation(
                "invalid-head-dim", f"x's last dim D = {d} is not divisible by {divisor}, "
                f"which mode {mode} ({MODES[mode]}) needs",
                f"use a head dim divisible by {divisor}" + (" or another mode" if mode == 2 else ""),
                operand="x"))
    return out


def _x_layout(x: TensorSpec) -> tuple[Layout, list[Violation]]:
    """x's usable layout (Partial reduced, D gathered) and the violations found on the way."""
    out = []
    lay = x.layout
    d_dim = x.ndim - 1
    for axis, p in enumerate(lay.placements):
        name = lay.mesh.names[axis]
        if isinstance(p, Partial):
            out.append(Violation(
                "partial-input", f"x is {p} on mesh axis {name!r}: RotaryPositionEmbedding is not linear "
                "in a partial sum across x, cos and sin together",
                f"reduce x on {name!r} first (all-reduce), or produce x Replicate/Shard on {name!r}",
                operand="x", fixable=True))
        elif isinstance(p, Shard) and p.dim == d_dim:
            out.append(Violation(
                "sharded-rotation-dim", f"x's rotation dim D (dim {d_dim}, size {x.shape[-1]}) is sharded on mesh "
                f"axis {name!r}; the kernel rotates within D",
                f"keep D Replicate: all-gather x on {name!r}, or shard B, N or S on {name!r} instead",
                operand="x", fixable=True))
    fixed = without_partial(lay).with_placements(
        [Replicate() if p.is_shard(d_dim) else p for p in without_partial(lay).placements])
    return fixed, out


def _table_shape_violations(x: TensorSpec, cos: TensorSpec, sin: TensorSpec) -> list[Violation]:
    out = []
    if cos.shape != sin.shape:
        out.append(Violation("broadcast-shape", f"cos has shape {list(cos.shape)} but sin has {list(sin.shape)}",
                             "give cos and sin the same shape", operand="sin"))
    for name, t in (("cos", cos), ("sin", sin)):
        if t.ndim > x.ndim or t.ndim == 0:
            out.append(Violation("broadcast-shape", f"{name} has rank {t.ndim} (shape {list(t.shape)}) but x has rank "
                                 f"{x.ndim}", f"give {name} rank 1..{x.ndim}, aligned with x from the right",
                                 operand=name))
            continue
        if t.shape[-1] != x.shape[-1]:
            out.append(Violation("broadcast-shape", f"{name}'s last dim is {t.shape[-1]} but x's D is {x.shape[-1]}",
                                 f"{name} must cover the whole rotation dim D = {x.shape[-1]}", operand=name))
        off = x.ndim - t.ndim
        for i, size in enumerate(t.shape[:-1]):
            if size not in (1, x.shape[i + off]):
                out.append(Violation(
                    "broadcast-shape", f"{name} dim {i} has size {size}, which neither equals x's aligned dim "
                    f"{i + off} ({x.shape[i + off]}) nor is 1",
                    f"make {name} dim {i} size {x.shape[i + off]} or 1 (broadcast)", operand=name))
    return out


def _table_want(x_fixed: Layout, x: TensorSpec, t: TensorSpec) -> Layout:
    """The layout cos/sin must have locally: x's shards on its full-size dims, else Replicate."""
    off = x.ndim - t.ndim
    ps = []
    for p in x_fixed.placements:
        if isinstance(p, Shard) and p.dim >= off and t.shape[p.dim - off] == x.shape[p.dim]:
            ps.append(Shard(p.dim - off))
        else:
            ps.append(Replicate())
    return Layout(t.mesh, ps, t.ndim)


def _table_violations(name: str, x: TensorSpec, x_fixed: Layout, t: TensorSpec, want: Layout) -> list[Violation]:
    out = []
    lay = t.layout
    d_dim = t.ndim - 1
    off = x.ndim - t.ndim
    for axis, p in enumerate(lay.placements):
        axis_name = lay.mesh.names[axis]
        if isinstance(p, Partial):
            out.append(Violation(
                "partial-input", f"{name} is {p} on mesh axis {axis_name!r}; RotaryPositionEmbedding needs whole "
                f"{name} values", f"reduce {name} on {axis_name!r} first, or keep it Replicate there",
                operand=name, fixable=True))
        elif isinstance(p, Shard) and p.dim == d_dim:
            out.append(Violation(
                "sharded-rotation-dim", f"{name}'s rotation dim D (dim {d_dim}, size {t.shape[-1]}) is sharded on "
                f"mesh axis {axis_name!r}", f"keep {name}'s last dim Replicate on {axis_name!r}",
                operand=name, fixable=True))
    if out:
        return out
    for dim, axes in sorted(lay.sharded_dims().items()):
        x_axes = x_fixed.dim_axes(dim + off)
        if axes != x_axes:
            x_desc = f"sharded on {axes_label(x_fixed, x_axes)}" if x_axes else "not sharded"
            hint = (f"shard {name} dim {dim} on {axes_label(x_fixed, x_axes)} like x, or keep it Replicate"
                    if x_axes else f"keep {name} dim {dim} Replicate, or shard x dim {dim + off} on "
                    f"{axes_label(lay, axes)} too")
            v = free_or_violation(
                t, want, name, "sharding-mismatch",
                f"{name} dim {dim} is sharded on mesh axis {axes_label(lay, axes)} but x's aligned dim {dim + off} "
                f"(size {x.shape[dim + off]}) is {x_desc}; {name} is {lay}, x is {x.layout}", hint)
            if v is not None:
                out.append(v)
    return out


def _dtype_violations(x: TensorSpec, cos: TensorSpec, sin: TensorSpec) -> list[Violation]:
    if x.dtype not in FLOAT_DTYPES:
        return [Violation("invalid-dtype", f"x has dtype {x.dtype}; RotaryPositionEmbedding takes float16, float32 "
                          "or float64", "cast x to a float type", operand="x")]
    return [Violation("invalid-dtype", f"{name} has dtype {t.dtype} but x has {x.dtype}",
                      f"give {name} x's dtype {x.dtype} (the CANN kernel requires one dtype too)", operand=name)
            for name, t in (("cos", cos), ("sin", sin)) if t.dtype != x.dtype]


def rpe_layout_analysis(x: TensorSpec, cos: TensorSpec, sin: TensorSpec, attrs: dict):
    """Shared by the forward and gradient rules: ``(x_fixed, wants, violations, tables_ok)``."""
    violations = _check_attrs(x, attrs) + _dtype_violations(x, cos, sin)
    x_fixed, x_violations = _x_layout(x)
    violations += x_violations
    shape_violations = _table_shape_violations(x, cos, sin) if x.ndim in INPUT_LAYOUTS else []
    violations += shape_violations
    wants: list[Layout | None] = [x_fixed if x_fixed != x.layout else None, None, None]
    if not shape_violations and x.ndim in INPUT_LAYOUTS:
        for i, (name, t) in enumerate((("cos", cos), ("sin", sin)), start=1):
            want = _table_want(x_fixed, x, t)
            violations += _table_violations(name, x, x_fixed, t, want)
            wants[i] = want if want != t.layout else None
    return x_fixed, wants, violations, not shape_violations


@register_op
class RotaryPositionEmbedding(OpRule):
    """``rotary_position_embedding(x, cos, sin, mode=0, input_layout="BNSD")``."""

    name = "rotary_position_embedding"
    operands = OPERANDS
    aliases = ("RotaryPositionEmbedding", "npu_rotary_mul", "rotary_mul", "rope")
    attr_defaults = {"mode": 0, "input_layout": None}
    violation_codes = VIOLATION_CODES

    def sample_inputs(self):
        from layout_prop.core.registry import OpSample

        return [
            OpSample([(3, 2, 5, 8), (1, 1, 5, 8), (1, 1, 5, 8)], {"mode": 0}),
            OpSample([(2, 3, 4, 4), (2, 3, 4, 4), (2, 3, 4, 4)], {"mode": 2}),
            OpSample([(5, 1, 3, 6), (1, 3, 6), (1, 3, 6)], {"mode": 1}),
            OpSample([(4, 2, 8), (4, 1, 8), (4, 1, 8)], {"mode": 3, "input_layout": "TND"}),
        ]

    def infer_layout(self, inputs, attrs):
        x, cos, sin = inputs
        x_fixed, wants, violations, _ = rpe_layout_analysis(x, cos, sin, attrs)
        out = TensorSpec(x.shape, x.dtype, x_fixed)
        return RuleResult((out,), tuple(violations), tuple(wants))

    def check_kernel(self, backend, local_shapes, inputs, attrs):
        return _check_cann(local_shapes, inputs, attrs, False, False) if backend == "cann" else []

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        grads = g.op("rotary_position_embedding_grad", [dy, *inputs], dict(attrs), num_outputs=3)
        return tuple(v if need else None for v, need in zip(grads, needs))


def _check_cann(local_shapes, inputs, attrs, backward: bool, need_dcos: bool) -> list[Violation]:
    from layout_prop.core.errors import LayoutPropError
    from layout_prop.kernels.rpe_cann import check_cann_constraints

    x_shape, cos_shape = local_shapes[-3], local_shapes[-2]
    if len(x_shape) != 4:
        return [Violation("kernel-constraint", f"the CANN kernel takes 4-D x, got local shape {list(x_shape)}",
                          "use the mindspore backend for 3-D (TND) x", operand="x")]
    try:
        check_cann_constraints(x_shape, cos_shape, attrs["mode"], attrs.get("input_layout") or "BNSD",
                               backward=backward, need_dcos=need_dcos, dtype=inputs[-3].dtype)
    except LayoutPropError as err:
        return [Violation(err.code, err.message, err.hint or "use the mindspore backend", operand="x")]
    return []


def grad_table_layout(x_fixed: Layout, x: TensorSpec, t: TensorSpec) -> Layout:
    """Layout of the locally computed dcos/dsin: sliced dims stay sharded, broadcast dims are partial sums."""
    off = x.ndim - t.ndim
    ps = []
    for p in x_fixed.placements:
        if isinstance(p, Shard):
            if p.dim >= off and t.shape[p.dim - off] == x.shape[p.dim]:
                ps.append(Shard(p.dim - off))
            else:
                ps.append(Partial("sum"))
        else:
            ps.append(Replicate())
    return Layout(t.mesh, ps, t.ndim)


@register_op
class RotaryPositionEmbeddingGrad(OpRule):
    """``rotary_position_embedding_grad(dy, x, cos, sin) -> (dx, dcos, dsin)``.

    dx takes x's layout.  dcos and dsin are reduced locally over the dims cos broadcasts
    along, so a mesh axis that shards such a dim of x leaves ``P(sum)``; a full-size
    cos dim that x shards stays sharded.  The backward pass brings both back to the
    layout of cos and sin.
    """

    name = "rotary_position_embedding_grad"
    operands = ("dy", "x", "cos", "sin")
    aliases = ("RotaryPositionEmbeddingGrad",)
    num_outputs = 3
    attr_defaults = {"mode": 0, "input_layout": None}
    violation_codes = VIOLATION_CODES
    differentiable = False

    def check_kernel(self, backend, local_shapes, inputs, attrs):
        # the gradient kernel computes dcos/dsin too (the graph's needs are not visible to a rule)
        return _check_cann(local_shapes, inputs, attrs, True, True) if backend == "cann" else []

    def infer_layout(self, inputs, attrs):
        dy, x, cos, sin = inputs
        x_fixed, wants, violations, tables_ok = rpe_layout_analysis(x, cos, sin, attrs)
        dy_want = None
        if dy.shape != x.shape:
            violations.append(Violation("broadcast-shape", f"dy has shape {list(dy.shape)} but x has "
                                        f"{list(x.shape)}", "the cotangent has the output's shape", operand="dy"))
        elif dy.layout != x_fixed:
            dy_want = x_fixed
            v = free_or_violation(dy, x_fixed, "dy", "sharding-mismatch",
                                  f"dy is {dy.layout} but the gradient kernel needs x's layout {x_fixed}",
                                  "give the cotangent the output's layout")
            if v is not None:
                violations.append(v)
        dx = TensorSpec(x.shape, x.dtype, x_fixed)
        if tables_ok:
            dcos = TensorSpec(cos.shape, cos.dtype, grad_table_layout(x_fixed, x, cos))
            dsin = TensorSpec(sin.shape, sin.dtype, grad_table_layout(x_fixed, x, sin))
        else:
            dcos = dsin = None
        return RuleResult((dx, dcos, dsin), tuple(violations), (dy_want, *wants))
