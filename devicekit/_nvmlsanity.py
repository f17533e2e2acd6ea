"""NVML readings that cannot be true, made unknown: the checks `_nvmlread` applies.

`checked_number` (in `_nvml`) turns a single number that cannot be a reading
(NVML's "not available" sentinel, a negative, a non-integer) into ``None``.
What is here needs more than one number, or a table: memory that does not add
up, a process holding more memory than its GPU has, a power limit of 0 W, a
compute mode NVML's table does not name, a PID NVML could not give. The rule
is the project's: a reading that cannot be true is unknown, ``None``, never a
made-up number. What can be true stays, however odd (a fan past 100 %, an SM
clock above ``sm_clock_max``: NVML says the current clock can differ from
the maximum, and overclocked boards pass it).
"""

from __future__ import annotations

from typing import Any

from ._nvml import checked_number

__all__ = ["compute_mode_name", "memory", "power_limit", "process_memory", "process_pid"]

_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def memory(total: Any, used: Any, free: Any) -> tuple[int | None, int | None, int | None]:
    """Total, used and free bytes as NVML gave them; each None where it cannot be true.

    Examples:
        >>> memory(80, 2, 78)
        (80, 2, 78)
        >>> memory(80, 90, 2**64 - 10)  # wrapped: the total stands, the rest is unknown
        (80, None, None)
        >>> memory(0, 0, 0)  # a GPU has memory: nothing here is known
        (None, None, None)
    """
    total, used, free = (checked_number(part, bits=64) for part in (total, used, free))
    if not total:
        # "Not available" (or 0, which no GPU has) in place of the total: used and free
        # cannot be checked, and free may be a wrapped 2**64 - 2**31 that pick_gpu would
        # rank first; 0 B of 0 B would read as "little free memory".
        return None, None, None
    if any(part is not None and part > total for part in (used, free)):
        # More used (or free) than the GPU has: NVML's unsigned arithmetic wrapped, or
        # the driver miscounted. Neither number can be trusted; the total can.
        return total, None, None
    return total, used, free


def process_memory(raw: Any, total: int | None) -> int | None:
    """Bytes one process holds; None unknown (WDDM, some MIG), or more than its GPU's ``total``.

    Examples:
        >>> process_memory(2**30, 80 * 2**30), process_memory(2**63, 80 * 2**30)
        (1073741824, None)
    """
    used = checked_number(raw, bits=64)
    return None if used is None or (total is not None and used > total) else used


def process_pid(raw: Any) -> int | None:
    """A process id NVML gave; None for its "not available" (``0xFFFFFFFF``) or a negative.

    Examples:
        >>> process_pid(1234), process_pid(0xFFFFFFFF), process_pid(-1)
        (1234, None, None)
    """
    return checked_number(raw)


def power_limit(raw_milliwatts: Any) -> float | None:
    """The enforced power limit in watts; None where unknown, or 0 W (no GPU runs on none).

    Examples:
        >>> power_limit(700_000), power_limit(0)
        (700.0, None)
    """
    limit = checked_number(raw_milliwatts)
    return limit / 1000 if limit else None


def compute_mode_name(raw: Any) -> str | None:
    """NVML's compute mode by name; ``"unknown (7)"`` for a number its table does not name.

    The number stays visible (a newer driver's mode is real), but never as if
    it were a name: nothing compares ``"7"`` with ``"exclusive_process"``.

    Examples:
        >>> compute_mode_name(3), compute_mode_name(7), compute_mode_name(None)
        ('exclusive_process', 'unknown (7)', None)
    """
    mode = checked_number(raw)
    if mode is None:
        return None
    return _COMPUTE_MODES.get(mode, f"unknown ({mode})")
