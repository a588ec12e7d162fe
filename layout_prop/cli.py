"""The ``layout-prop`` command line.

Exit codes: 0 ok; 1 when the answer is no (violations in check, run, lower and plan, a
numerical mismatch in run, a wrong op in verify; viz and explain exit 0 once their output
is written); 2 unusable input (a bad spec, an unknown op, a bad flag) with one line on
stderr and never a traceback; 141 (as a Unix tool killed by SIGPIPE) and no message when
the reader of stdout goes away.
Everything printed goes through :func:`layout_prop.core.errors.printable`: control characters
from a spec are escaped, never written raw to the terminal.
"""

from __future__ import annotations

import argparse
import errno
import gc
import io
import os
import sys
from pathlib import Path
from typing import Sequence

from . import __version__
from .commands.flags import RUNS_CODE
from .core.errors import CUT_LENGTH, LayoutPropError, cut, describe, printable
from .io.output import OutputFailed

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line, with the closest known flag, and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = _choice_suggestion(message) or f"see {self.prog} --help"
        if len(message) > CUT_LENGTH:  # argparse quotes the whole bad argument: its middle goes
            keep = (CUT_LENGTH - 5) // 2
            message = message[:keep] + " ... " + message[-keep:]
        print(printable(f"layout-prop: error: bad-usage: {message} (hint: {hint})"), file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command_parser(getattr(ns, "command", None))
            close = _closest_flag(command, extras[0])
            hint = f"did you mean {close}?" if close else f"see {command.prog} --help"
            words = " ".join(extras)
            if len(words) > CUT_LENGTH:
                words = words[:CUT_LENGTH - 3] + "..."
            print(printable(f"layout-prop: error: bad-usage: unrecognized arguments: {words} "
                            f"(hint: {hint})"), file=sys.stderr)
            raise SystemExit(2)
        return ns

    def _command_parser(self, command: str | None) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return self


def _closest_flag(parser: argparse.ArgumentParser, word: str) -> str | None:
    """The flag of ``parser`` closest to the unknown ``word`` (``--reshrad`` -> ``--reshard``)."""
    import difflib

    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        return None
    flags = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
    return close[0] if close else None


def _choice_suggestion(message: str) -> str | None:
    """For argparse's ``invalid choice: 'chek' (choose from ...)``, the closest choice."""
    import difflib
    import re

    m = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not m:
        return None
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    close = difflib.get_close_matches(m.group(1), choices, n=1)
    return f"did you mean {close[0]!r}?" if close else None


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line: the program's own flags, and every command's parser, declared by its module
    (``add_parser(subparsers)``), in :data:`COMMANDS`' order (``--help``'s); with ``only``, that command's
    alone (what a command line naming it parses the same way, without importing the other commands)."""
    p = _Parser(prog="layout-prop", description="Layout propagation, checking, resharding and SPMD execution "
                "for sharded tensor graphs.", epilog=RUNS_CODE)
    p.add_argument("--version", action="version", version=f"layout-prop {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS if only is None else (only,):
        _command(name).add_parser(sub)
    return p


#: each command's module in :mod:`layout_prop.commands`, in ``--help``'s order; each declares its flags
#: (``add_parser(subparsers)``) and runs (``run(args) -> exit code``)
COMMANDS = {"check": "check", "run": "run", "demo": "demo", "explain": "explain", "verify": "verify",
            "audit": "audit", "viz": "viz", "import": "import_model", "plan": "plan", "gen": "gen",
            "estimate": "estimate", "pipeline": "pipeline", "export": "export", "ops": "ops", "lower": "lower"}


#: exit status when the reader of stdout went away (128 + SIGPIPE, as a Unix tool killed by it)
EXIT_BROKEN_PIPE = 141

#: the collector's thresholds while a command runs (Python's default is (700, 10, 10))
GC_THRESHOLD = (50_000, 20, 20)
#: commands that analyse one graph and end: they run without the cyclic collector (their
#: objects live until the process exits and form no cycles worth collecting; the collector
#: only walked them, 1.5 to 2 us a node of a 10,000-node check).  The rest (run, plan,
#: verify, demo: many graphs or arrays, minutes long) collect with GC_THRESHOLD.
UNCOLLECTED_COMMANDS = frozenset({"check", "explain", "lower", "viz", "gen", "import", "ops", "estimate"})


#: writing stdout or stderr (or a pipe given with -o) failed: see :class:`layout_prop.io.output.OutputFailed`
_OutputFailed = OutputFailed


class _Printable:
    """A text stream that escapes control characters (:func:`printable`, line breaks kept);
    it drops the text when the process has no such stream (started with it closed).

    When the stream is unbuffered (``python -u``, ``PYTHONUNBUFFERED=1``), its text wrapper
    writes straight to the file and ignores a short write: a pipe whose reader leaves
    while a large output is written would take part of it and report success, and the
    rest would be lost with exit 0.  The text is then written to the file here, until
    every byte is taken or the write fails."""

    def __init__(self, stream) -> None:
        self._stream = stream
        buffer = getattr(stream, "buffer", None)
        self._raw = buffer if isinstance(buffer, io.RawIOBase) else None

    @property
    def unescaped_stream(self):
        """The stream itself, for a progress line that escapes its own text but draws with ``\\r``."""
        return self._stream

    def write(self, text: str) -> int:
        if self._stream is not None:
            out = printable(text, newlines=True)
            try:
                if self._raw is None:
                    self._stream.write(out)
                else:
                    self._stream.flush()
                    if os.linesep != "\n":
                        out = out.replace("\n", os.linesep)
                    _write_fully(self._raw, out.encode(self._stream.encoding or "utf-8", self._stream.errors or "strict"))
            except OSError as exc:
                raise _OutputFailed(exc) from None
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except OSError as exc:
                raise _OutputFailed(exc) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


#: the longest error line printed: a message that quotes a long value is cut in its middle
MAX_ERROR_LINE = 1000


def _write_fully(raw: io.RawIOBase, data: bytes) -> None:
    """Write every byte of ``data`` to an unbuffered file, however many writes it takes."""
    view = memoryview(data)
    while view:
        written = raw.write(view)
        if written is None:  # a non-blocking file that is full for now: wait until it takes more
            import select

            select.select([], [raw.fileno()], [])
            continue
        if written <= 0:
            raise OSError(errno.EIO, "the output took no bytes")
        view = view[written:]


def _error_text(err: LayoutPropError) -> str:
    """``layout-prop: error: CODE at WHERE: MESSAGE (hint: HINT)`` on one line of at most
    :data:`MAX_ERROR_LINE` characters (a rule's message may quote a whole long value)."""
    text = printable(f"layout-prop: error: {err}")
    if len(text) <= MAX_ERROR_LINE:
        return text
    where = err.where()
    head = printable(f"layout-prop: error: {err.code} at {where}: " if where else f"layout-prop: error: {err.code}: ")
    hint = printable(f" (hint: {err.hint})") if err.hint else ""
    head, hint = head[:300], hint[:300]
    room = max(MAX_ERROR_LINE - len(head) - len(hint), 40)
    message = printable(err.message)
    if len(message) > room:
        keep = (room - 5) // 2
        message = message[:keep] + " ... " + message[-keep:]
    return head + message + hint


def _error_line(code: str, message: str, hint: str) -> None:
    print(printable(f"layout-prop: error: {code}: {message} (hint: {hint})"), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    global _HARD_EXIT
    stdout, stderr = sys.stdout, sys.stderr
    threshold, collecting = gc.get_threshold(), gc.isenabled()
    # A command builds graphs of 10^4 to 10^5 objects that live until it ends; with Python's
    # default thresholds the collector walks them again and again (check of a 10,000-node spec
    # 1.5 to 2 times slower).  Collect rarely (cycles are still freed), or not at all in the
    # commands that analyse one graph and end (UNCOLLECTED_COMMANDS).
    gc.set_threshold(*GC_THRESHOLD)
    # a process started with stdout or stderr closed has None there: write to /dev/null instead
    sys.stdout = _Printable(stdout if stdout is not None else open(os.devnull, "w"))
    sys.stderr = _Printable(stderr if stderr is not None else open(os.devnull, "w"))
    try:
        parsed = _guarded("layout-prop", lambda: _parse(argv))
        if not isinstance(parsed, int) and parsed.command in UNCOLLECTED_COMMANDS:
            gc.disable()
        if _HARD_EXIT is not None and not isinstance(parsed, int):
            _HARD_EXIT = parsed.command in HARD_EXIT_COMMANDS and not getattr(parsed, "module", None)
        code = parsed if isinstance(parsed, int) else _run(parsed)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not after main returned
        return code
    except _OutputFailed as failed:  # stdout closed by its reader (| head), on a full disk (> /dev/full), or gone
        exc = failed.error
        _silence(stdout)
        if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE:
            return EXIT_BROKEN_PIPE  # quietly, as Unix tools do
        try:
            _error_line("write-failed", f"cannot write the output: {exc.strerror or exc}",
                        "check the disk or the file stdout goes to")
        except (OSError, _OutputFailed):  # stderr is gone too: nothing left to tell
            _silence(stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        gc.set_threshold(*threshold)
        if collecting:
            gc.enable()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code of ``--help``, ``--version`` or a bad flag (already reported)."""
    words = list(sys.argv[1:] if argv is None else argv)
    named = words[0] if words and words[0] in COMMANDS else None  # a command's line needs its parser alone
    try:
        return _parser(named).parse_args(words)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 2


def _run(args) -> int:
    return _guarded(args.command, lambda: _command(args.command).run(args))


def _command(name: str):
    """The module of command ``name`` in :mod:`layout_prop.commands`."""
    import importlib

    return importlib.import_module(f"layout_prop.commands.{COMMANDS[name]}")


def _guarded(what: str, work):
    """``work()``, with every exception it may raise turned into an exit code and at most one
    stderr line: whatever an op's rule, kernel or plugin raises (any BaseException, even
    one that is neither an Exception nor SystemExit), never a traceback.  Only a failed
    write of the output itself goes on, to :func:`main`."""
    try:
        return work()
    except _OutputFailed:
        raise
    except LayoutPropError as err:
        print(_error_text(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("layout-prop: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # raised by an op's code (a plugin, a --module file): keep the contract
        _error_line("unexpected-exit", f"op code called exit({cut(exc.code)})",
                    "an op's rule or kernel must raise an error, not exit; fix the op module")
        return 2
    except MemoryError:
        _error_line("out-of-memory", f"{what} ran out of memory",
                    "use smaller shapes or fewer ranks (a run estimates its memory first: see --max-memory)")
        return 2
    except RecursionError:
        _error_line("too-deep", f"{what} recursed too deeply",
                    "the graph or a value nests too deeply; please report the spec")
        return 2
    except Exception as exc:  # a bug: one line that says so (LAYOUT_PROP_DEBUG=1 shows the traceback)
        if os.environ.get("LAYOUT_PROP_DEBUG"):
            raise
        _error_line("internal-error", describe(exc),
                    "this is a bug in layout-prop; please report it with the spec "
                    "(LAYOUT_PROP_DEBUG=1 shows the traceback)")
        return 2
    except BaseException as exc:  # noqa: B036 (GeneratorExit, or a class of an op's own derived from BaseException)
        if os.environ.get("LAYOUT_PROP_DEBUG"):
            raise
        _error_line("unexpected-exception", f"{what} was stopped by {describe(exc)}, which is not an Exception "
                    "(raised by an op's rule or kernel, or a plugin)",
                    "an op's code must raise an Exception (an OpError for a use it refuses), not a BaseException; "
                    "LAYOUT_PROP_DEBUG=1 shows the traceback")
        return 2


def _silence(stream) -> None:
    """Point a failed stream's file at /dev/null, so that the interpreter's last flush of
    what is still buffered cannot fail again (with a message) at exit."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file behind it (a test's capture): nothing to do
        pass


#: commands whose process may end with :func:`os._exit` once their output is flushed (see
#: :func:`entry`): they analyse one graph with numpy and Python only, and write their files
#: (``-o``) whole and closed before they return
HARD_EXIT_COMMANDS = frozenset({"check", "explain", "lower", "gen", "ops"})
#: set by :func:`entry`: None while :func:`main` may run in a process that goes on; then
#: whether the command run may end the process with :func:`os._exit`
_HARD_EXIT: bool | None = None


def entry() -> None:
    """The ``layout-prop`` console script: :func:`main`, then the process ends.

    After a command of :data:`HARD_EXIT_COMMANDS` that loaded no user module (``--module``)
    and left no exit handler (:mod:`atexit`), the process ends with :func:`os._exit` once stdout and
    stderr are flushed, as mypy does: the interpreter's teardown (every module freed, a last
    collection) costs about 55 million instructions (20 ms here) of a 0.17 s one-node
    check, and has nothing left to do.  Any other command exits the usual way.
    """
    global _HARD_EXIT
    import atexit

    _HARD_EXIT = False
    code = main()
    # (atexit._ncallbacks is CPython's; elsewhere the handlers are taken to be there)
    if _HARD_EXIT and getattr(atexit, "_ncallbacks", lambda: 1)() == 0 and _flushed():
        os._exit(code)
    sys.exit(code)


def _flushed() -> bool:
    """Flush stdout and stderr; whether both took everything (else the usual exit reports it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            return False
    return True


if __name__ == "__main__":
    entry()
