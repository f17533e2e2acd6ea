"""How much host memory this process can still take, and a bound that keeps a search inside it.

On the CPU no out-of-memory error comes before the operating system's own:
Linux lets an allocation past the memory there is succeed, takes its pages as
they are written, and when none is left its out-of-memory killer ends a
process (this one, or a neighbour) with SIGKILL. Three things bound what this
process can take, and each can be read beforehand:

- the machine: ``MemAvailable`` in ``/proc/meminfo`` (what can be allocated
  without swapping, page cache the kernel can drop included);
- its container: the limit of its memory cgroup or of a parent (cgroup v2
  ``memory.max``, v1 ``memory.limit_in_bytes``), less the cgroup's working set
  (usage less its inactive page cache, as Kubernetes counts it): the limit the
  out-of-memory killer enforces inside a container;
- itself: ``ulimit -v``, the soft ``RLIMIT_AS``, a bound on its address space,
  of which ``/proc/self/statm`` gives the size in use.

`host_memory` says which leaves the least free: the out-of-memory report of
the CPU reports that one. `bounded` lowers the soft ``RLIMIT_AS`` for a block
to `search_bound`, read once when a search begins (so that a size is tried
against the same bound each time): the address space in use plus what the
machine and the cgroup leave free, less a reserve (`RESERVE`). An allocation
past it fails at once, as torch's "can't allocate memory" or Python's
``MemoryError``, instead of ending in SIGKILL; the old soft limit comes back
when the block ends, whatever ends it (a soft limit may be raised again, up
to the hard one). The address space is what a limit can be set on; it grows
at least as much as the memory in use, so the bound errs on the side of
stopping early.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ._census import device_census
from ._format import format_bytes, plural

__all__ = [
    "RESERVE",
    "HostLimit",
    "bounded",
    "can_bound",
    "cpu_note",
    "host_memory",
    "meminfo",
    "search_bound",
    "with_limit_fix",
]

RESERVE = 256 * 2**20
"""The least a bound leaves free for the rest of the machine; 5% of what is free, when more."""
_PROC = "/proc"
_NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as the largest page multiple below 2**63
# v2, then v1: the limit, the usage, and the page cache the kernel can drop first.
_FILES = {
    True: ("memory.max", "memory.current", "inactive_file"),
    False: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


class HostLimit(NamedTuple):
    """One bound on this process's host memory, and where it stands (bytes).

    Attributes:
        kind: ``"machine"``, ``"ulimit -v"`` or ``"cgroup"``.
        total: The bound: the machine's memory, the soft ``RLIMIT_AS``, the cgroup's limit.
        free: What this process can still take under it.
        where: For a cgroup, its path and limit file (``/docker/ab12 memory.max``).
    """

    kind: str
    total: int
    free: int
    where: str | None = None

    @property
    def name(self) -> str:
        """The bound in words, for reports: ``"this process's ulimit -v"``."""
        if self.kind == "ulimit -v":
            return "this process's ulimit -v"
        if self.kind == "cgroup":
            return f"the container's memory limit (cgroup {self.where})"
        return "the machine's memory"


def _linux() -> bool:
    return sys.platform.startswith("linux")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            return file.read()
    except OSError:
        return None


def meminfo() -> tuple[int | None, int | None]:
    """(total, available) bytes of this machine's memory, from ``/proc/meminfo``; None elsewhere.

    Examples:
        >>> total, available = meminfo()
        >>> total is None or 0 < (available or 1) <= total
        True
    """
    fields: dict[str, int] = {}
    for line in (_read(f"{_PROC}/meminfo") or "").splitlines():
        name, _, value = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            try:
                fields[name] = int(value.split()[0]) * 1024  # the file says kB: KiB
            except (ValueError, IndexError):
                return None, None
    return fields.get("MemTotal"), fields.get("MemAvailable")


def _address_space() -> int | None:
    """Bytes of address space this process holds now (its virtual size); None where unknown."""
    text = _read(f"{_PROC}/self/statm")
    try:
        return int((text or "").split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, IndexError, OSError):
        return None


def _soft_limit() -> int | None:
    """This process's soft ``RLIMIT_AS`` (``ulimit -v``) in bytes; None: none, or not Linux."""
    if not _linux():
        return None
    import resource  # noqa: PLC0415 - Unix only

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _number(text: str | None) -> int | None:
    try:
        return None if text is None else int(text.strip())
    except ValueError:  # v2's "max": no limit
        return None


