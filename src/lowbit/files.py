"""The one reader of the files lowbit is given: an error of the operating system is a sentence.

Every file lowbit reads (a checkpoint's ``config.json`` and weights, a corpus, an eval result, a
GGUF file's header) is opened here, so a file this user may not read, a directory where a file
was expected, or an I/O error is a :class:`~lowbit.errors.LowbitError` naming the path, never a
``PermissionError`` traceback from deep inside a check. It lives at the lowest layer, beside
``lowbit.checksum`` (which reads through it), because loaders and writers of every layer read.
Where lowbit keeps what it caches (converted GGUF models, compiled C libraries) is decided here
too: ``cache_root``.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from lowbit.atomic import os_error_reason
from lowbit.errors import LowbitError

__all__ = ["cache_root", "read_error", "opened", "read_bytes", "read_text", "is_file", "is_dir"]


def read_error(path: str | os.PathLike, err: OSError, what: str = "") -> LowbitError:
    """The sentence for an ``OSError`` met reading ``path`` (``what`` names it: "dataset file")."""
    name = f"{what} {path}" if what else str(path)
    if isinstance(err, PermissionError):
        reason = "permission denied (this user may not read it)"
    elif isinstance(err, IsADirectoryError):
        reason = "it is a directory, not a file"
    elif isinstance(err, FileNotFoundError):
        reason = "it does not exist"
    elif err.errno == errno.ENOTDIR:
        reason = "a part of the path is not a directory"
    else:
        reason = os_error_reason(err)
    return LowbitError(f"cannot read {name}: {reason}")


@contextlib.contextmanager
def opened(path: str | os.PathLike, what: str = "") -> Iterator[BinaryIO]:
    """``open(path, "rb")``; an ``OSError`` while opening or reading is a LowbitError."""
    try:
        with open(path, "rb") as f:
            yield f
    except OSError as err:
        raise read_error(path, err, what) from err


def read_bytes(path: str | os.PathLike, what: str = "") -> bytes:
    """The whole file; an ``OSError`` is a LowbitError naming ``path``."""
    with opened(path, what) as f:
        return f.read()


def read_text(path: str | os.PathLike, what: str = "") -> str:
    """The whole file as UTF-8 text; an ``OSError`` or text that is not UTF-8 is a LowbitError
    naming ``path``."""
    raw = read_bytes(path, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        name = f"{what} {path}" if what else str(path)
        raise LowbitError(f"{name} is not UTF-8 text ({err.reason})") from err


def _stat(path: Path, what: str):
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:  # a directory on the way that this user may not search
        raise read_error(path, err, what) from err


def is_file(path: str | os.PathLike, what: str = "") -> bool:
    """``Path.is_file``, but a path this user may not look at is a LowbitError, not a
    ``PermissionError`` (nor, as ``os.path.isfile`` would have it, "no such file")."""
    import stat

    found = _stat(Path(path), what)
    return found is not None and stat.S_ISREG(found.st_mode)


def is_dir(path: str | os.PathLike, what: str = "") -> bool:
    """``Path.is_dir``, with the same sentence as :func:`is_file` for a path it may not see."""
    import stat

    found = _stat(Path(path), what)
    return found is not None and stat.S_ISDIR(found.st_mode)


def cache_root() -> Path:
    """lowbit's cache directory: ``$LOWBIT_CACHE`` or ``$XDG_CACHE_HOME/lowbit`` or ``~/.cache/lowbit``."""
    if os.environ.get("LOWBIT_CACHE"):
        return Path(os.environ["LOWBIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lowbit"
