"""numpy kernels of the attention op family, merged into the numpy table."""

from __future__ import annotations

from typing import Callable

__all__ = ["KERNELS"]

KERNELS: dict[str, Callable] = {}
