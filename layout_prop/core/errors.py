"""One small exception hierarchy, and the violation record.

Every error says what failed (``code`` and ``message``), where (``path``, ``node``,
``input``) and how to fix it (``hint``).  The CLI prints ``str(error)`` on one line and
exits 2.  A :class:`Violation` is not an exception: a layout that exists but breaks an
op's rule is data that passes collect, never raise.

Examples
--------
>>> err = SpecError("bad-placement", "cannot parse placement 'Q'", path="inputs.x.placements[0]",
...                 hint="write R, S(d), P or P(op)")
>>> str(err)
"bad-placement at inputs.x.placements[0]: cannot parse placement 'Q' (hint: write R, S(d), P or P(op))"
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CONTROL_CHARS",
    "printable",
    "one_line",
    "cut",
    "describe",
    "LayoutPropError",
    "SpecError",
    "LayoutError",
    "GraphError",
    "OpError",
    "ExecutionError",
    "Violation",
]


#: characters that must not reach a terminal raw: C0 and C1 controls (ESC starts escape
#: sequences, BEL rings, CR and newlines rewrite lines), the Unicode line separators, every
#: bidirectional control (the marks U+061C, U+200E, U+200F, the embeddings, overrides and
#: isolates) that reorder what is shown, the invisible ones that make two names look alike
#: (zero-width space and joiners U+200B-U+200D, U+2060, U+FEFF, the tag characters), lone
#: surrogates (which no terminal or file encoding can write) and the noncharacters U+FFFE and
#: U+FFFF (not allowed in XML: an SVG holding one does not open).  Names holding any of them
#: are refused by the loader (``bad-name``).
CONTROL_CHARS = ("\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060"
                 "\u2066-\u2069\ud800-\udfff\ufeff\ufffe\uffff\U000e0000-\U000e007f")
_CONTROL_ALL = re.compile(f"[\n{CONTROL_CHARS}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[{CONTROL_CHARS}]")
#: the ASCII characters that are not in CONTROL_CHARS, without and with the line break
_PLAIN_ASCII = bytes(range(0x20, 0x7f))
_PLAIN_ASCII_NEWLINE = _PLAIN_ASCII + b"\n"


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: re.Match) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str, *, newlines: bool = False) -> str:
    """``text`` with every control character escaped (``\\x1b``, ``\\x07``, ``\\n``, ``\\u202e``).

    The one place that decides what may reach a terminal: every message, table and
    explanation the command line prints goes through it, so a name or value from a spec
    can never ring the bell, move the cursor, recolour the terminal or split a one-line
    error.  With ``newlines=True`` the line breaks of a multi-line text stay (tabs,
    carriage returns and the rest are still escaped).

    >>> printable("x\\x1b[31mred\\x07\\nnext")
    'x\\\\x1b[31mred\\\\x07\\\\nnext'
    >>> printable("line 1\\nline 2", newlines=True)
    'line 1\\nline 2'
    """
    if text.isascii() and not text.encode("ascii").translate(None, _PLAIN_ASCII_NEWLINE if newlines else _PLAIN_ASCII):
        return text  # nothing to escape (found in C: a fifth of the pattern's time on a long report)
    pattern = _CONTROL_BUT_NEWLINE if newlines else _CONTROL_ALL
    return pattern.sub(_escape_char, text)


class _BoundedRepr(reprlib.Repr):
    """reprlib with an integer cut too: ``repr`` of an integer over 4,300 digits raises."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * self.maxlong:  # more digits than maxlong: never convert it all
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


def one_line(text: Any) -> str:
    """``text`` (``str`` of it) on one line: every run of whitespace, newlines too, one space.

    >>> one_line("Traceback:\\n  File x\\n\\tValueError")
    'Traceback: File x ValueError'
    """
    return " ".join(str(text).split())


_REPR = _BoundedRepr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = 8
_REPR.maxstring = 80
_REPR.maxlong = 40
_REPR.maxother = 80

#: the longest value a message quotes
CUT_LENGTH = 200


def cut(value: Any, limit: int = CUT_LENGTH) -> str:
    """A short, one-line ``repr`` of a value from a spec, for messages.

    Bounded in time and length whatever the value is: nested lists are cut at depth 3 and
    8 items (so a YAML "billion laughs" value, shared lists expanding to 9^9 items, prints
    in microseconds), long strings and integers are shortened, and the result is at most
    ``limit`` characters with control characters escaped.

    >>> cut(list(range(100)))
    '[0, 1, 2, 3, 4, 5, 6, 7, ...]'
    >>> cut(10 ** 5000)
    '<an integer of 16610 bits>'
    >>> cut("x" * 500, limit=20)
    "'xxxxxxxxxxxxxxx...'"
    """
    try:
        text = _REPR.repr(value)
    except Exception:  # a value whose repr fails: its type still helps
        text = f"<a {type(value).__name__}>"
    text = printable(text)
    if len(text) > limit:
        quote = text[0] if text[:1] in ("'", '"') else ""
        text = text[:limit - 3 - len(quote)] + "..." + quote
    return text


