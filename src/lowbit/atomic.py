"""Directories that appear whole or not at all: saved checkpoints, exports, the GGUF cache.

:func:`atomic_directory` is the one way lowbit writes a directory. The files go to a temporary
directory beside the target, named ``.<target>.tmp-<pid>@<host>-<random>``; at the end it is
renamed to the target in one step. Whatever stops the writing on the way leaves no trace:

* an exception removes the temporary directory; an ``OSError`` (a full disk, a quota, a
  read-only file system) becomes one sentence, a :class:`~lowbit.errors.LowbitError`;
* SIGTERM and SIGINT (while it runs, in the main thread) remove it, print
  ``lowbit: interrupted; nothing was written to <target>`` and exit with 143 or 130;
* SIGKILL cannot be caught: the pid and host in the name let the next write beside the same
  target (:func:`remove_stale_temporaries`) see that the writer is dead and remove it.

What may be written is one rule for every writer (:func:`check_target`): a new or empty target,
or with the user's ``--force`` an existing regular file; never a directory that holds files,
and never what a symbolic link points to (a link to nothing or to an empty directory is
written through and stays a link). It lives at the lowest layer of the package, as
``lowbit.errors`` does, because both ``lowbit.models.loader`` (the GGUF cache) and ``lowbit.io``
(checkpoints, exports) write through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from lowbit.errors import LowbitError

__all__ = [
    "atomic_directory",
    "atomic_file",
    "check_target",
    "os_error_reason",
    "remove_stale_temporaries",
    "write_json",
    "STALE_SECONDS",
]

#: a temporary older than this is stale even when its pid runs (it may have been reused) or it
#: was made on another host (a shared file system)
STALE_SECONDS = 24 * 3600
# ".<name>.tmp-<pid>@<host>-<random>", and ".tmp-<pid>@<host>-<random>" (the GGUF cache of
# earlier versions), and the same without "<pid>@<host>-" (earlier versions' saves)
_TEMPORARY = re.compile(r"^\.(?:.+\.)?tmp-(?:(?P<pid>\d+)@(?P<host>.+)-)?[A-Za-z0-9_]+$")
_SIGNALS = {signal.SIGTERM: 143, signal.SIGINT: 130}  # exit status: 128 + the signal's number


def _host() -> str:
    return socket.gethostname().replace("/", "_")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary directories of writers that died before renaming them.

    A temporary (a directory named as :func:`atomic_directory` names them) is stale when it was
    made on this host by a process that no longer runs, or when it is older than
    ``STALE_SECONDS`` (another host's, a reused pid, or an earlier version's name without a
    pid). A directory that cannot be listed is left alone. Returns what was removed.
    """
    try:
        entries = list(Path(directory).iterdir())
    except OSError:  # missing, unreadable: nothing of ours to clean there
        return []
    host = _host()
    removed = []
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            age = time.time() - entry.stat().st_mtime
        except OSError:  # its writer just renamed or removed it
            continue
        pid = match["pid"]
        dead = pid is not None and match["host"] == host and not _pid_alive(int(pid))
        if dead or age > STALE_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


def _resolve(path: str | os.PathLike) -> tuple[Path, str]:
    """The path to write for ``path`` (a link followed to where it points) and how to name it
    in a sentence ("a link" only when the path itself is one)."""
    given = Path(path).expanduser()
    if not given.is_symlink():
        return given, str(given)
    target = Path(os.path.realpath(given))
    return target, f"{given} (a link to {target})"


def _is_empty(path: Path) -> bool:
    """Whether ``path`` is an empty regular file or an empty directory (nothing to lose)."""
    if path.is_dir():
        return not any(path.iterdir())
    return path.is_file() and path.stat().st_size == 0


