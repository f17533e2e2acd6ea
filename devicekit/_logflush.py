"""How a [`LogBuffer`][devicekit.LogBuffer]'s pending values reach the host: by key, in bulk.

A flush sees its values by key: one column per key, in order of first
appearance. Values already on the host (Python numbers, CPU tensors) are read
at once, one ``float()`` each, which is faster than stacking them. Values on an
accelerator are stacked per device and dtype and copied to the host in one
non-blocking copy per stack (into pinned memory on CUDA), and `land()`
waits for those copies only. Across ranks, every rank arranges its values by
key name, checks with the other ranks (over devicekit's gloo group, ``_dist``)
that all logged the same, and only then combines them in one ``all_reduce``;
the combined records keep rank 0's keys in the order it logged them, on every
rank, as one rank's records keep its own.
Once the job's collectives are broken for good (`broken_job`), nothing can be
combined any more, and the buffer records each rank's own values instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import torch

from ._dist import DEFAULT_TIMEOUT, all_reduce, gather_objects
from ._errors import RanksDisagreeError, RanksOutOfStepError
from ._format import plural, shorten
from ._jobstate import Job, refuse_if_broken, this_job
from ._timing import CudaEvent

__all__ = [
    "HOST_TENSORS",
    "HOST_VALUES",
    "ON_DEVICE",
    "InFlight",
    "broken_job",
    "by_key",
    "land",
    "start",
    "start_reduced",
]

_Tensor = torch.Tensor
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
_Column = tuple[str, list[int] | None, list[Any]]


@dataclass
class InFlight:
    """A flush whose copies to the host were started but not yet waited on."""

    steps: Sequence[Any]
    columns: list[_Column]  # values become floats; None where a copy has yet to land
    hosts: list[torch.Tensor] = field(default_factory=list)  # one per copied group
    done: list[Any] = field(default_factory=list)  # events that mark each copy complete
    # Where each group's values go: (host index, its offset, column floats, index, count).
    fills: list[tuple[int, int, list[Any], int, int]] = field(default_factory=list)
    # Values that could not be read (changed after log(): resized, storage freed),
    # recorded as NaN: (key, step, the error).
    unreadable: list[tuple[str, Any, Exception]] = field(default_factory=list)


def land(in_flight: InFlight) -> tuple[list[dict[str, Any]], int]:
    """Wait for a flush's copies; its records, and how many values are NaN or infinite."""
    for event in in_flight.done:
        event.synchronize()  # this copy only, not the whole device
    host_values = [host.tolist() for host in in_flight.hosts]
    for host, offset, floats, index, count in in_flight.fills:
        floats[index : index + count] = map(float, host_values[host][offset : offset + count])
    steps, columns = in_flight.steps, in_flight.columns
    rest = columns
    if columns and columns[0][1] is None:  # nearly always: every step has the first key
        (key, _, floats), *rest = columns
        records = [{"step": s, key: v} for s, v in zip(steps, floats, strict=True)]
    else:
        records = [{"step": step} for step in steps]
    for key, rows, floats in rest:  # keys in order of first appearance, as they were logged
        for row, value in zip(range(len(steps)) if rows is None else rows, floats, strict=True):
            records[row][key] = value
    nonfinite = 0
    for _, _, floats in columns:
        if not math.isfinite(sum(floats)):  # one C loop; count only when needed
            nonfinite += sum(not math.isfinite(value) for value in floats)
    return records, nonfinite


# --- one rank ---------------------------------------------------------------------------------


def by_key(
    rows: Sequence[dict[str, Any]], *, read: Callable[[Any], Any] | None = None
) -> list[_Column]:
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


def read_each(steps: Sequence[Any], columns: list[_Column]) -> InFlight:
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
                in_flight.unreadable.append((key, steps[row], error))
        in_flight.columns.append((key, rows, floats))
    return in_flight


def _start_copies(steps: Sequence[Any], columns: list[_Column]) -> InFlight:
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
        _copy_to_host(in_flight, torch.stack(members))
        in_flight.fills.extend((number, *place) for place in places[group])
    return in_flight


