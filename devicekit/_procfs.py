"""One process's line of Linux's ``/proc/<pid>/stat``, read the one safe way.

Its second field is the process's name in parentheses, which the process
chooses and which may hold spaces and parentheses of its own (``a) (b ) Z``):
every field after it is found from the *last* ``)``. `_contention` reads
which processes compete for this process's CPUs, and `_workerstate` which
processes a worker started, and when each started.

Also which file system a folder is on, from ``/proc/self/mountinfo``: `_sinks`
refuses a CSV file in the kernel's own (``/proc``, ``/sys``), where no file
can be created although the folder may look writable (as root).
"""

from __future__ import annotations

import os
import re

__all__ = ["file_system_type", "read_stat"]

_ESCAPED = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a path as \040


def read_stat(pid: int, proc: str = "/proc") -> tuple[str, list[bytes]] | None:
    """The name of process ``pid`` and its stat fields from the third on (the state first).

    None where it cannot be read: no such process (it ended), no ``/proc``, not
    ours to read.

    Examples:
        >>> import os
        >>> name, fields = read_stat(os.getpid()) or ("python", [b"R"])
        >>> fields[0] in (b"R", b"S", b"D")
        True
    """
    try:
        with open(f"{proc}/{pid}/stat", "rb") as file:
            text = file.read()
    except OSError:
        return None
    close = text.rfind(b")")
    name = text[text.find(b"(") + 1 : close].decode(errors="replace")
    return name, text[close + 1 :].split()


def file_system_type(folder: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``folder`` is on (``ext4``, ``proc``, ``sysfs``...).

    None where it cannot be told: no ``/proc`` (not Linux), or no mount holds it.

    Examples:
        >>> file_system_type("/proc") in ("proc", None)
        True
    """
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    where = os.path.realpath(folder)
    best, kind = "", None
    for line in lines:
        # "36 35 98:0 /root /mnt rw,noatime shared:1 - ext4 /dev/sda1 rw": the mount
        # point is the fifth field; the type follows the " - " that ends the optional ones.
        fields, _, tail = line.partition(" - ")
        parts = fields.split(" ")
        if len(parts) < 5 or not tail:
            continue
        point = _ESCAPED.sub(lambda match: chr(int(match.group(1), 8)), parts[4])
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        # The last of equal mount points is the one on top (mounted later).
        if inside and len(point) >= len(best):
            best, kind = point, tail.split(" ", 1)[0]
    return kind
