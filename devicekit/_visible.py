"""``CUDA_VISIBLE_DEVICES``: read it the way CUDA does, and check a value before it is set.

CUDA's rules are lenient and easy to trip over: it stops at the first entry it
cannot use, reads a leading integer, and hides every GPU when one is listed
twice. [`parse_visible_devices()`][devicekit.parse_visible_devices] applies
them, `misreading` says where a value departs from what was written, and
`normalize_devices` refuses, naming the entry and the fix, a value that CUDA
would read differently, or that names no GPU here. The variable is read once,
when the CUDA driver starts in a process; `cuda_started` says whether it has.
Setting the variable for a block is `_scopedenv`'s.
"""

from __future__ import annotations

import ctypes
import operator
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, NoReturn

import torch

from . import _nvml
from ._format import plural
from ._options import got, short_repr

__all__ = [
    "ENV_VAR",
    "Misreading",
    "cuda_started",
    "misreading",
    "normalize_devices",
    "parse_visible_devices",
    "read_as",
    "reads_as_written",
    "uuid_matches",
]

ENV_VAR = "CUDA_VISIBLE_DEVICES"

# strtoul-like: a leading integer counts ("3a" is 3, "1gpu2" is 1).
_LEADING_INT = re.compile(r"[+-]?[0-9]+")
_UUID_PREFIXES = ("GPU-", "MIG-")
# CUDA accepts unique prefixes of a UUID, so only the start is fixed.
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F][0-9a-fA-F-]*")
# MIG-<uuid> (R470+ drivers) or the older MIG-GPU-<uuid>/<gi>/<ci>.
_MIG_UUID = re.compile(r"MIG-(?:[0-9a-fA-F][0-9a-fA-F-]*|GPU-[0-9a-fA-F-]+/\d+/\d+)")
_CUDA_ERROR_NOT_INITIALIZED = 3
# CUDA's rules, in the words every message about them uses (visible_devices' errors,
# and the finding that status, doctor and the CLI show).
_DUPLICATE = "any duplicate makes CUDA hide every GPU"
_STOPS = "CUDA stops reading at the first entry it cannot use and ignores the rest"
# Typed alias: torch leaves is_initialized unannotated.
torch_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized


def parse_visible_devices(value: str | None = None) -> list[int | str] | None:
    """Read a ``CUDA_VISIBLE_DEVICES`` value the way CUDA and torch do.

    The rules are lenient and easy to trip over, which is why this function
    exists: parsing stops at the first invalid entry (``"0,x,1"`` is ``[0]``),
    a leading integer counts (``"3a"`` is 3), whitespace around entries is
    ignored, a negative entry ends the list (``"-1"`` hides every GPU), and any
    duplicate hides *every* GPU (``"0,0"`` is ``[]``). Entries that start with
    ``GPU-`` or ``MIG-`` are UUIDs (or unique UUID prefixes) and are kept as
    strings; the first entry decides which kind the list is.

    Args:
        value: The text to parse. Default: the current environment's
            ``CUDA_VISIBLE_DEVICES``.

    Returns:
        None when the variable is unset (every GPU is visible), else the
        entries CUDA will use, in order; ``[]`` hides every GPU.

    Raises:
        TypeError: ``value`` is neither a string nor None.

    Examples:
        >>> import devicekit as dk
        >>> dk.parse_visible_devices("1, 0")
        [1, 0]
        >>> dk.parse_visible_devices("2,0,2")  # a duplicate hides everything
        []
        >>> dk.parse_visible_devices("0,1a,oops,3")
        [0, 1]
    """
    if value is None:
        value = os.environ.get(ENV_VAR)
        if value is None:
            return None
    if not isinstance(value, str):
        raise TypeError(f"parse_visible_devices() expects a string or None, got {got(value)}")
    return _read(value)[0]


class Misreading(NamedTuple):
    """How CUDA's reading of a ``CUDA_VISIBLE_DEVICES`` value departs from what was written.

    Attributes:
        why: The rule that makes the difference, naming the entry.
        fix: What to write instead.
    """

    why: str
    fix: str


