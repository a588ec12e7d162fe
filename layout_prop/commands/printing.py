"""What the commands print: strict JSON on stdout."""

from __future__ import annotations

import json
import sys

__all__ = ["print_json"]


def print_json(obj) -> None:
    """Strict JSON on stdout: indented on a terminal, else on one line (Python's fast C encoder).

    A float that is not finite (which strict JSON cannot hold) is written as ``null``.
    """
    indent = 1 if sys.stdout.isatty() else None
    separators = None if indent else (",", ":")
    try:
        text = json.dumps(obj, indent=indent, separators=separators, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere in the report
        text = json.dumps(_finite_json(obj), indent=indent, separators=separators, allow_nan=False)
    print(text)


def _finite_json(obj):
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj
