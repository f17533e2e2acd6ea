"""How a [`LogBuffer`][devicekit.LogBuffer]'s records reach its sinks: each once, in order.

A flush lands its records in ``history`` first, then queues them here; the
queue hands each landed flush to every sink, oldest first. Records wait here,
not in the sinks' hands, so that nothing is lost or handed on twice when a
sink raises, logs (which may start a flush while the sinks run), or removes
itself from the list. Which of the sinks' errors a flush raises, and how the
others are told, is ``_logreport``'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Deliveries", "Record", "Sink"]

Record = dict[str, Any]
"""One logged step on the host: ``{"step": 12, "loss": 0.25, ...}``."""
Sink = Callable[[list[Record]], Any]
"""Anything that takes the new records of a flush."""


class Deliveries:
    """The landed flushes not yet handed to every sink, and the loop that hands them on."""

    def __init__(self) -> None:
        # One entry per landed flush: [records, index of the next sink].
        self._queue: deque[list[Any]] = deque()
        self._running = False  # the sinks are running (one may log, and so flush)

    def __bool__(self) -> bool:
        """Whether some landed records have not reached every sink yet."""
        return bool(self._queue)

    def add(self, records: list[Record]) -> None:
        """Queue a landed flush's records for every sink."""
        self._queue.append([records, 0])

    def unsent(self) -> int:
        """How many records some sink has not had yet."""
        return sum(len(records) for records, _ in self._queue)

    def deliver(self, sinks: list[Sink]) -> list[tuple[Sink, BaseException]]:
        """Hand each landed flush to every sink, in order; what each failing sink raised.

        Each sink gets its own copies of the records, so one that changes them
        (``record.pop("step")``) changes nothing for ``history`` or the other
        sinks. A sink that logs may start a flush: that flush delivers nothing,
        and this loop hands its records on after the ones before them. A sink
        interrupted by Ctrl-C (or that calls ``sys.exit``) counts as done, and
        is not called again by this loop; the other sinks still get the
        records, and the interrupt is among the errors returned, for the
        caller to raise once they have (``_logreport.flush_error``).
        """
        if self._running:
            return []
        self._running = True
        errors: list[tuple[Sink, BaseException]] = []
        interrupted: set[int] = set()  # id() of the sinks Ctrl-C got out of
        queue = self._queue
        try:
            # Only what had landed when this call began: what the sinks log meanwhile
            # waits for the next flush, so a sink that logs at every record cannot
            # keep this loop going forever.
            for _ in range(len(queue)):
                entry = queue[0]
                records, first = entry
                current = list(sinks)  # a sink may remove itself from the list
                for index in range(first, len(current)):
                    entry[1] = index + 1
                    if id(current[index]) in interrupted:
                        continue
                    try:
                        current[index](list(map(dict.copy, records)))
                    except Exception as error:  # noqa: BLE001 - every sink runs; one is raised
                        errors.append((current[index], error))
                    except BaseException as error:  # noqa: BLE001 - Ctrl-C: raised once all ran
                        errors.append((current[index], error))
                        interrupted.add(id(current[index]))
                queue.popleft()
        finally:
            self._running = False
        return errors
