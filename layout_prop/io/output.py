"""Write output files atomically: a full disk or a crash never leaves a truncated file.

Every file the tool writes (``viz -o``, ``gen -o``, ``import -o``, ``plan -o``, the
demo's HTML) is written to a temporary file beside the target, flushed to disk, and
renamed over the target in one step, so the target is either the old file (or absent) or
the complete new one.

- A target that exists and is not a regular file (a named pipe, ``/dev/null``), or that
  is under ``/dev`` or ``/proc`` (``/dev/stdout``, even when stdout is a file), is written
  directly: renaming over it would replace the device, the pipe or the link.
- A target that is a symbolic link is written through: the link is followed (each link of
  a chain) and the real file is replaced beside itself, so the link stays a link, as
  editors (Emacs, Vim) and ``sed -i --follow-symlinks`` do.  A link that another user
  owns, in a folder that others can write to (``/tmp``), is refused instead of followed,
  as the kernel's ``protected_symlinks`` refuses it: it may be a trap pointing at one of
  your files.
- Where an output goes is checked before a command's work (:func:`check_output`): a
  folder, a missing folder, a folder one cannot write to, a link that is refused, and a
  device that refuses writes (``/dev/full``: an empty write, which leaves nothing behind,
  fails as a real one would) are refused at once, not after a 50 s solve.  A full disk or
  a quota met half way is still found only by the write itself (the old file then stays).
- ``-`` is standard output (as ``-`` as an input is standard input): :func:`write_output` writes
  the text there, and :func:`check_output` has nothing to check.
- A new file gets the permissions a plain ``open()`` would give it (the kernel applies the
  umask: the process umask is never changed); a replaced file keeps its permissions.  As
  with any rename-based write, a replaced file's other hard links keep the old content
  and the file becomes owned by the writer.

Examples
--------
>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> write_text_atomic(folder / "a.txt", "hello")
>>> (folder / "a.txt").read_text(), sorted(p.name for p in folder.iterdir())
('hello', ['a.txt'])
>>> (folder / "link.txt").symlink_to(folder / "a.txt")
>>> write_text_atomic(folder / "link.txt", "through the link")
>>> (folder / "link.txt").is_symlink(), (folder / "a.txt").read_text()
(True, 'through the link')
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "write_text_atomic", "write_output", "check_output", "check_distinct_outputs",
           "resolve_target", "OutputFailed", "STDOUT", "is_stdout"]

#: the output name that means standard output (``-o -``), as ``-`` as an input means standard input
STDOUT = "-"


def is_stdout(path: str | Path | None) -> bool:
    """Whether the output ``path`` is ``-``, standard output (``./-`` is a file named ``-``).

    >>> is_stdout("-"), is_stdout(Path("-")), is_stdout("./-"), is_stdout(None)
    (True, True, False, False)
    """
    return path is not None and str(path) == STDOUT


class OutputFailed(BaseException):
    """Writing the output (stdout, stderr, or a pipe or device given with ``-o``) failed.

    A BaseException, so that no command's own error handling mistakes it for a failure of
    its work: the command line ends quietly with 141 when the reader went away (a broken
    pipe), or with one ``write-failed`` line otherwise."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


def _is_special(path: Path) -> bool:
    """Whether ``path`` exists and is not a regular file (a device, a pipe, a socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


#: the most symbolic links followed from a target (the kernel's own limit is 40)
_MAX_LINKS = 40


def _kernel_file(path: Path) -> bool:
    """Whether ``path`` is under ``/dev`` or ``/proc`` (``/dev/stdout`` leads to
    ``/proc/self/fd/1``, whose link text is not a path one could write beside)."""
    text = os.path.abspath(path)
    return text.startswith(("/dev/", "/proc/"))


def _target(path: str | Path) -> tuple[Path, bool]:
    """``(the file a write to path replaces, whether to write it in place instead)``; see :func:`resolve_target`."""
    path = Path(path)
    for _ in range(_MAX_LINKS):
        if _is_special(path) or _kernel_file(path):
            return path, True
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return path, False
        if not stat.S_ISLNK(info.st_mode):
            return path, False
        folder = os.stat(path.parent)
        if info.st_uid not in (os.geteuid(), folder.st_uid) and folder.st_mode & stat.S_IWOTH:
            raise PermissionError(errno.EACCES, f"refusing to follow the symbolic link {str(path)!r}: it belongs to "
                                  f"uid {info.st_uid}, in a folder that others can write to")
        path = path.parent / os.readlink(path)  # an absolute link replaces the whole path
    raise OSError(errno.ELOOP, f"too many levels of symbolic links at {str(path)!r}")


def resolve_target(path: str | Path) -> Path:
    """The file a write to ``path`` replaces: ``path``, or where its symbolic links lead.

    Only the last component is followed here (folders on the way are resolved by the
    kernel when the file is renamed).  A device, a pipe or a file under ``/dev`` or
    ``/proc`` (``/dev/stdout``) is returned as it is reached: it is written in place.  A
    link owned by another user, in a folder that others can write to, is refused
    (``PermissionError``), as Linux's ``protected_symlinks`` refuses to follow it.

    Raises
    ------
    OSError
        ``PermissionError`` for such a link, ``ELOOP`` for a chain of more than 40 links.
    """
    return _target(path)[0]


def _new_temporary(folder: Path, name: str) -> Path:
    """A new empty file beside the target, made with mode 0666 minus the umask (as ``open()`` makes one)."""
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) |
                         getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {str(folder)!r}")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` when the block ends.

    If the block raises, the temporary file is removed and ``path`` is left as it was.
    A ``path`` that is a device or a pipe is yielded itself (written in place); a symbolic
    link is followed (:func:`resolve_target`) and the file it leads to is replaced.

    Raises
    ------
    OSError
        When the folder is not writable, the disk is full, the rename fails, or a link is
        refused.
    """
    path, in_place = _target(path)
    if in_place:
        try:
            yield path
        except BrokenPipeError as exc:  # a pipe whose reader went away: ends the command as stdout's would
            raise OutputFailed(exc) from None
        return
    tmp = _new_temporary(path.parent, path.name)
    try:
        yield tmp
        with contextlib.suppress(FileNotFoundError):  # keep an existing file's permissions
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
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


