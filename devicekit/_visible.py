"""``CUDA_VISIBLE_DEVICES``: read it the way CUDA does, and check a value before it is set.

CUDA's rules are lenient and easy to trip over: it stops at the first entry it
cannot use, reads a leading integer, and hides every GPU when one is listed
twice. [`parse_visible_devices()`][devicekit.parse_visible_devices] applies
them as torch does (where torch and CUDA differ, on spaces around UUIDs and
digits other than 0-9, torch's count is the one ``cuda:N`` means before CUDA
starts), `misreading` says where a value departs from what was written, and
`_visiblearg.normalize_devices` refuses, naming the entry and the fix, a value that CUDA
would read differently, or that names no GPU here. The variable is read once,
when the CUDA driver starts in a process; `cuda_started` says whether it has.
Setting the variable for a block is `_scopedenv`'s.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ._keywords import suggest_keywords
from ._shortrepr import got, short_repr

__all__ = [
    "ASCII_INT",
    "DUPLICATE",
    "ENV_VAR",
    "GPU_UUID",
    "LEADING_INT",
    "MIG_UUID",
    "STOPS",
    "UUID_PREFIXES",
    "Misreading",
    "comma_fix",
    "cuda_started",
    "misreading",
    "parse_visible_devices",
    "read_as",
    "reads_as_written",
    "uuid_matches",
    "why_number",
]

ENV_VAR = "CUDA_VISIBLE_DEVICES"

# strtoul-like: a leading integer counts ("3a" is 3, "1gpu2" is 1). Read as torch reads it
# (str.isdigit, so "٣" is 3); torch's int() fails on the other digits ("²"), and CUDA's
# strtoul reads none of them: such an entry stops the list.
LEADING_INT = re.compile(r"[+-]?\d+")
# What visible_devices() writes: ASCII digits, which CUDA and torch read alike.
ASCII_INT = re.compile(r"[+-]?[0-9]+")
UUID_PREFIXES = ("GPU-", "MIG-")
# CUDA accepts unique prefixes of a UUID, so only the start is fixed.
GPU_UUID = re.compile(r"GPU-[0-9a-fA-F][0-9a-fA-F-]*")
# MIG-<uuid> (R470+ drivers) or the older MIG-GPU-<uuid>/<gi>/<ci>.
MIG_UUID = re.compile(r"MIG-(?:[0-9a-fA-F][0-9a-fA-F-]*|GPU-[0-9a-fA-F-]+/\d+/\d+)")
_CUDA_ERROR_NOT_INITIALIZED = 3
# CUDA's rules, in the words every message about them uses (visible_devices' errors,
# and the finding that status, doctor and the CLI show).
DUPLICATE = "any duplicate makes CUDA hide every GPU"
STOPS = "CUDA stops reading at the first entry it cannot use and ignores the rest"
_WHITESPACE = "has whitespace"
_UUID_START = "torch reads UUIDs only in a value that starts with GPU- or MIG-, so it counts no GPU"
_SPACED_UUID = (
    f"{_WHITESPACE} around the UUID, and torch compares UUIDs as written, so it counts no GPU "
    "from there on"
)
# Typed alias: torch leaves is_initialized unannotated.
torch_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized


@suggest_keywords
def parse_visible_devices(value: str | None = None) -> list[int | str] | None:
    """Read a ``CUDA_VISIBLE_DEVICES`` value the way CUDA and torch do.

    The rules are lenient and easy to trip over, which is why this function
    exists: parsing stops at the first invalid entry (``"0,x,1"`` is ``[0]``),
    a leading integer counts (``"3a"`` is 3), whitespace around indices is
    ignored, a negative entry ends the list (``"-1"`` hides every GPU), and any
    duplicate hides *every* GPU (``"0,0"`` is ``[]``). A value that starts
    with ``GPU-`` or ``MIG-`` lists UUIDs (or unique UUID prefixes), kept as
    strings; the start of the value decides which kind the list is.

    Where torch's reading (``torch.cuda.device_count()`` before CUDA starts)
    is what ``cuda:N`` means here, this is torch's: whitespace around a UUID is
    not ignored (``" GPU-5bd6"`` is no UUID, and ``"GPU-5bd6, GPU-8f3a"`` stops
    at ``" GPU-8f3a"``; an entry with a space inside or after it names no GPU,
    so the list ends there), and an index may be written in any script's
    digits (``"٣"`` is 3), which CUDA itself reads as no index: `misreading`
    says so for each.

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
        >>> dk.parse_visible_devices("GPU-5bd6, GPU-8f3a")  # as torch reads it
        ['GPU-5bd6']
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
    written = [entry.strip() for entry in value.split(",")]
    if value.lstrip().startswith(UUID_PREFIXES) and written != value.split(","):
        spelled, what = ",".join(written), "the UUIDs without whitespace"
    else:
        spelled, what = ",".join(map(_ascii_index, written)), "indices with the digits 0-9"
    changed = spelled != ",".join(written) or what.startswith("the UUIDs")
    if changed and reads_as_written(spelled):  # whitespace or other digits are all that is wrong
        return Misreading(why, f"write {what}, such as {ENV_VAR}={spelled}")
    if entries:
        # Indices in other digits are torch's reading: CUDA's own stops at them.
        other = any(not entry.isascii() and LEADING_INT.match(entry) for entry in written)
        fix = (
            "write only valid, distinct indices or UUIDs of one kind; "
            f"as written, {'torch counts' if other else 'CUDA uses'} {ENV_VAR}={read_as(value)}"
        )
        return Misreading(why, fix)
    # Nothing read, yet the first entry was valid: a duplicate hid everything.
    distinct = read_as(",".join(dict.fromkeys(entry.strip() for entry in value.split(","))))
    if distinct:
        return Misreading(why, f"list each GPU once, such as {ENV_VAR}={distinct}")
    return Misreading(why, f"unset {ENV_VAR}, or list the GPUs to use, such as {ENV_VAR}=0")


