"""Placements: how a tensor lives on one mesh axis.

``Replicate()`` (``R``), ``Shard(dim)`` (``S(d)``), ``Partial(op)`` (``P(sum)``), and
``StridedShard(dim, split_factor)`` (``_S(d,k)``, DTensor's ``_StridedShard``): what a
reshape that merges dims leaves of a shard of an inner dim.
Frozen and hashable, with a short ``str`` and an exact ``repr``.

Examples
--------
>>> parse_placement("S(-1)")
Shard(dim=-1)
>>> str(parse_placement("Partial(sum)")), str(parse_placement("P")), str(parse_placement("Replicate()"))
('P(sum)', 'P(sum)', 'R')
>>> Shard(2) == parse_placement("Shard(2)")
True
>>> parse_placement("_S(0, 2)"), str(StridedShard(0, 2))
(StridedShard(dim=0, split_factor=2), '_S(0,2)')
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from .errors import LayoutError

__all__ = ["Replicate", "Shard", "StridedShard", "Partial", "Placement", "parse_placement", "REDUCE_OPS",
           "shard_dim"]

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
class StridedShard:
    """Tensor dim ``dim`` viewed as ``(split_factor, n // split_factor)``, its inner part cut
    across the axis in ``torch.chunk`` pieces.

    Rank ``c`` of the axis holds the elements ``b * m + j`` of the dim for every
    ``b < split_factor`` and every ``j`` in chunk ``c`` of ``range(m)``, ``m = n //
    split_factor``, in that order: exactly what a rank holds after merging dims
    ``(split_factor, m)`` into one when the inner one was ``S``-sharded (x ``S(1)`` of
    shape (2, 16, 16) viewed as (32, 16) is ``_S(0,2)``), uneven chunks included.  With
    several mesh axes on one dim, each cuts the piece the outer ones left (as ``Shard``
    does), so ``split_factor`` counts blocks of that piece.  DTensor's ``_StridedShard``
    coincides when the shard count divides ``m``.  ``split_factor`` is at least 2
    (``1`` is a plain ``Shard``); MindSpore's ``tensor_map`` cannot express it.
    """

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise LayoutError("bad-placement", f"StridedShard dim must be an integer, got {self.dim!r}",
                              hint="write _S(d,k) with integers d and k >= 2")
        if isinstance(self.split_factor, bool) or not isinstance(self.split_factor, int) or self.split_factor < 2:
            raise LayoutError("bad-placement", f"StridedShard split factor must be an integer >= 2, got "
                              f"{self.split_factor!r}", hint="write _S(d,k) with k >= 2 (k = 1 is S(d))")

    def __str__(self) -> str:
        return f"_S({self.dim},{self.split_factor})"

    def is_replicate(self) -> bool:
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        return False  # not a contiguous shard: rules that do not know strided shards must not take it for one

    def is_partial(self) -> bool:
        return False


def shard_dim(p) -> int | None:
    """The tensor dim a ``Shard`` or ``StridedShard`` cuts, else None.

    >>> shard_dim(Shard(1)), shard_dim(StridedShard(0, 2)), shard_dim(Replicate())
    (1, 0, None)
    """
    return p.dim if isinstance(p, (Shard, StridedShard)) else None


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


Placement = Union[Replicate, Shard, StridedShard, Partial]

_SHARD = re.compile(r"^(?:S|Shard)\(\s*(-?\d+)\s*\)$")
_PARTIAL = re.compile(r"^(?:P|Partial)(?:\(\s*(\w*)\s*\))?$")
_REPLICATE = re.compile(r"^(?:R|Replicate)(?:\(\s*\))?$")
_STRIDED = re.compile(r"^(?:_S|_StridedShard|StridedShard)\(\s*(?:dim\s*=\s*)?(-?\d+)\s*,\s*"
                      r"(?:split_factor\s*=\s*)?(-?\d+)\s*\)$")


def parse_placement(text) -> Placement:
    """Parse ``R``, ``S(d)``, ``P``, ``P(op)``, ``_S(d,k)`` and their long forms; pass placements through.

    Raises
    ------
    LayoutError
        ``bad-placement`` when the text is none of these.
    """
    if isinstance(text, (Replicate, Shard, StridedShard, Partial)):
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
    m = _STRIDED.match(s)
    if m:
        return StridedShard(int(m.group(1)), int(m.group(2)))
    m = _PARTIAL.match(s)
    if m:
        op = m.group(1) or "sum"
        if op not in REDUCE_OPS:
            raise LayoutError("bad-placement", f"unknown reduce op {op!r} in placement {text!r}",
                              hint=f"use one of {', '.join(REDUCE_OPS)}")
        return Partial(op)
    raise LayoutError("bad-placement", f"cannot parse placement {text!r}",
                      hint="write R, S(d) (d an integer, may be negative), P or P(sum|avg|max|min)")