def _cgroup_folders() -> tuple[list[tuple[str, str]], bool] | None:
    """(folder, cgroup path) of this process's memory cgroup and its parents, and whether v2.

    The parents up to the mount only: a container sees no further.
    """
    membership = _read(f"{_PROC}/self/cgroup")
    mounts = _read(f"{_PROC}/self/mountinfo")
    if membership is None or mounts is None:
        return None
    paths: dict[bool, str] = {}  # v2 ("0::/path"), and v1's memory controller
    for line in membership.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            paths.setdefault(True, path)
        elif "memory" in controllers.split(","):
            paths[False] = path
    for line in mounts.splitlines():
        # "36 25 0:31 /docker/ab /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory"
        fields, _, tail = line.partition(" - ")
        parts, kind = fields.split(" "), tail.split(" ")
        if len(parts) < 5 or len(kind) < 3:
            continue
        v2 = kind[0] == "cgroup2"
        if not (v2 or (kind[0] == "cgroup" and "memory" in kind[2].split(","))):
            continue
        mine, root, point = paths.get(v2), parts[3], parts[4]
        if mine is None or (v2 and False in paths):  # v1 holds the memory controller
            continue
        if root != "/" and not (mine + "/").startswith(root.rstrip("/") + "/"):
            continue  # the mount shows another part of the hierarchy
        inside = mine[len(root) :] if root != "/" else mine
        top = point.rstrip("/")
        folders = [top + inside.rstrip("/")]
        while len(folders[-1]) > len(top):
            folders.append(folders[-1].rsplit("/", 1)[0])
        base = root.rstrip("/")
        return [(folder, base + folder[len(top) :] or "/") for folder in folders], v2
    return None


