"""lowbit's small C kernels, compiled on first use with the system's C compiler.

:func:`compile_library` builds a C source of the package (``$CC`` or ``cc``; ``-O3
-march=native -ffp-contract=off -fopenmp``) into lowbit's cache directory (``<cache>/native/``,
named by a hash of the source, the flags, the compiler and the CPU), once per machine; later
processes load the cached library. No compiler, a failed build (a compiler without
``_Float16`` or OpenMP), a platform that is not POSIX or ``LOWBIT_NATIVE=0``: it returns None,
and each caller stays on its torch path, which gives the same numbers, slower.

The kernels: :mod:`lowbit.kv.native` (a quantized KV cache's decode step) and
:mod:`lowbit.algorithms.gptq_native` (GPTQ's column loop).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from lowbit.files import cache_root

__all__ = ["compile_library", "FLAGS"]

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp"]


def _cpu_name() -> str:
    """The CPU's model and instruction-set flags (``-march=native`` builds for them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{model}\n{flags}" if model or flags else platform.processor()


def _build(compiler: str, source: Path, target: Path) -> None:
    """Compile ``source`` to ``target`` (through a temporary name, renamed when complete)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", tmp],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compile_library(source: Path) -> ctypes.CDLL | None:
    """``source`` compiled and loaded; None where it cannot be (see the module doc)."""
    if os.environ.get("LOWBIT_NATIVE", "1") == "0" or os.name != "posix":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler found: %s stays on its torch path", source.stem)
        return None
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                 platform.machine().encode(), _cpu_name().encode()):  # fmt: skip
        key.update(part + b"\0")
    target = cache_root() / "native" / f"{source.stem}-{key.hexdigest()[:20]}.so"
    try:
        if not target.is_file():
            _build(compiler, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        log.info("%s stays on its torch path: building %s failed (%s)", source.stem, target, err)
        return None
