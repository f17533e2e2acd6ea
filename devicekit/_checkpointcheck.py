"""What ``load()`` checks of a checkpoint torch read without an error, and of a memory error.

Three things a successful ``torch.load`` does not say:

- **Tensors saved from the meta device.** A meta tensor has a shape and no
  values, so ``torch.save`` writes no record for it, and ``torch.load``
  rebuilds it on meta whatever ``map_location`` says (``map_location`` is
  called once per *stored* record, and a meta tensor has none). The failure
  shows only later, in ``load_state_dict`` (*"Cannot copy out of meta
  tensor; no data!"*). The pickle names the function that rebuilds them,
  ``torch._utils._rebuild_meta_tensor_no_storage``; `_meta_saved` looks for
  that name in the archive's ``data.pkl`` (its first record: a few reads of
  the directory, under a millisecond), and only then walks the result for
  the tensors' names. A legacy-format file has no directory: its result is
  walked (dicts, lists, tuples).
- **Damage in a tensor's data** (``verify=True``): `_verify` checks the
  CRC-32 of every record, the tensors' too, and maps a damaged one to the
  tensors it holds. It costs about as much as the load itself from the page
  cache (see docs/benchmarks.md), so it runs only when asked.
- **A compressed archive** (not one torch.save wrote) that expands past the
  memory at hand: `inflated_note` says how much it claims, once the load
  has failed with a memory error.
"""

from __future__ import annotations

import ctypes
import os
import warnings
import zlib
from collections.abc import Iterator
from typing import IO

import torch

from ._errors import CheckpointError
from ._format import plural
from ._frames import caller_stacklevel
from ._ziparchive import check_archive, first_record, inflated, unchecked

__all__ = ["check_loaded", "inflated_note", "not_verified", "out_of_memory"]

_META = b"_rebuild_meta_tensor_no_storage"  # what the pickle calls to rebuild a meta tensor
_NAMED = 5  # names a message lists
_WALKED = 100_000  # containers' entries walked at most, for names only


def _meta_saved(
    result: object, file: str | os.PathLike[str] | IO[bytes], start: int
) -> list[str] | None:
    """The names of tensors in ``result`` saved from meta; None if the file holds none.

    The list may be empty: meta tensors inside objects other than dicts,
    lists and tuples are found, not named.
    """
    pickled = first_record(file, start)
    if pickled is not None and _META not in pickled:
        return None
    names = [name for name, tensor in _tensors(result) if tensor.is_meta]
    if pickled is None and not names:
        return None  # legacy format (or unreadable): nothing on meta among what was walked
    return names


def _meta_message(where: str, names: list[str], device: torch.device) -> str:
    """Why ``load()`` refuses a checkpoint of meta tensors for ``device``, and the fixes."""
    shown = ", ".join(names[:_NAMED]) + (
        f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    )
    which = f" ({shown})" if shown else ""
    return (
        f"{where}: the checkpoint was saved from tensors on the meta device{which}, which "
        f"have a shape and no values, so the file has none to put on {device}. Save it "
        "again from real weights: after model.to_empty(device=...) and initialising them, or "
        "after loading them; or, if a skeleton of shapes is what you want, load it with "
        "device='meta'"
    )


def _verify(
    result: object, file: str | os.PathLike[str] | IO[bytes], start: int, where: str
) -> str | None:
    """Why ``result``'s file is damaged, from the CRC-32 of every record; None if it is whole.

    Raises:
        OSError: The file could not be read again.
    """
    damage = check_archive(file, start, tensors=True)
    if damage is None:
        return None
    if damage.cut:
        return (
            f"{where}: the checkpoint is cut short: {damage.detail}. Save it again, or copy "
            "it again from a whole one"
        )
    holds = ""
    if damage.record is not None and damage.crc is not None:
        names = _holding(result, damage.record, damage.crc)
        if names:
            holds = f" (it holds {', '.join(names[:_NAMED])})"
    return (
        f"{where}: the checkpoint is damaged: {damage.detail}{holds}, so bytes in it changed "
        "after it was saved (a disk, memory or copy error), and the values loaded from it "
        "are wrong. Copy it again from a good copy, or save it again"
    )


