"""Whether a checkpoint in torch's format that torch failed to read is cut short or damaged.

``torch.save`` writes a zip archive of stored (uncompressed) records: the
pickle ``data.pkl``, a few small ones (``version``, ``byteorder``) and one per
tensor storage (``data/0``, ``data/1``...). Its directory comes last, after
every record, and gives each record's offset, size and CRC-32. torch's reader
trusts that directory and checks no CRC-32, so a damaged file fails with
whatever error its reader or unpickler meets first: a file cut short inside
its last records gets ``OSError: [Errno 22] Invalid argument`` (a seek to a
negative offset; ``ValueError: negative seek value`` from a ``BytesIO``), and
a flipped byte in ``data.pkl`` gets ``Unsupported operand 151``, with the
advice to turn ``weights_only`` off, or ``Trying to resize storage that is
not resizable``.

So after such a failure `check_archive` reads the directory itself. Every
offset is checked against the file's size before it is read, so an
``OSError`` while reading is the disk's or the system's (``EIO``), never one
the damage caused: it propagates, and ``load()`` keeps torch's error. Then it
checks the CRC-32 of every record but the tensors' data, which is the bulk of
the file: a flipped byte there changes a value but never makes a load fail,
so it cannot explain a failure. Checking every record on every load would
cost about 200 ms on a 1 GB checkpoint that loads in about 490 ms from the
page cache (zlib's CRC-32 runs at 5.3 GB/s here), and would read all of a
file that ``mmap=True`` maps in 1.5 ms; the directory and the small records
take under 3 ms (37 ms for 10,000 tensors), once a load has failed.

Where the archive is whole (and for torch's legacy format, which has no
directory), `damaged` tells from torch's error alone whether it means bad
bytes.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pickletools
import re
import struct
import zlib
from typing import IO

import torch

from ._format import shorten

__all__ = ["Damage", "check_archive", "damaged", "told", "torch_said"]

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
    """

    cut: bool
    detail: str


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: bytes
    offset: int  # of the record's own header, from the archive's start
    size: int  # stored size
    crc: int
    method: int


class _Bad(Exception):
    """The archive contradicts itself; the message says how (internal: becomes a Damage)."""


