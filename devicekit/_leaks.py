"""``find_leaks``: call a function again and again, and report what keeps growing.

After the warm-up calls (caches fill, lazy state starts), each call is
followed by ``gc.collect()`` and a census of every live tensor on every
device, grouped by device, dtype, shape and the line that created it. A group
leaks when it holds more tensors after the last call than after the warm-up,
and was still growing in the second half of the calls (a cache that fills up
and stops is not a leak); or, with as many tensors, more bytes, growing so
and never shrinking in the second half (a tensor that ``torch.cat`` or
``resize_`` makes larger every call; a kept output whose size varies by call
is no leak). On CUDA, allocated bytes are read after every call
too: growth that no tensor group explains is memory no Python object holds,
usually an autograd graph kept alive (``losses.append(loss)`` keeps every
step's saved activations).

Creation sites come from a ``TorchFunctionMode`` that is active only while
``fn`` runs: every tensor a torch function or tensor method returns is noted
with the first line of the user's own code that asked for it (outside torch,
devicekit, the standard library and installed packages), and the line inside
an installed package (transformers) that made it, as a detail: the user can
change the first, not the second. Tensors made in C++ without a Python call
(gradients in ``backward()``) have no site, nor do tensors made by code
``torch.compile`` generated; the mode steps aside while Dynamo traces, so
that compiled code is the same graph as outside ``find_leaks``.
"""

from __future__ import annotations

import gc
import html
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ._census import GroupKey, census, only_new_objects
from ._creationsites import CreationSites, Site
from ._errors import add_note
from ._format import (
    NOT_APPLICABLE,
    UNKNOWN,
    PlainResult,
    format_bytes,
    format_count,
    html_table,
    plain_fields,
    plural,
    shown,
)
from ._keywords import suggest_keywords
from ._memory import used_cuda_indices
from ._options import check_count, refuse_lazy
from ._visible import torch_cuda_initialized

__all__ = ["Leak", "LeakReport", "find_leaks"]

_BLOCK = 512  # CUDA's caching allocator rounds every block up to a multiple of this
_SPLIT = 2**20  # ... and does not split off a remainder smaller than this


def _b(value: float | None) -> str:
    return format_bytes(value, digits=2)


@dataclass(frozen=True)
class Leak(PlainResult):
    """Something that grew with every call of the function.

    Attributes:
        device: Such as ``"cpu"`` or ``"cuda:0"``.
        dtype: Such as ``"float32"``; None for memory no tensor holds.
        shape: The tensors' shape; None when they vary, or for memory no tensor holds.
        location: ``file:line`` of the user's own code that created the
            tensors: the first line outside torch, devicekit, the standard
            library and installed packages (``site-packages``). None when
            unknown: created in C++, by code ``torch.compile`` generated, or
            before ``find_leaks`` started.
        count_per_call: Tensors added per call (0: as many tensors, each
            call larger); None for memory no tensor holds.
        bytes_per_call: Bytes added per call (tensors: of their storages; else
            CUDA allocated bytes that no tensor explains).
        count_before: Tensors after the warm-up. Tensors that existed before
            ``find_leaks`` was called are not counted: they cannot be what grows.
        count_after: Tensors after the last call.
        library_location: When ``location`` called into an installed package
            (transformers, timm) that made the tensors, the line in it that
            made most of their bytes; None when ``location`` made them itself.
    """

    device: str
    dtype: str | None
    # As the report's table writes them: None is shapes that vary, not an unknown shape.
    shape: tuple[int, ...] | None = field(
        metadata=shown(lambda shape: str(list(shape)), none="various")
    )
    location: str | None
    count_per_call: float | None
    bytes_per_call: float = field(metadata=shown(_b))
    count_before: int | None
    count_after: int | None
    # None: the user's line made the tensors itself, so no library line applies.
    library_location: str | None = field(default=None, metadata=shown(none=NOT_APPLICABLE))

    def _not_applicable(self) -> tuple[str, ...]:
        # Memory no tensor holds has no tensor's fields (None there is not "?").
        if self.dtype is not None:
            return ()
        return ("dtype", "shape", "location", "count_per_call", "count_before", "count_after")

    def __str__(self) -> str:
        if self.dtype is None:
            return (
                f"+{_b(self.bytes_per_call)}/call on {self.device} held by no tensor "
                "(an autograd graph kept alive, a C++ cache)"
            )
        shape = "various shapes" if self.shape is None else list(self.shape)
        where = self.location or "an unknown line"
        if self.library_location:
            where += f" (inside {self.library_location})"
        larger = " (as many tensors, larger each call)" if self.count_per_call == 0 else ""
        return (
            f"+{self.count_per_call:g} tensor/call, +{_b(self.bytes_per_call)}/call{larger}: "
            f"{self.device} {self.dtype} {shape}, created at {where} "
            f"({self.count_before} → {self.count_after})"
        )


