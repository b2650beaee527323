"""The records of one TensorBoard event file, read past damage, with each damaged stretch named.

An event file is a sequence of TFRecords: `uint64 length`, `uint32 masked CRC-32C of length`, `length`
bytes of an `Event` proto, `uint32 masked CRC-32C of the bytes` (the writer's format:
`tensorboard/summary/writer/record_writer.py`, `RecordWriter.write`). TensorBoard's reader stops at the
first record that fails its check and says so only at debug level
(`event_file_loader.RawEventFileLoader.Load` swallows `DataLossError`), so one bad record (a disk that
filled and freed, a torn NFS write) silently hides every step after it in that file. Here a bad record is
skipped to the next position where a whole record checks out, and the bytes skipped are reported.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

HEADER_BYTES = 12
"""length (8) + its masked CRC (4)."""
FOOTER_BYTES = 4


@dataclass(frozen=True)
class Damage:
    """A stretch of an event file that holds no readable record."""

    offset: int
    """Byte offset of the stretch's start."""
    length: int
    """Bytes in the stretch."""
    at_end: bool
    """The stretch runs to the end of the file: a record the writer had not finished (a process killed
    mid-write leaves one), rather than corruption with records after it."""


def read_records(path: str | Path) -> tuple[list[tuple[int, bytes]], list[Damage], int]:
    """Every intact record as (byte offset, payload) in file order, the damaged stretches between and after
    them, and the file's size in bytes.

    A record is intact when both of its CRCs match. After one that is not, reading resumes at the next
    byte offset where a whole record checks out (a false match needs two 32-bit CRCs to agree by chance).
    Costs one pass of CRC-32C over the file (TensorBoard's own pure-Python one, ~0.1 s per MB, as its
    reader), and a scan of the damaged bytes.
    """
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    data = Path(path).read_bytes()
    size = len(data)

    def record_at(pos: int) -> bytes | None:
        if pos + HEADER_BYTES + FOOTER_BYTES > size:
            return None
        (length,) = struct.unpack_from("<Q", data, pos)
        end = pos + HEADER_BYTES + length
        # the length first: a random 8 bytes is almost never a length that fits, so a scan stays cheap
        if end + FOOTER_BYTES > size:
            return None
        (header_crc,) = struct.unpack_from("<I", data, pos + 8)
        if masked_crc32c(data[pos : pos + 8]) != header_crc:
            return None
        payload = data[pos + HEADER_BYTES : end]
        (payload_crc,) = struct.unpack_from("<I", data, end)
        return payload if masked_crc32c(payload) == payload_crc else None

    records: list[tuple[int, bytes]] = []
    damage: list[Damage] = []
    pos = 0
    while pos < size:
        payload = record_at(pos)
        if payload is not None:
            records.append((pos, payload))
            pos += HEADER_BYTES + len(payload) + FOOTER_BYTES
            continue
        start = pos
        pos += 1
        while pos < size and record_at(pos) is None:
            pos += 1
        damage.append(Damage(offset=start, length=pos - start, at_end=pos >= size))
    return records, damage, size
