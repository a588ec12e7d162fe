"""Tie the msrun process tree to the launcher's life: whoever loses its parent dies.

Linux delivers a chosen signal to a process when its parent dies if the process asked for
it with ``prctl(PR_SET_PDEATHSIG)``.  The msrun engine uses it at two levels, so that no
signal that ends ``layout-prop`` (SIGKILL included, which nothing can catch) leaves
processes behind:

- the launcher starts ``python -m layout_prop.engines.msrun_guard LAUNCHER_PID msrun ...``;
  the guard asks for SIGKILL on its parent's death, checks that the parent is still the
  launcher (else the launcher died before the request and the guard exits), records its
  pid in :data:`MSRUN_PID_ENV` and replaces itself by ``msrun`` (same pid; the request
  survives ``exec``);
- every worker and the scheduler (children of msrun) make the same request at start
  (:func:`die_with_parent`), checking their parent against :data:`MSRUN_PID_ENV`.

Only the standard library is imported here: the guard starts in a few milliseconds.
Elsewhere than Linux the request is not available and :func:`set_parent_death_signal`
returns False; the launcher's own signal handlers and kill-on-exit still apply.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Sequence

__all__ = ["MSRUN_PID_ENV", "set_parent_death_signal", "die_with_parent", "main"]

MSRUN_PID_ENV = "LAYOUT_PROP_MSRUN_PID"
"""The pid of the run's msrun (the guard's pid, kept by ``exec``), for its children."""

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies; False if unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int | None) -> None:
    """SIGKILL this process when its parent dies; exit now if the parent is already gone.

    ``expected_parent`` is the pid the parent must have (the parent may have died before
    the request, and this process been adopted by another); None skips that check.
    """
    set_parent_death_signal(signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(3)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m layout_prop.engines.msrun_guard LAUNCHER_PID COMMAND [ARGS...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m layout_prop.engines.msrun_guard LAUNCHER_PID COMMAND [ARGS...]", file=sys.stderr)
        return 2
    die_with_parent(int(argv[0]))
    os.environ[MSRUN_PID_ENV] = str(os.getpid())
    os.execv(argv[1], argv[1:])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