@dataclass(frozen=True)
class DeviceGrowth(PlainResult):
    """CUDA allocated bytes after the warm-up and after the last call."""

    device: str
    before: int = field(metadata=shown(_b))
    after: int = field(metadata=shown(_b))
    per_call: float = field(metadata=shown(_b))


@dataclass(frozen=True, repr=False)
class LeakReport:
    """What [`find_leaks()`][devicekit.find_leaks] saw grow; ``leaks`` is empty when nothing did.

    Attributes:
        calls: Calls measured (after the warm-up).
        warmup: Calls made before measuring.
        leaks: What grew, most bytes per call first.
        allocated: Per CUDA device in use: allocated bytes before and after.
    """

    calls: int
    warmup: int
    leaks: tuple[Leak, ...]
    allocated: tuple[DeviceGrowth, ...]

    @property
    def verdict(self) -> str:
        """One line: whether anything leaks, and the worst."""
        if not self.leaks:
            return self._summary()
        return f"{self._summary()}; worst: {self.leaks[0]}"

    def _summary(self) -> str:
        calls = f"{plural(self.calls, 'call')} after {plural(self.warmup, 'warm-up call')}"
        if not self.leaks:
            return f"no leak: nothing grew over {calls}"
        return f"{format_count(len(self.leaks), 'leak')} over {calls}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with the verdict."""
        return {**plain_fields(self), "verdict": self.verdict}

    def __str__(self) -> str:
        lines = [self._summary()]
        lines += [f"  {leak}" for leak in self.leaks]
        lines += [
            f"  {g.device}: allocated {_b(g.before)} → {_b(g.after)} ({_b(g.per_call)}/call)"
            for g in self.allocated
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LeakReport({self.verdict})"

    def _repr_html_(self) -> str:
        rows = [
            (
                leak.device,
                leak.dtype,
                "various" if leak.shape is None else list(leak.shape),
                _where(leak),
                _per_call(leak.count_per_call),
                _b(leak.bytes_per_call),
            )
            if leak.dtype is not None
            # Memory no tensor holds: the tensor columns do not apply (None there is not "?").
            else (leak.device, *[NOT_APPLICABLE] * 4, _b(leak.bytes_per_call))
            for leak in self.leaks
        ]
        # Nothing grew: the caption says so, and a header over no rows would say nothing.
        parts = [
            html_table(
                rows,
                header=("device", "dtype", "shape", "created at", "tensors/call", "bytes/call"),
                caption=self._summary(),
            )
            if rows
            else f"<p>{html.escape(self._summary())}</p>"
        ]
        if self.allocated:  # CUDA's allocated bytes, as str() lists them
            growth = [(g.device, _b(g.before), _b(g.after), _b(g.per_call)) for g in self.allocated]
            header = ("device", "allocated before", "after", "per call")
            parts.append(html_table(growth, header=header, caption="allocated by PyTorch"))
        return "".join(parts)


def _per_call(count: float | None) -> str:
    """The "tensors/call" cell; 0 says what grew instead."""
    if count is None:
        return UNKNOWN
    return "0 (larger each call)" if count == 0 else f"{count:g}"


def _where(leak: Leak) -> str | None:
    """The "created at" cell: the user's line, and the library's line inside it if any."""
    if leak.location and leak.library_location:
        return f"{leak.location} (inside {leak.library_location})"
    return leak.location


# (device, dtype, shape or None when the line is known, line) -> tensors, bytes, shapes,
# and per library line (None: made by the user's line itself) its tensors and bytes.
_MergedKey = tuple[str, str, Any, str | None]
_Merged = tuple[int, int, set[Any], dict[str | None, tuple[int, int]]]


def _merge(groups: dict[GroupKey, tuple[int, int]]) -> dict[_MergedKey, _Merged]:
    """Groups with a known creation line merge across shapes and library lines.

    ``torch.zeros(step)`` leaks too; a model call that leaks tensors made on
    twenty lines of a library's code is one leak at the user's line.
    """
    merged: dict[_MergedKey, _Merged] = {}
    for (device, dtype, shape, site), (count, size) in groups.items():
        line, library = (None, None) if site is None else cast(Site, site)
        key = (device, dtype, None if line else shape, line)
        old_count, old_size, shapes, libraries = merged.get(key, (0, 0, set(), {}))
        shapes.add(shape)
        lib_count, lib_size = libraries.get(library, (0, 0))
        libraries[library] = (lib_count + count, lib_size + size)
        merged[key] = (old_count + count, old_size + size, shapes, libraries)
    return merged


def _library_line(first: _Merged | None, last: _Merged) -> str | None:
    """The library line whose tensors grew the most (bytes, then count); None: the user's own."""
    before = {} if first is None else first[3]

    def growth(line: str | None) -> tuple[int, int]:
        count, size = last[3][line]
        old_count, old_size = before.get(line, (0, 0))
        return size - old_size, count - old_count

    return max(last[3], key=lambda line: (growth(line), line is None))


def _allocated() -> dict[str, int]:
    """Allocated bytes per CUDA device this process uses; nothing before CUDA starts."""
    if not torch_cuda_initialized():
        return {}
    return {f"cuda:{i}": torch.cuda.memory_allocated(i) for i in used_cuda_indices()}


def _growing(values: list[int]) -> bool:
    """Grew over the calls, and still in their second half (a cache that filled up stopped)."""
    middle = values[len(values) // 2] if len(values) > 2 else values[0]
    return values[-1] > values[0] and values[-1] > middle


def _never_shrank(values: list[int]) -> bool:
    """Did not go down from the middle call on (a size that varies by call does, at random)."""
    half = values[len(values) // 2 :]
    return all(later >= earlier for earlier, later in itertools.pairwise(half))


def _allocator_bytes(leak: Leak, size: int, calls: int) -> float:
    """The most CUDA allocated bytes a tensor leak can account for, per call.

    The caching allocator rounds each block up to 512 bytes, and may hand a
    request over 1 MiB a block up to 1 MiB larger rather than split it. A
    group that grew with as many tensors (``size``: its bytes after the last
    call) has blocks of other sizes at the end than at the start: each may be
    that much larger or smaller, once over the calls.
    """
    if not leak.count_per_call:
        tensors = max(leak.count_after or 0, 1)
        slack = _BLOCK + (_SPLIT if size / tensors > _SPLIT else 0)
        return leak.bytes_per_call + tensors * slack / calls
    each = leak.bytes_per_call / leak.count_per_call
    slack = _SPLIT if each > _SPLIT else 0
    return leak.count_per_call * (math.ceil(each / _BLOCK) * _BLOCK + slack)


@suggest_keywords
def find_leaks(fn: Callable[[], Any], *, repeat: int = 10, warmup: int = 2) -> LeakReport:
    """Call ``fn()`` ``warmup + repeat`` times and report what keeps growing per call.

    Counts live tensors on every device (CPU included) after each measured
    call, grouped by device, dtype, shape and the line that created them, and
    on CUDA the allocated bytes too. Catches the usual culprits: a list that
    keeps each step's loss with its graph (``losses.append(loss)``), a tensor
    cache keyed by step, a hook that stores activations, a history that
    ``torch.cat`` makes longer each call (as many tensors, more bytes: a leak
    of ``+0 tensor/call``). Creation lines are recorded only while
    ``find_leaks`` runs.

    Args:
        fn: Called with no arguments; wrap arguments in a lambda. Its return
            value is dropped at once.
        repeat: Calls to measure (at least 1; 10 tells a leak from a cache).
        warmup: Calls before measuring, for caches and lazy state to settle.

    Returns:
        A [`LeakReport`][devicekit.LeakReport]; ``report.leaks`` is empty when nothing grew.

    Raises:
        TypeError: ``fn`` is not callable, is a generator or ``async def``
            function (its body would never run), or ``repeat``/``warmup`` not ints.
        ValueError: ``repeat`` is below 1 or ``warmup`` negative.

    An error from ``fn`` propagates as it was, with a note of the call that raised it.

    Examples:
        >>> import torch, devicekit as dk
        >>> kept = []
        >>> report = dk.find_leaks(lambda: kept.append(torch.ones(3)), repeat=4)
        >>> [(leak.count_per_call, leak.shape) for leak in report.leaks]
        [(1.0, (3,))]
        >>> dk.find_leaks(lambda: torch.ones(3).sum()).leaks
        ()
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable with no arguments, got {type(fn).__name__}")
    refuse_lazy(fn, call="fn()", fix=_LAZY_FIX)
    # As plain ints: np.int64(10) would reach the report, whose to_dict() must be JSON-ready.
    repeat = check_count(repeat, name="repeat", minimum=1, fix="measure one call or more")
    warmup = check_count(warmup, name="warmup")
    with only_new_objects():  # what existed before cannot be what grows
        counts, allocated = _measure(fn, repeat, warmup)
    found = _tensor_leaks(counts, repeat)
    leaks = [leak for leak, _ in found]
    growth, unexplained = _device_growth(allocated, found, repeat)
    return LeakReport(
        calls=repeat,
        warmup=warmup,
        leaks=tuple(sorted(leaks + unexplained, key=lambda leak: -leak.bytes_per_call)),
        allocated=growth,
    )


_Census = dict[_MergedKey, _Merged]
_LAZY_FIX = (
    "pass a function that does the work: lambda: list(gen()) for a generator, "
    "lambda: asyncio.run(step()) for async def"
)


def _call_numbered(fn: Callable[[], Any], number: int, repeat: int, warmup: int) -> None:
    """Call ``fn``; its error leaves with a note of which call raised it, a lazy result refused.

    fn's error is fn's own and propagates as it was, but a call that fails only
    the fifth time looks, without the note, like one that always fails. A
    Ctrl-C gets the note too: it says how far the calls had come.
    """
    try:
        result = fn()
    except (Exception, KeyboardInterrupt) as error:
        kind = "a warm-up call" if number <= warmup else "a measured call"
        add_note(
            error,
            f"devicekit.find_leaks: fn() raised this on call {number} of "
            f"{warmup + repeat} ({kind}; warmup={warmup}, repeat={repeat})",
        )
        raise
    # Outside the try: devicekit's refusal of a result that means fn's body never ran
    # is not fn's error, and a note saying fn raised it would say it was (T50).
    refuse_lazy(fn, call="fn()", fix=_LAZY_FIX, result=result)


def _measure(
    fn: Callable[[], Any], repeat: int, warmup: int
) -> tuple[list[_Census], list[dict[str, int]]]:
    """Call ``fn``; after the warm-up and after each measured call, count what is alive."""
    recorder = CreationSites()
    for call in range(warmup):
        with recorder:
            _call_numbered(fn, call + 1, repeat, warmup)
    counts: list[_Census] = []
    allocated: list[dict[str, int]] = []
    for call in range(repeat + 1):
        if call:  # the first census is the baseline, after the warm-up
            with recorder:
                _call_numbered(fn, warmup + call, repeat, warmup)
        gc.collect()
        counts.append(_merge(census(recorder.site)))
        allocated.append(_allocated())
    return counts, allocated


def _tensor_leaks(counts: list[_Census], calls: int) -> list[tuple[Leak, int]]:
    """The groups that grew in tensors, or in bytes with as many; and their bytes at the end."""
    leaks = []
    for key, last in counts[-1].items():
        series = [census.get(key, (0, 0, set(), {})) for census in counts]
        numbers = [count for count, _, _, _ in series]
        sizes = [size for _, size, _, _ in series]
        more = _growing(numbers)
        if not more and not (_growing(sizes) and _never_shrank(sizes)):
            continue
        device, dtype, _, site = key
        shapes = last[2]
        leak = Leak(
            device=device,
            dtype=dtype,
            shape=next(iter(shapes)) if len(shapes) == 1 else None,
            location=site,
            # Only bytes grew: a count that rose for a while (then stopped) is not what leaks.
            count_per_call=(numbers[-1] - numbers[0]) / calls if more else 0.0,
            bytes_per_call=(sizes[-1] - sizes[0]) / calls,
            count_before=numbers[0],
            count_after=numbers[-1],
            library_location=_library_line(counts[0].get(key), last),
        )
        leaks.append((leak, sizes[-1]))
    return leaks


def _device_growth(
    allocated: list[dict[str, int]], leaks: list[tuple[Leak, int]], calls: int
) -> tuple[tuple[DeviceGrowth, ...], list[Leak]]:
    """Per CUDA device: allocated bytes over the calls, and growth that no tensor leak explains."""
    growth, unexplained = [], []
    for device in allocated[-1]:
        series = [values.get(device, 0) for values in allocated]
        per_call = (series[-1] - series[0]) / calls
        growth.append(DeviceGrowth(device, series[0], series[-1], per_call))
        explained = sum(
            _allocator_bytes(leak, size, calls) for leak, size in leaks if leak.device == device
        )
        if _growing(series) and per_call - explained > 0:
            unexplained.append(
                Leak(device, None, None, None, None, per_call - explained, None, None)
            )
    return tuple(growth), unexplained
