"""Whether the ranks' reducing flushes can combine, and if not, why: the same verdict on each.

Every rank of a reducing [`LogBuffer`][devicekit.LogBuffer] flush says what it
logged (its `Layout`: steps, and each key's rows) and how (its `Terms`: op,
``flush_every``, and what kind of flush this is), and each rank reaches the same
verdict from the same answers (`agreed_entries`): combine all, combine the
entries every rank holds from the front (ranks out of step by a flush
realign), or raise, every rank, with what each logged and the fix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from ._errors import RanksDisagreeError
from ._format import shorten
from ._logreport import made_differently

__all__ = [
    "Answer",
    "FlushKind",
    "Layout",
    "ReduceOp",
    "Terms",
    "agreed_entries",
    "check_agreement",
    "final_ranks",
    "ranks_ended",
]

ReduceOp = Literal["mean", "sum", "max", "min"]
"""How a reducing buffer combines each value across ranks."""

FlushKind = Literal["automatic", "flush", "final"]
"""Which flush: ``log()``'s every ``flush_every`` calls, a ``flush()`` call, or the last
one, at the end of the ``with`` block (after which that rank flushes no more)."""


Layout = tuple[tuple[Any, ...], tuple[tuple[str, tuple[int, ...] | None], ...]]
"""What a rank logged in one flush: its steps, and each key with its rows (None: all)."""
Answer = tuple[Layout | None, str, bool, tuple[str, ...]]
"""A rank's answer: its layout, its summary, whether its values are on its GPU, its keys."""
Terms = tuple[str, int | None, FlushKind]
"""How a rank's buffer reduces: its op, its ``flush_every``, and which flush this is."""


def _describe(layout: Layout | None) -> str:
    if layout is None:
        return "None"
    steps, keys = layout
    if not steps:
        return "logged nothing since the last flush"
    shown = ", ".join(
        repr(key) if rows is None else f"{key!r} at rows {list(rows)}" for key, rows in keys
    )
    return f"steps {list(steps)}; keys {shown}"


def agreed_entries(answers: list[Answer], terms: list[Terms], op: ReduceOp) -> int | None:
    """How many entries, from the front, the ranks combine (None: all); raise if none can be.

    All when every rank logged the same. Fewer when the ranks realign (see
    `start_reduced`): their first entries agree as far as the shortest rank's
    go, and every rank that holds more is in an automatic flush. Never where
    some ranks are in their final flush and others are not: a rank whose
    block ended flushes no more, so what the ranks hold apart would never
    meet. Else the reasons of `check_agreement`, with what the ranks'
    ``terms`` explain.

    Raises:
        RanksDisagreeError: The ranks' buffers reduce by different ops, or the
            ranks logged different keys or steps; its ``ended_ranks`` are the
            ranks in their final flush where some others were not.
        ValueError: A rank could not prepare its values.
    """
    made = [(rank_op, flush_every) for rank_op, flush_every, _ in terms]
    if len(set(made)) > 1:  # never passes, whatever was logged
        raise RanksDisagreeError(made_differently(made, op))
    layouts = [layout for layout, _, _, _ in answers]
    if all(layout is not None for layout in layouts) and len(set(layouts)) > 1:
        kinds = [kind for _, _, kind in terms]
        ended = final_ranks(terms)
        if ended and len(ended) < len(kinds):  # they flush no more: the rest never meets
            error = RanksDisagreeError(_ended_apart(answers, op, ended))
            error.ended_ranks = ended
            raise error
        shortest = min(len(layout[0]) for layout in layouts if layout is not None)
        if len({first_layout(layout, shortest) for layout in layouts}) == 1:
            if all(
                kind == "automatic" or len(layout[0]) == shortest
                for layout, kind in zip(layouts, kinds, strict=True)
                if layout is not None
            ):
                return shortest
            check_agreement(answers, op, flushed_apart=True)  # out of step by a flush
        latest = _apart_from(layouts)
        # The same steps in another order, unless the ranks' windows agree over two
        # entries or more from the latest first step on (steps that repeat, such as a
        # batch index per epoch, may look reordered in windows that flushed apart).
        if _reordered(layouts) and (latest is None or _window(layouts, latest) < 2):
            check_agreement(answers, op, reordered=True)
        if latest is not None:  # flush() on several ranks at different steps: never realigns
            check_agreement(answers, op, flushed_apart=True, agree_from=latest)
    check_agreement(answers, op)
    return None


