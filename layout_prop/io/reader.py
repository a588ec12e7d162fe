"""The one way the tool reads a file a user names, and the checks every file's values share.

Specs (:mod:`.loader`), sharding plans (:mod:`.plan_file`), cluster profiles
(:mod:`layout_prop.perf.clusters`), models and run inputs are read here, with the same limits:

- :func:`read_file_bytes`: a size cap, regular files and pipes only (a device such as
  ``/dev/zero``, even behind a symbolic link, a folder or a socket is refused from its
  ``stat``), a named pipe nobody writes to refused after a bounded wait;
- :func:`read_text`: that, decoded as UTF-8 with a clear error naming the byte;
- :func:`read_mapping`: that, parsed as YAML or JSON by the spec parser (keys written twice,
  nesting depth and YAML alias expansion bounded), and a mapping;
- :func:`check_keys` (known keys only, with a did-you-mean), :func:`check_text` (names and
  labels: a string, no control character or line break, length-capped) and
  :func:`check_number` (a number a float holds, within the range a figure's physics allows).

Examples
--------
>>> check_number(2, "cluster.hbm_gb", low=1e-6, high=1e6)
2.0
>>> check_number(10 ** 400, "cluster.hbm_gb", low=1e-6, high=1e6)
Traceback (most recent call last):
...
layout_prop.core.errors.SpecError: bad-value at cluster.hbm_gb: hbm_gb is <an integer of 1329 bits>, not a number in [1e-06, 1e+06] (hint: give a number from 1e-06 to 1e+06)
>>> check_keys({"bsae": 1}, {"base", "name"}, "cluster")
Traceback (most recent call last):
...
layout_prop.core.errors.SpecError: unknown-key at cluster.bsae: cluster has no key 'bsae' (did you mean 'base'?) (hint: known keys: base, name)
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from layout_prop.core.errors import CONTROL_CHARS, SpecError, cut

__all__ = ["read_file_bytes", "read_text", "read_mapping", "check_keys", "check_text", "check_number",
           "MAX_FILE_BYTES", "MAX_TEXT", "PIPE_WRITER_WAIT_SECONDS"]

#: the largest small file read (a cluster profile, a plan is a few KiB)
MAX_FILE_BYTES = 4 * 2 ** 20
#: the longest name or label a file may give (a cluster's name, a device's description)
MAX_TEXT = 256

#: how long a pipe that no process holds open for writing is waited for (a named pipe made
#: with ``mkfifo`` and never written): then it is refused instead of waiting forever
PIPE_WRITER_WAIT_SECONDS = 10.0
_POLL_SECONDS = 0.2


def _not_a_file(mode: int) -> str | None:
    """What a file of this mode is, if it is neither a regular file nor a pipe."""
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_file_bytes(path: str | Path, limit: int, *, what: str, missing: str, too_large: str, hint: str) -> bytes:
    """At most ``limit`` bytes of the file at ``path``, never an unbounded read nor an endless wait.

    The one way the tool reads a file a user names (specs, plans, models):

    - a regular file (or a symbolic link to one) is read, and refused past ``limit``
      bytes (``too_large``) before more than ``limit + 1`` bytes are read;
    - a pipe is read the same way: ``/dev/stdin``, process substitution
      (``layout-prop check <(gen ...)``) or a named pipe.  It is read until its writers
      close it, as ``cat`` reads it, however long a writer takes; but a pipe that no
      process holds open for writing (a ``mkfifo`` nobody writes to) is refused
      (``missing``) after :data:`PIPE_WRITER_WAIT_SECONDS`, never waited for forever;
    - a device (``/dev/zero``, ``/dev/urandom``, a terminal), a folder or a socket is
      refused (``missing``) from its ``stat``, before it is opened.

    The file is opened with ``O_NONBLOCK`` (opening a named pipe does not wait for a
    writer; opening a device cannot block) and checked again with ``fstat``: a file
    swapped between the two is refused too.

    Raises
    ------
    SpecError
        ``missing`` or ``too_large``, naming the path (cut) and the limit.
    """
    shown, where = cut(str(path)), str(path)

    def refuse(code: str, message: str) -> SpecError:
        if code == too_large:  # (``hint`` says what to give; this file was found, and is too big)
            example = " (a 100,000-node spec is about 15 MB)" if what == "spec" else ""
            size = f"{limit / 2 ** 20:g} MiB" if limit >= 2 ** 20 else f"{limit} bytes"
            return SpecError(code, message, path=where,
                             hint=f"check the path: a {what} file is read up to {size}{example}")
        return SpecError(code, message, path=where, hint=hint)

    try:
        before = os.stat(path)  # follows symbolic links, as opening does
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise refuse(missing, f"cannot read {shown}: {getattr(exc, 'strerror', None) or exc}") from None
    kind = _not_a_file(before.st_mode)
    if kind:
        raise refuse(missing, f"{shown} is {kind}, not a {what} file")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise refuse(missing, f"cannot read {shown}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if _not_a_file(info.st_mode) or (info.st_dev, info.st_ino) != (before.st_dev, before.st_ino):
            raise refuse(missing, f"{shown} changed while it was opened")
        if stat.S_ISREG(info.st_mode):
            if info.st_size > limit:  # refused without reading (files under /proc say 0 and are read)
                raise refuse(too_large, f"{shown} is larger than {limit} bytes ({info.st_size} bytes)")
            os.set_blocking(fd, True)
            data = _read_regular(fd, limit, info.st_size)
        else:
            data = _read_pipe(fd, limit, lambda: refuse(missing, f"{shown} is a pipe that no process writes to "
                                                                  f"(waited {PIPE_WRITER_WAIT_SECONDS:g} s)"))
    except OSError as exc:
        raise refuse(missing, f"cannot read {shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise refuse(too_large, f"{shown} is larger than {limit} bytes")
    return data


def _read_regular(fd: int, limit: int, size: int) -> bytes:
    """Up to ``limit + 1`` bytes of a regular file of ``size`` bytes (it may grow or shrink meanwhile)."""
    parts, total = [], 0
    while total <= limit:
        want = min(max(size + 1 - total, 2 ** 16), limit + 1 - total)
        piece = os.read(fd, want)
        if not piece:
            break
        parts.append(piece)
        total += len(piece)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_pipe(fd: int, limit: int, no_writer) -> bytes:
    """Up to ``limit + 1`` bytes of a pipe opened with ``O_NONBLOCK``, until its writers close it.

    ``poll`` says when there is data or every writer has gone; meanwhile a read that
    ends at once (rather than "would block") means that no process has the pipe open for
    writing: after :data:`PIPE_WRITER_WAIT_SECONDS` of that, ``no_writer()`` is raised.
    """
    import select
    import time

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    parts: list[bytes] = []
    total = 0
    alone_since = None
    while total <= limit:
        if poller.poll(int(_POLL_SECONDS * 1000)):
            try:
                piece = os.read(fd, min(2 ** 20, limit + 1 - total))
            except BlockingIOError:
                continue
            if not piece:
                break  # every writer closed it: the end
            parts.append(piece)
            total += len(piece)
            alone_since = None
            continue
        try:  # nothing to read: is there a writer at all?
            piece = os.read(fd, min(2 ** 20, limit + 1 - total))
        except BlockingIOError:  # a writer holds it open and has not written yet: wait, as cat does
            alone_since = None
            continue
        if piece:
            parts.append(piece)
            total += len(piece)
            continue
        # no writer, and none ever seen (a named pipe, whose poll reports no hang-up before its first writer)
        alone_since = alone_since if alone_since is not None else time.monotonic()
        if time.monotonic() - alone_since >= PIPE_WRITER_WAIT_SECONDS:
            raise no_writer()
    return b"".join(parts)


def read_text(path: str | Path, limit: int, *, what: str, missing: str, too_large: str, syntax: str,
              hint: str) -> str:
    """The UTF-8 text of the file at ``path`` (:func:`read_file_bytes`); ``syntax`` when it is not UTF-8."""
    raw = read_file_bytes(path, limit, what=what, missing=missing, too_large=too_large, hint=hint)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(syntax, f"{cut(str(path))} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                        path=str(path), hint=f"save the {what} as UTF-8 YAML or JSON") from None


def read_mapping(path: str | Path, *, what: str, limit: int | None = None, hint: str) -> dict:
    """The mapping a small YAML or JSON file holds, read as a spec is (:func:`read_text`, then
    :func:`layout_prop.io.loader.parse_spec`: keys written twice, nesting and YAML aliases bounded).

    The codes are the ``what``'s: ``{what}-not-found``, ``{what}-too-large``, ``{what}-syntax``,
    ``{what}-too-deep`` (a cluster file: ``cluster-not-found``...).  ``limit`` is in bytes
    (:data:`MAX_FILE_BYTES` when None).
    """
    from .loader import parse_spec

    text = read_text(path, MAX_FILE_BYTES if limit is None else limit, what=what, missing=f"{what}-not-found", too_large=f"{what}-too-large",
                     syntax=f"{what}-syntax", hint=hint)
    try:
        return parse_spec(text, cut(str(path), 120)[1:-1], what=what)
    except SpecError as err:  # the spec parser's codes (spec-syntax, spec-too-deep...) said of this file
        if not err.code.startswith("spec-"):
            raise
        raise SpecError(f"{what}-" + err.code[len("spec-"):], err.message, path=err.path, hint=err.hint) from None


def _sort_key(key: Any) -> tuple[str, str]:
    return type(key).__name__, str(key)


def check_keys(data: dict, known: set | frozenset, path: str, what: str | None = None) -> None:
    """Refuse a key of ``data`` that is not in ``known`` (``unknown-key``, with the closest known key),
    whatever the keys' types (a file may mix ``1:``, ``null:`` and names)."""
    unknown = [key for key in data if not isinstance(key, str) or key not in known]
    if not unknown:
        return
    import difflib

    key = min(unknown, key=_sort_key)
    close = difflib.get_close_matches(str(key)[:MAX_TEXT], sorted(known), n=1) if isinstance(key, str) else []
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
    where = f"{path}.{cut(key, 40)[1:-1] if isinstance(key, str) else cut(key, 40)}"
    raise SpecError("unknown-key", f"{what or path} has no key {cut(key, 60)}{more}{guess}", path=where,
                    hint=f"known keys: {', '.join(sorted(known))}")


