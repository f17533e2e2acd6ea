"""One process's line of Linux's ``/proc/<pid>/stat``, read the one safe way.

Its second field is the process's name in parentheses, which the process
chooses and which may hold spaces and parentheses of its own (``a) (b ) Z``):
every field after it is found from the *last* ``)``. `_contention` reads
which processes compete for this process's CPUs, and `_workerstate` which
processes a worker started, and when each started.
"""

from __future__ import annotations

__all__ = ["read_stat"]


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
