"""One worker as the parent sees it: its process, its pipe, and what it is doing.

A worker leads a process group, in a session of its own (``_worker``), that
holds the processes ``fn`` starts, so that stopping the worker can stop them
too (``_dispatch.stop_workers`` signals the group). The group's ID is the
worker's PID, and a PID is the worker's own only until the worker is reaped
(waited for): after that the system may give it to another process, whose
group a signal would then reach. So a worker's state is read here without
reaping it, where ``os.waitid`` can (``_peek``), and ``stop_workers`` reaps a
worker only after its last signal to the group.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Slot", "Worker"]

Slot = str | int  # "cpu", or a CUDA index as this process numbers it
_POLL_SECONDS = 0.05  # how often a wait checks a worker's PID


@dataclass
class Worker:
    """One worker process and the parent's end of its pipe, with what it is doing."""

    number: int
    slot: Slot
    process: Any  # a spawn-context Process
    conn: Any  # the parent's end of the duplex pipe
    ready: bool = False
    running: int | None = None  # the index of the item it is working on
    # The item it will run once it has loaded fn: each worker takes one at once, so
    # that two items on two workers run one on each (on each GPU), whichever starts first.
    next_item: int | None = None
    fn_id: int = -1  # the map whose fn it was sent: each map numbers its fn
    loaded: int = -1  # the map whose fn it has unpickled
    deadline: float | None = None  # when its item's, or its start-up's, time is up (monotonic)
    owner: int = field(default_factory=os.getpid)  # the process that started it: its parent

    def where(self) -> str:
        """``"worker 2 on cuda:1"``, ``"worker 1 on the CPU"``."""
        device = "the CPU" if self.slot == "cpu" else f"cuda:{self.slot}"
        return f"worker {self.number} on {device}"

    def alive(self) -> bool:
        """Whether the process still runs (a dead one is not reaped, where that can be told)."""
        peeked = _peek(self.process)
        return self.process.is_alive() if peeked is None else not peeked[0]

    def unreaped(self) -> bool:
        """Whether its PID, and so its process group's ID, is still its own."""
        return _peek(self.process) is not None

    def wait(self, seconds: float | None) -> None:
        """Wait until it has ended, ``seconds`` at most (None: as long), without reaping it."""
        if _peek(self.process) is None:
            self.process.join(seconds)
            return
        end = None if seconds is None else time.monotonic() + seconds
        while self.alive():
            left = _POLL_SECONDS if end is None else min(end - time.monotonic(), _POLL_SECONDS)
            if left <= 0:
                return
            # Its sentinel is ready once it has exited, unless a process it started
            # (with os.fork, say) holds that pipe too: the PID is checked each time.
            multiprocessing.connection.wait([self.process.sentinel], left)

    def exit_code(self, wait: float = 0.0) -> int | None:
        """Its exit code, minus the signal that ended it; None while it runs (after ``wait`` s)."""
        self.wait(wait)
        peeked = _peek(self.process)
        return self.process.exitcode if peeked is None else peeked[1]

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to its process group: the worker and the processes ``fn`` started."""
        killpg = getattr(os, "killpg", None)
        if killpg is not None:
            # No such group: the worker has not made it yet (nor started anything).
            with contextlib.suppress(OSError):
                killpg(self.process.pid, signum)


def _peek(process: Any) -> tuple[bool, int | None] | None:
    """``(ended, exit code)`` of a worker not yet reaped, read without reaping it.

    ``os.waitid`` with ``WNOWAIT`` leaves a dead worker a zombie, which keeps
    its PID. None where this cannot be told (no ``os.waitid``, a process not
    started, one already reaped): multiprocessing's own calls, which reap,
    answer then.
    """
    waitid = getattr(os, "waitid", None)
    if waitid is None or process.pid is None:
        return None
    try:
        found = waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (multiprocessing has its exit code)
        return None
    if found is None:
        return False, None
    exited = found.si_code == os.CLD_EXITED
    return True, found.si_status if exited else -found.si_status
