"""lowbit.atomic: a directory appears whole or not at all, whatever stops its writing."""

import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from lowbit.atomic import atomic_directory, os_error_reason, remove_stale_temporaries
from lowbit.errors import LowbitError


def _write(directory, name="weights", text="w"):
    (directory / name).write_text(text)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now a dead process's
    return child.pid


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_the_directory_appears_whole_with_the_umasks_modes(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".out.tmp-{os.getpid()}@")
        _write(tmp)
        os.chmod(tmp / "weights", 0o600)  # as safetensors writes its files
        assert not target.exists()
    assert _names(tmp_path) == ["out"] and (target / "weights").read_text() == "w"
    umask = os.umask(0)
    os.umask(umask)
    assert (target / "weights").stat().st_mode & 0o777 == 0o666 & ~umask
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask


def test_links_are_written_through_and_stay_links(tmp_path):
    (tmp_path / "empty").mkdir()
    to_empty = tmp_path / "to-empty"
    to_empty.symlink_to(tmp_path / "empty")
    dangling = tmp_path / "dangling"
    dangling.symlink_to("not-yet")  # relative to the link's directory
    for link in (to_empty, dangling):
        with atomic_directory(link) as tmp:
            _write(tmp)
        assert link.is_symlink() and (link / "weights").read_text() == "w"
    assert (tmp_path / "not-yet" / "weights").is_file()
    lost = tmp_path / "lost"
    lost.symlink_to(tmp_path / "no" / "such" / "dir")
    with pytest.raises(LowbitError, match=r"lost \(a link to .*dir\): the directory .* not exist"):
        with atomic_directory(lost):
            pass


@pytest.mark.parametrize(
    "number, reason",
    [
        (errno.ENOSPC, "the disk is full (No space left on device)"),
        (errno.EDQUOT, "the disk quota is used up (Disk quota exceeded)"),
        (errno.EIO, "Input/output error"),
    ],
)
def test_an_os_error_while_writing_is_a_sentence_and_leaves_nothing(tmp_path, number, reason):
    with pytest.raises(LowbitError) as info:
        with atomic_directory(tmp_path / "out", verb="export to") as tmp:
            _write(tmp)
            raise OSError(number, os.strerror(number))
    assert str(info.value) == f"cannot export to {tmp_path / 'out'}: {reason}; nothing was written"
    assert _names(tmp_path) == []


def test_safetensors_io_errors_are_read_as_os_errors():
    from safetensors import SafetensorError

    full = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    assert os_error_reason(full) == "the disk is full (No space left on device)"
    assert os_error_reason(SafetensorError("header too large")) is None
    assert os_error_reason(ValueError("os error 28")) is None


def test_other_errors_pass_unchanged_and_leave_nothing(tmp_path):
    with pytest.raises(KeyError):
        with atomic_directory(tmp_path / "out") as tmp:
            _write(tmp)
            raise KeyError("bug")
    assert _names(tmp_path) == []


def test_a_target_another_writer_fills_meanwhile_is_kept(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(LowbitError, match="it appeared while writing .* left as it is"):
        with atomic_directory(target) as tmp:
            _write(tmp, text="ours")
            target.mkdir()
            _write(target, text="theirs")
    assert _names(tmp_path) == ["out"] and (target / "weights").read_text() == "theirs"
    # a cache entry (exist_ok): the first finished copy stays, the other is dropped quietly
    with atomic_directory(target, exist_ok=True) as tmp:
        _write(tmp, text="ours")
    assert _names(tmp_path) == ["out"] and (target / "weights").read_text() == "theirs"


def test_a_directory_that_takes_no_files_is_a_sentence(tmp_path):
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    elif os.path.isdir("/sys"):  # root writes anywhere but in sysfs
        locked = "/sys"
    else:
        pytest.skip("no directory this user cannot write to")
    with pytest.raises(LowbitError, match="does not take new files"):
        with atomic_directory(f"{locked}/out", exist_ok=True):
            pass


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    host = socket.gethostname()
    dead = _dead_pid()
    kept = {
        f".out.tmp-{os.getpid()}@{host}-ab12cd",  # a live writer
        f".out.tmp-{dead}@elsewhere.example-ef34gh",  # another host's: only when old
        ".out.tmp-ij56kl",  # no pid (an earlier version's): only when old
        "out.tmp-12@host-x",  # not hidden: not ours
        "data",
    }
    removed = {f".out.tmp-{dead}@{host}-mn78op", f".other.tmp-{dead}@{host}-qr90st"}
    old = {".tmp-st12uv", f".x.tmp-{dead}@elsewhere.example-wx34yz"}  # two days old
    for name in kept | removed | old:
        (tmp_path / name).mkdir()
        _write(tmp_path / name)
    two_days_ago = time.time() - 2 * 24 * 3600
    for name in old:
        os.utime(tmp_path / name, (two_days_ago, two_days_ago))
    assert {p.name for p in remove_stale_temporaries(tmp_path)} == removed | old
    assert set(_names(tmp_path)) == kept
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_the_next_save_removes_a_killed_saves_temporary(tmp_path):
    """A save killed with SIGKILL leaves its temporary; the next save beside it removes it."""
    from lowbit.api import quantize
    from lowbit.io.checkpoint import save
    from lowbit.models.tiny import tiny_model

    left = tmp_path / f".ck.tmp-{_dead_pid()}@{socket.gethostname()}-ab12cd"
    left.mkdir()
    _write(left, "model.safetensors")
    model = quantize(tiny_model("llama"), "rtn", progress=False)
    save(model, tmp_path / "ck")
    assert _names(tmp_path) == ["ck"]


def test_sigint_removes_the_temporary_and_exits_130(tmp_path, capsys):
    target = tmp_path / "out"
    # Python's own handler, as in a foreground process: a background job starts with SIGINT
    # ignored, which atomic_directory rightly leaves alone
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as info:
            with atomic_directory(target) as tmp:
                _write(tmp)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler runs before this ends
        assert info.value.code == 130
        assert _names(tmp_path) == []
        assert capsys.readouterr().err == f"lowbit: interrupted; nothing was written to {target}\n"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler gone
    finally:
        signal.signal(signal.SIGINT, original)


def test_sigterm_while_the_cli_saves_leaves_nothing(tiny_model_dir, tmp_path):
    """A real process: `lowbit quantize` is sent SIGTERM while it writes its checkpoint."""
    out = tmp_path / "q"
    script = textwrap.dedent(
        f"""
        import sys, time
        import safetensors.torch

        def slow_save_file(*args, **kwargs):  # the save stops here until the signal comes
            print("writing", flush=True)
            time.sleep(60)

        safetensors.torch.save_file = slow_save_file
        from lowbit.cli import main

        sys.exit(main(["quantize", "--model", {str(tiny_model_dir)!r}, "--recipe", "rtn",
                       "--out", {str(out)!r}, "--no-progress", "--device", "cpu"]))
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "writing\n"
        assert len(list(tmp_path.iterdir())) == 1  # the temporary directory, being written
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert err.strip().splitlines()[-1] == f"lowbit: interrupted; nothing was written to {out}"
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
