"""Pointwise ops that imported models use on their own: ``sqrt``, ``rsqrt``, ``reciprocal``,
``sigmoid``, ``tanh``, ``erf``, ``relu``, ``pow(x, exponent)``, ``cos``, ``sin`` and ``gelu_erf``
(GELU without the tanh approximation).

Each is elementwise and not linear: any sharding of x passes through (the output keeps x's
layout), a Partial x is ``partial-input`` (reduce it first), as for ``exp`` or ``silu``.  Each
has a numpy kernel and a gradient rule built from existing ops:

- ``sqrt``: ``dy * 0.5 / y``; ``rsqrt``: ``dy * -0.5 * y**3``; ``reciprocal``: ``-dy * y**2``
- ``sigmoid``: ``dy * (y - y**2)``; ``tanh``: ``dy - dy * y**2``
- ``erf``: ``dy * 2/sqrt(pi) * exp(-x**2)``; ``pow``: ``dy * p * x**(p - 1)``
- ``cos``: ``-dy * sin(x)``; ``sin``: ``dy * cos(x)``
- ``relu``: ``relu_grad(dy, x) = dy * (x > 0)``, an op of its own, linear in dy
- ``gelu_erf``: ``gelu_erf_grad(dy, x) = dy * (cdf(x) + x * pdf(x))``, likewise

They are registered by importing this module (the importers do; so does the command line
before it loads a spec), under these names unless the registry already has an op of the
same name, which then wins.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> from layout_prop.core.registry import get_rule
>>> x = TensorSpec((4, 8), "float32", Layout(DeviceMesh((2,), ("tp",)), ["S(1)"], 2))
>>> str(get_rule("rsqrt").infer_layout((x,), {}).outputs[0])
'float32[4, 8] (S(1))'
>>> import numpy as np
>>> KERNELS["pow"](np.array([2.0, 3.0]), exponent=2.0)
array([4., 9.])
"""

from __future__ import annotations

import math

import numpy as np

from ..kernels.numpy_backend import KERNELS, register_kernel
from ..ops.nn import PointwiseRule
from layout_prop.core.registry import register_op

__all__ = ["POINTWISE_OPS"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class _Unary(PointwiseRule):
    """A non-linear pointwise op of one operand; subclasses give ``grad``."""

    operands = ("x",)
    partial_mode = "none"
    linear_note = "is not linear"

    def grad(self, g, x: str, y: str, dy: str, attrs: dict) -> str:
        raise NotImplementedError

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[0] or g.spec(inputs[0]).dtype not in _FLOATS:
            return (None,)
        return (self.grad(g, inputs[0], outputs[0], dy, attrs),)


class Sqrt(_Unary):
    """``sqrt(x)``; gradient ``dy * 0.5 / y``."""

    name = "sqrt"
    aliases = ("Sqrt",)

    def grad(self, g, x, y, dy, attrs):
        return g.op("div", [g.op("scale", [dy], {"factor": 0.5}), y])


class Rsqrt(_Unary):
    """``1 / sqrt(x)``; gradient ``dy * -0.5 * y**3``."""

    name = "rsqrt"
    aliases = ("Rsqrt",)

    def grad(self, g, x, y, dy, attrs):
        cube = g.op("mul", [y, g.op("mul", [y, y])])
        return g.op("scale", [g.op("mul", [dy, cube])], {"factor": -0.5})


class Reciprocal(_Unary):
    """``1 / x``; gradient ``-dy * y**2``."""

    name = "reciprocal"
    aliases = ("Reciprocal",)

    def grad(self, g, x, y, dy, attrs):
        return g.op("neg", [g.op("mul", [dy, g.op("mul", [y, y])])])


class Sigmoid(_Unary):
    """``1 / (1 + exp(-x))``; gradient ``dy * (y - y**2)``."""

    name = "sigmoid"
    aliases = ("Sigmoid",)

    def grad(self, g, x, y, dy, attrs):
        return g.op("mul", [dy, g.op("sub", [y, g.op("mul", [y, y])])])


class Tanh(_Unary):
    """``tanh(x)``; gradient ``dy - dy * y**2``."""

    name = "tanh"
    aliases = ("Tanh",)

    def grad(self, g, x, y, dy, attrs):
        return g.op("sub", [dy, g.op("mul", [dy, g.op("mul", [y, y])])])


class Erf(_Unary):
    """``erf(x)``; gradient ``dy * 2/sqrt(pi) * exp(-x**2)``."""

    name = "erf"
    aliases = ("Erf",)

    def grad(self, g, x, y, dy, attrs):
        bell = g.op("exp", [g.op("neg", [g.op("mul", [x, x])])])
        return g.op("mul", [dy, g.op("scale", [bell], {"factor": 2.0 / math.sqrt(math.pi)})])


class Pow(_Unary):
    """``pow(x, exponent)``: x to a constant real power; gradient ``dy * p * x**(p - 1)``."""

    name = "pow"
    aliases = ("Pow",)
    attr_defaults = {"exponent": None}
    required_attrs = ("exponent",)

    def attr_problem(self, inputs, attrs):
        from layout_prop.core.errors import Violation

        p = attrs["exponent"]
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            return Violation("invalid-attr", f"pow's exponent {p!r} is not a number", "give exponent a real number",
                             operand="x")
        return None

    def sample_inputs(self):
        from layout_prop.core.registry import OpSample

        return [OpSample([(5, 3)], attrs={"exponent": 2.0}), OpSample([(2, 3, 4)], attrs={"exponent": 3})]

    def grad(self, g, x, y, dy, attrs):
        p = float(attrs["exponent"])
        if p == 1.0:
            return g.op("identity", [dy])
        return g.op("mul", [dy, g.op("scale", [g.op("pow", [x], {"exponent": p - 1.0})], {"factor": p})])


class Relu(_Unary):
    """``max(x, 0)``; gradient ``relu_grad(dy, x) = dy * (x > 0)``."""

    name = "relu"
    aliases = ("Relu", "ReLU")

    def grad(self, g, x, y, dy, attrs):
        return g.op("relu_grad", [dy, x])


class ReluGrad(PointwiseRule):
    """``relu_grad(dy, x) = dy * (x > 0)``: linear in dy (a Partial dy passes with x Replicate)."""

    name = "relu_grad"
    operands = ("dy", "x")
    partial_mode = "first"
    differentiable = False
    linear_note = "is linear in dy only"


class Cos(_Unary):
    """``cos(x)``; gradient ``-dy * sin(x)``."""

    name = "cos"
    aliases = ("Cos",)

    def grad(self, g, x, y, dy, attrs):
        return g.op("neg", [g.op("mul", [dy, g.op("sin", [x])])])


class Sin(_Unary):
    """``sin(x)``; gradient ``dy * cos(x)``."""

    name = "sin"
    aliases = ("Sin",)

    def grad(self, g, x, y, dy, attrs):
        return g.op("mul", [dy, g.op("cos", [x])])


class GeluErf(_Unary):
    """``x * 0.5 * (1 + erf(x / sqrt(2)))``, GELU without approximation (torch's default, ONNX's
    ``Gelu``; the registry's ``gelu`` is the tanh approximation); gradient
    ``gelu_erf_grad(dy, x) = dy * (cdf(x) + x * pdf(x))``, an op of its own, linear in dy."""

    name = "gelu_erf"
    aliases = ("GeluErf",)

    def grad(self, g, x, y, dy, attrs):
        return g.op("gelu_erf_grad", [dy, x])


class GeluErfGrad(PointwiseRule):
    """``gelu_erf_grad(dy, x) = dy * (cdf(x) + x * pdf(x))``: linear in dy (a Partial dy passes with x
    Replicate)."""

    name = "gelu_erf_grad"
    operands = ("dy", "x")
    partial_mode = "first"
    differentiable = False
    linear_note = "is linear in dy only"


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.result_type(x, np.float32))
    return np.asarray(x * 0.5 * (1.0 + _erf(x / math.sqrt(2.0))), dtype=x.dtype)


