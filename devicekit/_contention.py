"""What other processes took from this process's CPU cores while it was being timed.

The 1-minute load average says little about a 0.2-second benchmark: it is
system-wide, it counts this process too, and it lags. This module measures
the timing window itself, on the cores this process may run on
(``os.sched_getaffinity``):

1. ``/proc/stat`` gives each core's busy time (user, nice, system, irq and
   softirq) in clock ticks. Summed over our cores and differenced across the
   window, it is what *every* process did there.
2. ``getrusage(RUSAGE_SELF)`` gives this process's own CPU time (all its
   threads), precisely. Busy minus own is what the *others* took.
3. ``ru_nivcsw`` counts involuntary context switches: how often the
   scheduler took a core away from this process.
4. ``/proc/stat``'s steal column is the time a hypervisor gave our virtual
   cores' host CPUs to other machines.

Two reads of ``/proc/stat`` and ``getrusage`` per window, about 25 µs each:
nothing per call. The counters tick at ``USER_HZ`` (100 per second), so each
core's busy time is known to one tick; the verdict allows for that. When
contention is found, a scan of ``/proc/*/stat``, limited to half a percent of
the window's time, names processes seen running on our cores as the window
closed. Off Linux all of it is ``None``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ._procfs import read_stat

__all__ = ["CpuEvidence", "CpuWindow", "allowed_cpus", "contended"]

CONTENDED_SHARE = 0.1  # others took a tenth of our cores: the result depends on them
_MAX_NAMED = 5  # processes named in a note
_NAMING_SHARE = 0.005  # of the window: the most that naming competitors may cost
_BUSY_COLUMNS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq
_STEAL_COLUMN = 7


def _tick() -> float:
    try:
        return 1.0 / os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):  # no sysconf: Linux's usual 100 Hz
        return 0.01


TICK = _tick()


def allowed_cpus() -> frozenset[int] | None:
    """The CPUs this thread may run on, or None where the OS does not say."""
    affinity = getattr(os, "sched_getaffinity", None)
    return None if affinity is None else frozenset(affinity(0))


def contended(cpu_time: float, window: float, cores: int) -> bool:
    """Whether ``cpu_time`` seconds taken by others over ``window`` on ``cores`` distort a timing.

    More than a tenth of the cores' time counts, and always more than the
    counters' resolution (one tick per core at each end of the window).

    Examples:
        >>> contended(0.9, window=1.0, cores=2), contended(0.05, window=1.0, cores=2)
        (True, False)
    """
    return cpu_time > max(CONTENDED_SHARE * cores * window, (cores + 1) * TICK)


_PROC_STAT = "/proc/stat"


def _proc_stat(cpus: frozenset[int]) -> tuple[int, int] | None:
    """Busy and steal ticks summed over ``cpus``; None unless ``/proc/stat`` lists each of them.

    The affinity mask holds online CPUs only, and ``/proc/stat`` lists every
    online CPU, so one missing means the file describes other CPUs than ours:
    a container's ``/proc/stat`` rewritten by LXCFS numbers its CPUs from 0.
    Summing what matched would report an idle machine, not an unknown one.
    """
    try:
        with open(_PROC_STAT, "rb") as file:
            text = file.read()
    except OSError:
        return None
    busy = steal = 0
    seen: set[int] = set()
    for line in text.split(b"\n")[1:]:  # the first line is the total of all CPUs
        if not line.startswith(b"cpu"):
            break  # per-CPU lines come first
        name, *values = line.split()
        if not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        seen.add(int(name[3:]))
        ticks = [int(v) for v in values]
        busy += sum(ticks[i] for i in _BUSY_COLUMNS if i < len(ticks))
        steal += ticks[_STEAL_COLUMN] if len(ticks) > _STEAL_COLUMN else 0
    return (busy, steal) if seen == cpus else None


def _own_usage() -> tuple[float, int] | None:
    """This process's CPU seconds (every thread) and involuntary context switches."""
    try:
        import resource  # noqa: PLC0415 - Unix only
    except ImportError:  # Windows
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_nivcsw


def running_on(cpus: frozenset[int], *, budget: float = 1.0) -> tuple[tuple[int, str | None], ...]:
    """(pid, name) of a few other processes running or runnable on ``cpus`` now.

    Newest processes are read first: a competitor is more often a job started
    lately than a daemon from boot. Reading one costs about 15 µs; the scan
    stops after ``budget`` seconds, so naming them cannot cost the caller much.
    """
    me, deadline = os.getpid(), time.perf_counter() + budget
    found: list[tuple[int, str | None]] = []
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return ()
    for pid in sorted(pids, reverse=True):
        if pid == me:
            continue
        if len(found) == _MAX_NAMED or time.perf_counter() > deadline:
            break
        read = read_stat(pid)
        if read is None:  # it exited, or it is not ours to read
            continue
        name, fields = read
        # fields[0] is the state (field 3); fields[36] the CPU it last ran on (field 39).
        if len(fields) > 36 and fields[0] == b"R" and int(fields[36]) in cpus:
            found.append((pid, name or None))
    return tuple(sorted(found))


@dataclass(frozen=True)
class CpuEvidence:
    """What `CpuWindow` saw; every field None where the OS does not say."""

    window: float | None = None
    other_cpu_time: float | None = None
    steal_time: float | None = None
    preemptions: int | None = None
    competitors: tuple[tuple[int, str | None], ...] | None = None


class CpuWindow:
    """Measures, between `start()` and `stop()`, what other processes took."""

    def __init__(self) -> None:
        self.cpus = allowed_cpus()
        self.began: float | None = None
        self.ticks: tuple[int, int] | None = None
        self.own: tuple[float, int] | None = None

    def start(self) -> None:
        """Open the window."""
        self.ticks = None if self.cpus is None else _proc_stat(self.cpus)
        self.own = _own_usage()
        self.began = time.perf_counter()

    def stop(self) -> CpuEvidence:
        """Close the window and account for it."""
        if self.began is None:
            return CpuEvidence()  # never opened
        window = time.perf_counter() - self.began
        own = _own_usage()
        preemptions = None if own is None or self.own is None else own[1] - self.own[1]
        if self.cpus is None or self.ticks is None or own is None or self.own is None:
            return CpuEvidence(window=window, preemptions=preemptions)
        ticks = _proc_stat(self.cpus)
        if ticks is None:
            return CpuEvidence(window=window, preemptions=preemptions)
        cores = len(self.cpus)
        busy = (ticks[0] - self.ticks[0]) * TICK
        # Ticks attribute whole 10 ms slices, so over a short window others can
        # read a little below zero or above the cores' capacity: clamp.
        others = min(max(busy - (own[0] - self.own[0]), 0.0), cores * window)
        steal = min((ticks[1] - self.ticks[1]) * TICK, cores * window)
        # Naming competitors may take half a percent of the window, no more.
        budget = _NAMING_SHARE * window
        named = running_on(self.cpus, budget=budget) if contended(others, window, cores) else None
        return CpuEvidence(window, others, steal, preemptions, named)
