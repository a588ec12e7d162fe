"""``opaque``: a model op the importer cannot map, kept as a barrier (``--opaque``).

``opaque(x0, x1, ..., op_type, shape, dtype)`` declares its output's shape and dtype and
nothing else: every input must be Replicate (a sharded or partial input is
``opaque-input``, fixable: ``--reshard`` gathers it), the output is Replicate.  It has no
kernel and no gradient: ``run`` refuses a graph that holds one.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2,), ("tp",))
>>> x = TensorSpec((4, 8), "float32", Layout(mesh, ["S(1)"], 2))
>>> res = Opaque().infer_layout((x,), {"op_type": "Erf", "shape": [4, 8], "dtype": "float32"})
>>> str(res.outputs[0]), [v.code for v in res.violations], [str(w) for w in res.wants]
('float32[4, 8] (R)', ['opaque-input'], ['(R)'])
"""

from __future__ import annotations

from layout_prop.core.errors import Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Replicate
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op, registered_ops
from layout_prop.core.spec import TensorSpec

__all__ = ["Opaque"]


class Opaque(OpRule):
    """See the module docstring."""

    name = "opaque"
    operands = ()
    variadic = True
    attr_defaults = {"op_type": None, "shape": None, "dtype": "float32"}
    required_attrs = ("op_type", "shape")
    differentiable = False
    violation_codes = ("opaque-input",)

    def infer_layout(self, inputs, attrs):
        mesh = inputs[0].mesh if inputs else None
        violations, wants = [], []
        for i, t in enumerate(inputs):
            replicated = Layout(t.mesh, [Replicate()] * t.mesh.ndim, t.ndim)
            if t.layout == replicated:
                wants.append(None)
                continue
            wants.append(replicated)
            violations.append(Violation(
                "opaque-input", f"input {i} is {t.layout}, but {attrs['op_type']} is opaque to the importer "
                "(its sharding rule is unknown), so it takes every input whole",
                f"gather input {i} to Replicate (--reshard does), or replace {attrs['op_type']} by ops "
                "layout-prop knows", operand=f"x{i}", fixable=True))
        if mesh is None:
            return RuleResult((None,), (), ())
        shape = tuple(attrs["shape"])
        out = TensorSpec(shape, attrs["dtype"], Layout(mesh, [Replicate()] * mesh.ndim, len(shape)))
        return RuleResult((out,), tuple(violations), tuple(wants))

    def infer_source_layout(self, mesh, attrs):
        """An opaque node with no inputs (a constant the importer could not fold): its declared
        shape and dtype, replicated."""
        shape = tuple(attrs["shape"])
        return RuleResult((TensorSpec(shape, attrs["dtype"], Layout(mesh, [Replicate()] * mesh.ndim, len(shape))),))

    def operand_name(self, index: int) -> str:
        return f"x{index}"


if "opaque" not in registered_ops():
    register_op(Opaque)
else:  # a re-import (importlib.reload): the registered rule stays
    get_rule("opaque")