def _gelu_erf_grad(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.result_type(x, np.float32))
    slope = 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return np.asarray(dy * slope, dtype=np.result_type(dy, x))


def _erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x), dtype=np.result_type(x, np.float32))


def _kernels() -> dict:
    def floating(fn):
        return lambda x, **_: np.asarray(fn(np.asarray(x, dtype=np.result_type(x, np.float32))))

    return {
        "sqrt": floating(np.sqrt),
        "rsqrt": floating(lambda x: 1.0 / np.sqrt(x)),
        "reciprocal": floating(lambda x: 1.0 / x),
        "sigmoid": floating(lambda x: 1.0 / (1.0 + np.exp(-x))),
        "tanh": floating(np.tanh),
        "erf": floating(_erf),
        "relu": floating(lambda x: np.maximum(x, 0)),
        "relu_grad": lambda dy, x: np.asarray(np.where(np.asarray(x) > 0, dy, np.zeros_like(dy))),
        "cos": floating(np.cos),
        "sin": floating(np.sin),
        "gelu_erf": lambda x, **_: _gelu_erf(x),
        "gelu_erf_grad": lambda dy, x: _gelu_erf_grad(dy, x),
        "pow": lambda x, exponent: np.asarray(np.power(np.asarray(x, dtype=np.result_type(x, np.float32)),
                                                       np.asarray(exponent, dtype=np.result_type(x, np.float32)))),
    }


POINTWISE_OPS = ("sqrt", "rsqrt", "reciprocal", "sigmoid", "tanh", "erf", "pow", "relu", "relu_grad", "cos", "sin",
                 "gelu_erf", "gelu_erf_grad")

def _taken(cls) -> bool:
    """Whether the registry already knows the op's name or an alias (a built-in wins; a re-import
    of this module is a no-op)."""
    from layout_prop.core.registry import is_registered

    return any(is_registered(name) for name in (cls.name, *cls.aliases))


for _cls in (Sqrt, Rsqrt, Reciprocal, Sigmoid, Tanh, Erf, Pow, Relu, ReluGrad, Cos, Sin, GeluErf, GeluErfGrad):
    if not _taken(_cls):
        register_op(_cls)
        if _cls.name not in KERNELS:
            register_kernel(_cls.name, _kernels()[_cls.name])

from . import opaque as _opaque  # noqa: E402,F401  (the importers' barrier op, registered with these)
