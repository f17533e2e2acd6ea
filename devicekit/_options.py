"""Checking plain option values: a count, a number of seconds.

Every devicekit option that is a number goes through one of these, so an
``inf``, a ``nan``, a bool or a string is refused the same way everywhere,
with the option's name, what was given and the fix.
"""

from __future__ import annotations

import math
import numbers
import operator

__all__ = ["check_index", "check_seconds"]


def check_index(value: object, *, name: str) -> int:
    """Return ``value`` as a non-negative int, or raise an error that names it.

    Accepts anything with ``__index__`` (numpy integers too) except ``bool``,
    which is almost always a mistake (``try_gpu(True)`` is not device 1).

    Examples:
        >>> check_index(3, name="n")
        3
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a non-negative int, got the bool {value!r}")
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be a non-negative int, got {value!r} of type {type(value).__name__}"
        ) from None
    if index < 0:
        raise ValueError(f"{name} must be a non-negative int, got {index}; the first device is 0")
    return index


def check_seconds(value: object, *, name: str, zero_ok: bool = False, fix: str = "") -> float:
    """Return ``value`` as a finite number of seconds (> 0, or >= 0 with ``zero_ok``).

    ``inf`` is refused: every devicekit wait is bounded, and an unbounded one
    is what a timeout exists to prevent.

    Examples:
        >>> check_seconds(2, name="timeout")
        2.0
        >>> check_seconds(float("inf"), name="timeout", fix="say timeout=600")
        Traceback (most recent call last):
        ...
        ValueError: timeout must be a finite number of seconds > 0, got inf; say timeout=600
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(
            f"{name} must be a finite number of seconds {bound}, got {value!r}"
            + (f"; {fix}" if fix else "")
        )
    return seconds
