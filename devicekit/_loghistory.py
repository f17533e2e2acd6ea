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

    def land(self, flight: Flight) -> Landed:
        """Land ``flight`` (again, harmlessly): its batch, in history once only."""
        if flight.landed is None:
            flight.landed = land(flight.values)  # kept: landing again gives the same object
        landed = flight.landed
        self.keys.update(dict.fromkeys(key for key, _, _ in landed.columns))
        batches = self.batches
        if landed.steps and not (batches and batches[-1] is landed):
            batches.append(landed)  # the commit
        return landed

    def counts(self) -> tuple[int, int]:
        """How many records, and how many NaN or infinite values, the history holds."""
        records, nonfinite, seen = self._counted
        end = len(self.batches)  # a flush on another thread may append meanwhile
        for batch in self.batches[seen:end]:
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
        ]
        return {"columns": batches, "keys": [*self.keys]}

    @classmethod
    def from_plain(cls, state: dict[str, Any]) -> History:
        """The history `to_plain` wrote, or the dicts per step an earlier version wrote."""
        if "columns" in state:
            batches = (
                Landed.of(steps, [(key, rows, floats) for key, rows, floats in columns], count)
                for steps, columns, count in state["columns"]
            )
        else:
            batches = (_from_records(records, count) for records, count in state["batches"])
        return cls(batches, state["keys"])


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