def _ascii_index(entry: str) -> str:
    """``"٣"`` as ``"3"``: an index in other digits, written in those CUDA reads; else as is."""
    return str(int(entry)) if LEADING_INT.fullmatch(entry) and not entry.isascii() else entry


def _read(value: str) -> tuple[list[int | str], list[str]]:
    """CUDA's entries for ``value``, and a note for each place its reading departs from the text."""
    for prefix in UUID_PREFIXES:
        if value.startswith(prefix):  # as torch decides: " GPU-5bd6" is no UUID list
            return _parse_uuids(value.split(","), prefix)
    if value.lstrip().startswith(UUID_PREFIXES):
        # torch reads it as indices, and its first entry as none: no GPU.
        return [], [f"{short_repr(value)} {_WHITESPACE} before the first UUID, and {_UUID_START}"]
    return _parse_indices([entry.strip() for entry in value.split(",")])


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
    """UUID entries as torch reads them: as written, whitespace and all.

    torch keeps an entry with whitespace around it, but it is the start of no
    UUID, so torch counts no GPU from there on: the list ends there (after
    torch's duplicate check, which reads on to the first entry of another kind).
    """
    parsed: list[int | str] = []
    stop = None
    for entry in entries:
        if entry in parsed:
            return [], [f"{short_repr(entry)} is listed twice, and {DUPLICATE}"]
        if not entry.startswith(prefix):
            stop = entry
            break
        parsed.append(entry)
    spaced = next((i for i, entry in enumerate(parsed) if entry != str(entry).strip()), None)
    if spaced is not None:
        return parsed[:spaced], [f"{short_repr(parsed[spaced])} {_SPACED_UUID}"]
    if stop is None:
        return parsed, []
    if stop.strip().startswith(prefix):
        return parsed, [f"{short_repr(stop)} {_SPACED_UUID}"]
    return parsed, [f"{_named(stop)} is not a {prefix} UUID like the first entry, and {STOPS}"]


def _parse_indices(entries: list[str]) -> tuple[list[int | str], list[str]]:
    parsed: list[int | str] = []
    notes: list[str] = []
    for entry in entries:
        match = LEADING_INT.match(entry)
        if match is None:
            return parsed, [*notes, f"{_named(entry)} is not a device index, and {STOPS}"]
        index = int(match.group())
        if index in parsed:
            return [], [f"{index} is listed twice, and {DUPLICATE}"]
        if index < 0:
            return parsed, [*notes, f"the negative entry {short_repr(entry)} ends the list"]
        if not match.group().isascii():
            notes.append(
                f"{short_repr(entry)} is read as {short_repr(index)} by torch, but CUDA reads "
                "only the digits 0-9, so CUDA itself stops there"
            )
        elif str(index) != entry:
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


# What people separate a list with besides commas (a newline: nvidia-smi --query-gpu output).
_SEPARATORS = {"\n": "newline", "\t": "tab", " ": "space", ";": "semicolon"}


def why_number(entry: str, index: int) -> str:
    """Why CUDA reads ``entry`` as ``index``: what ends the number, and what it drops.

    Examples:
        >>> print(why_number("0 1", 0))
        CUDA separates entries with commas only, so '0 1' is one entry: CUDA reads its number, \
0, stops at the space and drops the rest, '1'
        >>> print(why_number("1a", 1))
        CUDA reads the number an entry starts with and ignores the rest of it, so '1a' is 1 \
and 'a' is ignored
    """
    rest = ASCII_INT.sub("", entry, count=1)
    if not rest:  # '01', '+1', '-0': the same number, spelled another way
        return f"CUDA reads {short_repr(entry)} as the number {index}, without sign or leading 0s"
    name = _SEPARATORS.get(rest[0]) or (f"whitespace {rest[0]!r}" if rest[0].isspace() else None)
    if name is not None:
        return (
            f"CUDA separates entries with commas only, so {short_repr(entry)} is one entry: "
            f"CUDA reads its number, {index}, stops at the {name} and drops the rest, "
            f"{short_repr(rest[1:].strip())}"
        )
    return (
        "CUDA reads the number an entry starts with and ignores the rest of it, so "
        f"{short_repr(entry)} is {index} and {short_repr(rest)} is ignored"
    )


def comma_fix(raw: str) -> str | None:
    """``...=0,1`` for ``'0 1'``: distinct indices separated by something besides commas."""
    parts = [part for part in re.split(r"[\s,;]+", raw) if part]
    if not re.search(r"[0-9][\s;]+[0-9]", raw) or not all(p.isdigit() for p in parts):
        return None
    if len({int(part) for part in parts}) < len(parts):
        return None  # "0 0": commas would make a duplicate, which hides every GPU
    return (
        f"separate the GPUs with commas, such as {ENV_VAR}={','.join(str(int(p)) for p in parts)}"
    )
