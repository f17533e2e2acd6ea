"""A [`LogBuffer`][devicekit.LogBuffer]'s records on the host, kept whole through Ctrl-C.

Ctrl-C raises ``KeyboardInterrupt`` between any two bytecodes, and a notebook
user carries on with the same buffer. So each change of state here is made
in one step that leaves the buffer whole whether or not it ran, and the steps
around it can be run again without effect:

- A flush's values stay in ``_pending`` until its flight is set (`Flight`, the
  commit); only then are they taken off the front, and `settle` does that
  again, doing nothing the second time, wherever a flight is read.
- A landed flight's batch is kept on it, so landing it again gives the very
  same object, and `History.land` appends it only if the last batch is not
  it already (one ``list.append``, the commit); the flight is let go after.
- What is counted (NaN values, records) is counted from the batches, not added
  up as they land, so nothing is counted twice or never.

Each batch keeps its values by key (`Landed`), not as a dict per step; the
dicts are built when asked for. Pickled, the batches are plain lists and
numbers: a saved buffer needs no class of devicekit's but `LogBuffer`
(``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._logdeliver import Record
from ._logflush import InFlight, Landed, by_key, land, records_of

__all__ = ["Flight", "History", "mean_of", "settle"]

Entry = tuple[Any, dict[str, Any], int]
"""One ``log()`` call, pending: (step, values, how to read them)."""


@dataclass
class Flight:
    """A flush on its way to the host, and what its values left behind in ``_pending``."""

    values: InFlight
    first: Entry | None  # the first pending entry it took (by identity), or None
    count: int  # how many pending entries it took, from the front
    taken: int  # the buffer's count of log() calls taken off _pending, with these
    landed: Landed | None = None  # its batch, once landed


def settle(flight: Flight, pending: list[Entry]) -> int:
    """Take ``flight``'s entries off the front of ``pending`` if still there; the new count.

    Runs right after the flight is set and again before it lands: the second
    time (or after Ctrl-C between the two), it changes nothing. ``log()`` only
    appends, so the entries are still in front if they were not taken.
    """
    if flight.count and pending and pending[0] is flight.first:
        del pending[: flight.count]  # one step
    return flight.taken


class History:
    """Every landed flush's values, oldest first, as one batch per flush."""

    def __init__(self, batches: Iterable[Landed] = (), keys: Iterable[str] = ()):
        self.batches: list[Landed] = list(batches)
        self.keys: dict[str, None] = dict.fromkeys(keys)  # in order of first appearance
        self._counted = (0, 0, 0)  # records and NaN values in the first n batches, n
        self._compacted = 0  # batches before this one are merged as far as they will be

    def land(self, flight: Flight) -> Landed:
        """Land ``flight`` (again, harmlessly): its batch, in history once only."""
        if flight.landed is None:
            flight.landed = land(flight.values)  # kept: landing again gives the same object
        landed = flight.landed
        keys = self.keys
        for key, _, _ in landed.columns:
            keys[key] = None
        batches = self.batches
        if landed.steps and not (batches and batches[-1] is landed):
            batches.append(landed)  # the commit
        return landed

    def compact(self, *, upto: int) -> None:
        """Merge small batches before ``upto`` (every sink has had them) into one.

        A flush of one step (``flush_every=1``, a flush per epoch) lands a batch
        of its own, with a tuple per key: 630 bytes a record of three keys, where
        64 steps merged take 150. The merged batch takes the first one's place
        and the others become `EMPTY`, in one slice assignment: no index moves
        (the sinks' count of batches had stays true), and Ctrl-C leaves either
        the batches or their merge. Only batches already counted (`counts`) are
        merged, so that a count read meanwhile, without the lock (a repr), stays
        true, and never the last, which a flush in flight lands again by identity.
        """
        start = self._compacted
        if upto - start < _MERGED:
            return
        self.counts()  # brings the count up to date: only what it has counted is merged
        end = min(upto, self._counted[2], len(self.batches) - 1)
        batches = self.batches[start:end]
        if len(batches) < _MERGED:
            return
        if sum(len(batch.steps) for batch in batches) > _SMALL * len(batches):
            self._compacted = end  # large batches: nothing to gain
            return
        self.batches[start:end] = [_merged(batches), *[EMPTY] * (len(batches) - 1)]  # the commit
        self._compacted = end

    def counts(self) -> tuple[int, int]:
        """How many records, and how many NaN or infinite values, the history holds."""
        records, nonfinite, seen = self._counted
        end = len(self.batches)  # a flush on another thread may append meanwhile
        batches = self.batches[seen:end]
        if EMPTY in batches:  # merged since that count (`compact`, on another thread)
            records, nonfinite, batches = 0, 0, self.batches[:end]
        for batch in batches:
            records += len(batch.steps)
            nonfinite += batch.nonfinite
        self._counted = (records, nonfinite, end)
        return records, nonfinite

    def records(self) -> list[Record]:
        """New dicts of every record, oldest first."""
        return records_of(self.batches)

    def latest(self) -> Record | None:
        """A new dict of the newest record, or None."""
        return self.batches[-1].last_record() if self.batches else None

    def values(self, key: str, last: int | None = None) -> list[float]:
        """The values of ``key``, oldest first; only the ``last`` ones, read from the end."""
        found: list[float] = []
        if last is None:
            for floats in self._columns_of(key, self.batches):
                found += floats
            return found
        for floats in self._columns_of(key, reversed(self.batches)):
            found[:0] = floats[-(last - len(found)) :]
            if len(found) == last:
                break
        return found

    @staticmethod
    def _columns_of(key: str, batches: Iterable[Landed]) -> Iterable[Sequence[float]]:
        """The floats of ``key`` in each of ``batches`` that has it ("step": the steps)."""
        for batch in batches:
            if key == "step":  # every record has one, as with a dict per step
                yield batch.steps
                continue
            for name, _, floats in batch.columns:
                if name == key:
                    yield floats
                    break

    def to_plain(self) -> dict[str, Any]:
        """The history as lists, dicts and numbers (for pickling)."""
        batches = [
            [
                list(batch.steps),
                [[key, rows and list(rows), list(floats)] for key, rows, floats in batch.columns],
                batch.nonfinite,
            ]
            for batch in self.batches
            if batch is not EMPTY
        ]
        return {"columns": batches, "keys": [*self.keys]}

    @classmethod
    def from_plain(cls, state: dict[str, Any]) -> History:
        """The history `to_plain` wrote, or the dicts per step an earlier version wrote."""
        if "columns" in state:
            batches = (
                Landed.of(steps, columns, count) for steps, columns, count in state["columns"]
            )
        else:
            batches = (_from_records(records, count) for records, count in state["batches"])
        return cls(batches, state["keys"])