_CONTROL = re.compile(f"[\n{CONTROL_CHARS}]")


def check_text(value: Any, path: str, what: str, limit: int = MAX_TEXT) -> str:
    """``value`` when it is a non-empty string of at most ``limit`` characters without a control
    character or a line break (a name that would forge or split an output line); else ``bad-name``."""
    if not isinstance(value, str) or not value:
        raise SpecError("bad-name", f"{what} {cut(value, 60)} is not a non-empty string", path=path,
                        hint=f"write {what} as a short string")
    if len(value) > limit:
        raise SpecError("bad-name", f"{what} {cut(value, 40)} is {len(value):,} characters long, over the limit "
                        f"{limit}", path=path, hint=f"write a shorter {what}")
    if _CONTROL.search(value):
        raise SpecError("bad-name", f"{what} {cut(value, 60)} has a control character or a line break", path=path,
                        hint=f"write {what} with printable characters on one line")
    return value


def check_number(value: Any, path: str, *, low: float, high: float, integer: bool = False,
                 low_open: bool = False) -> float:
    """``value`` as a float (an int when ``integer``), when it is a number (not a boolean) from
    ``low`` to ``high`` (``low`` excluded when ``low_open``); else ``bad-value`` naming the range.

    The range is the one a figure's physics allows, far inside what a float holds: a figure of
    400 digits, ``1e308`` or ``inf`` is refused here, never turned into an ``inf`` or a ``0``
    later (two accepted figures multiplied or divided stay finite and non-zero).
    """
    key = path.rsplit(".", 1)[-1]
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = float(value) if abs(value) <= 2 ** 1000 else math.inf
    elif isinstance(value, float):
        number = value
    inside = number is not None and math.isfinite(number) and (low < number if low_open else low <= number) \
        and number <= high and (not integer or number == int(number))
    if not inside:
        kind = "an integer" if integer else "a number"
        span = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise SpecError("bad-value", f"{key} is {cut(value, 120)}, not {kind} in {span}", path=path,
                        hint=f"give {kind} from {low:g}{' (excluded)' if low_open else ''} to {high:g}")
    return int(number) if integer else float(number)