def _reordered(layouts: Sequence[Layout | None]) -> bool:
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


def _window(layouts: Sequence[Layout | None], latest: int) -> int:
    """How many entries every rank holds from its step ``latest`` on (see `_apart_from`)."""
    return min(len(layout[0]) - layout[0].index(latest) for layout in layouts if layout is not None)


def _apart_from(layouts: Sequence[Layout | None]) -> int | None:
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
    later: list[Layout] = []
    for layout in layouts:
        assert layout is not None
        if latest not in layout[0]:
            return None
        later.append(_later_layout(layout, layout[0].index(latest)))
    shortest = min(len(layout[0]) for layout in later)
    return latest if len({first_layout(layout, shortest) for layout in later}) == 1 else None


def _later_layout(layout: Layout, skip: int) -> Layout:
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


def first_layout(layout: Layout | None, count: int) -> Layout | None:
    """``layout`` of a rank's first ``count`` entries only, as `start_reduced` would make it.

    Examples:
        >>> first_layout(((3, 4, 5), (("a", (1, 2)), ("b", None), ("c", (2,)))), 2)
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


def check_agreement(
    answers: list[Answer],
    op: ReduceOp,
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
    lines = _said(answers)
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
            f"shortest flush goes: {_numbered_apart(layouts)}"
            "the ranks flushed at different points, which flush() called "
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
            "same steps on every rank (log a NaN where a rank has no value, such as a batch "
            "one rank skipped with `continue` or an exception it caught; pass the step "
            "explicitly where ranks may log different numbers of times, since the default step "
            "counts this rank's own log() calls)."
        )


def _numbered_apart(layouts: Sequence[Layout | None]) -> str:
    """The first cause, where every rank's flush holds as many steps: their numbers differ.

    An automatic flush holds ``flush_every`` steps on every rank: windows of
    one length that start at different steps are most often steps numbered
    differently (``log(i + rank, ...)``, a counter one rank started at 1).
    """
    lengths = {len(layout[0]) for layout in layouts if layout is not None}
    if len(lengths) != 1:
        return ""
    return (
        "each rank's flush holds as many steps, so either the ranks number their steps "
        "differently (a step counter that starts elsewhere on one rank, a step one rank "
        "skipped), or "
    )


def _said(answers: list[Answer]) -> str:
    """What each rank logged, a line each: its summary, or its layout where those agree."""
    layouts = [layout for layout, _, _, _ in answers]
    summaries = [said for _, said, _, _ in answers]
    if len(set(summaries)) == 1 and len(set(layouts)) > 1:  # they differ in what no summary shows
        summaries = [shorten(_describe(layout), 300) for layout in layouts]
    return "\n".join(f"  rank {rank}: {text}" for rank, text in enumerate(summaries))


def final_ranks(terms: Sequence[Terms]) -> tuple[int, ...]:
    """The ranks in their final flush: their ``with`` block ended, they flush no more."""
    return tuple(rank for rank, (_, _, kind) in enumerate(terms) if kind == "final")


def ranks_ended(ended: Sequence[int]) -> str:
    """``"rank 1 ended its"`` or ``"ranks 1, 2 ended their"``, for the messages about them."""
    many = len(ended) > 1
    ranks = ", ".join(map(str, ended))
    return f"rank{'s' if many else ''} {ranks} ended {'their' if many else 'its'}"


def _ended_apart(answers: list[Answer], op: ReduceOp, ended: Sequence[int]) -> str:
    """Why the ranks whose block ended cannot combine with the others, which hold other steps."""
    return (
        f"LogBuffer(reduce={op!r}) cannot combine this flush: {ranks_ended(ended)} "
        "with block (the last flush) while the "
        f"ranks hold different steps:\n{_said(answers)}\nA rank whose block has ended "
        "flushes no more, so what the ranks hold apart could never be combined. Each rank "
        "records its own values, unreduced, so none is lost, and so do the other ranks to "
        "the end of their blocks, without waiting for those that ended. Log the same keys "
        "at the same steps on every rank (a value only some ranks have, such as validation "
        "on rank 0 only, goes in a LogBuffer of its own, with reduce=None, on those ranks), "
        "and call flush() on every rank or on none: a flush() on one rank only, to print, "
        "makes its flushes hold other steps than the others'."
    )