def check_target(
    path: str | os.PathLike,
    verb: str = "save to",
    *,
    kind: str = "directory",
    force: bool = False,
    inputs: Sequence[str | os.PathLike | None] = (),
) -> Path:
    """The one rule for every path lowbit writes: refuse, with one sentence, a target that
    holds something of the user's; returns the path that will be written (links followed).

    A target may be new, or empty (an empty directory, or for a file an empty file). Anything
    else that exists is refused unless ``force``, and then only a regular file is replaced (by
    the file or directory written), never a directory that holds files, a device, a FIFO or
    socket. A symbolic link is followed only to nothing or to something empty: what a link
    points to is never replaced, not even with ``force``. The target's directory must exist
    and take new files.

    Args:
        path: the target as the user gave it.
        verb: what the sentence says cannot be done, e.g. ``"save to"``, ``"export to"``.
        kind: ``"directory"`` or ``"file"``: what is written there.
        force: the user's ``--force``: replace an existing regular file.
        inputs: the files the command reads (model, corpora, result files): a target that is
            one of them is refused, ``force`` or not.
    """
    if kind not in ("directory", "file"):
        raise ValueError(f"kind must be 'directory' or 'file', not {kind!r}")
    given = Path(path).expanduser()
    target, shown = _resolve(given)
    for source in inputs:
        if source is not None and os.path.lexists(Path(source).expanduser()):
            if os.path.realpath(Path(source).expanduser()) == os.path.realpath(target):
                raise LowbitError(
                    f"cannot {verb} {shown}: it is also what this command reads ({source}); "
                    "give another path"
                )
    try:
        _check_existing(given, target, shown, verb, kind, force)
    except OSError as err:  # a directory on the way this user cannot search or list
        raise LowbitError(f"cannot {verb} {shown}: {os_error_reason(err)}") from err
    if not target.parent.is_dir():
        raise LowbitError(f"cannot {verb} {shown}: the directory {target.parent} does not exist")
    try:  # the directory must really take a new entry (os.access says yes to root)
        Path(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=target.parent)).rmdir()
    except OSError as err:
        raise LowbitError(
            f"cannot {verb} {shown}: the directory {target.parent} does not take new files "
            f"({os_error_reason(err)})"
        ) from err
    return target


def _check_existing(
    given: Path, target: Path, shown: str, verb: str, kind: str, force: bool
) -> None:
    if (
        not os.path.lexists(target)
        or _is_empty(target)
        and target.is_dir() == (kind == "directory")
    ):
        return
    if given.is_symlink():
        raise LowbitError(
            f"cannot {verb} {shown}: the link points to something that exists, and lowbit never "
            "replaces what a link points to (not even with --force); remove the link or give "
            "another path"
        )
    if target.is_dir():
        if kind == "file":
            raise LowbitError(f"cannot {verb} {shown}: it is a directory")
        raise LowbitError(
            f"cannot {verb} {shown}: the directory exists and is not empty (lowbit never "
            "replaces a directory's files, not even with --force); remove it or give another path"
        )
    if not target.is_file():
        raise LowbitError(
            f"cannot {verb} {shown}: it is not a regular file (a device, FIFO or socket), and "
            "lowbit writes only regular files"
        )
    if not force:
        size = target.stat().st_size
        raise LowbitError(
            f"cannot {verb} {shown}: it exists (a file of {size:,} bytes); pass --force to "
            "replace it"
        )


def os_error_reason(err: BaseException) -> str | None:
    """What an error of the operating system means in words (``"the disk is full (No space
    left on device)"``), or None when ``err`` is not one.

    safetensors reports its I/O errors as its own ``SafetensorError`` with ``(os error N)`` in
    the message; those count too.
    """
    if isinstance(err, OSError):
        number, text = err.errno, err.strerror or str(err)
    else:
        found = re.search(r"os error (\d+)", str(err))
        if type(err).__name__ != "SafetensorError" or found is None:
            return None
        number = int(found[1])
        text = os.strerror(number)
    if number == errno.ENOSPC:
        return f"the disk is full ({text})"
    if number == errno.EDQUOT:
        return f"the disk quota is used up ({text})"
    if number == errno.EROFS:
        return f"the file system is read-only ({text})"
    return text


