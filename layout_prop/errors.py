"""One small exception hierarchy, and the violation record.

Every error says what failed (``code`` and ``message``), where (``path``, ``node``,
``input``) and how to fix it (``hint``).  The CLI prints ``str(error)`` on one line and
exits 2.  A :class:`Violation` is not an exception: a layout that exists but breaks an
op's rule is data that passes collect, never raise.

Examples
--------
>>> err = SpecError("bad-placement", "cannot parse placement 'Q'", path="inputs.x.placements[0]",
...                 hint="write R, S(d), P or P(op)")
>>> str(err)
"bad-placement at inputs.x.placements[0]: cannot parse placement 'Q' (hint: write R, S(d), P or P(op))"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LayoutPropError",
    "SpecError",
    "LayoutError",
    "GraphError",
    "OpError",
    "ExecutionError",
    "Violation",
]


class LayoutPropError(Exception):
    """Base class: a typed error with a code, a location and a hint.

    Parameters
    ----------
    code : str
        A stable kebab-case identifier such as ``"unknown-op"``.
    message : str
        What failed, with the offending values.
    path : str, optional
        Where in a spec file (``nodes[2].inputs[1]``).
    node, input : str, optional
        The graph node and the input value involved.
    hint : str, optional
        How to fix it.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        path: str | None = None,
        node: str | None = None,
        input: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.code = code
        self.message = message
        self.path = path
        self.node = node
        self.input = input
        self.hint = hint
        super().__init__(str(self))

    def where(self) -> str:
        parts = []
        if self.path:
            parts.append(self.path)
        if self.node:
            parts.append(f"node {self.node!r}")
        if self.input:
            parts.append(f"input {self.input!r}")
        return ", ".join(parts)

    def __str__(self) -> str:
        where = self.where()
        text = f"{self.code} at {where}: {self.message}" if where else f"{self.code}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "path": self.path,
            "node": self.node,
            "input": self.input,
            "hint": self.hint,
        }


class SpecError(LayoutPropError):
    """A spec file (YAML or JSON) that cannot be used as written."""


class LayoutError(LayoutPropError):
    """A mesh, placement or layout that cannot exist (as opposed to a rule violation)."""


class GraphError(LayoutPropError):
    """A malformed graph: arity, undefined values, duplicate names, cycles."""


class OpError(LayoutPropError):
    """An unknown op, a bad attribute, or an op used in a way it never supports."""


class ExecutionError(LayoutPropError):
    """Lowering or execution failed (a kernel missing for a backend, an engine failure)."""


@dataclass(frozen=True)
class Violation:
    """A layout that exists but breaks an op's rule.

    ``input`` is the value's name in the graph and ``operand`` the op's parameter name
    (``x``, ``cos``, ``sin``); the propagate pass fills ``node``, ``op`` and ``input``.
    ``fixable`` says whether a redistribution of the inputs can cure it (``--reshard``).
    """

    code: str
    message: str
    hint: str
    operand: str | None = None
    node: str | None = None
    op: str | None = None
    input: str | None = None
    fixable: bool = False
    details: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def located(self, node: str, op: str, input: str | None) -> "Violation":
        """A copy that names the node, the op and the input value.

        Built by copying the fields directly: propagation locates every violation of every
        node, and the frozen dataclass constructor (one ``object.__setattr__`` per field)
        was a visible part of its cost.

        >>> Violation("c", "m", "h", "x").located("n", "add", "a").input
        'a'
        """
        copy = object.__new__(Violation)
        fields = copy.__dict__
        fields.update(self.__dict__)
        fields["node"], fields["op"], fields["input"] = node, op, input
        return copy

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op": self.op,
            "input": self.input,
            "operand": self.operand,
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
        }

    def __str__(self) -> str:
        where = f"{self.node}" + (f".{self.operand}" if self.operand else "")
        return f"{self.code} at {where}: {self.message} (hint: {self.hint})"
