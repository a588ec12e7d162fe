"""A user op: RotaryPositionEmbedding fused with a constant scale, ``y = rope(x, cos, sin) * scale``.

This file is a complete example of adding an op from outside layout-prop: a layout rule,
a gradient rule, numpy kernels and sample inputs for the testing kit.  Import it (or pass
it to ``layout-prop verify fused_rope_scale --module examples/custom_op/fused_rope_scale.py``)
and the op is registered.

The layout rule is the RotaryPositionEmbedding rule (a scale does not change where data
lives), so it reuses ``rpe_layout_analysis``; the gradient op reuses the RPE gradient rule.
"""

from __future__ import annotations

from layout_prop import OpRule, RuleResult, TensorSpec, register_kernel, register_op
from layout_prop.kernels.rpe_numpy import rpe_backward, rpe_forward
from layout_prop.ops.rpe import VIOLATION_CODES, RotaryPositionEmbeddingGrad, rpe_layout_analysis
from layout_prop.testing import OpSample


@register_op
class FusedRopeScale(OpRule):
    """``fused_rope_scale(x, cos, sin, mode=0, scale=1.0)``."""

    name = "fused_rope_scale"
    operands = ("x", "cos", "sin")
    aliases = ("FusedRopeScale",)
    attr_defaults = {"mode": 0, "scale": 1.0}
    violation_codes = VIOLATION_CODES

    def infer_layout(self, inputs, attrs):
        x, cos, sin = inputs
        x_layout, wants, violations, _ = rpe_layout_analysis(x, cos, sin, {"mode": attrs["mode"]})
        return RuleResult((TensorSpec(x.shape, x.dtype, x_layout),), tuple(violations), tuple(wants))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        grads = g.op("fused_rope_scale_grad", [cotangents[0], *inputs], dict(attrs), num_outputs=3)
        return tuple(v if need else None for v, need in zip(grads, needs))

    def sample_inputs(self):
        return [
            OpSample([(4, 2, 6, 8), (1, 1, 6, 8), (1, 1, 6, 8)], {"mode": 0, "scale": 0.5}),
            OpSample([(3, 1, 5, 4), (3, 1, 5, 4), (3, 1, 5, 4)], {"mode": 1, "scale": 2.0}),
        ]


@register_op
class FusedRopeScaleGrad(RotaryPositionEmbeddingGrad):
    """``fused_rope_scale_grad(dy, x, cos, sin) -> (dx, dcos, dsin)``: the RPE gradient layouts."""

    name = "fused_rope_scale_grad"
    aliases = ()
    attr_defaults = {"mode": 0, "scale": 1.0}

    def infer_layout(self, inputs, attrs):
        return super().infer_layout(inputs, {"mode": attrs["mode"], "input_layout": None})


def fused_rope_scale(x, cos, sin, mode=0, scale=1.0):
    """The numpy kernel (the reference, and what each simulated rank runs on its local arrays)."""
    return rpe_forward(x, cos, sin, mode) * x.dtype.type(scale)


def fused_rope_scale_grad(dy, x, cos, sin, mode=0, scale=1.0):
    return rpe_backward(dy * dy.dtype.type(scale), x, cos, sin, mode)


register_kernel("fused_rope_scale", fused_rope_scale)
register_kernel("fused_rope_scale_grad", fused_rope_scale_grad)
