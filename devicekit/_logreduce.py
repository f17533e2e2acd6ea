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
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from ._dist import DEFAULT_TIMEOUT, all_reduce, gather_objects
from ._errors import RanksDisagreeError, RanksOutOfStepError
from ._format import plural, shorten
from ._jobstate import Job, refuse_if_broken, this_job
from ._logflush import Column, InFlight, copy_to_host, read_each
from ._logreport import made_differently

__all__ = ["broken_job", "start_reduced"]

_Tensor = torch.Tensor


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
    steps: Sequence[Any],
    columns: list[Column],
    op: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    flush_every: int | None = None,
    automatic: bool = False,
) -> InFlight:
    """Combine every rank's values, matched by key name, in one collective.

    First every rank says what it logged (which keys, at which steps) and how
    it reduces (``op``, ``flush_every``, whether this flush is ``log()``'s
    ``automatic`` one) through devicekit's own gloo group: CPU bytes, so even
    with NCCL nothing waits for the GPU, and a rank that never arrives ends in
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
    terms: _Terms = (op, flush_every, automatic)
    # Met as one call whatever the op, which is compared with the rest: buffers that
    # reduce differently disagree (every flush, records unreduced), not "different calls".
    gathered = gather_objects((answer, terms), timeout=timeout, what=what, meets=_MEETS)
    answers = [answer for answer, _ in gathered]
    # The same verdict on every rank, from the same answers.
    take = _agreed_entries(answers, [terms for _, terms in gathered], op)
    assert flat is not None
    taken: int | None = None
    if take is not None and take < len(steps):  # realigned: the later entries stay pending
        ordered, flat = _first_rows(ordered, flat, take)
        kept = set(steps[:take])
        unreadable = [spoiled for spoiled in unreadable if spoiled[1] in kept]
        steps, taken = steps[:take], take
    if not ordered:  # every rank had nothing to send, and all agree
        return InFlight(steps, [], taken=taken)
    on_gpu = all(wants for _, _, wants, _ in answers)
    if wants_gpu and not on_gpu:  # a rank's values are all on the host: gloo, on the host
        flat = flat.cpu()
    flat = _combine(flat, op, on_gpu=on_gpu, what=what, timeout=timeout)
    in_flight = InFlight(steps, [], unreadable=unreadable, taken=taken)
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


_Layout = tuple[tuple[Any, ...], tuple[tuple[str, tuple[int, ...] | None], ...]]
"""What a rank logged in one flush: its steps, and each key with its rows (None: all)."""
_Answer = tuple[_Layout | None, str, bool, tuple[str, ...]]
"""A rank's answer: its layout, its summary, whether its values are on its GPU, its keys."""
_Terms = tuple[str, int | None, bool]
"""How a rank's buffer reduces: its op, its ``flush_every``, whether this flush is automatic."""
_MEETS = "LogBuffer(reduce=...).flush()"
"""What every rank's reducing flush meets as, whatever its op (compared in `_Terms`)."""


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


def _agreed_entries(answers: list[_Answer], terms: list[_Terms], op: str) -> int | None:
    """How many entries, from the front, the ranks combine (None: all); raise if none can be.

    All when every rank logged the same. Fewer when the ranks realign (see
    `start_reduced`): their first entries agree as far as the shortest rank's
    go, and every rank that holds more is in an automatic flush. Else the
    reasons of `_check_agreement`, with what the ranks' ``terms`` explain.

    Raises:
        RanksDisagreeError: The ranks' buffers reduce by different ops, or the
            ranks logged different keys or steps.
        ValueError: A rank could not prepare its values.
    """
    made = [(rank_op, flush_every) for rank_op, flush_every, _ in terms]
    if len(set(made)) > 1:  # never passes, whatever was logged
        raise RanksDisagreeError(made_differently(made, op))
    layouts = [layout for layout, _, _, _ in answers]
    if all(layout is not None for layout in layouts) and len(set(layouts)) > 1:
        shortest = min(len(layout[0]) for layout in layouts if layout is not None)
        if len({_first_layout(layout, shortest) for layout in layouts}) == 1:
            if all(
                automatic or layout is None or len(layout[0]) == shortest
                for layout, (_, _, automatic) in zip(layouts, terms, strict=True)
            ):
                return shortest
            _check_agreement(answers, op, flushed_apart=True)  # out of step by a flush
        latest = _apart_from(layouts)
        # The same steps in another order, unless the ranks' windows agree over two
        # entries or more from the latest first step on (steps that repeat, such as a
        # batch index per epoch, may look reordered in windows that flushed apart).
        if _reordered(layouts) and (latest is None or _window(layouts, latest) < 2):
            _check_agreement(answers, op, reordered=True)
        if latest is not None:  # flush() on several ranks at different steps: never realigns
            _check_agreement(answers, op, flushed_apart=True, agree_from=latest)
    _check_agreement(answers, op)
    return None


def _reordered(layouts: Sequence[_Layout | None]) -> bool:
    """Whether the ranks logged the same steps, as many times each, in different orders.

    Examples:
        >>> _reordered([((1, 2), (("a", None),)), ((2, 1), (("a", None),))])
        True
        >>> _reordered([((1, 2), (("a", None),)), ((2, 3), (("a", None),))])
        False
    """
    steps = [layout[0] for layout in layouts if layout is not None]
    if len(steps) < len(layouts) or len(set(steps)) < 2:
        return False
    counted = [Counter(each) for each in steps]
    return all(count == counted[0] for count in counted)