_MERGED = 64  # batches merged at once, at least
_SMALL = 16  # steps a batch holds on average, at most, for a merge to be worth it
EMPTY = Landed((), (), 0)
"""What a merged batch leaves in the places of the others: no step, no key."""


def _merged(batches: list[Landed]) -> Landed:
    """One batch of every step of ``batches``, keys in order of first appearance."""
    steps: list[Any] = []
    columns: dict[str, tuple[list[int], list[float]]] = {}
    nonfinite = 0
    for batch in batches:
        offset, count = len(steps), len(batch.steps)
        steps += batch.steps
        nonfinite += batch.nonfinite
        for key, rows, floats in batch.columns:
            column = columns.get(key)
            if column is None:
                column = columns[key] = ([], [])
            if rows is None:
                column[0].extend(range(offset, offset + count))
            else:
                column[0].extend(offset + row for row in rows)
            column[1].extend(floats)
    merged = [
        (key, None if len(rows) == len(steps) else rows, floats)
        for key, (rows, floats) in columns.items()
    ]
    return Landed.of(steps, merged, nonfinite)


def _from_records(records: list[Record], nonfinite: int) -> Landed:
    """A batch saved as one dict per step (devicekit 0.x before columns), as columns."""
    steps = [record["step"] for record in records]
    values = [{key: value for key, value in record.items() if key != "step"} for record in records]
    return Landed.of(steps, by_key(values) if values else [], nonfinite)


def mean_of(values: list[float]) -> float:
    """The mean of ``values`` from their exact sum (``math.fsum``); NaN and infinities propagate.

    ``sum()`` loses what cancels (``[1e16, 1.0, -1e16]`` gave 0.0, not 1/3) and
    overflows where the mean does not (``[1e308, 1e308]`` gave inf); ``fsum``
    is exact, and the values are divided first where their sum overflows.

    Examples:
        >>> mean_of([1e16, 1.0, -1e16]), mean_of([1e308, 1e308]), mean_of([0.1] * 10)
        (0.3333333333333333, 1e+308, 0.1)
    """
    count = len(values)
    try:
        return math.fsum(values) / count
    except OverflowError:  # a sum past the largest float, of finite values
        return math.fsum(value / count for value in values)
    except ValueError:  # inf and -inf: as sum() says, and as the mean is
        return math.nan
