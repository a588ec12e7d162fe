"""Moved to :mod:`layout_prop.io.loader`; this path is kept for code written against it."""

from layout_prop.io.loader import *  # noqa: F401,F403
from layout_prop.io.loader import __all__  # noqa: F401
