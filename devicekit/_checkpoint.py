"""Loading checkpoints onto the device at hand: `load()`.

When ``torch.load`` fails, its error rarely says what is wrong with the file:
random bytes, a JSON file or a safetensors file under ``weights_only=True``
all read as "Weights only load failed ... re-running with weights_only=False
will likely succeed", advice that is wrong (the file is no checkpoint at all)
and unsafe. So after a failure devicekit reads the file's first bytes, which
tell torch's two formats (a zip archive; the legacy pickle, which starts with
torch's magic number) from everything else, and says which it is:

- not torch's format: always a `CheckpointError` that names what the file
  looks like (empty, safetensors, NumPy, gzip, a plain pickle) and how to load
  it, or, where its few bytes are the start of torch's own first bytes, that it
  is cut short;
- torch's zip format: the archive's own directory and CRC-32s say whether it
  is cut short or damaged (`check_archive`, which torch's reader never does),
  whatever error torch met first (an ``OSError`` from a seek the damage
  caused, a ``weights_only`` refusal of a flipped opcode); where the archive
  is whole, and for the legacy format, a `CheckpointError` ("cut short or
  damaged") only where torch's error is one its readers raise on bad bytes;
- a class the file names that this program lacks (one of the saving script's
  ``__main__``): torch's error, of its own type, said again with the class
  and the fix (`missing_class`).

An error raised in the user's own code (a ``__setstate__``), a
``weights_only`` refusal of a whole file, a device or out-of-memory error,
and an ``OSError`` of a whole file (``EIO``) stay torch's own, unchanged.
Nothing of this runs when the load succeeds.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import struct
from collections.abc import Iterator
from typing import IO, Any

import torch

from ._accelerators import try_gpu
from ._checkpointargs import (
    MMAP_LEGACY,
    check_keywords,
    check_mmap,
    check_pickle_module,
    check_seekable,
    legacy_mmap,
    not_a_file,
    path_shown,
    too_long,
)
from ._checkpointcheck import check_loaded, inflated_note, out_of_memory
from ._checkpointclass import missing_class
from ._checkpointdamage import damaged, told, torch_said
from ._checkpointsafe import load_safetensors
from ._devices import DeviceLike, resolve_device
from ._errors import CheckpointError, add_note
from ._frames import is_user
from ._keywords import suggest_keywords
from ._options import check_path
from ._shortrepr import got
from ._ziparchive import Damage, check_archive

__all__ = ["load"]

# torch.save's two formats: a zip archive (the default since torch 1.6), and before
# it a pickle that starts with torch's magic number (binary, or as text in protocol 0/1).
_ZIP = b"PK\x03\x04"
_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_MAGIC = _MAGIC_NUMBER.to_bytes(10, "little")
_MAGIC_TEXT = b"119547037146038801333356"
# The legacy format's first bytes: the magic number, pickled with the save's protocol.
_LEGACY_STARTS = tuple(
    pickle.dumps(_MAGIC_NUMBER, protocol=protocol)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1)
)
# Bytes read to tell the formats apart: a zip's first record name too (a .npz's
# "x.npy"; torch's "archive/data.pkl"), after the 30 bytes of its header.
_HEAD = 256


@suggest_keywords
def load(
    path: str | os.PathLike[str] | IO[bytes],
    device: DeviceLike | None = None,
    *,
    verify: bool = False,
    **kwargs: Any,
) -> Any:
    """``torch.load`` onto ``device``, whatever device the checkpoint was saved from.

    A checkpoint saved on ``cuda:1`` loads on a CPU-only or one-GPU machine:
    every tensor is mapped to ``device``. ``weights_only=True`` is the default,
    so loading never runs code from the file; pass ``weights_only=False`` only
    for files you trust.

    A safetensors file (told by its first bytes, whatever its name) is
    loaded with the ``safetensors`` package, onto ``device``. A file that is
    not a checkpoint gets an error that says what it is instead: empty, cut
    short or damaged, or another format (NumPy, gzip, a plain pickle), with
    how to load that. A checkpoint saved from
    tensors on the meta device (shapes, no values) is refused unless
    ``device`` is meta.

    What is detected: a file torch cannot read, always (from its first
    bytes, and for torch's zip format the archive's directory and the
    CRC-32 of every record but the tensors'). What is not, unless
    ``verify=True``: bytes changed inside a tensor's data, which load
    without an error and give wrong values. ``verify=True`` checks the
    CRC-32 of every record after the load, at about the cost of the load
    itself from the page cache. Never checked: a legacy-format file (no
    CRC-32s), records saved without CRC-32s
    (``torch.utils.serialization.config.save.compute_crc32 = False``) and
    compressed records (not torch.save's).

    Args:
        path: The file to load: a path, or a binary file object with
            ``read()`` and ``seek()`` (opened with ``"rb"``, not ``"r"``) that
            can seek (not a pipe: pass ``io.BytesIO(f.read())`` for one).
        device: Where the tensors go, a [`DeviceLike`][devicekit.DeviceLike].
            Default: [`try_gpu()`][devicekit.try_gpu].
        verify: Whether to check, after a load that succeeds, the CRC-32 of
            every record of a zip-format checkpoint (the whole file read
            again, ``mmap=True`` or not), and refuse a damaged one.
        **kwargs: Passed to ``torch.load`` (``weights_only``, ``mmap``...).
            ``map_location`` may replace ``device``: a device string or
            ``torch.device`` is checked as ``device`` is, a dict or a function
            goes to torch as it is, and ``None`` means "not given" (the
            tensors go to ``try_gpu()``, never back to the device they were
            saved from). ``weights_only`` and ``mmap`` must be True, False
            or None. With a dict or a function, tensors saved from meta
            come back on meta (torch never maps them), unrefused. A
            ``pickle_module`` of your own needs ``weights_only=False``.

    Returns:
        What ``torch.load`` returns, with its tensors on ``device``.

    Raises:
        TypeError: ``path`` is neither a path nor a binary file (or is a
            file opened in text mode, or one that cannot seek), a keyword
            is one neither ``torch.load`` nor its unpickler takes (a typo
            such as ``maplocation``), both ``device`` and ``map_location``
            were given, ``map_location`` is of no type torch takes,
            ``weights_only`` or ``mmap`` is not True, False or None, or
            ``verify`` is not True or False.
        ValueError: A ``pickle_module`` with ``weights_only=True`` (the
            default), or ``mmap=True`` with a file object.
        DeviceNotFoundError: This torch build or machine has no such device.
        CheckpointError: The file is not one ``torch.save`` wrote (empty,
            another format, a safetensors file without the ``safetensors``
            package installed), or is one cut short or damaged, or a file object
            stands past the start of its checkpoint; the message says which,
            and torch's own error is its cause. Also, after a load that
            succeeded: the checkpoint holds tensors saved from the meta
            device and ``device`` is not meta (the message names some), or,
            with ``verify=True``, a record fails its CRC-32 (the message
            names it, and the tensors that hold it).
        pickle.UnpicklingError: With ``weights_only=True``, a checkpoint
            that holds objects other than tensors and plain data (torch's
            message lists them, and how to allow them; where this program
            lacks the class as well, devicekit's says so and how to give it).
        AttributeError: With ``weights_only=False``, the checkpoint holds an
            object of a class this program lacks, such as one the saving
            script defined in its ``__main__`` (``ModuleNotFoundError``: a
            class from a module this program cannot import); the message
            names the class and how to give it.
        FileNotFoundError: No file at ``path``, or ``path`` is empty
            (``IsADirectoryError``: a folder; ``NotADirectoryError``: a file
            as a folder, as in ``"sd.pt/"``).
        OSError: The file could not be read (``EIO``, ``EACCES``).
        MemoryError: The tensors do not fit in memory (``RuntimeError``
            from torch's CPU allocator, ``torch.OutOfMemoryError``); where
            the archive's records are compressed (not torch.save's), a note
            says how much they inflate to.

    Examples:
        >>> import io, torch, devicekit as dk
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> _ = buffer.seek(0)
        >>> dk.load(buffer, "cpu")
        {'w': tensor([1., 1.])}
        >>> dk.load(io.BytesIO(b'{"w": [1.0, 1.0]}'), "cpu")
        Traceback (most recent call last):
        ...
        devicekit.CheckpointError: load(path=the file): not a checkpoint torch.load can read: \
it was not written by torch.save (its first bytes are neither a zip archive nor torch's \
legacy format). Check the path
    """
    fix = "pass the checkpoint's path"
    if isinstance(path, (bytes, bytearray, memoryview)):
        fix = "pass io.BytesIO(data) for a checkpoint's bytes, or os.fsdecode(path) for a path"
    check_path(path, name="path", fix=fix, file_objects=True)
    if isinstance(path, io.TextIOBase):
        raise TypeError(
            "path is a file opened in text mode, but a checkpoint is binary; "
            "open it with open(path, 'rb'), or pass the path itself"
        )
    check_keywords(kwargs)
    map_location = _map_location(device, kwargs.pop("map_location", None))
    weights_only = kwargs.setdefault("weights_only", True)
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(
            f"weights_only must be True, False or None (torch's default), got "
            f"{got(weights_only)}; pass weights_only=False only for files you trust"
        )
    check_pickle_module(path, kwargs.get("pickle_module"), weights_only)
    check_mmap(path, kwargs.get("mmap"))
    if not isinstance(verify, bool):
        raise TypeError(
            f"verify must be True or False, got {got(verify)}; pass verify=True to check the "
            "CRC-32 of every record after the load"
        )
    check_seekable(path)
    start = _position(path)
    head = _head(path, start)
    if head is not None and _kind(head) == "safetensors":  # whatever its name: see there
        return load_safetensors(path, start, map_location, verify=verify)
    try:
        with _unrouted(path, mmap=bool(kwargs.get("mmap"))) as source:
            result = torch.load(source, map_location=map_location, **kwargs)
    except Exception as error:
        if out_of_memory(error):
            note = inflated_note(path, start)
            if note is not None:
                add_note(error, note)
        better = _explained(error, path, start, head, mmap=bool(kwargs.get("mmap")))
        if better is None:
            raise  # torch's own message says it best (weights_only refusals, device errors)
        # A CheckpointError keeps torch's error as its cause; the others say all it said.
        raise better from (error if isinstance(better, CheckpointError) else None)
    check_loaded(
        result, path, start, map_location, verify=verify, where=f"load(path={path_shown(path)}"
    )
    return result


# The errors torch raises on bytes it cannot read (its unpickler's, its readers'): a
# damaged length in a pickle asks for exabytes (MemoryError, OverflowError).
_UNREADABLE = (
    MemoryError,
    OverflowError,
    KeyError,
    EOFError,
    IndexError,
    pickle.UnpicklingError,
    RuntimeError,
    ValueError,
    struct.error,
)


def _explained(
    error: Exception, path: object, start: int | None, head: bytes | None, *, mmap: bool
) -> Exception | None:
    """The error ``load()`` raises instead of torch's ``error``; None to raise torch's own.

    ``head``: the file's first bytes, read before the load (`_head`).
    """
    if isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError)) or (
        isinstance(error, OSError) and error.errno == errno.ENAMETOOLONG
    ):
        return _path_error(error, path)
    if not isinstance(error, (OSError, AttributeError, ModuleNotFoundError, *_UNREADABLE)):
        return None
    if _raised_outside_torch(error):
        return None  # the file's own objects (a __setstate__) or a map_location function failed
    if mmap and str(error).startswith(MMAP_LEGACY) and (head is None or _kind(head) is None):
        return legacy_mmap(path)  # torch says so of any file not a zip: an empty one too
    # A zip archive's directory and CRC-32s tell damage apart from the rest: an OSError
    # from a seek that damage made torch compute ([Errno 22], a file cut short inside its
    # last records) from the disk's own (EIO); a flipped byte from a class that is missing.
    damage = _zip_damage(path, start, head)
    if damage is not None:
        return CheckpointError(_unreadable(path, told(error, damage)))
    if isinstance(error, OSError):
        return None
    whole = head is not None and head.startswith(_ZIP)  # checked: the names in it are as saved
    if isinstance(error, (AttributeError, ModuleNotFoundError)) or whole:  # or a refusal
        missing = missing_class(error)
        if missing is not None:
            refined = type(error)(f"load(path={path_shown(path)}): {missing}")
            if isinstance(error, ImportError) and isinstance(refined, ImportError):
                refined.name = error.name  # the module, as ModuleNotFoundError keeps it
            return refined
    why = _why_unreadable(error, head)
    if why is None:
        return None
    if start and head is not None and _kind(head) is not None:
        why = _misplaced(path, start) or f"{why} (read from byte {start}, where the file stood)"
    return CheckpointError(_unreadable(path, why))


def _path_error(error: OSError, path: object) -> OSError | None:
    """No file at ``path``, a folder, a file as a folder, a path too long; None: a file object."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    if error.errno == errno.ENAMETOOLONG:
        return OSError(error.errno, too_long(os.fspath(path)))
    return type(error)(not_a_file(os.fspath(path), error))


def _unreadable(path: object, why: str) -> str:
    """The message of a file ``load()`` cannot read: the path, then ``why``."""
    return f"load(path={path_shown(path)}): not a checkpoint torch.load can read{why}"


def _misplaced(path: object, start: int) -> str | None:
    """Why a file object read from ``start`` failed when it holds a checkpoint at byte 0."""
    head = _head(path, 0)
    try:
        path.seek(start)  # type: ignore[attr-defined]  # where it stood, as _head leaves it
    except (AttributeError, OSError, ValueError, TypeError):
        return None
    if head is None or _kind(head) is not None:
        return None
    return (
        f": the file object stands at byte {start}, and torch reads from where it stands, but "
        "the checkpoint starts at byte 0. Call file.seek(0) before load(file), or open the "
        "file again"
    )


def _map_location(device: DeviceLike | None, given: object) -> Any:
    """The ``map_location`` torch gets: from ``device``, or ``map_location`` checked."""
    if given is None:
        return try_gpu() if device is None else resolve_device(device)
    if device is not None:
        raise TypeError("load() takes device or map_location, not both; pass only device")
    if isinstance(given, (str, torch.device)):
        return resolve_device(given, name="map_location")
    if isinstance(given, dict) or callable(given):
        return given  # torch's own forms: {"cuda:1": "cpu"}, or a function of (storage, location)
    raise TypeError(
        "map_location must be a device (such as 'cpu' or 'cuda:0'), a dict of locations or a "
        f"function, got {got(given)}; pass device instead"
    )


@contextlib.contextmanager
def _unrouted(
    path: str | os.PathLike[str] | IO[bytes], *, mmap: bool
) -> Iterator[str | os.PathLike[str] | IO[bytes]]:
    """What torch.load reads: ``path``, or where it ends in ``.safetensors``, the file open.

    torch 2.13 hands a path so named to the safetensors package, whatever it
    holds (a safetensors file was loaded already: see `load_safetensors`), so a
    torch.save checkpoint misnamed so, or an empty or damaged file, raised
    safetensors' bare error. An open file is read by its bytes. Not with
    ``mmap``, which needs the path: that case is left to torch.
    """
    if (
        mmap
        or not isinstance(path, (str, os.PathLike))
        or not os.fspath(path).endswith(".safetensors")
    ):
        yield path
        return
    with open(path, "rb") as file:
        yield file


def _position(path: object) -> int | None:
    """Where a file object stands before torch reads it; 0 for a path; None if unknown."""
    if isinstance(path, (str, os.PathLike)):
        return 0
    try:
        return int(path.tell())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError, TypeError):
        return None


def _head(path: object, start: int | None) -> bytes | None:
    """The file's first bytes (from where torch began reading), or None if they cannot be read."""
    if start is None:
        return None
    try:
        if isinstance(path, (str, os.PathLike)):
            with open(path, "rb") as file:
                return file.read(_HEAD)
        path.seek(start)  # type: ignore[attr-defined]
        head = path.read(_HEAD)  # type: ignore[attr-defined]
        path.seek(start)  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError, TypeError):
        return None
    return head if isinstance(head, bytes) else None


def _kind(head: bytes) -> str | None:
    r"""What a file's first bytes say it is; None when they are torch.save's.

    "cut": all the file holds is the start of torch.save's first bytes (a zip
    archive's signature, the legacy format's magic number).

    Examples:
        >>> _kind(b""), _kind(b"\x93NUMPY\x01\x00"), _kind(b"PK\x03\x04...") is None
        ('empty', 'numpy', True)
        >>> _kind(b"PK\x03"), _kind(b"\x80\x02\x8a\x0al"), _kind(b"\x1f\x8b\x08\x08")
        ('cut', 'cut', 'gzip')
    """
    if head.startswith(_ZIP):
        return "npz" if _first_record(head).endswith(b".npy") else None
    if _MAGIC in head or _MAGIC_TEXT in head:
        return None
    if not head:
        return "empty"
    if any(start.startswith(head) for start in (_ZIP, *_LEGACY_STARTS)):
        return "cut"  # the whole file (a start is 29 bytes at most, under _HEAD)
    if head.startswith(b"\x93NUMPY"):
        return "numpy"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    # safetensors: an 8-byte little-endian header length, then the JSON header.
    if len(head) > 9 and head[8:10] == b'{"' and struct.unpack("<Q", head[:8])[0] < 2**30:
        return "safetensors"
    if head[:1] == b"\x80":  # a pickle's PROTO opcode
        return "pickle"
    return "other"


def _first_record(head: bytes) -> bytes:
    """The name of a zip archive's first record, from its local header; b"" if cut off."""
    size = int.from_bytes(head[26:28], "little")
    name = head[30 : 30 + size]
    return name if len(name) == size else b""


_KINDS = {
    "empty": "the file is empty (0 bytes): a save that never ran or was stopped at once. "
    "Save it again",
    "numpy": "it is a NumPy .npy file, not one torch.save wrote; load it with "
    "torch.from_numpy(numpy.load(path))",
    "npz": "it is a NumPy .npz archive (a zip of .npy arrays), not one torch.save wrote; load "
    "it with numpy.load(path), and each array with torch.from_numpy",
    "gzip": "it is gzip-compressed (a .gz file); if a checkpoint is inside, load it with "
    "dk.load(gzip.open(path, 'rb'))",
    "safetensors": "it is a safetensors file, not one torch.save wrote; load it with "
    "safetensors.torch.load_file(path, device='cpu') (or another device)",
    "pickle": "it is a pickle, but not one torch.save wrote (no torch header); if you trust "
    "it, load it with pickle.load",
    "other": "it was not written by torch.save (its first bytes are neither a zip archive nor "
    "torch's legacy format). Check the path",
}


def _why_unreadable(error: BaseException, head: bytes | None) -> str | None:
    """What is wrong with the file, from its first bytes and torch's words; None: not its fault."""
    kind = None if head is None else _kind(head)
    if kind == "cut" and head is not None:  # said as a zip archive cut short is (`told`)
        size = f"{len(head)} byte{'s' if len(head) > 1 else ''}"
        what = "a zip archive's signature" if _ZIP.startswith(head) else "its magic number"
        detail = f"it ends after {size}, inside the first bytes torch.save writes ({what})"
        return told(error, Damage(cut=True, detail=detail))
    if kind is not None:
        return f": {_KINDS[kind]}"
    if isinstance(error, (AttributeError, ModuleNotFoundError)) or not damaged(error, head):
        return None
    return (
        f" ({torch_said(error)}): it is cut short or "
        "damaged (a writer killed or a disk full mid-save), or not written by torch.save. "
        "Check the path, and save it again if it was cut short"
    )


def _zip_damage(path: object, start: int | None, head: bytes | None) -> Damage | None:
    """What `check_archive` finds wrong with a file in torch's zip format; None if nothing.

    None too where the file cannot be read (an ``OSError``: the disk's, not the file's fault).
    """
    if start is None or head is None or not head.startswith(_ZIP) or _kind(head) is not None:
        return None  # not a zip, or a .npz: what it is says more than its damage
    try:
        return check_archive(path, start)  # type: ignore[arg-type]  # a path or file object
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _raised_outside_torch(error: BaseException) -> bool:
    """Whether the innermost Python frame of ``error`` is outside torch (and devicekit)."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return is_user(traceback.tb_frame.f_code.co_filename)