def _copy_to_host(in_flight: InFlight, tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = CudaEvent()
        event.record(torch.cuda.current_stream(tensor.device))
        in_flight.done.append(event)
    else:
        host = tensor.to("cpu")  # CPU: no copy; other devices: their safe copy
    in_flight.hosts.append(host)


# --- across ranks ----------------------------------------------------------------------------


def broken_job(op: str) -> RanksOutOfStepError | None:
    """What a reducing flush meets at once, this job's collectives being broken for good; or None.

    When a job-wide call fails, gloo closes devicekit's connections between the
    ranks, and ``_jobstate`` refuses every later call of the job at once: no
    flush can combine again until the job is made again. This rank's own
    knowledge, no store read (a rank that learns it from the store does so in
    `start_reduced`, which raises the same error).
    """
    with Job.lock:  # _jobstate has no query for this: its refusal, caught, is the answer
        this_job()  # a job made again is not broken
        try:
            refuse_if_broken(_what(op))
        except RanksOutOfStepError as error:
            return error
    return None


def _what(op: str) -> str:
    return f"LogBuffer(reduce={op!r}).flush()"


def start_reduced(
    steps: Sequence[Any], columns: list[_Column], op: str, *, timeout: float = DEFAULT_TIMEOUT
) -> InFlight:
    """Combine every rank's values, matched by key name, in one collective.

    First every rank says what it logged (which keys, at which steps) through
    devicekit's own gloo group: CPU bytes, so even with NCCL nothing waits for
    the GPU, and a rank that never arrives ends in ``RanksOutOfStepError``, not
    a hang. Only when all ranks agree are the values combined, in key order.
    The records then hold the keys in the order rank 0 logged them first (as
    a single process's records do, so a CSV has the same columns however the
    script is launched), the same on every rank.

    Raises:
        RanksDisagreeError: The ranks logged different keys or steps; every rank
            raises it, and no values are mixed.
        ValueError: A rank could not prepare its values; every rank raises it.
        RanksOutOfStepError: A rank did not arrive within ``timeout`` seconds, or an
            earlier job-wide call of this job failed (`broken_job` then says so).
    """
    import torch.distributed as dist  # noqa: PLC0415 - only when reducing

    ordered = sorted(columns, key=lambda column: column[0])  # by name: the same on every rank
    # Values on a GPU under NCCL are combined there, by the job's own group, queued on the
    # stream: no host sync. Otherwise they go through devicekit's gloo group, bounded in
    # time, which never starts CUDA. The path is chosen from every rank's answer below,
    # so that no rank waits in a collective the others never join: NCCL only when every
    # rank's values are on its GPU. (Moving a host-only rank's values to "its" GPU could
    # put two ranks on one device, which NCCL refuses or hangs on.)
    gpu = next((v.device for _, _, values in ordered for v in values if _on_cuda(v)), None)
    wants_gpu = gpu is not None and dist.get_backend() == "nccl"
    device = gpu if wants_gpu and gpu is not None else torch.device("cpu")
    # Compared as data, never as joined text (a key may hold ", "), and the steps
    # themselves, not only how many: values of different steps never combine.
    layout: _Layout | None = (
        tuple(steps),
        tuple((key, None if rows is None else tuple(rows)) for key, rows, _ in ordered),
    )
    said = f"logged {_summary(ordered, steps)}"
    flat: torch.Tensor | None = None
    unreadable: list[tuple[str, Any, Exception]] = []
    try:
        flat, unreadable = _flatten(steps, ordered, device)
    except Exception as error:  # noqa: BLE001 - every rank must still hear of it
        layout, said = None, f"could not prepare its values: {error!r}"
    what = _what(op)
    logged = tuple(key for key, _, _ in columns)  # in order of first appearance
    answer: _Answer = (layout, said, wants_gpu, logged)
    answers = gather_objects(answer, timeout=timeout, what=what)
    _check_agreement(answers, op)  # the same verdict on every rank, from the same answers
    assert flat is not None
    if not ordered:  # every rank had nothing to send, and all agree
        return InFlight(steps, [])
    on_gpu = all(wants for _, _, wants, _ in answers)
    if wants_gpu and not on_gpu:  # a rank's values are all on the host: gloo, on the host
        flat = flat.cpu()
    flat = _combine(flat, op, on_gpu=on_gpu, what=what, timeout=timeout)
    in_flight = InFlight(steps, [], unreadable=unreadable)
    offset = 0
    for key, rows, values in ordered:
        floats: list[Any] = [None] * len(values)
        in_flight.columns.append((key, rows, floats))
        in_flight.fills.append((0, offset, floats, 0, len(values)))
        offset += len(values)
    # Combined in name order; recorded in rank 0's order (the ranks agree on the keys).
    named = {column[0]: column for column in in_flight.columns}
    in_flight.columns = [named[key] for key in answers[0][3]]
    _copy_to_host(in_flight, flat)
    return in_flight


_Layout = tuple[tuple[Any, ...], tuple[tuple[str, tuple[int, ...] | None], ...]]
"""What a rank logged in one flush: its steps, and each key with its rows (None: all)."""
_Answer = tuple[_Layout | None, str, bool, tuple[str, ...]]
"""A rank's answer: its layout, its summary, whether its values are on its GPU, its keys."""


def _flatten(
    steps: Sequence[Any], ordered: list[_Column], device: torch.device
) -> tuple[torch.Tensor, list[tuple[str, Any, Exception]]]:
    """Every value as one float64 tensor on ``device``, and those that could not be read."""
    try:
        return _concatenated(ordered, device), []
    except Exception:  # noqa: BLE001 - a value changed since log(): read each (NaN for it)
        each = read_each(steps, ordered)
        return _concatenated(each.columns, device), each.unreadable


def _concatenated(columns: list[_Column], device: torch.device) -> torch.Tensor:
    return torch.cat(
        [torch.zeros(0, dtype=torch.float64, device=device)]
        + [_as_float64(values, device) for _, _, values in columns]
    )


def _describe(layout: _Layout | None) -> str:
    if layout is None:
        return "None"
    steps, keys = layout
    if not steps:
        return "logged nothing since the last flush"
    shown = ", ".join(
        repr(key) if rows is None else f"{key!r} at rows {list(rows)}" for key, rows in keys
    )
    return f"steps {list(steps)}; keys {shown}"


def _check_agreement(answers: list[_Answer], op: str) -> None:
    """Raise unless every rank prepared its values and logged the same keys at the same steps."""
    layouts = [layout for layout, _, _, _ in answers]
    summaries = [said for _, said, _, _ in answers]
    if len(set(summaries)) == 1 and len(set(layouts)) > 1:  # they differ in what no summary shows
        summaries = [shorten(_describe(layout), 300) for layout in layouts]
    lines = "\n".join(f"  rank {rank}: {text}" for rank, text in enumerate(summaries))
    if None in layouts:  # may pass (out of memory): the values stay pending, to try again
        raise ValueError(
            f"LogBuffer(reduce={op!r}) cannot combine this flush: a rank could not prepare its "
            f"values:\n{lines}\nThe values stay pending; the next flush tries again."
        )
    if len(set(layouts)) > 1:  # never passes: trying again would fail again, every time
        raise RanksDisagreeError(
            f"LogBuffer(reduce={op!r}) cannot combine this flush: the ranks disagree, and values "
            f"are matched by key name and step, never by position:\n{lines}\nEach rank records "
            "its own values of this flush, unreduced, so none is lost. Log the same keys at the "
            "same steps on every rank (log a NaN where a rank has no value; pass the step "
            "explicitly where ranks may log different numbers of times, since the default step "
            "counts this rank's own log() calls)."
        )


def _combine(
    flat: torch.Tensor, op: str, *, on_gpu: bool, what: str, timeout: float
) -> torch.Tensor:
    """Every rank's ``flat`` combined by ``op``, in one collective: NCCL's or devicekit's gloo."""
    import torch.distributed as dist  # noqa: PLC0415 - only when reducing

    count = flat.numel()
    if op in ("max", "min"):
        # gloo's MAX keeps or drops a NaN by rank order; NaN must win wherever a rank had
        # one. Still one collective: min is the max of the negated values, and each
        # value's NaN flag (1.0 or 0.0) travels beside it under the same MAX.
        sign = -1.0 if op == "min" else 1.0
        flat = torch.cat([flat * sign, flat.isnan().to(flat.dtype)])
        reduce_op = dist.ReduceOp.MAX
    else:
        reduce_op = dist.ReduceOp.SUM  # a NaN on any rank makes the sum NaN
        if op == "mean":  # divided first: a sum of large values would overflow to inf
            flat /= dist.get_world_size()
    if on_gpu:
        dist.all_reduce(flat, op=reduce_op)
    else:
        all_reduce(flat, reduce_op, timeout=timeout, what=what)
    if op in ("max", "min"):
        nan = flat[count:] > 0
        flat = (flat[:count] * sign).masked_fill_(nan, math.nan)
    return flat


def _on_cuda(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda


def _as_float64(values: list[Any], device: torch.device) -> torch.Tensor:
    """One column as a float64 tensor on ``device``: one stack when the values allow it."""
    if all(value.__class__ is float or value.is_cpu for value in values):
        return torch.tensor(list(map(float, values)), dtype=torch.float64).to(device)
    if all(isinstance(value, _Tensor) for value in values):
        kinds = {(value.device, value.dtype) for value in values}
        if len(kinds) == 1:
            return torch.stack(values).to(device=device, dtype=torch.float64)
    return torch.stack(
        [
            torch.as_tensor(value, dtype=torch.float64).to(device)
            if isinstance(value, float)
            else value.to(device=device, dtype=torch.float64)
            for value in values
        ]
    )


def _summary(columns: list[_Column], steps: Sequence[Any]) -> str:
    """What a rank logged, after ``logged``: ``2 steps (0 to 1) of loss``, or ``nothing ...``."""
    if not steps:  # a flush with nothing pending still joins the collective
        return "nothing since the last flush"
    keys = ", ".join(
        key if rows is None else f"{key} ({plural(len(rows), 'step')})" for key, rows, _ in columns
    )
    return f"{plural(len(steps), 'step')}{_step_range(steps)} of {keys or 'nothing'}"


def _step_range(steps: Sequence[Any]) -> str:
    """`` (3 to 5)`` for consecutive steps, else the first few: where the ranks stand."""
    if not steps:
        return ""
    first = steps[0]
    if list(steps) == list(range(first, first + len(steps))):
        return f" ({first})" if len(steps) == 1 else f" ({first} to {steps[-1]})"
    shown = ", ".join(map(str, steps[:4]))
    return f" ({shown}{', ...' if len(steps) > 4 else ''})"
