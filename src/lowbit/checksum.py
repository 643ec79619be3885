"""SHA-256 of a file, read in blocks: the GGUF cache's key and a checkpoint's checksums."""

from __future__ import annotations

import hashlib
import os

from lowbit.files import opened

__all__ = ["file_sha256"]


def file_sha256(path: str | os.PathLike) -> str:
    """The file's SHA-256 as hex, read 4 MiB at a time; a file this user cannot read is a
    LowbitError naming it (:mod:`lowbit.files`)."""
    digest = hashlib.sha256()
    with opened(path) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
