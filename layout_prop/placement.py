"""Placements: how a tensor lives on one mesh axis.

``Replicate()`` (``R``), ``Shard(dim)`` (``S(d)``), ``Partial(op)`` (``P(sum)``).
Frozen and hashable, with a short ``str`` and an exact ``repr``.

Examples
--------
>>> parse_placement("S(-1)")
Shard(dim=-1)
>>> str(parse_placement("Partial(sum)")), str(parse_placement("P")), str(parse_placement("Replicate()"))
('P(sum)', 'P(sum)', 'R')
>>> Shard(2) == parse_placement("Shard(2)")
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from .errors import LayoutError

__all__ = ["Replicate", "Shard", "Partial", "Placement", "parse_placement", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the whole (local) tensor."""

    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"

    def is_replicate(self) -> bool:
        return True

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard:
    """The tensor dim ``dim`` is split across the axis in ``torch.chunk`` pieces."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise LayoutError("bad-placement", f"Shard dim must be an integer, got {self.dim!r}",
                              hint="write S(d) with an integer d")

    def __str__(self) -> str:
        return f"S({self.dim})"

    def is_replicate(self) -> bool:
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Partial:
    """Each rank along the axis holds a term; the tensor is their reduction by ``reduce_op``."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise LayoutError("bad-placement", f"unknown reduce op {self.reduce_op!r} in Partial",
                              hint=f"use one of {', '.join(REDUCE_OPS)}")

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def is_replicate(self) -> bool:
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_partial(self) -> bool:
        return True


Placement = Union[Replicate, Shard, Partial]

_SHARD = re.compile(r"^(?:S|Shard)\(\s*(-?\d+)\s*\)$")
_PARTIAL = re.compile(r"^(?:P|Partial)(?:\(\s*(\w*)\s*\))?$")
_REPLICATE = re.compile(r"^(?:R|Replicate)(?:\(\s*\))?$")


def parse_placement(text) -> Placement:
    """Parse ``R``, ``S(d)``, ``P``, ``P(op)`` and their long forms; pass placements through.

    Raises
    ------
    LayoutError
        ``bad-placement`` when the text is none of these.
    """
    if isinstance(text, (Replicate, Shard, Partial)):
        return text
    if not isinstance(text, str):
        raise LayoutError("bad-placement", f"cannot parse placement {text!r}: not a string",
                          hint="write R, S(d), P or P(op), quoted in YAML")
    s = text.strip()
    if _REPLICATE.match(s):
        return Replicate()
    m = _SHARD.match(s)
    if m:
        return Shard(int(m.group(1)))
    m = _PARTIAL.match(s)
    if m:
        op = m.group(1) or "sum"
        if op not in REDUCE_OPS:
            raise LayoutError("bad-placement", f"unknown reduce op {op!r} in placement {text!r}",
                              hint=f"use one of {', '.join(REDUCE_OPS)}")
        return Partial(op)
    raise LayoutError("bad-placement", f"cannot parse placement {text!r}",
                      hint="write R, S(d) (d an integer, may be negative), P or P(sum|avg|max|min)")