def _window(layouts: Sequence[_Layout | None], latest: int) -> int:
    """How many entries every rank holds from its step ``latest`` on (see `_apart_from`)."""
    return min(len(layout[0]) - layout[0].index(latest) for layout in layouts if layout is not None)


def _apart_from(layouts: Sequence[_Layout | None]) -> int | None:
    """The step from which the ranks' entries agree, when they are out of step by a flush.

    Ranks that each called ``flush()`` at a different step hold windows of the
    same entries that start at different steps: rank 0 steps 2 to 5, rank 1
    steps 3 to 6. Each rank's entries from the latest first step on (3) then
    agree as far as the shortest goes. None when that is not so (the ranks
    logged different keys or steps), or when the ranks start at the same step.

    Examples:
        >>> rank0 = ((2, 3, 4, 5), (("loss", None),))
        >>> _apart_from([rank0, ((3, 4, 5, 6), (("loss", None),))])
        3
        >>> print(_apart_from([rank0, ((3, 4, 5, 6), (("acc", None),))]))
        None
    """
    if any(layout is None or not layout[0] for layout in layouts):
        return None
    firsts = [layout[0][0] for layout in layouts if layout is not None]
    latest = max(firsts)
    if len(set(firsts)) == 1:
        return None
    later: list[_Layout] = []
    for layout in layouts:
        assert layout is not None
        if latest not in layout[0]:
            return None
        later.append(_later_layout(layout, layout[0].index(latest)))
    shortest = min(len(layout[0]) for layout in later)
    return latest if len({_first_layout(layout, shortest) for layout in later}) == 1 else None


def _later_layout(layout: _Layout, skip: int) -> _Layout:
    """``layout`` without its first ``skip`` entries, rows counted from the first one kept.

    Examples:
        >>> _later_layout(((3, 4, 5), (("a", (0, 2)), ("b", None), ("c", (0,)))), 1)
        ((4, 5), (('a', (1,)), ('b', None)))
    """
    steps, keys = layout
    count = len(steps) - skip
    kept: list[tuple[str, tuple[int, ...] | None]] = []
    for key, rows in keys:
        if rows is None:
            kept.append((key, None))
            continue
        later = tuple(row - skip for row in rows if row >= skip)
        if later:
            kept.append((key, None if len(later) == count else later))
    return tuple(steps[skip:]), tuple(kept)


def _first_layout(layout: _Layout | None, count: int) -> _Layout | None:
    """``layout`` of a rank's first ``count`` entries only, as `start_reduced` would make it.

    Examples:
        >>> _first_layout(((3, 4, 5), (("a", (1, 2)), ("b", None), ("c", (2,)))), 2)
        ((3, 4), (('a', (1,)), ('b', None)))
    """
    if layout is None:
        return None
    steps, keys = layout
    kept: list[tuple[str, tuple[int, ...] | None]] = []
    for key, rows in keys:
        if rows is None:
            if count:
                kept.append((key, None))
            continue
        first = tuple(row for row in rows if row < count)  # rows ascend: a prefix
        if first:
            kept.append((key, None if len(first) == count else first))
    return tuple(steps[:count]), tuple(kept)


def _first_rows(
    ordered: list[Column], flat: torch.Tensor, count: int
) -> tuple[list[Column], torch.Tensor]:
    """The columns and ``flat`` values of the first ``count`` entries only (see `_first_layout`).

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


def _check_agreement(
    answers: list[_Answer],
    op: str,
    *,
    flushed_apart: bool = False,
    agree_from: int | None = None,
    reordered: bool = False,
) -> None:
    """Raise unless every rank prepared its values and logged the same keys at the same steps.

    ``flushed_apart``: the ranks logged the same entries as far as the
    shortest rank's go (from step ``agree_from`` on, when given: see
    `_apart_from`), and are out of step only by a flush; the error says so.
    ``reordered``: the ranks logged the same steps in different orders (see
    `_reordered`); the error says that instead.
    """
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
    if len(set(layouts)) > 1 and reordered:  # never passes either
        raise RanksDisagreeError(
            f"LogBuffer(reduce={op!r}) cannot combine this flush: the ranks logged the same "
            f"steps in a different order:\n{lines}\nValues are matched by key name and step "
            "in the order each rank logged them, so a step logged out of order on one rank "
            "would meet another step's values. Each rank records its own values of this "
            "flush, unreduced, so none is lost. Log the steps in the same order on every rank "
            "(the loop's order, not the order in which threads or workers finish)."
        )
    if len(set(layouts)) > 1 and flushed_apart:  # never passes either
        where = "" if agree_from is None else f"from step {agree_from} on, "
        raise RanksDisagreeError(
            f"LogBuffer(reduce={op!r}) cannot combine this flush: the ranks disagree, they "
            f"flushed different steps:\n{lines}\nWhat they logged agrees {where}as far as the "
            "shortest flush goes: the ranks flushed at different points, which flush() called "
            "on one rank only, or on several ranks at different steps, does. Each rank records "
            "its own values of this flush, unreduced, so none is lost. The automatic flushes "
            "realign the ranks only after a flush() on one rank only; ranks that each called "
            "flush() at a different step stay apart, and every later flush raises this until "
            "flush() is called at the same step on every rank. Call flush() on every rank at the "
            "same step (or flush only at the end of the with block and through the automatic "
            "flushes), and log the same steps on every rank."
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
