"""Moved to :mod:`layout_prop.engines.eager`; this path is kept for code written against it."""

from layout_prop.engines.eager import *  # noqa: F401,F403
from layout_prop.engines.eager import __all__  # noqa: F401
