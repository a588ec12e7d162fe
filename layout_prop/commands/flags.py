"""The flag types and flag groups the commands' parsers share: integers, numbers, sizes and seconds in ASCII
text with their limits (each refusal an :class:`argparse.ArgumentTypeError`, which the command line prints as
one ``bad-usage`` line), ``--plan``/``--opaque`` for a command whose SPEC may be a model
(:func:`add_model_args`), and the warning that ops come from Python code (:data:`RUNS_CODE`).

Each command module declares its own parser (``add_parser(subparsers)``) with these; :mod:`layout_prop.cli`
assembles them.  Imports nothing but the standard library at start-up (``--help`` builds every parser).
"""

from __future__ import annotations

import argparse

from layout_prop.core.errors import cut

__all__ = ["RUNS_CODE", "add_model_args", "ascii_int", "ascii_float", "integer_arg", "non_negative_int",
           "positive_int", "bounded_int", "count_arg", "node_rank_arg", "jobs_arg", "layers_arg", "finite_float",
           "time_limit_arg", "positive_float_arg", "probability_arg", "seconds_arg", "tolerance_arg",
           "memory_size_arg", "mesh_arg", "samples_arg", "MAX_JOBS", "MAX_LAYERS"]

RUNS_CODE = ("Ops come from Python code: `verify --module FILE` imports FILE, and every command imports the "
             "installed packages that declare a `layout_prop.ops` entry point; that code runs with your "
             "permissions, so give only files and packages you trust.")


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--plan`` and ``--opaque``, for a command whose SPEC may also be a model file."""
    parser.add_argument("--plan", metavar="PLAN", help="with a model (.onnx or .mindir) instead of a spec: its "
                        "sharding plan (YAML or JSON)")
    parser.add_argument("--opaque", action="store_true",
                        help="with a model: treat ops the importer cannot map as barriers instead of refusing")
    return parser


def ascii_int(text: str) -> int:
    """``int(text)`` for ASCII digits after an optional minus, else ``ValueError``: ``int`` alone also takes
    other scripts' digits (``'١٢'`` is 12), underscores (``'1_000'``), a plus and surrounding blanks.

    >>> ascii_int("512"), ascii_int("-1")
    (512, -1)
    >>> ascii_int("1_000")
    Traceback (most recent call last):
    ValueError: '1_000' is not written in ASCII digits
    """
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"{text!r} is not written in ASCII digits")
    return int(text)


def ascii_float(text: str) -> float:
    """``float(text)`` for ASCII text without blanks or underscores, else ``ValueError``: ``float`` alone
    also takes other scripts' digits (``'٢'`` is 2.0), underscores (``'1_0'``) and surrounding blanks.

    >>> ascii_float("0.5"), ascii_float("1e-3")
    (0.5, 0.001)
    >>> ascii_float("٢")
    Traceback (most recent call last):
    ValueError: '٢' is not a number in ASCII characters
    """
    if not text.isascii() or "_" in text or text != text.strip():
        raise ValueError(f"{text!r} is not a number in ASCII characters")
    return float(text)


def integer_arg(text: str) -> int:
    """An integer flag's value (``lower --rank``: the command says which are ranks), in ASCII digits."""
    try:
        return ascii_int(text)
    except ValueError:  # also more than 4,300 digits
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not an integer") from None


def non_negative_int(text: str) -> int:
    value = integer_arg(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def bounded_int(text: str, low: int, high: int, what: str) -> int:
    value = non_negative_int(text)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{cut(value, 60)} is not {what} in {low}..{high}")
    return value


def count_arg(text: str) -> int:
    """--nodes, --local-workers, --emulate-nodes: at least 1, at most a mesh's ranks."""
    from layout_prop.core.mesh import MAX_RANKS

    return bounded_int(text, 1, MAX_RANKS, "a count")


def node_rank_arg(text: str) -> int:
    from layout_prop.core.mesh import MAX_RANKS

    return bounded_int(text, 0, MAX_RANKS - 1, "a node rank")


#: the most processes ``verify --jobs`` starts
MAX_JOBS = 256


def jobs_arg(text: str) -> int:
    return bounded_int(text, 1, MAX_JOBS, "a number of processes")


#: the most layers ``gen`` writes (about 230,000 nodes, 30 s; the spec stays under the loader's 64 MiB as JSON)
MAX_LAYERS = 10_000


def layers_arg(text: str) -> int:
    value = positive_int(text)
    if value > MAX_LAYERS:
        raise argparse.ArgumentTypeError(f"{value} layers is over the limit {MAX_LAYERS:,}")
    return value


def finite_float(text: str) -> float:
    import math

    try:
        value = ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a finite number")
    return value


def time_limit_arg(text: str) -> float:
    """plan --time-limit: seconds in (0, 86400]."""
    value = finite_float(text)
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 86400] seconds")
    return value


def positive_float_arg(text: str) -> float:
    """gen --capacity-factor: a number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def probability_arg(text: str) -> float:
    """gen --dropout: a probability in [0, 1)."""
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1)")
    return value


def seconds_arg(text: str) -> float:
    try:
        value = ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a number of seconds") from None
    if not 0 < value <= 7 * 24 * 3600:  # nan and inf fail too
        raise argparse.ArgumentTypeError(f"{cut(text, 60)[1:-1]} is not a number of seconds in (0, 604800]")
    return value


def tolerance_arg(text: str) -> float:
    try:
        value = ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{cut(text, 60)[1:-1]} is not a finite number >= 0")
    return value


def memory_size_arg(text: str) -> int:
    """``run --max-memory``: ``4096``, ``512M``, ``8G``, ``1.5TiB``, ``3MB`` -> bytes, in the one
    size grammar of :mod:`layout_prop.io.sizes` (the same as ``plan --memory-per-rank``); refused
    with ``bad-usage``, the grammar as the hint."""
    from layout_prop.io.sizes import parse_size

    return parse_size(text, code="bad-usage", label="argument --max-memory: size")


def mesh_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(ascii_int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not like 2x2") from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"mesh {text!r} needs positive sizes")
    return shape


def samples_arg(text: str) -> int | str:
    if text == "all":
        return text
    try:
        n = ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"samples must be 'all' or a number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("samples must be at least 1")
    return n


def refuse_stdout_output(command: str, flag: str, path, printed: str = "its report") -> None:
    """``bad-usage`` when ``flag`` names standard output (``-``) for ``command``, which prints ``printed`` there:
    the written file and that would be mixed on one stream."""
    from layout_prop.core.errors import SpecError
    from layout_prop.io.output import is_stdout

    if is_stdout(path):
        raise SpecError("bad-usage", f"{command} prints {printed} on standard output, so {flag} - would mix "
                        "what it writes into it", path=flag, hint=f"give {flag} a file name")

