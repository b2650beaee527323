"""`file_digest` against hashlib on the bytes, through a rewrite that keeps size and mtime."""

from __future__ import annotations

import hashlib
import os

from megatron_tail.utils.file_digest import file_digest


def test_a_rewrite_with_size_and_mtime_kept_is_hashed_again(tmp_path):
    """Before: remembered per (path, size, mtime), so a process that hashed a file kept its digest through
    a rewrite of the same length given its old mtime back."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"aaaa\n")
    first = os.stat(path)
    assert file_digest(path) == hashlib.sha256(b"aaaa\n").hexdigest()
    path.write_bytes(b"bbbb\n")
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))
    assert file_digest(path) == hashlib.sha256(b"bbbb\n").hexdigest()