def misreading(value: str) -> Misreading | None:
    """Why CUDA reads ``value`` differently than written, and the fix; None if as written.

    Examples:
        >>> misreading("0,1,0")
        Misreading(why='0 is listed twice, and any duplicate makes CUDA hide every GPU', \
fix='list each GPU once, such as CUDA_VISIBLE_DEVICES=0,1')
        >>> misreading("0,x,1").why
        "'x' is not a device index, and CUDA stops reading at the first entry it cannot use and \
ignores the rest"
        >>> misreading("3a,1").why
        "'3a' is read as 3"
        >>> misreading("1, 0") is None
        True
    """
    if reads_as_written(value):
        return None
    entries, notes = _read(value)
    why = "; ".join(notes) if value.strip() else "an empty value lists no GPU"
    if entries:
        fix = (
            "write only valid, distinct indices or UUIDs of one kind; "
            f"as written, CUDA uses {ENV_VAR}={read_as(value)}"
        )
        return Misreading(why, fix)
    # Nothing read, yet the first entry was valid: a duplicate hid everything.
    distinct = read_as(",".join(dict.fromkeys(entry.strip() for entry in value.split(","))))
    if distinct:
        return Misreading(why, f"list each GPU once, such as {ENV_VAR}={distinct}")
    return Misreading(why, f"unset {ENV_VAR}, or list the GPUs to use, such as {ENV_VAR}=0")


def _read(value: str) -> tuple[list[int | str], list[str]]:
    """CUDA's entries for ``value``, and a note for each place its reading departs from the text."""
    entries = [entry.strip() for entry in value.split(",")]
    for prefix in _UUID_PREFIXES:
        if entries[0].startswith(prefix):
            return _parse_uuids(entries, prefix)
    return _parse_indices(entries)


def reads_as_written(value: str) -> bool:
    """Whether CUDA reads ``value`` entry for entry as written (whitespace aside).

    False when CUDA drops entries after a bad one, or hides everything.
    """
    parsed = parse_visible_devices(value) or []
    return [str(entry) for entry in parsed] == [entry.strip() for entry in value.split(",")]


def read_as(value: str) -> str:
    """What CUDA reads from ``value``, written back as a value: ``"0,x,1"`` -> ``"0"``.

    Examples:
        >>> read_as("0,x,1"), read_as("2, 0"), read_as("0,0")
        ('0', '2,0', '')
    """
    return ",".join(str(entry) for entry in parse_visible_devices(value) or [])


def _named(entry: str) -> str:
    return short_repr(entry) if entry else "an empty entry"


def _parse_uuids(entries: list[str], prefix: str) -> tuple[list[int | str], list[str]]:
    parsed: list[int | str] = []
    for entry in entries:
        if entry in parsed:
            return [], [f"{short_repr(entry)} is listed twice, and {_DUPLICATE}"]
        if not entry.startswith(prefix):
            return parsed, [
                f"{_named(entry)} is not a {prefix} UUID like the first entry, and {_STOPS}"
            ]
        parsed.append(entry)
    return parsed, []


def _parse_indices(entries: list[str]) -> tuple[list[int | str], list[str]]:
    parsed: list[int | str] = []
    notes: list[str] = []
    for entry in entries:
        match = _LEADING_INT.match(entry)
        if match is None:
            return parsed, [*notes, f"{_named(entry)} is not a device index, and {_STOPS}"]
        index = int(match.group())
        if index in parsed:
            return [], [f"{index} is listed twice, and {_DUPLICATE}"]
        if index < 0:
            return parsed, [*notes, f"the negative entry {short_repr(entry)} ends the list"]
        if str(index) != entry:
            notes.append(f"{short_repr(entry)} is read as {short_repr(index)}")
        parsed.append(index)
    return parsed, notes


