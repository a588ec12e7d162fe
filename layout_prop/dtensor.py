"""Moved to :mod:`layout_prop.engines.dtensor`; this path is kept for code written against it."""

from layout_prop.engines.dtensor import *  # noqa: F401,F403
from layout_prop.engines.dtensor import __all__  # noqa: F401
