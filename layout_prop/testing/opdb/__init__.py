"""The op database: one module per op family, each with a list ``RECORDS`` of :class:`OpRecord`.

``graph_tests/test_opdb.py`` runs every record through :func:`layout_prop.testing.verify_op`,
and ``layout-prop verify OP`` uses a built-in op's records when its rule defines no
``sample_inputs()`` of its own (:func:`samples_for`).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Sequence

from layout_prop.testing import OpSample

__all__ = ["OpRecord", "OpSample", "all_records", "samples_for"]


@dataclass(frozen=True)
class OpRecord:
    """An op to verify: sample inputs, meshes, and how many placement combinations to try.

    ``placements`` is ``"all"`` or the size of a seeded sample per (sample, mesh).
    """

    op: str
    samples: Sequence[OpSample]
    meshes: Sequence[Sequence[int]] = ((2,), (2, 2), (2, 2, 2))
    placements: int | str = 200
    backward: bool = True
    codes: Sequence[str] | None = None
    id: str = ""
    tags: Sequence[str] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return self.id or self.op


def all_records() -> list[OpRecord]:
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        out.extend(getattr(module, "RECORDS", []))
    return out


def samples_for(op: str) -> list[OpSample]:
    """The sample inputs of every record of ``op`` (its canonical name), in record order."""
    return [sample for record in all_records() if record.op == op for sample in record.samples]