def describe(exc: BaseException, limit: int = 300) -> str:
    """``TypeName: message`` of any exception, on one line and at most about ``limit`` characters.

    Safe on exceptions from code we do not control (an op plugin, a ``--module`` file):
    a ``__str__`` that raises, or a message of megabytes, still gives a short line.

    >>> describe(ValueError("bad\\nvalue"))
    'ValueError: bad\\\\nvalue'
    >>> class Odd(BaseException):
    ...     def __str__(self):
    ...         raise RuntimeError("no")
    >>> describe(Odd())
    'Odd: <its message cannot be shown>'
    """
    name = printable(str(getattr(type(exc), "__name__", "exception")))[:100]
    try:
        message = str(exc)
    except BaseException:  # noqa: B036 (a hostile __str__ may raise anything, even SystemExit)
        message = "<its message cannot be shown>"
    if not isinstance(message, str):
        message = "<its message cannot be shown>"
    if not message:
        return name
    text = printable(message[:limit * 4])
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{name}: {text}"


class LayoutPropError(Exception):
    """Base class: a typed error with a code, a location and a hint.

    Parameters
    ----------
    code : str
        A stable kebab-case identifier such as ``"unknown-op"``.
    message : str
        What failed, with the offending values.
    path : str, optional
        Where in a spec file (``nodes[2].inputs[1]``).
    node, input : str, optional
        The graph node and the input value involved.
    hint : str, optional
        How to fix it.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        path: str | None = None,
        node: str | None = None,
        input: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.code = code
        self.message = message
        self.path = path
        self.node = node
        self.input = input
        self.hint = hint
        super().__init__(str(self))

    def where(self) -> str:
        parts = []
        if self.path:
            parts.append(self.path)
        if self.node:
            parts.append(f"node {self.node!r}")
        if self.input:
            parts.append(f"input {self.input!r}")
        return ", ".join(parts)

    def __str__(self) -> str:
        where = self.where()
        text = f"{self.code} at {where}: {self.message}" if where else f"{self.code}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "path": self.path,
            "node": self.node,
            "input": self.input,
            "hint": self.hint,
        }


class SpecError(LayoutPropError):
    """A spec file (YAML or JSON) that cannot be used as written."""


class LayoutError(LayoutPropError):
    """A mesh, placement or layout that cannot exist (as opposed to a rule violation)."""


class GraphError(LayoutPropError):
    """A malformed graph: arity, undefined values, duplicate names, cycles."""


class OpError(LayoutPropError):
    """An unknown op, a bad attribute, or an op used in a way it never supports."""


class ExecutionError(LayoutPropError):
    """Lowering or execution failed (a kernel missing for a backend, an engine failure)."""


@dataclass(frozen=True)
class Violation:
    """A layout that exists but breaks an op's rule.

    ``input`` is the value's name in the graph and ``operand`` the op's parameter name
    (``x``, ``cos``, ``sin``); the propagate pass fills ``node``, ``op`` and ``input``.
    ``fixable`` says whether a redistribution of the inputs can cure it (``--reshard``).
    """

    code: str
    message: str
    hint: str
    operand: str | None = None
    node: str | None = None
    op: str | None = None
    input: str | None = None
    fixable: bool = False
    details: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def located(self, node: str, op: str, input: str | None) -> "Violation":
        """A copy that names the node, the op and the input value.

        Built by copying the fields directly: propagation locates every violation of every
        node, and the frozen dataclass constructor (one ``object.__setattr__`` per field)
        was a visible part of its cost.

        >>> Violation("c", "m", "h", "x").located("n", "add", "a").input
        'a'
        """
        copy = object.__new__(Violation)
        fields = copy.__dict__
        fields.update(self.__dict__)
        fields["node"], fields["op"], fields["input"] = node, op, input
        return copy

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op": self.op,
            "input": self.input,
            "operand": self.operand,
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
        }

    def __str__(self) -> str:
        where = f"{self.node}" + (f".{self.operand}" if self.operand else "")
        return f"{self.code} at {where}: {self.message} (hint: {self.hint})"
