"""Amounts of memory given on the command line: one grammar for ``run --max-memory`` and
``plan --memory-per-rank``.

A size is a number of bytes, or a number and a unit, case-insensitive, with spaces allowed
around and between them:

- the number: decimal digits with an optional fraction (``4096``, ``1.5``, ``.5``); no sign,
  no exponent;
- ``B`` (or nothing): bytes;
- ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB``: powers of 1024;
- ``KB``, ``MB``, ``GB``, ``TB``, ``PB``: powers of 1000;
- ``K``, ``M``, ``G``, ``T``, ``P`` alone: powers of 1024, as GNU coreutils, ``docker
  --memory`` and ``java -Xmx`` read them (``512M`` is 512 MiB).

The value is computed exactly (never a float) and rounded down to whole bytes; it must be at
least one byte and at most :data:`MAX_BYTES` (2^60, ``1024P``).  Zero, a negative number, a
fraction of a byte, ``inf`` or ``nan``, an exponent, an unknown unit and a value over the
limit are refused with one message saying which.

>>> parse_size("512M"), parse_size("3MB"), parse_size("1.5 KiB"), parse_size("1024p")
(536870912, 3000000, 1536, 1152921504606846976)
"""

from __future__ import annotations

import re
from fractions import Fraction

from layout_prop.core.errors import SpecError, cut

__all__ = ["MAX_BYTES", "UNITS", "GRAMMAR", "parse_size", "exact_bytes"]

#: the largest amount of memory a flag takes (2^60 bytes, 1024 PiB): --memory-per-rank, --max-memory
MAX_BYTES = 2 ** 60

#: unit (lower case) -> bytes
UNITS = {"": 1, "b": 1}
for _i, _letter in enumerate("kmgtp", start=1):
    UNITS[_letter] = 1024 ** _i
    UNITS[_letter + "ib"] = 1024 ** _i
    UNITS[_letter + "b"] = 1000 ** _i

#: the grammar in one line, the hint of every refusal and part of both flags' --help
GRAMMAR = ("a size is a number of bytes or a number with a unit (case-insensitive): KiB, MiB, GiB, TiB, PiB and "
           "K, M, G, T, P alone are powers of 1024, KB, MB, GB, TB, PB powers of 1000; from 1 byte to 1024P")

# (each matched against the stripped text, with no two repeats that can share a character:
# a long argument fails in linear time)
_SIZE = re.compile(r"([-+]?)\s*([0-9]*)(?:\.([0-9]*))?\s*([a-z]*)", re.IGNORECASE | re.ASCII)
_NON_FINITE = re.compile(r"[-+]?\s*(infinity|inf|nan)\s*([a-z]*)", re.IGNORECASE | re.ASCII)
_EXPONENT = re.compile(r"[-+]?\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*e\s*[-+]?[0-9]+\s*[a-z]*",
                       re.IGNORECASE | re.ASCII)
#: digits after the point that are read: 60 keep every result exact (a byte is 1/2^50 of a
#: PiB, which has 50 decimals; the rest cannot move the value past a whole byte)
_FRACTION_DIGITS = 60
#: digits before the point past which a size is over the limit whatever its unit (2^60 has 19)
_WHOLE_DIGITS = 30


def exact_bytes(number: str, factor: int) -> int | None:
    """``number`` (digits, optionally a point and more digits) times ``factor``, rounded down,
    computed exactly (a fraction, never a float that overflows); None past :data:`MAX_BYTES`.

    >>> exact_bytes("1.5", 1024), exact_bytes("0.", 8), exact_bytes("9" * 400, 1)
    (1536, 0, None)
    """
    whole, _, fraction = number.partition(".")
    whole = whole.lstrip("0") or "0"
    if len(whole) > _WHOLE_DIGITS:  # far past the limit
        return None
    value = int(Fraction(f"{whole}.{fraction[:_FRACTION_DIGITS] or '0'}") * factor)
    return None if value > MAX_BYTES else value


def parse_size(text: str, *, code: str = "bad-value", label: str = "size") -> int:
    """The bytes ``text`` stands for (the module's grammar).

    Raises a :class:`~layout_prop.core.errors.SpecError` with ``code``, a message starting with
    ``label`` and quoting the value, and :data:`GRAMMAR` as the hint.

    >>> try:
    ...     parse_size("0.5")
    ... except SpecError as err:
    ...     print(err.code, err.message)
    bad-value size '0.5' is not positive: it is less than one byte (sizes are whole bytes, rounded down)
    """
    shown = cut(str(text), 60)

    def refuse(problem: str) -> SpecError:
        return SpecError(code, f"{label} {shown} {problem}", hint=GRAMMAR)

    text = str(text).strip()
    m = _SIZE.fullmatch(text)
    if m is None or not (m.group(2) or m.group(3)):
        bad = _NON_FINITE.fullmatch(text)
        if bad is not None and bad.group(2).lower() in UNITS:
            raise refuse("is not a finite number")
        if _EXPONENT.fullmatch(text):
            raise refuse("has an exponent: write the number in full, or with a unit (1e9 is 1GB)")
        raise refuse("is not a size like 4096, 512MiB, 8GB or 16G")
    sign, whole, fraction, unit = m.groups()
    if unit.lower() not in UNITS:
        raise refuse(f"has the unknown unit {cut(unit, 20)}: use B, KiB, MiB, GiB, TiB, PiB (K, M, G, T, P alone "
                     "are the same) or KB, MB, GB, TB, PB")
    number = f"{whole or '0'}.{fraction or ''}"
    zero = not (whole + (fraction or "")).strip("0")
    if zero:
        raise refuse("is not positive: it is zero")
    if sign == "-":
        raise refuse("is not positive: it is negative")
    if sign:
        raise refuse("has a sign: write the number alone")
    value = exact_bytes(number, UNITS[unit.lower()])
    if value is None:
        raise refuse(f"is over the limit {MAX_BYTES} bytes (1024 PiB)")
    if value < 1:
        raise refuse("is not positive: it is less than one byte (sizes are whole bytes, rounded down)")
    return value
