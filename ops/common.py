"""Helpers shared by op rules: naming mesh axes, building violations, classifying wants."""

from __future__ import annotations

from typing import NamedTuple

from layout_prop.core.errors import LayoutPropError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Replicate
from layout_prop.core.spec import TensorSpec

__all__ = [
    "axes_label",
    "without_partial",
    "free_or_violation",
    "plan_summary",
    "move_violations",
    "Move",
]


def axes_label(layout: Layout, axes) -> str:
    return ", ".join(layout.mesh.names[a] for a in axes) or "no mesh axis"


def without_partial(layout: Layout) -> Layout:
    """The layout with every Partial axis reduced to Replicate."""
    return layout.with_placements([Replicate() if p.is_partial() else p for p in layout.placements])


class Move(NamedTuple):
    """What moving a spec to a wanted layout takes: ``free`` (local slices or nothing),
    ``fixable`` (a redistribution exists) and a short text of the plan or of why none exists."""

    free: bool
    fixable: bool
    text: str


def plan_summary(spec: TensorSpec, want: Layout) -> Move:
    """The :class:`Move` from ``spec`` to ``want`` (its cheapest plan)."""
    from layout_prop.core.redistribute import plan_redistribution

    try:
        plan = plan_redistribution(spec, want)
    except LayoutPropError as err:
        return Move(False, False, f"no redistribution exists ({err.message})")
    if not plan.steps:
        return Move(True, True, "nothing to do")
    steps = ", ".join(f"{s.kind} on {spec.mesh.names[s.mesh_axis]}" for s in plan.steps)
    return Move(plan.is_free, True, f"{steps}: {plan.bytes_per_rank} bytes per rank")


def free_or_violation(spec: TensorSpec, want: Layout | None, operand: str, code: str, message: str,
                      hint: str) -> Violation | None:
    """A violation when reaching ``want`` costs communication; None when it is free or not needed.

    The violation is ``fixable`` when a redistribution reaches ``want``; the check pass
    extends its hint with what ``--reshard`` inserts.
    """
    if want is None or want == spec.layout:
        return None
    move = plan_summary(spec, want)
    if move.free:
        return None
    return Violation(code, message, hint, operand=operand, fixable=move.fixable,
                     details={"want": [str(p) for p in want.placements]})


def move_violations(spec: TensorSpec, want: Layout, operand: str,
                     issues: list[tuple[str, str, str]]) -> list[Violation]:
    """The issues found on ``operand`` as violations, when moving it to ``want`` costs communication.

    ``issues`` holds ``(code, message, hint)`` per offending mesh axis.  A move that is a
    free local slice is no violation (lowering slices locally).
    """
    if want == spec.layout:
        return []
    free, fixable, _ = plan_summary(spec, want)
    if free:
        return []
    if not issues:
        issues = [("sharding-mismatch", f"{operand} is {spec.layout} but the kernel needs {want}",
                   f"give {operand} the layout {want}")]
    details = {"want": want.placement_strs()}
    return [Violation(code, message, hint, operand=operand, fixable=fixable, details=details)
            for code, message, hint in issues]
