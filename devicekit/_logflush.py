"""How a [`LogBuffer`][devicekit.LogBuffer]'s pending values reach the host: by key, in bulk.

A flush sees its values by key: one column per key, in order of first
appearance. Values already on the host (Python numbers, CPU tensors) are read
at once, one ``float()`` each, which is faster than stacking them. Values on an
accelerator are stacked per device and dtype and copied to the host in one
non-blocking copy per stack (into pinned memory on CUDA), and `land()`
waits for those copies only. Across ranks, `_logreduce` checks and combines
the columns before they land.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

import torch

from ._timing import CudaEvent

__all__ = [
    "HOST_TENSORS",
    "HOST_VALUES",
    "ON_DEVICE",
    "Column",
    "InFlight",
    "Landed",
    "LandedColumn",
    "LoggedInVmap",
    "by_key",
    "copy_to_host",
    "land",
    "read_each",
    "records_of",
    "start",
]

_item = torch.Tensor.item

# How a flush reads its values; log() notes the least general that fits each step.
HOST_TENSORS = 0
"""Only CPU tensors of a floating dtype: ``Tensor.item()`` each, 20% faster than ``float()``."""
HOST_VALUES = 1
"""Values on the host of any kind (Python numbers, integer tensors): ``float()`` each."""
ON_DEVICE = 2
"""Some on an accelerator: those are stacked per device and dtype and copied."""

# A column: the key, the rows (indices into the flush's steps) that have it or
# None when every row does, and one value per row.
Column = tuple[str, list[int] | None, list[Any]]
# A landed column, the same in tuples, which the garbage collector stops tracking.
LandedColumn = tuple[str, tuple[int, ...] | None, tuple[float, ...]]


@dataclass
class InFlight:
    """A flush whose copies to the host were started but not yet waited on."""

    steps: Sequence[Any]
    columns: list[Column]  # values become floats; None where a copy has yet to land
    hosts: list[torch.Tensor] = field(default_factory=list)  # one per copied group
    done: list[Any] = field(default_factory=list)  # events that mark each copy complete
    # Where each group's values go: (host index, its offset, column floats, index, count).
    fills: list[tuple[int, int, list[Any], int, int]] = field(default_factory=list)
    # Values that could not be read (changed after log(): resized, storage freed),
    # recorded as NaN: (key, step, the error).
    unreadable: list[tuple[str, Any, Exception]] = field(default_factory=list)
    # How many of the flush's pending entries it holds, from the front; None: all. The
    # others stay pending (an automatic flush that met a shorter one: see start_reduced).
    taken: int | None = None
    # The other ranks whose block ended in this flush: they flush no more (see start_reduced).
    ended_ranks: tuple[int, ...] = ()


class Landed(NamedTuple):
    """A landed flush, as ``history`` keeps it: by key, a tuple of floats per key.

    Columns, not a dict per step: a long run's history takes half the memory,
    ``values(key)`` is a concatenation, and a flush builds the dicts it returns
    once, not once for history and again as the caller's copies. Tuples
    throughout, not a dataclass and lists: the garbage collector stops tracking
    a tuple of numbers, as it does a dict of them, so a flush adds one object
    for it to walk, not eight (which made a flush per step 40% slower as the
    history grew).
    """

    steps: tuple[Any, ...]
    columns: tuple[LandedColumn, ...]  # (key, the rows that have it or None, their floats)
    nonfinite: int  # how many of the values are NaN or infinite

    @classmethod
    def of(cls, steps: Sequence[Any], columns: Sequence[Column], nonfinite: int) -> Landed:
        """A batch of ``columns``, their lists made tuples."""
        return cls(
            tuple(steps),
            tuple(
                (key, None if rows is None else tuple(rows), tuple(floats))
                for key, rows, floats in columns
            ),
            nonfinite,
        )

    def records(self) -> list[dict[str, Any]]:
        """New dicts, one per step, oldest first: ``{"step": ..., key: value, ...}``."""
        steps, columns = self.steps, self.columns
        if len(steps) == 1:  # a flush per step or per epoch: no loop to set up
            return [self.last_record()]
        rest: Sequence[LandedColumn] = columns
        if columns and columns[0][1] is None:  # nearly always: every step has the first key
            key, _, floats = columns[0]
            rest = columns[1:]
            records = [{"step": s, key: v} for s, v in zip(steps, floats, strict=True)]
        else:
            records = [{"step": step} for step in steps]
        for key, rows, floats in rest:  # keys in order of first appearance, as they were logged
            for row, value in zip(range(len(steps)) if rows is None else rows, floats, strict=True):
                records[row][key] = value
        return records

    def last_record(self) -> dict[str, Any]:
        """A new dict of the newest step (the batch has at least one)."""
        row = len(self.steps) - 1
        record = {"step": self.steps[row]}
        for key, rows, floats in self.columns:
            if rows is None or rows[-1] == row:
                record[key] = floats[-1]
        return record


def records_of(batches: Sequence[Landed]) -> list[dict[str, Any]]:
    """New dicts of the records of ``batches``, oldest first."""
    if len(batches) == 1:  # nearly every flush lands one batch
        return batches[0].records()
    return [record for batch in batches if batch.steps for record in batch.records()]


def land(in_flight: InFlight) -> Landed:
    """Wait for a flush's copies; its values by key, and how many are NaN or infinite."""
    for event in in_flight.done:
        event.synchronize()  # this copy only, not the whole device
    host_values = [host.tolist() for host in in_flight.hosts]
    for host, offset, floats, index, count in in_flight.fills:
        floats[index : index + count] = map(float, host_values[host][offset : offset + count])
    nonfinite = 0
    for _, _, floats in in_flight.columns:
        if not math.isfinite(sum(floats)):  # one C loop; count only when needed
            nonfinite += sum(not math.isfinite(value) for value in floats)
    return Landed.of(in_flight.steps, in_flight.columns, nonfinite)


