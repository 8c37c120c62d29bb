"""Atomic output: every file piper-sim produces (plans, traces, CSV, PNG, JSON reports,
calibrations, checkpoint markers) is written here.

The bytes go to a temporary file in the destination's folder, which is flushed, fsync'ed
and then renamed onto the destination with ``os.replace`` (atomic on POSIX). A reader,
or a process killed at any instant, sees the previous file or the complete new one,
never a truncated one. A destination that exists and is not a regular file (``/dev/stdout``,
a FIFO) is written in place: there is nothing to replace atomically. A directory is refused.

This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import IO, Iterator

_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_dir(folder: str) -> None:
    """Make a rename inside ``folder`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _named(e: OSError, path: str, tmp: str | None = None) -> OSError:
    """Name the destination, not the temporary file, in the error."""
    if e.filename is None or e.filename == tmp:
        e.filename = path
    return e


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path to write the whole output to (it keeps the destination's
    extension, for writers that pick a format from it); when the block ends without an
    error it replaces ``path``, otherwise it is removed and ``path`` is left untouched."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, "is a directory, not a file name", path)
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        yield path  # a device or a pipe: write through
        return
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp" + os.path.splitext(base)[1], dir=folder)
    except OSError as e:  # the folder is missing or read-only: name the file asked for
        e.filename = path
        raise e from None
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o666 & ~_UMASK
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _named(e, path, tmp) from None
        raise
    fsync_dir(folder)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: an open file that becomes ``path``
    only once the block has completed."""
    with atomic_path(path) as tmp:
        try:
            with open(tmp, mode, **open_kwargs) as f:
                yield f
        except OSError as e:
            raise _named(e, os.fspath(path)) from None


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


# --- output paths checked before the work that writes them (one-line ValueErrors) -------------


def check_output_file(path: str, flag: str, force: bool = True) -> None:
    """Refuse, naming ``flag``, a file path an output cannot be written to: an existing
    folder, a parent folder that is missing or not writable, or (unless ``force``) an
    existing regular file. Creates nothing."""
    shown = f"{flag} {path}"
    if os.path.isdir(path):
        raise ValueError(f"{shown}: is a folder; give a file path (a name inside it, say)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{shown}: folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{shown}: folder {parent} is not writable; choose another path")
    if not force and os.path.isfile(path):
        raise ValueError(f"{shown}: the file exists; pass --force to replace it, or choose another path")


def check_output_dir(path: str, flag: str) -> None:
    """Refuse, naming ``flag``, a folder path an output cannot be written into: an existing
    file, or a nearest existing ancestor (the folder is created with its parents) that is a
    file or not writable. Creates nothing."""
    shown = f"{flag} {path}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{shown}: is a file, not a folder; give a folder name")
    base = os.path.abspath(path)
    while not os.path.exists(base):
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        raise ValueError(f"{shown}: {base} is a file, so the folder cannot be created; choose another path")
    if not os.access(base, os.W_OK):
        raise ValueError(f"{shown}: folder {base} is not writable; choose another path")


CACHE_ENV = "PIPER_SIM_CACHE_DIR"


def cache_dir() -> str:
    """Where piper-sim keeps what it can recompute (this machine's calibrations, segment profiles):
    $PIPER_SIM_CACHE_DIR, else $XDG_CACHE_HOME/piper-sim, else ~/.cache/piper-sim."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "piper-sim")