def check_loaded(
    result: object,
    path: str | os.PathLike[str] | IO[bytes],
    start: int | None,
    map_location: object,
    *,
    verify: bool,
    where: str,
) -> None:
    """Refuse what torch loaded without an error: tensors saved from meta, damage asked about.

    ``where`` begins the message: ``load(path=...)``.

    Raises:
        CheckpointError: What is wrong, and the fix.
    """
    if start is None:
        if verify:  # asked for: say it did not happen
            not_verified(
                where, "the file object cannot say where it stood, so it cannot be read again"
            )
        return  # a file object that cannot say where it stood: not read again
    if isinstance(map_location, torch.device) and map_location.type != "meta":
        # A dict or a function of the caller's own is theirs: torch maps no meta tensor.
        names = _meta_saved(result, path, start)
        if names is not None:
            raise CheckpointError(_meta_message(f"{where})", names, map_location))
    if verify:
        if not _is_zip(path, start):
            not_verified(where, "it is in torch's legacy format, which keeps no CRC-32s")
            return
        damage = _verify(result, path, start, f"{where}, verify=True)")
        if damage is not None:
            raise CheckpointError(damage)
        skipped = unchecked(path, start)
        if skipped:
            not_verified(
                where,
                f"{plural(skipped, 'record')} of it keep no CRC-32 (saved with compute_crc32 off) "
                "or are compressed (not torch.save's), so those were not checked; the rest were",
            )


def not_verified(where: str, why: str) -> None:
    """Warn that ``verify=True`` could not check (all of) the file: it was asked for."""
    warnings.warn(f"{where}, verify=True): {why}", RuntimeWarning, stacklevel=caller_stacklevel())


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says memory ran out: Python's, CUDA's or torch's CPU allocator's."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _is_zip(file: str | os.PathLike[str] | IO[bytes], start: int) -> bool:
    """Whether ``file`` holds a zip archive from byte ``start`` (torch's format, not legacy)."""
    try:
        if isinstance(file, (str, os.PathLike)):
            with open(file, "rb") as opened:
                opened.seek(start)
                return opened.read(4) == b"PK\x03\x04"
        stood = file.tell()
        file.seek(start)
        head = file.read(4)
        file.seek(stood)
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    return head == b"PK\x03\x04"


def inflated_note(file: str | os.PathLike[str] | IO[bytes], start: int | None) -> str | None:
    """What a memory error loading a compressed archive comes from; None if not compressed."""
    if start is None:
        return None
    try:
        sizes = inflated(file, start)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    if sizes is None:
        return None
    stored, full = sizes
    return (
        f"devicekit.load: this archive's records are compressed, which torch.save never does "
        f"(another zip tool wrote it): {stored:,} bytes in the file inflate to {full:,} "
        f"({full / max(stored, 1):,.0f} times as many), all of which torch.load allocates. "
        "Load it where that much memory is free, and only if you trust it (a file that "
        "claims far more than its size is how a zip bomb looks); or get the file as "
        "torch.save wrote it"
    )


def _tensors(result: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``result``'s dicts, lists and tuples, with its key path."""
    stack: list[tuple[str, object]] = [(prefix, result)]
    walked = 0
    while stack and walked < _WALKED:
        name, value = stack.pop()
        walked += 1
        if isinstance(value, torch.Tensor):
            yield name or "the result", value
        elif isinstance(value, dict):
            stack.extend(
                (f"{name}.{key}" if name else str(key), item)
                for key, item in reversed(value.items())
            )
        elif isinstance(value, (list, tuple)):
            stack.extend(
                (f"{name}[{index}]", item) for index, item in reversed(list(enumerate(value)))
            )


def _holding(result: object, record: str, crc: int) -> list[str]:
    """The names of the tensors whose storage holds ``record``'s bytes (whose CRC-32 is ``crc``)."""
    if not record.rsplit("/", 1)[-1].isdigit():
        return []
    names = []
    crcs: dict[tuple[str, int], int] = {}  # a storage several tensors share: checked once
    for name, tensor in _tensors(result):
        if tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in crcs:
            crcs[key] = _crc_of(storage) if storage.nbytes() else -1
        if crcs[key] == crc:
            names.append(name)
    return names


def _crc_of(storage: torch.UntypedStorage) -> int:
    """The CRC-32 of a storage's bytes (copied to the CPU first, if elsewhere)."""
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).cpu()
    return zlib.crc32((ctypes.c_char * whole.numel()).from_address(whole.data_ptr()))
