"""Read a zip archive in torch's format: its directory, its records, their CRC-32s.

``torch.save`` writes a zip archive of stored (uncompressed) records: the
pickle ``data.pkl``, a few small ones (``version``, ``byteorder``) and one per
tensor storage (``data/0``, ``data/1``...). Its directory comes last, after
every record, and gives each record's offset, size and CRC-32. torch's reader
trusts that directory and checks no CRC-32.

`check_archive` reads the directory itself. Every offset is checked against
the file's size before it is read, so an ``OSError`` while reading is the
disk's or the system's (``EIO``), never one the damage caused: it propagates.
Then it checks the CRC-32 of every record but the tensors' data, which is the
bulk of the file: a flipped byte there changes a value but never makes a load
fail, so it cannot explain a failure. The directory and the small records
take under 3 ms (37 ms for 10,000 tensors). With ``tensors=True``
(``load(verify=True)``) it checks the tensors' records too: 0.31x to 0.41x of
the load of a 512 MB checkpoint from the page cache (75 to 93 ms, against 42
to 245 ms for ``torch.load``; zlib's CRC-32 runs at 7 GB/s here, see
docs/benchmarks.md), which is why a load that succeeds is checked only when
asked. `first_record` and `inflated` read the directory for `_checkpointcheck`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
import zlib
from collections.abc import Callable
from typing import IO, TypeVar

__all__ = ["Damage", "check_archive", "first_record", "inflated", "unchecked"]

T = TypeVar("T")

_END = b"PK\x05\x06"  # the end record: 22 bytes and a comment
_END64_LOCATOR = b"PK\x06\x07"  # zip64: 20 bytes, just before the end record
_END64 = b"PK\x06\x06"  # zip64's end record: 56 bytes (and an extensible part)
_ENTRY = b"PK\x01\x02"  # a directory entry: 46 bytes, its name, extra field and comment
_LOCAL = b"PK\x03\x04"  # a record's own header: 30 bytes, its name and extra field
_TAIL = 22 + 0xFFFF + 20  # where the end record can be: its longest comment, the locator
_CHUNK = 1 << 20  # bytes read at a time for a CRC-32
_STORED = 0  # the compression method torch writes: none
_ENCRYPTED = 0x1 | 0x20 | 0x40 | 0x2000  # flags: encrypted, patched, strongly, the directory
_DEFLATED = 8  # what other zip writers use (an .npz): a CRC-32 of the inflated bytes, unchecked


@dataclasses.dataclass(frozen=True)
class Damage:
    """What is wrong with an archive, for ``load()``'s message.

    Attributes:
        cut: Whether the file is cut short (its end is missing), not damaged inside.
        detail: What shows it, to follow "it is cut short: " or "it is damaged: ".
        record: The name of the record whose CRC-32 does not match, or None.
        crc: The CRC-32 that record's bytes have (not the one kept for it), or None.
    """

    cut: bool
    detail: str
    record: str | None = None
    crc: int | None = None


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: bytes
    offset: int  # of the record's own header, from the archive's start
    size: int  # stored size
    crc: int
    method: int
    full: int  # inflated size: ``size`` where stored as is


class _Bad(Exception):
    """The archive contradicts itself; the message says how (internal: becomes a Damage)."""

    def __init__(self, message: str, record: str | None = None, crc: int | None = None) -> None:
        super().__init__(message)
        self.record = record
        self.crc = crc


def check_archive(
    file: str | os.PathLike[str] | IO[bytes], start: int = 0, *, tensors: bool = False
) -> Damage | None:
    """What is wrong with the zip archive in ``file`` (from byte ``start``); None if nothing.

    A file object is left where it stood. A record saved without its CRC-32
    (a zero: ``torch.utils.serialization.config.save.compute_crc32 = False``)
    and a compressed one (never torch.save's) are not checked.

    Args:
        file: A path, or a binary file object with ``read()`` and ``seek()``.
        start: Where the archive starts in ``file`` (a file object read from there).
        tensors: Whether to check the tensors' records too (all of the file).

    Returns:
        The damage found, or None where the directory, the records' headers
        and the CRC-32 of every record but the tensors' agree.

    Raises:
        OSError: The file could not be read (``EIO``, ``EACCES``): not damage.

    Examples:
        >>> import io, torch
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> data = buffer.getvalue()
        >>> check_archive(io.BytesIO(data)) is None
        True
        >>> check_archive(io.BytesIO(data[:1000])).detail
        'its 1,000 bytes end without the directory every zip archive ends with'
    """
    return _reading(file, lambda opened: _check(opened, start, tensors))


def inflated(file: str | os.PathLike[str] | IO[bytes], start: int = 0) -> tuple[int, int] | None:
    """The stored and the inflated bytes of the archive's compressed records; None if none.

    torch.save never compresses; another zip tool may, and then torch.load
    allocates the inflated size. None too where the archive is unreadable.
    A file object is left where it stood.

    Examples:
        >>> import io, torch
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> inflated(buffer) is None
        True
    """
    return _reading(file, lambda opened: _inflated(opened, start))


def unchecked(file: str | os.PathLike[str] | IO[bytes], start: int = 0) -> int:
    """How many records ``check_archive(tensors=True)`` cannot check: no CRC-32, or compressed.

    Read from the directory alone; 0 where the archive is unreadable (then
    `check_archive` says why). A file object is left where it stood.

    Examples:
        >>> import io, torch
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> unchecked(buffer)
        0
    """

    def count(opened: IO[bytes]) -> int:
        entries = _entries_of(opened, start, opened.seek(0, io.SEEK_END) - start) or []
        return sum(1 for e in entries if e.method != _STORED or (e.crc == 0 and e.size > 0))

    try:
        return _reading(file, count)
    except (_Bad, OSError, ValueError, struct.error):
        return 0


def first_record(file: str | os.PathLike[str] | IO[bytes], start: int = 0) -> bytes | None:
    r"""The bytes of the archive's first record, torch.save's ``data.pkl``; None if not that.

    Read from the directory's first entry alone: a few small reads, whatever
    the count of records. None where the archive is unreadable, or where
    another zip tool put something else first. A file object is left where it
    stood.

    Examples:
        >>> import io, torch
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> first_record(buffer)[:2]
        b'\x80\x02'
    """
    try:
        return _reading(file, lambda opened: _first_record(opened, start))
    except (_Bad, OSError, ValueError, AttributeError, TypeError, struct.error):
        return None


def _reading(file: str | os.PathLike[str] | IO[bytes], read: Callable[[IO[bytes]], T]) -> T:
    """``read(file)``: a path opened for it, a file object left where it stood."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as opened:
            return read(opened)
    stood = file.tell()
    try:
        return read(file)
    finally:
        file.seek(stood)


def _first_record(file: IO[bytes], start: int) -> bytes | None:
    size = file.seek(0, io.SEEK_END) - start
    entries = _entries_of(file, start, size, first=True)
    # torch.save writes data.pkl first; another zip tool may put a folder or another
    # record first (torch finds data.pkl by name): then the caller reads what it loaded.
    if not entries or entries[0].method != _STORED or not entries[0].name.endswith(b"data.pkl"):
        return None
    entry = entries[0]
    header = _read(file, start + entry.offset, 30)
    data = entry.offset + 30 + _u16(header, 26) + _u16(header, 28)
    if header[:4] != _LOCAL or data + entry.size > size:
        return None
    return _read(file, start + data, entry.size)


def _inflated(file: IO[bytes], start: int) -> tuple[int, int] | None:
    try:
        entries = _entries_of(file, start, file.seek(0, io.SEEK_END) - start)
    except _Bad:
        return None
    packed = [entry for entry in entries or () if entry.method == _DEFLATED]
    if not packed:
        return None
    return sum(entry.size for entry in packed), sum(entry.full for entry in packed)


def _entries_of(
    file: IO[bytes], start: int, size: int, *, first: bool = False
) -> list[_Entry] | None:
    """The directory's entries; None where the file ends with no directory (cut short)."""
    if size < 0:
        raise _Bad("nothing there")
    tail_start = max(0, size - _TAIL)
    tail = _read(file, start + tail_start, size - tail_start)
    end = _find_end(tail)
    if end is None:
        return None
    return _directory(file, start, tail, tail_start + end, size, first=first)


def _check(file: IO[bytes], start: int, tensors: bool) -> Damage | None:
    size = file.seek(0, io.SEEK_END) - start
    if size < 0:
        return None  # nothing there to check
    try:
        entries = _entries_of(file, start, size)
        if entries is None:
            return Damage(
                cut=True,
                detail=f"its {size:,} bytes end without the directory every zip archive ends with",
            )
        for entry in entries:
            _check_entry(file, start, entry, size, tensors)
    except _Bad as bad:
        return Damage(cut=False, detail=str(bad), record=bad.record, crc=bad.crc)
    return None


def _read(file: IO[bytes], at: int, count: int) -> bytes:
    """``count`` bytes at ``at``: every caller checks they lie inside the file."""
    file.seek(at)
    data = file.read(count)
    if len(data) != count:  # the file shrank while it was checked
        raise _Bad(f"it changed size while it was read (at byte {at:,})")
    return data


def _find_end(tail: bytes) -> int | None:
    """Where in ``tail`` the end record is: the last one whose comment ends the file."""
    at = tail.rfind(_END)
    while at >= 0:
        if at + 22 <= len(tail) and at + 22 + _u16(tail, at + 20) == len(tail):
            return at
        at = tail.rfind(_END, 0, at)
    return None


def _directory(
    file: IO[bytes], start: int, tail: bytes, end: int, size: int, *, first: bool = False
) -> list[_Entry]:
    """The directory's entries (or its first only), as the end record (or zip64's) says."""
    local = end - (size - len(tail))  # the end record's place in ``tail``
    disks = (_u16(tail, local + 4), _u16(tail, local + 6), _u16(tail, local + 8))
    count, length, offset = _u16(tail, local + 10), _u32(tail, local + 12), _u32(tail, local + 16)
    before = end  # the directory must end before this
    locator = local - 20
    if locator >= 0 and tail[locator : locator + 4] == _END64_LOCATOR:
        at = _u64(tail, locator + 8)
        record = _read(file, start + at, 56) if at + 56 <= end - 20 else b""
        if record[:4] != _END64:
            raise _Bad(f"its zip64 end record is not where its locator says (byte {at:,})")
        disks = (_u32(record, 16) | _u32(tail, locator + 4), _u32(record, 20), _u64(record, 24))
        if _u32(tail, locator + 16) != 1:  # the locator's count of disks
            disks = (1, *disks[1:])
        count, length, offset = _u64(record, 32), _u64(record, 40), _u64(record, 48)
        before = at
    if disks[:2] != (0, 0) or disks[2] != count:  # its disk, the directory's, entries on it
        raise _Bad("its end record says it spans several disks, where a checkpoint has one")
    if offset + length != before:  # torch, as zip writers do, ends it where the end begins
        raise _Bad(f"its directory is not where its end record says (bytes {offset:,} on)")
    if first and count and length >= 46:
        entry = _read(file, start + offset, 46)
        length = min(length, 46 + _u16(entry, 28) + _u16(entry, 30) + _u16(entry, 32))
        count = 1
    return _entries(_read(file, start + offset, length), count)


def _entries(directory: bytes, count: int) -> list[_Entry]:
    """The entries of the directory, each checked against the others' bounds."""
    entries = []
    at = 0
    for _ in range(count):
        if directory[at : at + 4] != _ENTRY or at + 46 > len(directory):
            raise _Bad(f"its directory has a broken entry (at byte {at:,} of it)")
        flags, method, crc = (
            _u16(directory, at + 8),
            _u16(directory, at + 10),
            _u32(directory, at + 16),
        )
        size, full, offset = (
            _u32(directory, at + 20),
            _u32(directory, at + 24),
            _u32(directory, at + 42),
        )
        name_length, extra_length = _u16(directory, at + 28), _u16(directory, at + 30)
        comment_length, disk = _u16(directory, at + 32), _u16(directory, at + 34)
        folder = _u32(directory, at + 38) & 0x10  # MS-DOS's folder flag: torch reads no data
        name = directory[at + 46 : at + 46 + name_length]
        extra = directory[at + 46 + name_length : at + 46 + name_length + extra_length]
        at += 46 + name_length + extra_length + comment_length
        if at > len(directory):
            raise _Bad(f"its directory entry of {_text(name)} runs past the directory's end")
        if 0xFFFFFFFF in (size, full, offset):  # zip64: the real values are in the extra field
            full, size, offset = _zip64(extra, (full, size, offset), name)
        if (folder or name.endswith(b"/")) and full == 0:
            continue  # a folder's own entry, as `zip -r` writes them: no record to check
        if flags & _ENCRYPTED or method not in (_STORED, _DEFLATED) or disk or folder:
            raise _Bad(
                f"its directory entry of {_text(name)} says the record is encrypted, compressed "
                "in a way zip checkpoints are not, a folder, or on another disk"
            )
        if method == _STORED and size != full:
            raise _Bad(
                f"its directory gives record {_text(name)} two sizes, {size:,} and {full:,} "
                "bytes, for one stored as is"
            )
        entries.append(
            _Entry(name=name, offset=offset, size=size, crc=crc, method=method, full=full)
        )
    if at != len(directory):
        raise _Bad("its directory holds more than its end record counts")
    return entries


def _zip64(extra: bytes, values: tuple[int, int, int], name: bytes) -> tuple[int, int, int]:
    """An entry's 64-bit size, stored size and offset, those its extra field (id 1) holds."""
    at = 0
    while at + 4 <= len(extra):
        kind, length = _u16(extra, at), _u16(extra, at + 2)
        if kind == 1:
            found = list(values)
            place = at + 4
            for index, value in enumerate(values):
                if value == 0xFFFFFFFF:
                    if place + 8 > at + 4 + length or place + 8 > len(extra):
                        break
                    found[index] = _u64(extra, place)
                    place += 8
            else:
                return found[0], found[1], found[2]
        at += 4 + length
    raise _Bad(f"its directory entry of {_text(name)} lacks its zip64 sizes")


def _check_entry(file: IO[bytes], start: int, entry: _Entry, size: int, tensors: bool) -> None:
    """Refuse a record whose header or CRC-32 disagrees with its directory entry."""
    name = _text(entry.name)
    if entry.offset + 30 + len(entry.name) > size:
        raise _Bad(f"its record {name} is past the file's end (byte {entry.offset:,})")
    header = _read(file, start + entry.offset, 30 + len(entry.name))
    data = entry.offset + 30 + _u16(header, 26) + _u16(header, 28)
    if header[:4] != _LOCAL or header[30:] != entry.name or data + entry.size > size:
        raise _Bad(f"its record {name} is not where its directory says (byte {entry.offset:,})")
    if entry.crc == 0 and entry.size > 0:  # saved with torch.serialization.set_crc32_options(False)
        return
    if entry.method != _STORED or (
        not tensors and _is_tensor(entry.name.decode("utf-8", "replace"))
    ):
        return
    crc = _crc(file, start + data, entry.size)
    if crc != entry.crc:
        raise _Bad(
            f"its record {name} does not match the CRC-32 checksum its directory keeps for it",
            record=entry.name.decode("utf-8", "replace"),
            crc=crc,
        )


def _crc(file: IO[bytes], at: int, count: int) -> int:
    """The CRC-32 of ``count`` bytes at ``at``, read a chunk at a time into one buffer."""
    file.seek(at)
    buffer = memoryview(bytearray(min(_CHUNK, count)))
    crc = 0
    while count > 0:
        chunk = buffer[: min(_CHUNK, count)]
        if hasattr(file, "readinto"):
            read = file.readinto(chunk) or 0
        else:  # a file object of the caller's own, with read() only
            data = file.read(len(chunk))
            read = len(data)
            chunk[:read] = data
        if not read:  # the file shrank while it was checked
            raise _Bad(f"it changed size while it was read (at byte {at:,})")
        crc = zlib.crc32(chunk[:read], crc)
        at += read
        count -= read
    return crc


def _is_tensor(name: str) -> bool:
    """Whether a record holds a tensor's data: ``archive/data/7``.

    Examples:
        >>> _is_tensor("archive/data/7"), _is_tensor("archive/data.pkl")
        (True, False)
    """
    parts = name.split("/")
    return len(parts) >= 2 and parts[-2] == "data" and parts[-1].isdigit()


def _text(name: bytes) -> str:
    """A record's name as messages show it, quoted."""
    return repr(name.decode("utf-8", "replace"))


def _u16(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<H", data, at)[0])


def _u32(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<I", data, at)[0])


def _u64(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<Q", data, at)[0])
