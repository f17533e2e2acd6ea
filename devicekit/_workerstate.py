"""One worker as the parent sees it: its process, its pipe, and what it is doing.

And the processes it started: stopping a worker stops what its ``fn``
started too (``subprocess.Popen``, and what those start), so that none
outlives a map that stopped the workers. A worker stays in its parent's
process group (``_worker``), so its processes cannot be told apart by group;
they are found as its descendants, by parent PID, in ``/proc``: each
thread's ``task/<tid>/children``, or, where the kernel has no such file
(``CONFIG_PROC_CHILDREN`` is off), every ``/proc/<pid>/stat``. Where there
is no ``/proc`` (macOS), none are found, and only the workers are stopped.

A PID names a process only until that process is reaped; then the system
may give it to another one, which a signal to the PID would reach. So each
process found is recorded with its start time (field 22 of
``/proc/<pid>/stat``, in clock ticks since boot), and is signalled only
while the PID still has that start time. A process is listed as a child
only if its own ``stat`` names the parent, and a parent's children only if
the parent still has its start time once they are read: the worker's is
read when it starts, so a worker reaped meanwhile, and a PID of another
process, have no children here. The worker's start time is recorded only if
``/proc`` is this process's own (``/proc/self`` names it) and the worker's
``stat`` names this process as its parent: a ``/proc`` of another PID
namespace (``unshare -pf`` without ``--mount-proc``, some sandboxes) numbers
other processes, and the worker's PID there is another process, whose
descendants must not be signalled; there, as without ``/proc``, only the
workers are stopped.

A worker that ends by itself (``os._exit`` in ``fn``, a segfault, the
out-of-memory killer) leaves its processes to init (or a subreaper): by the
time the parent sees it dead, no ``/proc`` parent PID leads from it to them.
So each worker marks the processes it starts: it adds ``<its PID>-<its start
time>`` to ``DEVICEKIT_WORKER`` in its environment (``_worker.MARK``), which
every process started below it inherits. For a worker that was already dead
when a stop began (``orphans``), and for no other, the processes of this
user whose ``/proc/<pid>/environ`` names it that way and that started no
earlier than it are taken (``marked``), then their descendants by parent
PID. A live worker's processes are found by parent PID alone: a mark is
copied into processes ``fn`` never meant to tie to the map (a tmux or screen
server that ``fn`` started and the user went on using, a job that ``at``
replays with the environment it was given, a ``nohup`` daemon), and an
orderly stop, the end of every map, must not stop those. A PID and a start
time name one process since boot, so a mark names one worker, dead or
alive, never a later process given its PID; the environment is the
process's to change, so a mark is a hint that it came from below the
worker, and is trusted only within this user's processes (which could
signal ours anyway), from a process that started after the worker, and with
the start-time check before every signal. Not found: a process that dropped
the mark from its environment (``env={}``, ``env -u DEVICEKIT_WORKER``), and
a child the worker forked without running a program (``/proc`` shows the
environment a program was started with, and the worker's own has no mark:
it was added after).

Weighed and left: looking the busy workers' descendants up at every tick of
the map (a scan of ``/proc`` per tick, bounded by ``_MOST``, and what
started since the last tick is still lost); ``PR_SET_CHILD_SUBREAPER`` on a
worker (its orphans go to its parent, so its own death still loses them),
or on the caller (every orphan of the user's process would be the caller's
to reap); a cgroup per worker (not open to unprivileged users).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._procfs import read_stat
from ._worker import MARK

__all__ = [
    "Orphans",
    "Procs",
    "Slot",
    "Worker",
    "child_start_time",
    "descendants",
    "marked",
    "names",
    "orphans",
    "running",
    "signal_each",
    "start_time",
    "wait_ended",
]

Slot = str | int  # "cpu", or a CUDA index as this process numbers it
Procs = dict[int, int]  # processes, each as its PID and its start time
_PROC = "/proc"
_MOST = 4096  # descendants looked up per call: a fork bomb in fn must not hang the stop
_POLL_SECONDS = 0.05  # how often a wait reads whether processes have ended


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
    # Its start time, read once it was started: its PID is its own while /proc says so.
    started: int | None = None

    def where(self) -> str:
        """``"worker 2 on cuda:1"``, ``"worker 1 on the CPU"``."""
        device = "the CPU" if self.slot == "cpu" else f"cuda:{self.slot}"
        return f"worker {self.number} on {device}"

    def alive(self) -> bool:
        """Whether the process still runs."""
        return bool(self.process.is_alive())

    def wait(self, seconds: float | None) -> None:
        """Wait until it has ended, ``seconds`` at most (None: as long)."""
        self.process.join(seconds)

    def exit_code(self, wait: float = 0.0) -> int | None:
        """Its exit code, minus the signal that ended it; None while it runs (after ``wait`` s)."""
        self.wait(wait)
        code: int | None = self.process.exitcode
        return code

    def as_procs(self) -> Procs:
        """``{pid: start time}`` of the worker, or ``{}`` where it cannot be looked up."""
        pid = self.process.pid
        return {} if pid is None or self.started is None else {pid: self.started}


@dataclass(frozen=True)
class Orphans:
    """A worker that died, and the processes it had started that run on (maybe none)."""

    worker: Worker
    procs: Procs
    names: dict[int, str]  # {pid: its name}, read while it ran


def orphans(workers: list[Worker], *, proc: str = _PROC) -> list[Orphans]:
    """Each dead worker of these, with the processes it had started that run on.

    Found by the mark in their environment (`marked`), in one scan for all
    of them, then their descendants by parent PID; none where ``descendants``
    finds none. Look them up before ``stop_workers`` runs, and hand them to
    it: their names are read now, as a process that has ended has none. Live
    workers are left out: their processes are found by parent PID, and a
    mark copied into a process ``fn`` never started (a tmux server it
    started, say, later used for other work) must not tie it to an orderly
    stop.
    """
    dead = [worker for worker in workers if not worker.alive()]
    roots: Procs = {}
    for worker in dead:
        roots.update(worker.as_procs())
    by_root = _marks(roots, proc) if roots and _listable(proc) else {}
    found = []
    for worker in dead:
        pid = next(iter(worker.as_procs()), None)
        procs = dict(by_root.get(pid, {})) if pid is not None else {}
        procs.update(descendants(procs, proc=proc))
        found.append(Orphans(worker, procs, names(procs, proc=proc)))
    return found


def start_time(pid: int, proc: str = _PROC) -> int | None:
    """When the process ``pid`` started (clock ticks since boot); None if there is none.

    Examples:
        >>> start_time(os.getpid()) == start_time(os.getpid())
        True
    """
    found = _stat(pid, proc)
    return None if found is None else found[2]


def child_start_time(pid: int, proc: str = _PROC) -> int | None:
    """When ``pid`` started, if ``proc`` is this process's own and says it is our child; else None.

    Examples:
        >>> child_start_time(os.getpid()) is None  # our own process is not our child
        True
    """
    if not _ours(proc):
        return None
    found = _stat(pid, proc)
    return None if found is None or found[1] != os.getpid() else found[2]


def descendants(roots: Procs, *, proc: str = _PROC) -> Procs:
    """Every process below ``roots`` that is still the process its parent started.

    Found by parent PID only (those of a root that has ended: `orphans`). A
    root whose PID no longer has its start time has no descendants here. At
    most ``_MOST`` are looked up; ``{}`` where there is no ``/proc``, or where
    ``/proc`` is another PID namespace's (its PIDs are not ours).
    """
    if not _listable(proc):
        return {}
    found: Procs = {}
    todo = deque(roots.items())
    table: dict[int, Procs] | None = None  # children by parent, from one read of /proc
    while todo and len(found) < _MOST:
        pid, started = todo.popleft()
        children = _children(pid, proc)
        if children is None:  # no children files: every process's stat says its parent
            table = _by_parent(proc) if table is None else table
            children = table.get(pid, {})
        # Read after the list: were the PID another process's by now, the list may be its.
        if start_time(pid, proc) != started:
            continue
        for child, child_started in children.items():
            if child not in found and child not in roots and len(found) < _MOST:
                found[child] = child_started
                todo.append((child, child_started))
    return found


def marked(roots: Procs, *, proc: str = _PROC) -> Procs:
    """The processes of this user whose environment says a root worker started them.

    Each carries ``<root's PID>-<root's start time>`` in ``DEVICEKIT_WORKER``
    and started no earlier than that root. The roots themselves and this
    process are left out; at most ``_MOST`` are found. ``{}`` where this
    system has no users' IDs (Windows). For roots that have died only
    (`orphans`): see the module's docstring.
    """
    found: Procs = {}
    for procs in _marks(roots, proc).values():
        found.update(procs)
    return found


def _marks(roots: Procs, proc: str) -> dict[int, Procs]:
    """`marked`, by the root each carries the mark of: ``{root's PID: {pid: start time}}``."""
    getuid = getattr(os, "getuid", None)
    if getuid is None or not roots:
        return {}
    wanted = {f"{pid}-{started}".encode(): (pid, started) for pid, started in roots.items()}
    earliest = min(roots.values())
    uid, ours = getuid(), os.getpid()
    found: dict[int, Procs] = {}
    count = 0
    with contextlib.suppress(OSError), os.scandir(proc) as entries:
        for entry in entries:
            if count >= _MOST:
                break
            pid = int(entry.name) if entry.name.isdigit() else ours
            if pid == ours or pid in roots or not _owned_by(entry, uid):
                continue
            # Its stat first, which never blocks: reading a process's environ takes its
            # memory map's lock, which a hung process (in the kernel, mid-fault) may hold
            # for ever. Only a process that started after the earliest root can carry
            # one's mark, so most are passed over here, unread (and the scan is cheaper,
            # with a thousand processes); and only roots that have died are looked for.
            stat = _stat(pid, proc)
            if stat is None or stat[2] < earliest:
                continue
            root = _marked_by(pid, wanted, proc)
            if root is not None and stat[2] >= root[1]:  # after its worker: not an older PID
                found.setdefault(root[0], {})[pid] = stat[2]
                count += 1
    return found


def names(procs: Procs, *, proc: str = _PROC) -> dict[int, str]:
    """``{pid: its name}`` (``"sleep"``) for each of ``procs`` that is still that process."""
    shown: dict[int, str] = {}
    for pid, started in procs.items():
        read = read_stat(pid, proc)
        with contextlib.suppress(IndexError, ValueError):  # a stat cut short: not shown
            if read is not None and int(read[1][19]) == started:
                shown[pid] = read[0]
    return shown


def signal_each(procs: Procs, signum: int, *, proc: str = _PROC) -> list[int]:
    """Send ``signum`` to each of ``procs`` that is still the process recorded; say to which."""
    return [pid for pid, started in procs.items() if _signal(pid, started, signum, proc)]


def wait_ended(procs: Procs, seconds: float | None, *, proc: str = _PROC) -> None:
    """Wait until none of ``procs`` runs (a zombie has ended), ``seconds`` at most."""
    end = None if seconds is None else time.monotonic() + seconds
    while any(_running(pid, started, proc) for pid, started in procs.items()):
        if end is not None and time.monotonic() >= end:
            return
        time.sleep(_POLL_SECONDS)


def _signal(pid: int, started: int, signum: int, proc: str) -> bool:
    """Signal ``pid`` if it still started at ``started``; whether it was signalled."""
    # A pidfd holds the process it was opened on: checked after it is opened, the
    # start time says that the signal goes where it was meant to, even if the PID
    # is reused in between. Without one (before Linux 5.3), os.kill right after.
    pidfd: int | None = None
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        with contextlib.suppress(OSError):  # gone, or a kernel without pidfds
            pidfd = pidfd_open(pid)
    try:
        if start_time(pid, proc) != started:
            return False
        if pidfd is None:
            os.kill(pid, signum)
        elif not _pidfd_signal(pidfd, signum):  # refused: os.kill, right after a check
            if start_time(pid, proc) != started:
                return False
            os.kill(pid, signum)
    except OSError:  # it has ended (and was reaped) meanwhile, or is not ours to signal
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return True


def _pidfd_signal(pidfd: int, signum: int) -> bool:
    """Send ``signum`` through ``pidfd``; False where the system refuses pidfd signals.

    Raises:
        ProcessLookupError: The process has ended.
    """
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        raise
    except OSError:  # ENOSYS, EPERM: a seccomp filter, gVisor; os.kill may still work
        return False
    return True


def _ours(proc: str) -> bool:
    """Whether ``proc`` numbers processes as this process does: its ``self`` is this PID."""
    try:
        return os.readlink(f"{proc}/self") == str(os.getpid())
    except OSError:  # no /proc, or one of a PID namespace this process is not in
        return False


def running(procs: Procs, *, proc: str = _PROC) -> Procs:
    """Those of ``procs`` that still run (a zombie has ended), as the processes recorded."""
    return {pid: started for pid, started in procs.items() if _running(pid, started, proc)}


def _owned_by(entry: os.DirEntry[str], uid: int) -> bool:
    """Whether the process of a ``/proc`` entry is this user's (its directory is)."""
    try:
        return entry.stat(follow_symlinks=False).st_uid == uid
    except OSError:  # it has ended
        return False


def _marked_by(pid: int, wanted: dict[bytes, tuple[int, int]], proc: str) -> tuple[int, int] | None:
    """The root (PID, start time) whose mark ``pid``'s environment carries; None if none."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as file:
            environ = file.read()
    except OSError:  # ended, or not ours to read
        return None
    prefix = MARK.encode() + b"="
    for variable in environ.split(b"\0"):
        if variable.startswith(prefix):
            for token in variable[len(prefix) :].split():
                if token in wanted:
                    return wanted[token]
    return None


def _listable(proc: str) -> bool:
    """Whether ``proc`` can be searched for processes: Linux's, this namespace's, or a test's."""
    if proc == _PROC and not (sys.platform.startswith("linux") and _ours(proc)):
        return False  # another system's /proc says no parents; another namespace's, other PIDs
    return os.path.isdir(proc)


def _running(pid: int, started: int, proc: str) -> bool:
    found = _stat(pid, proc)
    return found is not None and found[2] == started and found[0] != "Z"


def _stat(pid: int, proc: str) -> tuple[str, int, int] | None:
    """``(state, parent PID, start time)`` from ``/proc/<pid>/stat``; None if unreadable."""
    read = read_stat(pid, proc)
    if read is None:  # no such process (or no /proc)
        return None
    fields = read[1]  # field 3 on
    try:
        return fields[0].decode("ascii", "replace"), int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _children(pid: int, proc: str) -> Procs | None:
    """The children of ``pid`` that say so themselves; None where the kernel cannot list them."""
    listed: set[int] = set()
    try:
        threads = os.listdir(f"{proc}/{pid}/task")
    except OSError:  # it has ended
        return {}
    for thread in threads:
        try:
            with open(f"{proc}/{pid}/task/{thread}/children", "rb") as file:
                listed.update(int(child) for child in file.read().split())
        except FileNotFoundError:
            if os.path.isdir(f"{proc}/{pid}/task/{thread}"):
                return None  # the thread is there, its file is not: CONFIG_PROC_CHILDREN is off
        except PermissionError:
            return None  # not ours to read: every stat is
        except (OSError, ValueError):  # the thread has ended meanwhile
            continue
    found: Procs = {}
    for child in listed:
        stat = _stat(child, proc)
        if stat is not None and stat[1] == pid:  # not a PID reused since the list was read
            found[child] = stat[2]
    return found


def _by_parent(proc: str) -> dict[int, Procs]:
    """Every process of ``proc``, as ``{parent PID: {PID: start time}}``."""
    table: dict[int, Procs] = {}
    with contextlib.suppress(OSError), os.scandir(proc) as entries:
        for entry in entries:
            if entry.name.isdigit():
                stat = _stat(int(entry.name), proc)
                if stat is not None:
                    table.setdefault(stat[1], {})[int(entry.name)] = stat[2]
    return table
