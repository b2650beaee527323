"""SHA-256 of a file's bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 8 << 20


def file_digest(path: str | Path) -> str:
    """SHA-256 (hex) of `path`'s bytes, read each call (~0.7 s per GB).

    Not remembered by the file's stat: a rewrite can keep the size and the mtime (`os.utime`, `cp -p`,
    `rsync -t`), and on kernels with coarse timestamps (before Linux 6.13's multigrain ones) two writes
    within one tick keep the ctime too.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
