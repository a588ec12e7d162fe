"""Write output files atomically: a full disk or a crash never leaves a truncated file.

Every file the tool writes (``viz -o``, ``gen -o``, the demo's HTML) is written to a
temporary file beside the target, flushed to disk, and renamed over the target in one
step, so the target is either the old file (or absent) or the complete new one.  A target
that exists and is not a regular file (``/dev/stdout``, a named pipe, ``/dev/null``) is
written directly: renaming over it would replace the device or pipe.

Examples
--------
>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> write_text_atomic(folder / "a.txt", "hello")
>>> (folder / "a.txt").read_text(), sorted(p.name for p in folder.iterdir())
('hello', ['a.txt'])
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "write_text_atomic"]


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _is_special(path: Path) -> bool:
    """Whether ``path`` exists and is not a regular file (a device, a pipe, a socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` when the block ends.

    If the block raises, the temporary file is removed and ``path`` is left as it was.
    A ``path`` that is a device or a pipe is yielded itself (written in place).

    Raises
    ------
    OSError
        When the folder is not writable, the disk is full, or the rename fails.
    """
    path = Path(path)
    if _is_special(path):
        yield path
        return
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)  # keep an existing file's permissions
        except OSError:
            mode = _default_mode()  # what a plain open() would have given a new file
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:  # on disk before the rename: a crash leaves the old file or the new
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_all(f, data: bytes) -> None:
    """Write ``data`` in pieces of 1 MiB (a test replaces this to fail half way)."""
    view = memoryview(data)
    for start in range(0, len(view), 2 ** 20):
        f.write(view[start:start + 2 ** 20])


def write_text_atomic(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`).

    Raises
    ------
    OSError
        When the file cannot be written; ``path`` is then unchanged.
    """
    data = text.encode(encoding)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            _write_all(f, data)
