"""CRC-32 of checkpoint files: taken while a save writes them, and by reading them back at a resume.

Why CRC-32: it finds every error of one flipped byte (any burst of up to 32 bits) with certainty, not
only with high probability, and zlib computes it at ~3.5 GB/s on the CPU box, against ~0.6 GB/s for
blake2b. It guards against damage (a bad disk, a truncated copy), not against someone who edits a
file on purpose: they can rewrite the manifest too (megatron/safe_load.py is what guards the loader).

At a save no byte is hashed twice: torch.save's zip writer computes the CRC-32 of every record (each
tensor's bytes, written in one call) and stores it in the zip's central directory. `StreamCRC` hashes
only the bytes around the records (zip headers, the pickle), takes each record's CRC from the central
directory once the file is written, and joins the pieces with `crc32_combine` (zlib's, which Python
does not expose). A file that is not such a zip (DeepSpeed's legacy serialization) is hashed whole as
it is written.

Standard library only: the launch scripts' resume rule reads protocol.py without importing torch.
"""
from __future__ import annotations

import bisect
import os
import zipfile
import zlib

_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected as zlib uses it
# a write this large is a zip record's data whose CRC torch computes anyway; smaller ones are hashed here
RECORD_BYTES = 64 * 1024
READ_CHUNK = 16 * 1024 * 1024


def _multmodp(a: int, b: int) -> int:
    """a times b modulo the CRC polynomial (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: the operator that appends n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A+B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def file_crc32(path: str) -> int:
    """The CRC-32 of a file, read back (a resume's check)."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class StreamCRC:
    """The CRC-32 and size of what is written to one file, fed each write in order (see the module
    docstring). reuse_zip_crcs: the file is a torch.save zip whose records carry their CRC-32."""

    def __init__(self, reuse_zip_crcs: bool):
        self.reuse_zip_crcs = reuse_zip_crcs
        self.size = 0
        self.hashed = 0  # bytes hashed here (the rest: records whose CRC-32 torch computed)
        self._pieces: list[tuple[int, int, int | None]] = []  # (offset, length, crc; None: a record's, later)
        self._run_start, self._run_crc = 0, 0

    def update(self, data) -> None:
        length = memoryview(data).nbytes
        if self.reuse_zip_crcs and length >= RECORD_BYTES:
            self._close_run()
            self._pieces.append((self.size, length, None))
            self._run_start = self.size + length
        else:
            self._run_crc = zlib.crc32(data, self._run_crc)
            self.hashed += length
        self.size += length

    def _close_run(self) -> None:
        if self.size > self._run_start:
            self._pieces.append((self._run_start, self.size - self._run_start, self._run_crc))
        self._run_start, self._run_crc = self.size, 0

    def finish(self, path: str) -> int:
        """The file's CRC-32, once every byte has been written to `path` and flushed."""
        self._close_run()
        deferred = [(offset, length) for offset, length, crc in self._pieces if crc is None]
        records = _record_crcs(path, deferred) if deferred else {}
        crc = 0
        for offset, length, piece in self._pieces:
            if piece is None:
                piece = records.get((offset, length))
                if piece is None:  # not a record's data after all (never seen with torch's writer): read it back
                    piece = _read_crc32(path, offset, length)
                    self.hashed += length
            crc = crc32_combine(crc, piece, length)
        return crc


def _record_crcs(path: str, pieces: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """For each (offset, length) written in one piece that is exactly one stored record's data in the zip
    at `path`, that record's CRC-32 from the central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
            directory = archive.start_dir
    except (zipfile.BadZipFile, OSError):
        return {}
    starts = [info.header_offset for info in infos]
    found = {}
    for offset, length in pieces:
        i = bisect.bisect_right(starts, offset) - 1  # the record whose local header comes just before
        if i < 0:
            continue
        info = infos[i]
        end = starts[i + 1] if i + 1 < len(infos) else directory
        if (info.compress_type == zipfile.ZIP_STORED and info.compress_size == length == info.file_size
                and offset - info.header_offset >= 30 + len(info.filename) and offset + length <= end):
            found[(offset, length)] = info.CRC
    return found


def _read_crc32(path: str, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as handle:
        handle.seek(offset)
        while length > 0:
            chunk = handle.read(min(READ_CHUNK, length))
            if not chunk:
                break
            crc, length = zlib.crc32(chunk, crc), length - len(chunk)
    return crc


def format_crc(crc: int) -> str:
    return f"{crc:08x}"


def size_and_crc(path: str) -> tuple[int, str]:
    return os.path.getsize(path), format_crc(file_crc32(path))
