"""A [`LogBuffer`][devicekit.LogBuffer]'s records on the host, kept whole through Ctrl-C.

Ctrl-C raises ``KeyboardInterrupt`` between any two bytecodes, and a notebook
user carries on with the same buffer. So each change of state here is made
in one step that leaves the buffer whole whether or not it ran, and the steps
around it can be run again without effect:

- A flush's values stay in ``_pending`` until its flight is set (`Flight`, the
  commit); only then are they taken off the front, and `settle` does that
  again, doing nothing the second time, wherever a flight is read.
- A landed flight's records are kept on it, so landing it again gives the very
  same objects, and `History.land` appends them only if the last batch is not
  them already (one ``list.append``, the commit); the flight is let go after.
- What is counted (NaN values, records) is counted from the batches, not added
  up as they land, so nothing is counted twice or never.

The batches are plain lists, dicts and numbers: a pickled buffer needs no
class of devicekit's but `LogBuffer` (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._logdeliver import Record
from ._logflush import InFlight, land

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
    landed: tuple[list[Record], int] | None = None  # its records and NaN count, once landed


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
    """Every landed flush's records, oldest first, as one batch per flush."""

    def __init__(self, batches: Iterable[tuple[list[Record], int]] = (), keys: Iterable[str] = ()):
        self.batches: list[tuple[list[Record], int]] = list(batches)  # (records, NaN count)
        self.keys: dict[str, None] = dict.fromkeys(keys)  # in order of first appearance
        self._counted = (0, 0, 0)  # records and NaN values in the first n batches, n

    def land(self, flight: Flight) -> list[Record]:
        """Land ``flight`` (again, harmlessly): its records, in history once only."""
        if flight.landed is None:
            flight.landed = land(flight.values)  # kept: landing again gives the same objects
        records, nonfinite = flight.landed
        self.keys.update(dict.fromkeys(key for key, _, _ in flight.values.columns))
        batches = self.batches
        if records and not (batches and batches[-1][0] is records):
            batches.append((records, nonfinite))  # the commit
        return records

    def counts(self) -> tuple[int, int]:
        """How many records, and how many NaN or infinite values, the history holds."""
        records, nonfinite, seen = self._counted
        end = len(self.batches)  # a flush on another thread may append meanwhile
        for batch, count in self.batches[seen:end]:
            records += len(batch)
            nonfinite += count
        self._counted = (records, nonfinite, end)
        return records, nonfinite

    def records(self) -> list[Record]:
        """Copies of every record, oldest first."""
        return [record.copy() for batch, _ in self.batches for record in batch]

    def latest(self) -> Record | None:
        """The newest record itself, or None."""
        return self.batches[-1][0][-1] if self.batches else None

    def values(self, key: str, last: int | None = None) -> list[float]:
        """The values of ``key``, oldest first; only the ``last`` ones, read from the end."""
        if last is None:
            return [record[key] for batch, _ in self.batches for record in batch if key in record]
        found: list[float] = []
        for batch, _ in reversed(self.batches):
            for record in reversed(batch):
                if key in record:
                    found.append(record[key])
                    if len(found) == last:
                        return found[::-1]
        return found[::-1]

    def to_plain(self) -> dict[str, Any]:
        """The history as lists, dicts and numbers (for pickling)."""
        return {"batches": [[batch, count] for batch, count in self.batches], "keys": [*self.keys]}

    @classmethod
    def from_plain(cls, state: dict[str, Any]) -> History:
        """The history `to_plain` wrote."""
        return cls(((batch, count) for batch, count in state["batches"]), state["keys"])


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