def cuda_started() -> str | None:
    """Say why ``CUDA_VISIBLE_DEVICES`` can no longer take effect in this process, or None.

    Two things can have started the CUDA driver: torch's own initialization,
    and a bare driver call such as ``torch.cuda.is_available()`` (unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), which starts the driver without
    torch counting itself initialized. The second is found by asking the
    already-loaded driver library whether it was initialized; when
    ``libcuda`` is not loaded, it cannot have been.
    """
    if torch_cuda_initialized():
        return "torch has initialized CUDA in this process"
    if _driver_started():
        return (
            "the CUDA driver was started in this process, for example by "
            "torch.cuda.is_available(), even though torch has not initialized CUDA"
        )
    return None


def _driver_started() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        # RTLD_NOLOAD finds the library only if it is already in this process.
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return bool(driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED)


_EXPECTED = (
    "an int, a comma-separated string, a sequence of ints or 'GPU-'/'MIG-' UUIDs, "
    "[] to hide every GPU, or None to unset the variable"
)


def normalize_devices(devices: object) -> list[int | str]:
    """Check a `visible_devices` argument whole and return its entries; change nothing."""
    raw: list[object]
    if isinstance(devices, str):
        raw = [] if not devices.strip() else list(devices.split(","))
    elif isinstance(devices, (bool, bytes, dict)):
        raise TypeError(f"visible_devices() expects {_EXPECTED}; got {got(devices)}")
    elif hasattr(devices, "__index__"):
        raw = [devices]
    elif isinstance(devices, Iterable):
        raw = list(devices)
    else:
        raise TypeError(f"visible_devices() expects {_EXPECTED}; got {got(devices)}")
    parsed = [_parse_entry(entry, devices) for entry in raw]
    _check_consistent(parsed, devices)
    _check_on_machine(parsed, devices)
    return parsed


def _check_on_machine(parsed: list[int | str], devices: object) -> None:
    """Refuse entries CUDA will not find, where NVML lists the GPUs (else accept them)."""
    if not parsed or not _nvml.nvml_available():
        return
    _check_indices(parsed, devices)
    _check_gpu_uuids(parsed, devices)


def _check_indices(parsed: list[int | str], devices: object) -> None:
    indices = [entry for entry in parsed if isinstance(entry, int)]
    if not indices:
        return
    count = len(_nvml.physical_gpus())
    beyond = next((index for index in indices if index >= count), None)
    if beyond is not None:
        have = f"{plural(count, 'GPU')} (0 to {count - 1})" if count else "no GPU"
        raise ValueError(
            f"entry {short_repr(beyond)} {_where(devices)}: this machine has {have}, and CUDA "
            f"hides every GPU from an entry that does not exist; list indices below {count} "
            "(nvidia-smi -L lists them)"
        )


def uuid_matches(entry: str, uuids: Sequence[str | None]) -> list[int]:
    """The positions of the UUIDs that ``entry`` is a prefix of, compared as torch does.

    torch (``torch.cuda.device_count()`` before CUDA starts) and devicekit's
    own mapping both read ``CUDA_VISIBLE_DEVICES`` UUIDs this way: a prefix, case
    and all. One match places the entry; none or several stop the list.

    Examples:
        >>> uuid_matches("GPU-5b", ["GPU-5bd6", "GPU-5bf0", None])
        [0, 1]
        >>> uuid_matches("GPU-5BD6", ["GPU-5bd6"])
        []
    """
    return [index for index, uuid in enumerate(uuids) if uuid and uuid.startswith(entry)]


def _check_gpu_uuids(parsed: list[int | str], devices: object) -> None:
    """Refuse a ``GPU-`` entry that names no GPU, several, or one another entry names.

    MIG UUIDs are not checked: drivers name them in two forms, and NVML may
    list the other one.
    """
    entries = [entry for entry in parsed if isinstance(entry, str) and entry.startswith("GPU-")]
    uuids = [gpu.uuid for gpu in _nvml.physical_gpus()]
    if not entries or any(uuid is None for uuid in uuids):
        return  # a GPU of unknown UUID could be the one an entry names
    where = _where(devices)
    named: dict[str, str] = {}  # GPU UUID -> the entry that names it
    for entry in entries:
        matches = [uuids[index] or "" for index in uuid_matches(entry, uuids)]
        if not matches:
            _refuse_unmatched(entry, where, [uuid for uuid in uuids if uuid])
        if len(matches) > 1:
            raise ValueError(
                f"entry {short_repr(entry)} {where} starts the UUIDs of {len(matches)} GPUs "
                f"({', '.join(matches)}), so CUDA cannot tell which it means, and {_STOPS}; give "
                "enough of the UUID to name one"
            )
        if matches[0] in named:
            raise ValueError(
                f"entries {short_repr(named[matches[0]])} and {short_repr(entry)} {where} both "
                f"name {matches[0]}, and {_DUPLICATE}; list each GPU once"
            )
        named[matches[0]] = entry


