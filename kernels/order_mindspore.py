"""MindSpore kernels of the order op family, merged into the mindspore and cann tables.

:mod:`.mindspore_backend` imports this module; import its helpers (``_ms``, ``to_tensor``...)
inside functions, not at the top.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["KERNELS"]

KERNELS: dict[str, Callable] = {}
