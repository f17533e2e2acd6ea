"""A reducing [`LogBuffer`][devicekit.LogBuffer]'s flush across ranks: check, then combine.

Every rank arranges its values by key name (`_logflush.by_key`), checks with
the other ranks (over devicekit's gloo group, ``_dist``) that all logged the
same and reduce alike (``reduce``, ``flush_every``), and only then combines
them in one ``all_reduce`` (or, for ranks out of step by a flush, the entries
all of them hold: see `start_reduced`); the combined records keep rank 0's
keys in the order it logged them, on every rank, as one rank's records keep
its own. Once the job's collectives are broken for good (`broken_job`),
nothing can be combined any more, and the buffer records each rank's own
values instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ._dist import DEFAULT_TIMEOUT, all_reduce, gather_objects
from ._errors import RanksDisagreeError, RanksOutOfStepError
from ._format import plural
from ._jobstate import Job, refuse_if_broken, this_job
from ._logagree import (
    Answer,
    FlushKind,
    Layout,
    ReduceOp,
    Terms,
    agreed_entries,
    final_ranks,
)
from ._logflush import Column, InFlight, copy_to_host, read_each

__all__ = ["broken_job", "start_reduced"]

_Tensor = torch.Tensor


def broken_job(op: ReduceOp) -> RanksOutOfStepError | None:
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


def _what(op: ReduceOp) -> str:
    return f"LogBuffer(reduce={op!r}).flush()"


def start_reduced(
    steps: Sequence[Any],
    columns: list[Column],
    op: ReduceOp,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    flush_every: int | None = None,
    kind: FlushKind = "flush",
) -> InFlight:
    """Combine every rank's values, matched by key name, in one collective.

    First every rank says what it logged (which keys, at which steps) and how
    it reduces (``op``, ``flush_every``, and which ``kind`` of flush this is:
    ``log()``'s automatic one, a ``flush()`` call, or the block's final one)
    through devicekit's own gloo group: CPU bytes, so even with NCCL nothing
    waits for the GPU, and a rank that never arrives ends in
    ``RanksOutOfStepError``, not a hang. Only when all ranks agree are the
    values combined, in key order. The records then hold the keys in the
    order rank 0 logged them first (as a single process's records do, so a
    CSV has the same columns however the script is launched), the same on
    every rank.

    Ranks out of step by a flush (a ``flush()`` on one rank only, or
    ``flush_every`` differing) realign here when they can, provably without
    mixing steps or losing a value: when the ranks' first entries agree, step
    for step and key for key, and every rank holding more than the shortest
    is in an automatic flush (which never promised to take everything), only
    those first entries are combined, and each rank keeps the rest pending
    (`InFlight.taken`), for its next flush, which then meets the others'.
    Ranks that each called ``flush()`` at a different step never realign:
    their entries start at different steps, every later flush disagrees, and
    the error says so (`_apart_from`), never to pass steps already passed.

    Raises:
        RanksDisagreeError: The ranks logged different keys or steps, or their
            buffers reduce by different ops; every rank raises it, and no values
            are mixed.
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
    layout: Layout | None = (
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
    answer: Answer = (layout, said, wants_gpu, logged)
    terms: Terms = (op, flush_every, kind)
    # Met as one call whatever the op, which is compared with the rest: buffers that
    # reduce differently disagree (every flush, records unreduced), not "different calls".
    gathered = gather_objects((answer, terms), timeout=timeout, what=what, meets=_MEETS)
    answers = [answer for answer, _ in gathered]
    # The same verdict on every rank, from the same answers.
    all_terms = [terms for _, terms in gathered]
    try:
        take = agreed_entries(answers, all_terms, op)
    except RanksDisagreeError as error:
        if kind == "final":  # told of the others' ends: its own block is ending too
            error.ended_ranks = ()
        raise
    # Ranks whose block ended in this flush flush no more: this rank's flushes to the end
    # of its block would wait for them until the timeout (its flush() met their last).
    ended = () if kind == "final" else final_ranks(all_terms)
    assert flat is not None
    taken: int | None = None
    if take is not None and take < len(steps):  # realigned: the later entries stay pending
        ordered, flat = _first_rows(ordered, flat, take)
        steps, taken = steps[:take], take
        if unreadable:  # those of the entries taken: told by row, as a step may repeat
            unreadable = read_each(steps, ordered).unreadable
    if not ordered:  # every rank had nothing to send, and all agree
        return InFlight(steps, [], taken=taken, ended_ranks=ended)
    on_gpu = all(wants for _, _, wants, _ in answers)
    if wants_gpu and not on_gpu:  # a rank's values are all on the host: gloo, on the host
        flat = flat.cpu()
    flat = _combine(flat, op, on_gpu=on_gpu, what=what, timeout=timeout)
    in_flight = InFlight(steps, [], unreadable=unreadable, taken=taken, ended_ranks=ended)
    offset = 0
    for key, rows, values in ordered:
        floats: list[Any] = [None] * len(values)
        in_flight.columns.append((key, rows, floats))
        in_flight.fills.append((0, offset, floats, 0, len(values)))
        offset += len(values)
    # Combined in name order; recorded in rank 0's order (the ranks agree on the keys).
    named = {column[0]: column for column in in_flight.columns}
    in_flight.columns = [named[key] for key in answers[0][3] if key in named]
    copy_to_host(in_flight, flat)
    return in_flight


_MEETS = "LogBuffer(reduce=...).flush()"
"""What every rank's reducing flush meets as, whatever its op (compared in `Terms`)."""


def _flatten(
    steps: Sequence[Any], ordered: list[Column], device: torch.device
) -> tuple[torch.Tensor, list[tuple[str, Any, Exception]]]:
    """Every value as one float64 tensor on ``device``, and those that could not be read."""
    try:
        return _concatenated(ordered, device), []
    except Exception:  # noqa: BLE001 - a value changed since log(): read each (NaN for it)
        each = read_each(steps, ordered)
        return _concatenated(each.columns, device), each.unreadable


def _concatenated(columns: list[Column], device: torch.device) -> torch.Tensor:
    return torch.cat(
        [torch.zeros(0, dtype=torch.float64, device=device)]
        + [_as_float64(values, device) for _, _, values in columns]
    )


def _first_rows(
    ordered: list[Column], flat: torch.Tensor, count: int
) -> tuple[list[Column], torch.Tensor]:
    """The columns and ``flat`` values of the first ``count`` entries only (``first_layout``).

    Each column's rows ascend, so its values of those entries are its first
    ones: one slice each of ``flat``, which holds the columns one after another.
    """
    columns: list[Column] = []
    parts = [flat[:0]]
    offset = 0
    for key, rows, values in ordered:
        kept = count if rows is None else sum(row < count for row in rows)
        if kept:
            first = None if rows is None or kept == count else rows[:kept]
            columns.append((key, first, values[:kept]))
            parts.append(flat[offset : offset + kept])
        offset += len(values)
    return columns, torch.cat(parts)


def _combine(
    flat: torch.Tensor, op: ReduceOp, *, on_gpu: bool, what: str, timeout: float
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


def _summary(columns: list[Column], steps: Sequence[Any]) -> str:
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
