"""Built-in ops; importing this package registers their rules.

One module per op family: :mod:`.elementwise`, :mod:`.rpe`, :mod:`.redistribute`.
"""

from . import elementwise, linalg, nn, redistribute, rpe, shape  # noqa: F401