def write_output(path: str | Path, text: str) -> None:
    """:func:`write_text_atomic` for a command's ``-o FILE``: a failure is one ``write-failed`` error.

    ``-o -`` (:func:`is_stdout`) writes ``text`` to standard output instead of a file named ``-``
    (a closed or full standard output ends the command as any of its output would).

    Raises
    ------
    layout_prop.core.errors.SpecError
        ``write-failed``, naming the file (cut) and the system's reason.
    """
    from layout_prop.core.errors import SpecError, cut

    if is_stdout(path):
        import sys

        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise SpecError("write-failed", f"cannot write {cut(str(path))}: {exc.strerror or exc}",
                        hint="choose a folder that exists and is writable, on a disk with space") from None


def _probe(path: Path) -> None:
    """Raise the ``OSError`` a write to ``path`` would meet before any byte is written."""
    target, in_place = _target(path)  # a refused link, a loop of links
    if in_place and os.path.lexists(target):
        mode = os.stat(target).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            return  # opening a pipe waits for its reader, who may come later: not probed
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # never O_CREAT or O_TRUNC
        try:
            os.write(fd, b"")  # nothing written: /dev/full still says ENOSPC, a read-only device EBADF or EROFS
        finally:
            os.close(fd)
        return
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, "it is a folder")
    folder = target.parent
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"its folder {str(folder)!r} does not exist")
    _new_temporary(folder, target.name).unlink()  # what the write makes first: EACCES, EROFS, EDQUOT here


def check_output(path: str | Path) -> None:
    """Refuse, before a command's work, an output file ``path`` that cannot be written.

    The same checks the write meets, made without writing anything: the target is not a
    folder, its folder exists, a temporary file can be made in it (and is removed at once),
    and a device or a file under ``/dev`` accepts an empty write (``/dev/full`` does not).
    A full disk is found only by the write itself.

    Raises
    ------
    layout_prop.core.errors.SpecError
        ``write-failed``, as :func:`write_output` says it.

    Examples
    --------
    >>> check_output("/dev/null")
    >>> check_output("/")
    Traceback (most recent call last):
    ...
    layout_prop.core.errors.SpecError: write-failed: cannot write '/': it is a folder (hint: choose a folder that \
exists and is writable, on a disk with space)
    """
    from layout_prop.core.errors import SpecError, cut

    if is_stdout(path):
        return  # standard output: written as the command's other output is
    try:
        _probe(Path(path))
    except OSError as exc:
        raise SpecError("write-failed", f"cannot write {cut(str(path))}: {exc.strerror or exc}",
                        hint="choose a folder that exists and is writable, on a disk with space") from None


def check_distinct_outputs(outputs: dict[str, str | Path | None]) -> None:
    """Refuse two flags of one command that name the same output file (``-o X --plan-out X``: the
    second write would replace the first, exit 0); ``outputs`` maps a flag to its path (None: not given).

    The same file is the same resolved path (``./m.py`` and ``m.py``, a link and its target), or the
    same existing file by device and inode.  A device or a pipe (``/dev/stdout``) may be named twice.

    Raises
    ------
    SpecError
        ``same-output``, naming both flags.
    """
    from layout_prop.core.errors import SpecError, cut

    seen: dict[tuple, str] = {}
    for flag, path in outputs.items():
        if path is None or is_stdout(path):  # standard output may be named twice, as /dev/stdout may
            continue
        try:
            target = resolve_target(path)
        except OSError:  # check_output says what is wrong with it
            continue
        if _is_special(target) or _kernel_file(target):
            continue
        try:
            info = os.stat(target)
            key: tuple = ("inode", info.st_dev, info.st_ino)
        except OSError:
            key = ("path", os.path.realpath(target))
        if key in seen:
            raise SpecError("same-output", f"{seen[key]} and {flag} name the same file {cut(str(path))}",
                            path=flag, hint="give each output its own file")
        seen[key] = flag
