"""What ``visible_devices()`` is given, read and checked before the variable is set.

Every form it takes (an int, a comma-separated string, a sequence of ints or
UUIDs, a NumPy array) becomes the list of entries CUDA would read, each
checked as CUDA reads it (`_visible`'s rules), against the GPUs on this
machine where NVML can say, with a message that names the entry and the fix.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from . import _nvml
from ._format import plural
from ._options import is_one_index, is_tensor, tensor_got
from ._shortrepr import got, is_bool, short_repr
from ._visible import (
    ASCII_INT,
    DUPLICATE,
    GPU_UUID,
    LEADING_INT,
    MIG_UUID,
    STOPS,
    UUID_PREFIXES,
    comma_fix,
    uuid_matches,
    why_number,
)

__all__ = ["Unplaced", "normalize_devices", "unplaced"]

_EXPECTED = (
    "an int, a comma-separated string, a sequence of ints or 'GPU-'/'MIG-' UUIDs, "
    "[] to hide every GPU, or None to unset the variable"
)


def normalize_devices(devices: object) -> list[int | str]:
    """Check a `visible_devices` argument whole and return its entries; change nothing."""
    raw: list[object]
    if isinstance(devices, str):
        raw = [] if not devices.strip() else list(devices.split(","))
    elif is_tensor(devices):
        raise TypeError(
            f"visible_devices() expects {_EXPECTED}; got {tensor_got(devices)}, and a tensor's "
            "value is never read as an index: pass tensor.tolist() if it holds the GPU indices"
        )
    elif is_bool(devices) or isinstance(devices, (bytes, dict)):
        raise TypeError(f"visible_devices() expects {_EXPECTED}; got {got(devices)}")
    elif isinstance(devices, (set, frozenset)):  # no order to keep
        raise TypeError(
            f"visible_devices() takes the GPUs in order, and got {got(devices)}: a set keeps "
            "no order of yours (one of UUIDs comes in an order that changes from run to run, "
            "with the hash seed), so cuda:0 could be another GPU than the one you meant. Pass "
            "a list in the order you want, such as sorted(...)"
        )
    elif is_one_index(devices):
        raw = [devices]
    elif isinstance(devices, Iterable):  # a numpy array of indices too
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
    physical = _nvml.physical_gpus()
    found = unplaced(parsed, len(physical), [gpu.uuid for gpu in physical])
    if found is not None:
        raise ValueError(f"{found.subject} {_where(devices)}{found.why}; {found.fix}")


class Unplaced(NamedTuple):
    """The first entry of a list that CUDA cannot place on this machine's GPUs, and why.

    In the words `visible_devices()` refuses it with and that `status` explains a
    variable with: ``f"{subject} in <the list>{why}; {fix}"``.

    Attributes:
        used: How many entries CUDA uses: those before it, or none after a duplicate.
        subject: ``"entry 5"``, or ``"entries 'GPU-bbbb' and 'GPU-bbbb2222'"``.
        why: What follows the subject and where the list is, rule and all.
        fix: What to write instead.
        title: What the list does, for a finding's title: ``"names the same GPU twice"``.
    """

    used: int
    subject: str
    why: str
    fix: str
    title: str


_MISSING = "names a GPU this machine does not have"


def unplaced(parsed: list[int | str], count: int, uuids: Sequence[str | None]) -> Unplaced | None:
    """The first entry of ``parsed`` that names no GPU here, several, or one named before.

    Args:
        parsed: The entries, as `parse_visible_devices` reads them (one kind).
        count: How many GPUs the machine has (NVML's count).
        uuids: The UUID of each GPU, None where NVML cannot read it.

    An index past ``count``; a ``GPU-`` entry that starts no GPU's UUID
    (with the spelling to use where only case differs), several, or the
    same as an earlier entry. MIG UUIDs are not checked: drivers name them in
    two forms, and NVML may list the other one; nor are GPU UUIDs where one
    is unknown (that GPU could be the one an entry names).

    Examples:
        >>> unplaced([1, 5], 3, []).why
        ': this machine has 3 GPUs (0 to 2), and CUDA stops reading at the first entry it \
cannot use and ignores the rest'
        >>> unplaced(["GPU-AB"], 1, ["GPU-ab12"]).fix
        "write 'GPU-ab', as nvidia-smi -L prints it"
    """
    for position, entry in enumerate(parsed):
        if isinstance(entry, int) and entry >= count:
            have = f"{plural(count, 'GPU')} (0 to {count - 1})" if count else "no GPU"
            return Unplaced(
                position,
                f"entry {short_repr(entry)}",
                f": this machine has {have}, and {STOPS}",
                f"list indices below {count} (nvidia-smi -L lists them)",
                _MISSING,
            )
    named: dict[str, str] = {}  # GPU UUID -> the entry that names it
    for position, entry in enumerate(parsed):
        if not isinstance(entry, str) or not entry.startswith("GPU-"):
            continue
        if any(uuid is None for uuid in uuids):
            return None
        matches = [uuids[index] or "" for index in uuid_matches(entry, uuids)]
        subject = f"entry {short_repr(entry)}"
        if not matches:
            return _unmatched(position, entry, [uuid for uuid in uuids if uuid])
        if len(matches) > 1:
            return Unplaced(
                position,
                subject,
                f" starts the UUIDs of {len(matches)} GPUs ({', '.join(matches)}), so CUDA "
                f"cannot tell which it means, and {STOPS}",
                "give enough of the UUID to name one",
                f"has an entry that starts the UUIDs of {len(matches)} GPUs",
            )
        if matches[0] in named:
            return Unplaced(
                0,
                f"entries {short_repr(named[matches[0]])} and {short_repr(entry)}",
                f" both name {matches[0]}, and {DUPLICATE}",
                "list each GPU once",
                "names the same GPU twice",
            )
        named[matches[0]] = entry
    return None


def _unmatched(position: int, entry: str, uuids: list[str]) -> Unplaced:
    folded = [uuid for uuid in uuids if uuid.lower().startswith(entry.lower())]
    if len(folded) == 1:
        # torch matches case and all: it would count no GPU here, while the
        # driver's own count may differ, and a script would quietly use the CPU.
        written = folded[0][: len(entry)]
        return Unplaced(
            position,
            f"entry {short_repr(entry)}",
            f" names {folded[0]} only if case is ignored, and torch compares UUIDs case and all, "
            "so it would find no GPU there",
            f"write {written!r}, as nvidia-smi -L prints it",
            "spells a GPU's UUID in the wrong case",
        )
    have = ", ".join(uuids) or "none"
    return Unplaced(
        position,
        f"entry {short_repr(entry)}",
        f" is the UUID of no GPU on this machine (it has {have}), and {STOPS}",
        "copy the UUID from nvidia-smi -L",
        _MISSING,
    )


def _where(devices: object) -> str:
    """How a message names the argument an entry is in: ``in visible_devices([0, 0])``."""
    return f"in visible_devices({short_repr(devices)})"


def _parse_entry(entry: object, devices: object) -> int | str:
    if is_bool(entry):
        raise TypeError(
            f"entry {entry!r} {_where(devices)} is a bool; expected a device index or a UUID"
        )
    if is_tensor(entry):
        raise TypeError(
            f"entry {tensor_got(entry)} {_where(devices)} is a tensor, and a tensor's value is "
            "never read as an index; expected an int or a UUID string (tensor.tolist() gives ints)"
        )
    if isinstance(entry, str):
        text = entry.strip()
        if not text:
            raise ValueError(
                f"empty entry {_where(devices)}; write indices as '0,1' with no empty slots"
            )
        if ASCII_INT.fullmatch(text):
            return _check_non_negative(int(text), devices)
        if GPU_UUID.fullmatch(text) or MIG_UUID.fullmatch(text):
            return text
        raise ValueError(
            f"malformed entry {short_repr(text)} {_where(devices)}: {_malformed(text)}"
        )
    if is_one_index(entry):
        return _check_non_negative(operator.index(entry), devices)  # type: ignore[arg-type]
    raise TypeError(
        f"entry {short_repr(entry)} {_where(devices)} has type {type(entry).__name__}; expected an "
        "int or a UUID string"
    )


_EXPECTED_ENTRY = (
    "expected a device index such as 0, a GPU UUID such as 'GPU-5bd6a7e1-...' or a MIG UUID "
    "such as 'MIG-8c3b...' (nvidia-smi -L lists them)"
)


def _malformed(text: str) -> str:
    """Why a string entry is no index or UUID, and what to write: for its likely meaning."""
    if LEADING_INT.fullmatch(text):  # "٣": torch reads it as 3, CUDA as nothing
        return f"CUDA reads indices written with the digits 0-9 only; write {str(int(text))!r}"
    separated = _separated(text)
    if separated is not None:
        return separated
    prefix = text[:4].upper()
    if prefix in UUID_PREFIXES:
        kind = "a GPU UUID" if prefix == "GPU-" else "a MIG UUID"
        if not text.startswith(prefix):
            return f"{kind} starts with {prefix!r} in capitals, as nvidia-smi -L prints it"
        older = " (or the older 'MIG-GPU-<uuid>/<gi>/<ci>')" if prefix == "MIG-" else ""
        return (
            f"{kind} is {prefix!r} followed by hexadecimal digits (0-9, a-f) and dashes{older}, "
            f"such as {'GPU-5bd6a7e1-...' if prefix == 'GPU-' else 'MIG-8c3b0f1e-...'!r}; "
            "copy it from nvidia-smi -L"
        )
    return _EXPECTED_ENTRY


def _separated(text: str) -> str | None:
    r"""For ``"0\n1"`` (nvidia-smi prints one index a line): the words `status` uses for it."""
    match = ASCII_INT.match(text)
    if match is None or comma_fix(text) is None:
        return None
    listed = ",".join(str(int(part)) for part in re.split(r"[\s;]+", text) if part)
    return (
        f"{why_number(text, int(match.group()))}; separate the GPUs with commas, such as "
        f"visible_devices({listed!r})"
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
                f"duplicate entry {short_repr(entry)} {_where(devices)}: {DUPLICATE}; "
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