def _refuse_unmatched(entry: str, where: str, uuids: list[str]) -> NoReturn:
    folded = [uuid for uuid in uuids if uuid.lower().startswith(entry.lower())]
    if len(folded) == 1:
        # torch matches case and all: it would count no GPU here, while the
        # driver's own count may differ, and a script would quietly use the CPU.
        written = folded[0][: len(entry)]
        raise ValueError(
            f"entry {short_repr(entry)} {where} names {folded[0]} only if case is ignored, and "
            f"torch compares UUIDs case and all, so it would find no GPU there; write {written!r}, "
            "as nvidia-smi -L prints it"
        )
    have = ", ".join(uuids) or "none"
    raise ValueError(
        f"entry {short_repr(entry)} {where} is the UUID of no GPU on this machine (it has {have}), "
        f"and {_STOPS}; copy the UUID from nvidia-smi -L"
    )


def _where(devices: object) -> str:
    """How a message names the argument an entry is in: ``in visible_devices([0, 0])``."""
    return f"in visible_devices({short_repr(devices)})"


def _parse_entry(entry: object, devices: object) -> int | str:
    if isinstance(entry, bool):
        raise TypeError(
            f"entry {entry!r} {_where(devices)} is a bool; expected a device index or a UUID"
        )
    if isinstance(entry, str):
        text = entry.strip()
        if not text:
            raise ValueError(
                f"empty entry {_where(devices)}; write indices as '0,1' with no empty slots"
            )
        if _LEADING_INT.fullmatch(text):
            return _check_non_negative(int(text), devices)
        if _GPU_UUID.fullmatch(text) or _MIG_UUID.fullmatch(text):
            return text
        raise ValueError(
            f"malformed entry {short_repr(text)} {_where(devices)}: expected a device index such "
            "as 0, a GPU UUID such as 'GPU-5bd6a7e1-...' or a MIG UUID such as 'MIG-8c3b...' "
            "(nvidia-smi -L lists them)"
        )
    if hasattr(entry, "__index__"):
        return _check_non_negative(operator.index(entry), devices)
    raise TypeError(
        f"entry {short_repr(entry)} {_where(devices)} has type {type(entry).__name__}; expected an "
        "int or a UUID string"
    )


def _check_non_negative(index: int, devices: object) -> int:
    if index < 0:
        raise ValueError(
            f"negative entry {short_repr(index)} {_where(devices)}: device indices start at 0; to "
            "hide every GPU pass []"
        )
    return index


def _check_consistent(parsed: list[int | str], devices: object) -> None:
    seen: set[int | str] = set()
    for entry in parsed:
        key = entry.upper() if isinstance(entry, str) else entry
        if key in seen:
            raise ValueError(
                f"duplicate entry {short_repr(entry)} {_where(devices)}: {_DUPLICATE}; "
                "list each once"
            )
        seen.add(key)
    kinds = {_kind(entry) for entry in parsed}
    if len(kinds) > 1:
        raise ValueError(
            f"mixed entry kinds {_where(devices)} ({', '.join(sorted(kinds))}): CUDA stops reading "
            "at the first entry of another kind, so the rest would be ignored. Use one kind only."
        )


def _kind(entry: int | str) -> str:
    if isinstance(entry, int):
        return "indices"
    return "GPU UUIDs" if entry.startswith("GPU-") else "MIG UUIDs"