def _set_default_permissions(directory: Path) -> None:
    """Give the directory and everything in it the modes the umask allows (mkdtemp makes the
    directory 0700 and safetensors writes its files 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _temporary_beside(target: Path, shown: str, verb: str) -> Path:
    """A new hidden temporary directory beside ``target`` (named after it, this process and
    host, so a later run can tell stale ones), after removing stale ones there."""
    remove_stale_temporaries(target.parent)
    try:
        prefix = f".{target.name}.tmp-{os.getpid()}@{_host()}-"
        return Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    except OSError as err:
        raise LowbitError(
            f"cannot {verb} {shown}: the directory {target.parent} does not take new files "
            f"({os_error_reason(err)})"
        ) from err


@contextlib.contextmanager
def _removed_on_signals(tmp: Path, shown: str, state: dict) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT remove ``tmp``, say so in one sentence and exit 143 or
    130. Installed only in the main thread (Python runs handlers there) and only for signals
    not ignored (``nohup``, background jobs)."""

    def on_signal(signum, frame) -> None:
        if state["renamed"]:
            message = f"interrupted after {shown} was written"
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            message = f"interrupted; nothing was written to {shown}"
        print(f"lowbit: {message}", file=sys.stderr, flush=True)
        raise SystemExit(_SIGNALS[signum])

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _SIGNALS:
            handler = signal.getsignal(signum)
            if handler is not signal.SIG_IGN and handler is not None:
                previous[signum] = signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _check_still_writable(path, verb: str, force: bool, kind: str = "directory") -> None:
    """:func:`check_target` again just before the rename; what it now refuses appeared while
    writing (an ``OSError``, which the callers turn into their sentence)."""
    try:
        check_target(path, verb, kind=kind, force=force)
    except LowbitError as err:
        raise FileExistsError(errno.EEXIST, "File exists") from err


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike,
    *,
    verb: str = "save to",
    exist_ok: bool = False,
    force: bool = False,
) -> Iterator[Path]:
    """Write a directory whole or not at all: yields an empty temporary directory to fill, and
    renames it to ``path`` when the block ends without an error.

    Before it starts, stale temporaries of dead writers beside the target are removed
    (:func:`remove_stale_temporaries`). See the module's docstring for what happens on errors
    and signals.

    Args:
        path: the directory to write: new, or empty (replaced); a link is followed.
        verb: the sentence's words for what failed, e.g. ``"save to"`` gives "cannot save to X:
            the disk is full (...); nothing was written".
        exist_ok: when the target appears meanwhile (a concurrent writer of the same content,
            as for the GGUF cache), keep it and drop this one; otherwise that is a LowbitError.
        force: the user's ``--force``: a regular file at ``path`` is replaced (see
            :func:`check_target`).

    Raises:
        LowbitError: a target that is not a new or empty directory (unless ``exist_ok``), a
            directory that takes no new files, an ``OSError`` while writing, or a target that
            another writer filled meanwhile.
    """
    if exist_ok:
        target, shown = _resolve(path)
    else:
        target = check_target(path, verb, force=force)
        shown = _resolve(path)[1]
    tmp = _temporary_beside(target, shown, verb)
    state = {"renamed": False}
    try:
        with _removed_on_signals(tmp, shown, state):
            try:
                yield tmp
                _set_default_permissions(tmp)
            except Exception as err:
                reason = os_error_reason(err)
                if reason is None:
                    raise
                raise LowbitError(f"cannot {verb} {shown}: {reason}; nothing was written") from err
            try:
                if not exist_ok:  # the same rule again: something may have appeared meanwhile
                    _check_still_writable(path, verb, force)
                    if force and target.is_file() and not target.is_symlink():
                        target.unlink()  # the regular file --force replaces
                os.rename(tmp, target)  # replaces an empty directory in one step (POSIX)
                state["renamed"] = True
            except OSError as err:
                if exist_ok and target.exists():
                    return
                raise LowbitError(
                    f"cannot {verb} {shown}: it appeared while writing (another process wrote "
                    f"there? {err.strerror}); it was left as it is and nothing was written"
                ) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike, *, verb: str = "write", force: bool = False
) -> Iterator[Path]:
    """Write one file whole or not at all: yields a path inside a temporary directory beside
    ``path`` (named as :func:`atomic_directory` names its own, so a dead writer's is cleaned the
    same way); the file is renamed onto ``path`` when the block ends without an error.

    ``path`` follows :func:`check_target`'s rule for a file: new or empty, or with ``force`` a
    regular file (which keeps its permissions); a link only to nothing or to an empty file.

    Raises:
        LowbitError: a target the rule refuses, a directory that does not exist or takes no new
            files, or an ``OSError`` while writing.
    """
    target = check_target(path, verb, kind="file", force=force)
    shown = _resolve(path)[1]
    tmp = _temporary_beside(target, shown, verb)
    state = {"renamed": False}
    try:
        with _removed_on_signals(tmp, shown, state):
            written = tmp / target.name
            try:
                yield written
                _check_still_writable(path, verb, force, kind="file")
                mode = 0o666 & ~_umask()
                if target.is_file():  # a replaced file keeps its permissions
                    mode = target.stat().st_mode & 0o7777
                os.chmod(written, mode)
                os.replace(written, target)
                state["renamed"] = True
            except Exception as err:
                reason = os_error_reason(err)
                if reason is None:
                    raise
                raise LowbitError(f"cannot {verb} {shown}: {reason}; nothing was written") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | os.PathLike, data, *, force: bool = False) -> Path:
    """Write ``data`` as indented JSON to ``path`` through :func:`atomic_file` (the same rule
    for the target: ``--force`` replaces an existing regular file). Returns the path written."""
    import json

    with atomic_file(path, verb="write", force=force) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    return Path(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
