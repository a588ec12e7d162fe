"""``redistribute(x, placements=...)``: an explicit move of a value to another layout.

The reshard and backward passes insert these nodes; lowering turns each into the steps
of its plan (local slices and collectives).  Users may write them in specs too.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2,), ("tp",))
>>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["S(0)"], 2))
>>> str(Redistribute().infer_layout((x,), {"placements": ["R"]}).outputs[0].layout)
'(R)'
"""

from __future__ import annotations

from layout_prop.core.errors import LayoutPropError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.registry import OpRule, RuleResult, register_op
from layout_prop.core.spec import TensorSpec

__all__ = ["Redistribute"]


@register_op
class Redistribute(OpRule):
    name = "redistribute"
    operands = ("x",)
    aliases = ("Redistribute", "reshard")
    attr_defaults = {"placements": None}
    required_attrs = ("placements",)
    strided = True  # the planner moves strided shards (gather, local slice)

    def infer_layout(self, inputs, attrs):
        from layout_prop.core.redistribute import plan_redistribution

        (x,) = inputs
        try:
            layout = Layout(x.mesh, attrs["placements"], x.ndim)
            out = TensorSpec(x.shape, x.dtype, layout)
            plan_redistribution(x, layout)
        except LayoutPropError as err:
            v = Violation(err.code, err.message, err.hint or "choose a reachable layout", operand="x")
            return RuleResult((None,), (v,), ())
        return RuleResult((out,))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        # the transpose of a reduction (P -> R) hands every term the whole cotangent: R there
        primal = g.spec(inputs[0]).layout
        target = ["R" if p.is_partial() else str(p) for p in primal.placements]
        return (g.op("redistribute", [cotangents[0]], {"placements": target}),)