def _stat(folder: str, name: str) -> int:
    """One number of a cgroup's ``memory.stat``; 0 where it is not there."""
    for line in (_read(f"{folder}/memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return _number(value) or 0
    return 0


def _cgroup_limit() -> HostLimit | None:
    """The cgroup limit (this process's, or a parent's) that leaves the least free; None: none."""
    found = _cgroup_folders()
    if found is None:
        return None
    folders, v2 = found
    limit_file, usage_file, idle_stat = _FILES[v2]
    best = None
    for folder, path in folders:
        limit = _number(_read(f"{folder}/{limit_file}"))
        usage = _number(_read(f"{folder}/{usage_file}"))
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        idle = _stat(folder, idle_stat)
        free = max(limit - max(usage - idle, 0), 0)
        if best is None or free < best.free:
            best = HostLimit("cgroup", limit, free, f"{path} {limit_file}")
    return best


def host_memory() -> tuple[HostLimit | None, HostLimit | None]:
    """(the machine's memory, the bound that leaves this process the least free); None: unknown.

    Examples:
        >>> machine, binding = host_memory()
        >>> machine is None or binding is not None and binding.free <= machine.free
        True
    """
    total, available = meminfo()
    machine = None if total is None or available is None else HostLimit("machine", total, available)
    bounds = [machine, _cgroup_limit() if _linux() else None]
    soft, size = _soft_limit(), _address_space()
    if soft is not None and size is not None:
        bounds.append(HostLimit("ulimit -v", soft, max(soft - size, 0)))
    known = [bound for bound in bounds if bound is not None]
    return machine, min(known, key=lambda bound: bound.free) if known else None


def _start_threads() -> None:
    """Start torch's CPU threads now, so that the address space counted includes their stacks.

    A thread started under the bound may find no room for its stack, and
    OpenMP ends the process then ("libgomp: Thread creation failed"); one op
    large enough to use every thread starts them all before the bound is set.
    """
    torch.empty(torch.get_num_threads() * 2**15 + 1).fill_(0.0)


def _room() -> int | None:
    """The least of what the machine and the cgroup leave free; None where neither says."""
    _, available = meminfo()
    cgroup = _cgroup_limit()
    limited = None if cgroup is None else cgroup.free
    room = [free for free in (available, limited) if free is not None]
    return min(room) if room else None


def search_bound() -> int | None:
    """The address-space size a search may grow this process to; None where nothing says.

    What it holds now, plus `_room`, less `RESERVE` (or 5% of the room, when
    more). None off Linux, or where neither the machine's nor the cgroup's
    free memory can be read. Starts torch's CPU threads first.
    """
    if not _linux():
        return None
    _start_threads()
    size, free = _address_space(), _room()
    if size is None or free is None:
        return None
    return size + max(free - max(RESERVE, free // 20), 0)


def can_bound() -> bool:
    """Whether `bounded` can bound this process here, or ``ulimit -v`` already does."""
    if not _linux():
        return False
    return _soft_limit() is not None or (_address_space() is not None and _room() is not None)


class _Users:
    """The blocks inside `bounded` now, and the soft limit to restore when the last ends.

    Threads may run bounded blocks at once: the first saves the soft limit,
    each lowers it further if it must, and the last restores the saved one.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.saved: int | None = None

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork


_users = _Users()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_users.after_fork)


@contextmanager
def bounded(bound: int | None) -> Iterator[int | None]:
    """Lower the soft ``RLIMIT_AS`` to ``bound`` (from `search_bound`) for the block; yield it.

    A soft limit already lower (``ulimit -v``) is kept, and yielded. With
    ``bound`` None, or off Linux, it changes nothing and yields None.
    """
    if bound is None or not _linux():
        yield None
        return
    import resource  # noqa: PLC0415 - Unix only

    entered = False
    try:
        with _users.lock:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            if _users.count == 0:
                _users.saved = soft
            _users.count += 1  # no call between these two lines: no signal lands between
            entered = True
            if soft != resource.RLIM_INFINITY:
                bound = min(bound, soft)
            resource.setrlimit(resource.RLIMIT_AS, (bound, hard))
        yield bound
    finally:
        if entered:
            with _users.lock:
                _users.count -= 1
                if _users.count == 0 and _users.saved is not None:
                    _, hard = resource.getrlimit(resource.RLIMIT_AS)
                    saved = _users.saved  # back up to at most the hard limit, if fn lowered it
                    if hard != resource.RLIM_INFINITY and (
                        saved == resource.RLIM_INFINITY or saved > hard
                    ):
                        saved = hard
                    resource.setrlimit(resource.RLIMIT_AS, (saved, hard))


def cpu_note() -> str:
    """What ``free_memory(devices="cpu")`` says: nothing to give back, and what tensors hold."""
    seen = device_census(torch.device("cpu"), top=0)
    return (
        "cpu: nothing more to give back than what gc freed, as PyTorch's CPU allocator keeps "
        f"no cache; live tensors there hold {format_bytes(seen.bytes, digits=2)} "
        f"({plural(seen.count, 'tensor')}), which goes back as they are freed"
    )


def with_limit_fix(
    fixes: tuple[str, ...], binding: HostLimit, machine: HostLimit | None, requested: int | None
) -> tuple[str, ...]:
    """``fixes``, with raising ``binding`` (this process's limit, not the machine's) among them.

    First when the request would fit what the machine has free (or is
    unknown), else last.
    """
    b = functools.partial(format_bytes, digits=2)
    besides = "" if machine is None else f", while the machine has {b(machine.free)} available"
    if binding.kind == "ulimit -v":
        fix = (
            f"Raise this process's memory limit: its `ulimit -v` (RLIMIT_AS) allows "
            f"{b(binding.total)} of address space, {b(binding.free)} of it free{besides}. "
            "Start Python from a shell with a higher one (`ulimit -v unlimited`, where the hard "
            "limit allows), or ask the batch system for more memory (SGE's h_vmem sets it)."
        )
    else:
        fix = (
            f"Raise the container's memory limit: cgroup {binding.where} allows "
            f"{b(binding.total)}, {b(binding.free)} of it free{besides}; the out-of-memory "
            "killer ends the process at that limit. Docker's --memory, Kubernetes' "
            "resources.limits.memory and Slurm's --mem set it."
        )
    if requested is None or machine is None or requested <= machine.free:
        return (fix, *fixes)
    return (*fixes, fix)
