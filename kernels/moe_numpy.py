"""numpy kernels of the moe op family, merged into the numpy table."""

from __future__ import annotations

from typing import Callable

__all__ = ["KERNELS"]

KERNELS: dict[str, Callable] = {}