def check_archive(file: str | os.PathLike[str] | IO[bytes], start: int = 0) -> Damage | None:
    """What is wrong with the zip archive in ``file`` (from byte ``start``); None if nothing.

    A file object is left where it stood.

    Args:
        file: A path, or a binary file object with ``read()`` and ``seek()``.
        start: Where the archive starts in ``file`` (a file object read from there).

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
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as opened:
            return _check(opened, start)
    stood = file.tell()
    try:
        return _check(file, start)
    finally:
        file.seek(stood)


def _check(file: IO[bytes], start: int) -> Damage | None:
    size = file.seek(0, io.SEEK_END) - start
    if size < 0:
        return None  # nothing there to check
    try:
        tail_start = max(0, size - _TAIL)
        tail = _read(file, start + tail_start, size - tail_start)
        end = _find_end(tail)
        if end is None:
            return Damage(
                cut=True,
                detail=f"its {size:,} bytes end without the directory every zip archive ends with",
            )
        for entry in _directory(file, start, tail, tail_start + end, size):
            _check_entry(file, start, entry, size)
    except _Bad as bad:
        return Damage(cut=False, detail=str(bad))
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


def _directory(file: IO[bytes], start: int, tail: bytes, end: int, size: int) -> list[_Entry]:
    """The directory's entries, as the end record (or zip64's) says where to find them."""
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
        entries.append(_Entry(name=name, offset=offset, size=size, crc=crc, method=method))
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


def _check_entry(file: IO[bytes], start: int, entry: _Entry, size: int) -> None:
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
    if entry.method != _STORED or _is_tensor(entry.name.decode("utf-8", "replace")):
        return
    crc = 0
    for at in range(data, data + entry.size, _CHUNK):
        crc = zlib.crc32(_read(file, start + at, min(_CHUNK, data + entry.size - at)), crc)
    if crc != entry.crc:
        raise _Bad(
            f"its record {name} does not match the CRC-32 checksum its directory keeps for it"
        )


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


# What torch's readers say about bad bytes in a file of its own format. A RuntimeError
# saying anything else (a device that does not exist, out of memory) is not the file's fault.
_DAMAGED = (
    "PytorchStreamReader",
    "inline_container",
    "unexpected EOF",
    "corrupt",
    "wrong byte size",
    "record size",
    "hasRecord",
    "magic number",
    "protocol version",
    "unsupported pickle protocol",
)


def told(error: BaseException, damage: Damage) -> str:
    """The message's end for a zip archive cut short or damaged, with torch's error in brief."""
    if damage.cut:
        return (
            f" ({torch_said(error)}): it is cut short: {damage.detail}, so its save stopped "
            "part way (a writer killed, a disk full, a copy interrupted). Save it again, or "
            "copy it again from a whole one"
        )
    return (
        f" ({torch_said(error)}): it is damaged: {damage.detail}, so bytes in it changed "
        "after it was saved (a disk, memory or copy error). Copy it again from a good copy, "
        "or save it again"
    )


def torch_said(error: BaseException) -> str:
    r"""Torch's error in a few words, for the message: its type, then its first line.

    Of a ``weights_only`` refusal, the unpickler's own words, not torch's advice.

    Examples:
        >>> torch_said(EOFError()), torch_said(struct.error("unpack requires 8 bytes"))
        ('EOFError: the data ends early', 'struct.error: unpack requires 8 bytes')
        >>> torch_said(pickle.UnpicklingError("Weights only load failed. Re-running ... "
        ...     "WeightsUnpickler error: \n\nUnsupported operand 151\n\nCheck the docs"))
        'UnpicklingError: Unsupported operand 151'
    """
    kind = "struct.error" if isinstance(error, struct.error) else type(error).__name__
    text = str(error).strip()
    if _WEIGHTS_ONLY in text:
        text = text.partition(_WEIGHTS_ONLY)[2].strip()
    if text:
        return f"{kind}: {shorten(text.splitlines()[0], 120)}"
    return f"{kind}: the data ends early" if isinstance(error, EOFError) else kind


# Pickle's opcodes, by their byte (as a character), with the protocol that brought each.
_OPCODES = {opcode.code: opcode for opcode in pickletools.opcodes}

# Where torch's weights_only refusal, after its advice, says what its unpickler met.
_WEIGHTS_ONLY = "WeightsUnpickler error:"


def damaged(error: BaseException, head: bytes | None = None) -> bool:
    r"""Whether torch's error, on a file in torch's format (first bytes ``head``), means bad bytes.

    A ``weights_only`` refusal does only where the opcode it names is none, or one
    newer than the pickle protocol the file declares: what a flipped byte makes.

    Examples:
        >>> refusal = pickle.UnpicklingError("Weights only load failed: Unsupported operand 151")
        >>> damaged(refusal, b"\x80\x02\x8a\x0al"), damaged(refusal, b"\x80\x05\x95")
        (True, False)
    """
    if isinstance(error, pickle.UnpicklingError):
        text = str(error)
        if not text.startswith("Weights only load failed"):
            return True
        found = re.search(r"Unsupported operand (\d+)", text)
        if found is None or head is None:
            return False
        opcode = _OPCODES.get(chr(int(found.group(1))))
        protocol = head[1] if head[:1] == b"\x80" and len(head) > 1 else 1  # PROTO, or text
        return opcode is None or opcode.proto > protocol
    if isinstance(error, MemoryError):
        return False  # the machine's, unless the archive's CRC-32s show damage
    if isinstance(error, (RuntimeError, ValueError)) and not isinstance(
        error, torch.OutOfMemoryError
    ):
        text = str(error)
        return isinstance(error, UnicodeDecodeError) or any(words in text for words in _DAMAGED)
    return True  # KeyError, EOFError, IndexError, struct.error: the unpickler read bad bytes
