"""How a console transcript on a page is compared with what the command prints today.

A page shows what the command printed when the page was written, digit for digit. Most of
it is deterministic (names, shapes, bytes, counts, layouts, and the step-time model's
figures, computed in float64 from the model) and must be printed again exactly. A few
figures are measured: the errors ``run`` and ``pipeline --run`` report against one device
(``max abs err 1.43e-06, max rel err 2.14e-07``) depend on how float32 matmuls round, which
depends on the CPU's BLAS kernel (AVX2, AVX-512, SSE3) and on the number of threads: on
another CPU the same command prints ``1.67e-06`` there, or ``1.43e-06`` where the page
shows ``0``.

The rule (:func:`transcript_differences`):

- both outputs are cut into lines (leading and trailing blank space of the whole output
  dropped, as before this rule) and there must be as many lines;
- each line is cut into tokens (words, numbers, punctuation and the blank space between
  them); every token must be exactly equal, integers and decimals included,
- except a *measured error*: the number after ``abs err`` or ``rel err`` (:data:`MEASURED`).
  Two measured errors agree when they are within a factor of :data:`FACTOR` (10, an order
  of magnitude) of each other, a value below :data:`FLOOR` (1e-6) counting as 1e-6: float32
  rounding on values of order 1 to 10, so that an exact 0 on one CPU and a few units in
  the last place on another agree, while an error ten times larger than the page's does
  not. ``inf`` and ``nan`` must be equal.

So a reader sees what the command prints, and a transcript passes on any x86-64 or aarch64
CPU and thread count (checked under ``OPENBLAS_CORETYPE=Haswell`` and ``Prescott`` with one
and two threads: ``.ci/run``).
"""

from __future__ import annotations

import math
import re

#: the labels whose number is a measured error (``run``'s and ``pipeline --run``'s lines
#: ``output y: max abs err 1.91e-06, max rel err 1.17e-07``)
MEASURED = ("abs err", "rel err")
#: two measured errors agree within this factor of each other
FACTOR = 10.0
#: a measured error below this counts as this (float32 rounding of values of order 1)
FLOOR = 1e-6

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
#: a measured error: its label, one space, the number as ``:.3g`` prints it (or inf / nan)
_MEASURED = re.compile(r"(?<![\w-])(?:" + "|".join(re.escape(label) for label in MEASURED) + r") "
                       r"(" + _NUMBER + r"|inf|nan)(?![\w.])")
#: every other token: a number, a word, a run of blank space, or one other character
_TOKEN = re.compile(_NUMBER + r"|[A-Za-z_]+|\s+|.", re.S)


def tokens(line: str) -> list[tuple[str, str]]:
    """The line cut into ``(kind, text)`` tokens, kind ``"measured"`` for a measured error's
    number and ``"exact"`` for every other token (they are joined again into the line).

    >>> tokens("grad x: max abs err 1.43e-06, max rel err 0")[-4:]
    [('exact', 'max'), ('exact', ' '), ('exact', 'rel err '), ('measured', '0')]
    >>> "".join(text for _, text in tokens("l0_w [2, 4] 10,723,424 bytes")) == "l0_w [2, 4] 10,723,424 bytes"
    True
    """
    out: list[tuple[str, str]] = []
    position = 0
    for match in _MEASURED.finditer(line):
        before = line[position:match.start()]
        out.extend(("exact", t) for t in _TOKEN.findall(before))
        out.append(("exact", line[match.start():match.start(1)]))
        out.append(("measured", match.group(1)))
        position = match.end()
    out.extend(("exact", t) for t in _TOKEN.findall(line[position:]))
    return out


def errors_agree(expected: str, actual: str) -> bool:
    """Whether two measured errors, as printed, agree (the module's rule).

    >>> errors_agree("1.43e-06", "1.67e-06"), errors_agree("0", "3.68e-07"), errors_agree("0", "1.43e-06")
    (True, True, True)
    >>> errors_agree("2.14e-07", "2.5e-05"), errors_agree("1.2e-05", "1.1e-06"), errors_agree("inf", "1e-07")
    (False, False, False)
    """
    e, a = float(expected), float(actual)
    if not (math.isfinite(e) and math.isfinite(a)):
        return expected == actual
    low, high = sorted((max(abs(e), FLOOR), max(abs(a), FLOOR)))
    return high <= FACTOR * low


def transcript_differences(expected: str, actual: str) -> list[str]:
    """Where ``actual`` output differs from the ``expected`` transcript under the module's rule:
    one message a differing line (empty when they agree).

    >>> transcript_differences("y: max abs err 0, max rel err 0", "y: max abs err 1.4e-06, max rel err 3.7e-07")
    []
    >>> transcript_differences("memory 16 KiB", "memory 17 KiB")
    ["line 1: expected 'memory 16 KiB', got 'memory 17 KiB' ('16' is not '17')"]
    """
    want, got = expected.strip().splitlines(), actual.strip().splitlines()
    if len(want) != len(got):
        return [f"{len(want)} line(s) expected, {len(got)} printed:\n" + "\n".join(got)]
    differences = []
    for number, (w, g) in enumerate(zip(want, got), start=1):
        reason = _line_difference(w, g)
        if reason:
            differences.append(f"line {number}: expected {w!r}, got {g!r} ({reason})")
    return differences


def _line_difference(expected: str, actual: str) -> str | None:
    """Why one line differs (the first differing token), or None when it agrees."""
    if expected == actual:
        return None
    want, got = tokens(expected), tokens(actual)
    for (wkind, wtext), (gkind, gtext) in zip(want, got):
        if wkind != gkind:
            return f"{wtext!r} is not {gtext!r}"
        if wkind == "measured":
            if not errors_agree(wtext, gtext):
                return (f"measured error {gtext} is not within a factor of {FACTOR:g} of {wtext} "
                        f"(below {FLOOR:g} counting as {FLOOR:g})")
        elif wtext != gtext:
            return f"{wtext!r} is not {gtext!r}"
    if len(want) != len(got):
        return f"{len(want)} tokens expected, {len(got)} printed"
    return None
