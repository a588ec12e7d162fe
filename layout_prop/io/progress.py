"""A progress line on stderr for long work: done/total, rate and time left, only on a terminal.

:class:`Progress` counts items; :class:`Ticker` says what is being done and for how long,
redrawn by a background thread while a call that reports nothing (a solver, a model reader)
runs.  Nothing is written when the stream is not a terminal (a pipe, a file, CI), so scripts and
``--json`` output stay clean; the line is redrawn at most a few times a second and erased
when the work ends.

Examples
--------
>>> import io
>>> p = Progress(100, "verify", stream=io.StringIO())   # not a terminal: silent
>>> p.update(50); p.close(); p.enabled
False
>>> format_seconds(75), format_seconds(3725)
('1m 15s', '1h 02m')
>>> with Ticker("plan", stream=io.StringIO()) as t:   # not a terminal: silent, no thread
...     t.say("solving")
>>> t.enabled
False
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from layout_prop.core.errors import printable

__all__ = ["Progress", "Ticker", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``42s``, ``1m 15s``, ``1h 02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {(s % 3600) // 60:02d}m"


class Progress:
    """``label: done/total (pct), rate/s, time left`` redrawn in place on ``stream`` (stderr).

    Parameters
    ----------
    total : int
        How many items the work has (0 or less: unknown; only done and rate are shown).
    label : str
        What is being done.
    stream : text stream, optional
        Default ``sys.stderr``; nothing is drawn unless it is a terminal.
    enabled : bool, optional
        Force drawing on or off (default: ``stream.isatty()``).
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool | None = None,
                 interval: float = 0.2) -> None:
        self.total = total
        self.label = label
        stream = sys.stderr if stream is None else stream
        # the command line escapes control characters on stderr; the line needs its \r raw
        self.stream = getattr(stream, "unescaped_stream", stream)
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.interval = interval
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._width = 0

    def update(self, done: int) -> None:
        """Set the number of items done; redraw if the last draw is old enough."""
        self.done = done
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw < self.interval and done < self.total:
            return
        self._last_draw = now
        self._draw(self.line(now))

    def show(self, text: str) -> None:
        """Draw ``label: text`` in place of the counts (work whose progress is a state, not a count).

        Redrawn at most every ``interval`` seconds, like :meth:`update`.

        >>> import io
        >>> stream = io.StringIO()
        >>> p = Progress(0, "msrun", stream=stream, enabled=True)
        >>> p.show("4/8 ranks joined"); stream.getvalue()
        '\\rmsrun: 4/8 ranks joined'
        """
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw < self.interval:
            return
        self._last_draw = now
        self._draw(f"{self.label}: {text}")

    def line(self, now: float | None = None) -> str:
        """The text of the progress line."""
        elapsed = max((time.monotonic() if now is None else now) - self.start, 1e-9)
        rate = self.done / elapsed
        if self.total > 0:
            text = f"{self.label}: {self.done:,}/{self.total:,} ({100 * self.done / self.total:.0f}%), {rate:,.1f}/s"
            if 0 < self.done < self.total:
                text += f", {format_seconds((self.total - self.done) / rate)} left"
        else:
            text = f"{self.label}: {self.done:,} done, {rate:,.1f}/s, {format_seconds(elapsed)}"
        return text

    def _draw(self, text: str) -> None:
        text = printable(text)  # an op or value name from the user's input: never raw control characters
        pad = " " * max(self._width - len(text), 0)
        self._width = len(text)
        try:
            self.stream.write("\r" + text + pad)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken terminal: stop drawing, never fail the work
            self.enabled = False

    def close(self) -> None:
        """Erase the line (the final result is printed by the caller)."""
        if self.enabled and self._width:
            self._draw("")
            try:
                self.stream.write("\r")
                self.stream.flush()
            except (OSError, ValueError):
                pass
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Ticker:
    """``label: text, elapsed`` on ``stream`` (stderr), redrawn every ``interval`` seconds by a
    daemon thread, so that work which reports nothing (a solver, a model reader, a kernel)
    still shows that it runs and for how long; :meth:`say` changes the text (a phase, a count).

    Drawn only on a terminal, as :class:`Progress`; with ``enabled=False`` (``--json``) or
    when the stream is not a terminal no thread is started and nothing is written.

    Parameters
    ----------
    label : str
        The command (``pipeline --run``).
    stream : text stream, optional
        Default ``sys.stderr``.
    enabled : bool, optional
        Force drawing on or off (default: whether the stream is a terminal).
    interval : float
        Seconds between the thread's redraws.
    throttle : float
        :meth:`say` redraws at once when the last draw is at least this old (the first always); a
        count said at every step of fast work costs a draw a tenth of a second at most.

    Examples
    --------
    >>> import io
    >>> stream = io.StringIO()
    >>> with Ticker("plan", stream=stream, enabled=True, interval=60) as t:
    ...     t.say("solving")
    >>> stream.getvalue().split("\\r")[1]
    'plan: solving, 0s'
    """

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool | None = None,
                 interval: float = 0.5, throttle: float = 0.1) -> None:
        self._bar = Progress(0, label, stream, enabled, interval=throttle)
        self.interval = interval
        self.text = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """Whether the line is drawn."""
        return self._bar.enabled

    def say(self, text: str) -> None:
        """Show ``text`` (with the time since the ticker started): now, unless the last draw is newer than
        ``throttle`` seconds; the thread draws the latest text at its next tick."""
        self.text = text
        self._redraw()

    def _redraw(self) -> None:
        if not self._bar.enabled:
            return
        elapsed = format_seconds(time.monotonic() - self._bar.start)
        with self._lock:
            if self._bar.enabled:  # (closed meanwhile by the other thread)
                self._bar.show(f"{self.text}, {elapsed}" if self.text else elapsed)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._redraw()

    def close(self) -> None:
        """Stop the thread and erase the line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._bar.close()

    def __enter__(self) -> "Ticker":
        if self._bar.enabled:
            self._thread = threading.Thread(target=self._run, name=f"progress {self._bar.label}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