# --- one rank ---------------------------------------------------------------------------------


def by_key(
    rows: Sequence[dict[str, Any]], *, read: Callable[[Any], Any] | None = None
) -> list[Column]:
    """The pending values by key: one list each, in order of first appearance.

    ``read`` converts each value on the way (``float``), in the same pass.
    """
    first = rows[0]
    if sum(map(len, rows)) == len(first) * len(rows):
        try:  # nearly always: every step logs the same keys
            if read is None:
                return [(key, None, list(map(itemgetter(key), rows))) for key in first]
            return [(key, None, list(map(read, map(itemgetter(key), rows)))) for key in first]
        except KeyError:
            pass
    columns: dict[str, tuple[list[int], list[Any]]] = {}
    for row, values in enumerate(rows):
        for key, value in values.items():
            column = columns.get(key)
            if column is None:
                column = columns[key] = ([], [])
            column[0].append(row)
            column[1].append(value)
    return [
        (key, indices, values if read is None else list(map(read, values)))
        for key, (indices, values) in columns.items()
    ]


def start(steps: Sequence[Any], rows: Sequence[dict[str, Any]], *, read: int) -> InFlight:
    """Start bringing one rank's values to the host: read those already there, copy the rest.

    ``read`` is the most general of `HOST_TENSORS`, `HOST_VALUES` and `ON_DEVICE`
    that the values need.
    """
    try:
        if read == HOST_TENSORS:
            return InFlight(steps, by_key(rows, read=_item))
        if read == HOST_VALUES:
            # Every value is a number or on the CPU: read each, nothing to copy. This
            # is faster than stacking them (13 µs for 100 values instead of 21).
            return InFlight(steps, by_key(rows, read=float))
        return _start_copies(steps, by_key(rows))
    except Exception:  # noqa: BLE001 - a value changed since log(), or a stack out of memory
        return read_each(steps, by_key(rows))


def read_each(steps: Sequence[Any], columns: list[Column]) -> InFlight:
    """Read every value alone (a GPU's wait for each): NaN where one cannot be read.

    The slow path, after reading in bulk failed: a value that passed ``log()``
    may have changed since (``resize_``, its storage freed), and one such value
    must not keep every other from being recorded, flush after flush. Reading
    alone also gets past a stack that ran out of memory.
    """
    in_flight = InFlight(steps, [])
    for key, rows, values in columns:
        floats: list[Any] = []
        for row, value in zip(range(len(values)) if rows is None else rows, values, strict=True):
            try:
                floats.append(float(value))
            except Exception as error:  # noqa: BLE001 - named in the error the flush raises
                floats.append(math.nan)
                told = LoggedInVmap("a batched tensor") if _batched(value) else error
                in_flight.unreadable.append((key, steps[row], told))
        in_flight.columns.append((key, rows, floats))
    return in_flight


class LoggedInVmap(RuntimeError):
    """A value logged inside ``torch.vmap``: one per sample, unreadable outside it."""


def _batched(value: object) -> bool:
    """Whether ``value`` is a functorch batched tensor (logged inside ``torch.vmap``).

    ``log()`` cannot tell: inside vmap it is a ``torch.Tensor``, 0-d, of a
    float dtype, and asking functorch at each call would cost every call.
    """
    functorch = getattr(torch._C, "_functorch", None)
    is_batched = getattr(functorch, "is_batchedtensor", None)
    return isinstance(value, torch.Tensor) and is_batched is not None and bool(is_batched(value))


def _start_copies(steps: Sequence[Any], columns: list[Column]) -> InFlight:
    """Read host values now; stack the others per device and dtype and start their copies."""
    in_flight = InFlight(steps, [])
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    places: dict[tuple[torch.device, torch.dtype], list[tuple[int, list[Any], int, int]]] = {}
    for key, rows, values in columns:
        floats: list[Any] = [None] * len(values)
        in_flight.columns.append((key, rows, floats))
        for index, value in enumerate(values):
            if value.__class__ is float or value.is_cpu:
                floats[index] = float(value)
                continue
            group = (value.device, value.dtype)
            members = groups.setdefault(group, [])
            places.setdefault(group, []).append((len(members), floats, index, 1))
            members.append(value)
    for number, (group, members) in enumerate(groups.items()):
        copy_to_host(in_flight, torch.stack(members))
        in_flight.fills.extend((number, *place) for place in places[group])
    return in_flight


def copy_to_host(in_flight: InFlight, tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = CudaEvent()
        event.record(torch.cuda.current_stream(tensor.device))
        in_flight.done.append(event)
    else:
        host = tensor.to("cpu")  # CPU: no copy; other devices: their safe copy
    in_flight.hosts.append(host)
