"""Who holds which GPU claim on this machine: ``devicekit claims``.

A claim is a ``flock`` on a lock file (`_claims`); the files stay after their
claims end, so a file says nothing. The kernel's lock table
(``/proc/locks``) says which are locked, and by which pid: only that is
shown as held. The pid a holder writes into its file is not used here: a
file whose holder has gone keeps it, and the pid may since belong to an
unrelated process. Listing creates nothing and locks nothing, so it cannot
turn a job away from a GPU that it would have claimed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import _gpus, _nvml
from ._claimfiles import DIR_VAR, PROC_LOCKS, claims_path, lock_name, locked_by, refusal
from ._format import plural, safe_text
from ._procfs import file_system_type, read_stat

__all__ = ["ClaimsReport", "HeldClaim", "claims_report"]

LOCK_TABLE = PROC_LOCKS  # where the kernel lists its locks (Linux only)


@dataclass(frozen=True)
class HeldClaim:
    """One GPU claim that a live process holds.

    Attributes:
        gpu: The GPU's UUID as its lock file names it (``GPU-5a3e...``).
        device: The GPU as this process numbers it (``"cuda:0"``), ``"nvml 3"``
            where this process cannot see it, or None where NVML does not
            list it (another machine's file, or no NVML here).
        pid: The holder's pid; None where it lives in another PID namespace.
        process: The holder's name, where this process can read it.
    """

    gpu: str
    device: str | None
    pid: int | None
    process: str | None

    def __str__(self) -> str:
        return self.line(nvml=True)

    def line(self, *, nvml: bool) -> str:
        """The claim as ``devicekit claims`` prints it; ``nvml``: whether NVML could be asked."""
        where = self.device or ("not a GPU NVML lists here" if nvml else "? (no NVML here)")
        if self.pid is None:
            holder = "a process in another PID namespace (a container's)"
        else:
            holder = f"pid {self.pid}" + (f" ({safe_text(self.process)})" if self.process else "")
        return f"{where}  {safe_text(self.gpu)}  held by {holder}"


# The version of to_dict()'s layout, as `devicekit --json`'s: it goes up when the layout changes.
SCHEMA = 1


@dataclass(frozen=True)
class ClaimsReport:
    """The GPU claims held on this machine, from the kernel's lock table.

    Attributes:
        directory: The claims directory (``DEVICEKIT_CLAIMS_DIR``, else
            ``/tmp/devicekit-<uid>``).
        held: The claims a live process holds, by GPU.
        lock_files: How many lock files the directory has (one per GPU ever
            claimed), held or not; None where it cannot be read or may not
            hold claims.
        unknown: Why it cannot be told which are held, or None when it can.
        nvml: Whether NVML could be asked which GPU each claim is; None where
            no claim was held, so NVML was not asked (nor started).
    """

    directory: str
    held: tuple[HeldClaim, ...]
    lock_files: int | None
    unknown: str | None
    nvml: bool | None = None

    def __str__(self) -> str:
        head = f"GPU claims in {safe_text(self.directory)}"
        if self.unknown is not None or self.lock_files is None:
            return f"{head}: {self.unknown}"
        if not self.held:
            files = plural(self.lock_files, "lock file")
            return f"{head}: none held ({files}; a claim ends with the process that holds it)"
        lines = [f"{head}: {len(self.held)} held"]
        lines.extend(f"  {claim.line(nvml=bool(self.nvml))}" for claim in self.held)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``devicekit claims --json``."""
        return {
            "schema": SCHEMA,
            "directory": self.directory,
            "held": [vars(claim).copy() for claim in self.held],
            "lock_files": self.lock_files,
            "unknown": self.unknown,
            "nvml": self.nvml,
        }


def claims_report() -> ClaimsReport:
    """List the GPU claims held on this machine; creates and locks nothing.

    Raises:
        ValueError: ``DEVICEKIT_CLAIMS_DIR`` is a relative path.

    Examples:
        >>> report = claims_report()
        >>> report.unknown is not None or all(claim.gpu for claim in report.held)
        True
    """
    directory = claims_path()
    try:
        # What claim=True refuses to keep claims in is no place to list them from either: a
        # link is not followed, and a directory others made or can write says nothing sure.
        why = refusal(directory, os.lstat(directory), os.environ.get(DIR_VAR) or None)
        if why is not None:
            return ClaimsReport(str(directory), (), None, f"claims cannot be kept here: {why}")
        names = sorted(name for name in os.listdir(directory) if name.endswith(".lock"))
    except FileNotFoundError:
        return ClaimsReport(str(directory), (), 0, None)  # nothing was ever claimed here
    except OSError as error:
        return ClaimsReport(str(directory), (), None, f"cannot be read ({error.strerror})")
    if not os.path.exists(LOCK_TABLE):
        why = "cannot tell which are held: this system has no kernel lock table (/proc/locks)"
        return ClaimsReport(str(directory), (), len(names), why)
    if file_system_type(str(directory)) == "btrfs":
        # Its lock table names files by a device number that stat() does not give.
        why = (
            "cannot tell which are held: on btrfs the kernel's lock table does not match the "
            "files; set DEVICEKIT_CLAIMS_DIR to a directory on another file system (tmpfs)"
        )
        return ClaimsReport(str(directory), (), len(names), why)
    holders = []
    for name in names:
        listed, pid = locked_by(directory / name)
        if listed:
            holders.append((name.removesuffix(".lock"), pid))
    if not holders:  # nothing to label: NVML is not started for it
        return ClaimsReport(str(directory), (), len(names), None)
    nvml = _nvml.nvml_error() is None
    labels = _gpu_labels() if nvml else {}
    held = []
    for gpu, pid in holders:
        stat = None if pid is None else read_stat(pid)
        held.append(HeldClaim(gpu, labels.get(gpu), pid, None if stat is None else stat[0]))
    return ClaimsReport(str(directory), tuple(held), len(names), None, nvml)


def _gpu_labels() -> dict[str, str]:
    """Each GPU's lock-file name (its UUID, made safe) to how this process names the GPU."""
    labels = {}
    for gpu in _nvml.physical_gpus():
        if gpu.uuid:
            labels[lock_name(gpu.uuid)] = f"nvml {gpu.nvml_index}"
    for index, visible in enumerate(_gpus.visible_gpus()):
        uuid = visible.uuid or visible.gpu.uuid
        if uuid:
            labels[lock_name(uuid)] = f"cuda:{index}"
    return labels
