"""``job_status``: every rank's host, device and GPU in one table, and what is wrong with them.

Under ``torch.distributed`` each process sees only itself; the questions of a
job (which rank's GPU throttles, did two ranks land on one GPU) need every
rank's answer. Each rank snapshots its own GPU through NVML (never starting
CUDA), and one gather over a gloo group that devicekit creates once and
reuses brings every snapshot to every rank. The group is gloo whatever the
job's backend: Python objects travel as CPU bytes, so an NCCL job's streams
never carry them, and a CPU-only job works the same.

The gather itself is `_dist.gather_results()`: a rank whose own part raises
still joins it, so every rank fails at once, naming that rank, instead of
waiting out the timeout for a rank that will never come.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ._accelerators import current_cuda_device
from ._dist import DEFAULT_TIMEOUT, gather_results, validated_timeout
from ._format import (
    NOT_APPLICABLE,
    UNKNOWN,
    PlainResult,
    format_bytes,
    format_percent,
    format_value,
    html_table,
    plain_fields,
    plural,
    safe_text,
    shown,
    text_table,
)
from ._gpufindings import ENVIRONMENTAL, environmental, is_hot, is_low_on_memory
from ._gpuinfo import GPUInfo
from ._gpus import gpu
from ._keywords import suggest_keywords
from ._launch import local_rank, resolve_local_device
from ._world import initialized, warn_if_launched_alone

__all__ = ["JobFlag", "JobStatus", "RankStatus", "job_status"]

_COLUMNS = (
    "host",
    "rank",
    "local",
    "pid",
    "device",
    "GPU",
    "uuid",
    "memory used",
    "temp",
    "util",
    "clocks held by",
    "flags",
)

FlagKind = Literal["duplicate_gpu", "throttling", "hot", "nearly_full"]


def _listing(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


@dataclass(frozen=True)
class RankStatus(PlainResult):
    """One rank of a job, as [`job_status()`][devicekit.job_status] sees it.

    Attributes:
        rank: The global rank.
        local_rank: The rank on its node, from the launcher (``LOCAL_RANK``,
            ``SLURM_LOCALID``...), or None when no launcher said.
        host: The host name.
        pid: The process id on that host.
        device: The torch device the rank uses (its current CUDA device once
            CUDA has started, else the one [`local_device()`][devicekit.local_device]
            would choose), or None when that cannot be told.
        gpu: A snapshot of that GPU, or None (a CPU rank, or no NVML).
    """

    rank: int
    local_rank: int | None
    host: str
    pid: int
    device: str | None
    gpu: GPUInfo | None

    def _title(self) -> str:
        return f"rank {self.rank} on {safe_text(self.host)}"

    def _not_applicable(self) -> tuple[str, ...]:
        # A CPU (or MPS) rank has no NVIDIA GPU to describe: the GPU does not apply. A
        # CUDA rank, or one whose device is unknown, may well have one that nobody
        # could read (no NVML): that is unknown, not absent.
        on_gpu = self.device is None or self.device.startswith("cuda")
        return () if self.gpu is not None or on_gpu else ("gpu",)


@dataclass(frozen=True)
class JobFlag(PlainResult):
    """Something wrong with one or more ranks, and what to do about it.

    Attributes:
        kind: ``"duplicate_gpu"`` (two ranks on one GPU), ``"throttling"``
            (clocks held down by heat or power trouble), ``"hot"`` or
            ``"nearly_full"`` (little GPU memory left).
        ranks: The ranks it concerns.
        detail: What was seen.
        fix: What to do about it.
    """

    kind: FlagKind
    ranks: tuple[int, ...] = field(metadata=shown(_listing))
    detail: str
    fix: str

    def __str__(self) -> str:
        who = f"{'rank' if len(self.ranks) == 1 else 'ranks'} {_listing(self.ranks)}"
        return f"{who}: {self.detail}\n  fix: {self.fix}"


@dataclass(frozen=True)
class JobStatus:
    """Every rank of a job: host, device, GPU snapshot, and the flags raised about them.

    ``print()`` it for a table with one row per rank, sorted by host and local
    rank, followed by the flags; a notebook renders it as HTML.

    Attributes:
        ranks: One entry per rank, sorted by host, then local rank.
        world_size: The number of ranks (1 without a process group).
        backend: The job's backend (``"nccl"``, ``"gloo"``), or None without
            a process group.
        flags: What is wrong, by rank, each with a fix; empty when nothing is.
    """

    ranks: tuple[RankStatus, ...]
    world_size: int
    backend: str | None
    flags: tuple[JobFlag, ...]

    @property
    def ok(self) -> bool:
        """True when nothing was flagged."""
        return not self.flags

    @property
    def hosts(self) -> tuple[str, ...]:
        """The host names, each once, in table order."""
        return tuple(dict.fromkeys(rank.host for rank in self.ranks))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (each GPU snapshot as `GPUInfo.to_dict()` gives it)."""
        return {**plain_fields(self), "ok": self.ok, "hosts": list(self.hosts)}

    def _rows(self) -> list[tuple[str, ...]]:
        flagged: dict[int, list[str]] = {}
        for flag in self.flags:
            for rank in flag.ranks:
                flagged.setdefault(rank, []).append(flag.kind)
        rows: list[tuple[str, ...]] = []
        for entry in self.ranks:
            rows.append(
                (
                    safe_text(entry.host),
                    str(entry.rank),
                    UNKNOWN if entry.local_rank is None else str(entry.local_rank),
                    str(entry.pid),
                    entry.device or UNKNOWN,
                    *_gpu_cells(entry),
                    ", ".join(flagged.get(entry.rank, ())),
                )
            )
        return rows

    def _title(self) -> str:
        backend = "no process group" if self.backend is None else self.backend
        flags = "nothing flagged" if self.ok else plural(len(self.flags), "flag")
        return (
            f"job status: {plural(self.world_size, 'rank')} on "
            f"{plural(len(self.hosts), 'host')} ({backend}); {flags}"
        )

    def __str__(self) -> str:
        lines = [self._title(), *text_table(_COLUMNS, self._rows())]
        if self.flags:
            lines.append("")
            lines += [f"- {flag}" for flag in self.flags]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        table = html_table(self._rows(), header=_COLUMNS, caption=self._title())
        if not self.flags:
            return table
        flags = [(_listing(flag.ranks), flag.kind, flag.detail, flag.fix) for flag in self.flags]
        return table + html_table(flags, header=("ranks", "flag", "detail", "fix"))


def _gpu_cells(entry: RankStatus) -> tuple[str, ...]:
    """The GPU columns of one rank: ``"-"`` for a rank without a GPU, ``"?"`` for one unread."""
    info = entry.gpu
    if info is None:  # no GPU, or one nobody could read: as the row's own HTML says
        return (NOT_APPLICABLE if "gpu" in entry._not_applicable() else UNKNOWN,) * 6
    return (
        safe_text(info.name or UNKNOWN),
        _short(info.uuid),
        info.memory_text(),
        format_value(info.temperature, "°C"),
        format_percent(info.utilization),
        info.held_text(),
    )


def _short(uuid: str | None) -> str:
    """``GPU-1a2b3c4d``: enough of a UUID to tell GPUs apart in a table."""
    return UNKNOWN if uuid is None else uuid[:12]


# --- the flags -------------------------------------------------------------------------


def _where(entry: RankStatus) -> str:
    return f"{safe_text(entry.host)} {entry.device or UNKNOWN}"


def _flags(ranks: Sequence[RankStatus]) -> list[JobFlag]:
    flags: list[JobFlag] = []
    sharing: dict[str, list[RankStatus]] = {}
    for entry in ranks:
        if entry.gpu is not None and entry.gpu.uuid is not None:
            sharing.setdefault(entry.gpu.uuid, []).append(entry)
    for uuid, entries in sharing.items():
        if len(entries) > 1:
            where = ", ".join(f"rank {e.rank} on {_where(e)}" for e in entries)
            flags.append(
                JobFlag(
                    "duplicate_gpu",
                    tuple(sorted(e.rank for e in entries)),
                    f"{len(entries)} ranks share one GPU, {uuid} ({where}); NCCL refuses "
                    "this with 'Duplicate GPU detected', and under other backends they compete "
                    "for it",
                    "give each rank its own GPU: start at most one process per GPU on each node "
                    "and call dk.local_device() in every rank before init_process_group; a "
                    "launcher or wrapper that sets CUDA_VISIBLE_DEVICES must give each rank of a "
                    "node a different GPU",
                )
            )
    for entry in sorted(ranks, key=lambda e: e.rank):
        flags += _gpu_flags(entry)
    order = {"duplicate_gpu": 0, "throttling": 1, "hot": 2, "nearly_full": 3}
    return sorted(flags, key=lambda flag: (order[flag.kind], flag.ranks))


def _gpu_flags(entry: RankStatus) -> list[JobFlag]:
    info = entry.gpu
    if info is None:
        return []
    flags = []
    rank = (entry.rank,)
    # The same judgements as doctor(), worded for a job: every rank waits for this one.
    reasons = environmental(info.throttle_reasons)
    if reasons:
        words = ", ".join(dict.fromkeys(ENVIRONMENTAL[r] for r in reasons))
        clock = f"SM clock {info.clock_text()}"
        flags.append(
            JobFlag(
                "throttling",
                rank,
                f"{_where(entry)}: clocks held down by {words} ({clock})",
                "check this node's cooling and power; every collective waits for this GPU, so "
                "the whole job runs at its speed",
            )
        )
    if is_hot(info):
        flags.append(
            JobFlag(
                "hot",
                rank,
                f"{_where(entry)}: {info.temperature} °C",
                "check this node's airflow and fans; a little hotter and the GPU slows itself down",
            )
        )
    if is_low_on_memory(info):
        flags.append(
            JobFlag(
                "nearly_full",
                rank,
                f"{_where(entry)}: {format_bytes(info.memory_free)} free of "
                f"{format_bytes(info.memory_total)}",
                "a larger batch or a fragmented cache will fail with out of memory: lower the "
                "batch size, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            )
        )
    return flags


# --- this rank -------------------------------------------------------------------------


def _this_device() -> torch.device | None:
    """The device this process uses: CUDA's current one once started, else the launcher's."""
    current = current_cuda_device()
    if current is not None:
        return current
    try:
        return resolve_local_device()[0]
    except ValueError:  # a launcher misconfigured (DeviceNotFoundError too): local_device says so
        return None


def _gpu_snapshot(device: torch.device | None) -> GPUInfo | None:
    """An NVML snapshot of ``device`` if it is a GPU NVML can describe (never starts CUDA)."""
    if device is None or device.type != "cuda":
        return None
    try:
        return gpu(device)
    except ValueError:
        # No NVML here (DeviceNotFoundError), or CUDA_VISIBLE_DEVICES malformed on this
        # rank: its GPU is unknown, as a malformed launcher variable makes its device.
        return None


def _this_rank(rank: int) -> RankStatus:
    try:
        found = local_rank()
    except ValueError:
        found = None
    device = _this_device()
    return RankStatus(
        rank=rank,
        local_rank=None if found is None else found[1],
        host=socket.gethostname(),
        pid=os.getpid(),
        device=None if device is None else str(device),
        gpu=_gpu_snapshot(device),
    )


# --- the call --------------------------------------------------------------------------


def _sort_key(entry: RankStatus) -> tuple[str, bool, int, int]:
    local = entry.local_rank
    return (entry.host, local is None, 0 if local is None else local, entry.rank)


@suggest_keywords
def job_status(*, timeout: float = DEFAULT_TIMEOUT) -> JobStatus:
    """Every rank's host, device and GPU, the same on every rank, with what is wrong flagged.

    A collective: every rank must call it, together. Each rank contributes its
    host name, global and local rank, PID, torch device and a
    [`GPUInfo`][devicekit.GPUInfo] snapshot of its GPU (None on the CPU or
    without NVML); one gather over a gloo group that devicekit creates on
    the first call and reuses brings them to every rank, whatever the job's
    backend. Never starts CUDA.

    Flags, by rank, each with a fix: two ranks on the same GPU (by UUID),
    clocks held down by heat or power trouble, a GPU at 85 °C or more, and
    less than 2 GiB of GPU memory free.

    Without an initialized process group it describes this process alone
    (and logs a warning once if ``WORLD_SIZE`` says there are several ranks:
    ``init_process_group`` was forgotten, or comes later).

    What cannot be read on a rank is unknown in its row, not an error: a
    malformed launcher variable or ``CUDA_VISIBLE_DEVICES``, a GPU without
    NVML. Anything else that fails on one rank fails the call on every rank
    at once, naming that rank.

    Args:
        timeout: Seconds to wait for every rank; a rank that does not arrive
            in time (it crashed, hangs, or is elsewhere) is an error, not a hang.

    Returns:
        A [`JobStatus`][devicekit.JobStatus]; ``print()`` it for the table.

    Raises:
        RanksOutOfStepError: Not every rank called it within ``timeout`` (every
            rank's message names the ranks missing and where they are), or
            one rank failed to describe itself (every rank's message names it).
        ValueError: ``timeout`` is not a positive number of seconds, at most a week.

    Examples:
        >>> import devicekit as dk
        >>> status = dk.job_status()  # no process group: this process alone
        >>> status.world_size, len(status.ranks)
        (1, 1)
    """
    seconds = validated_timeout(timeout)
    if not initialized():
        warn_if_launched_alone("job_status()")
        alone = _this_rank(0)
        return JobStatus((alone,), world_size=1, backend=None, flags=tuple(_flags([alone])))
    import torch.distributed as dist  # noqa: PLC0415 - initialized() imported it already

    rank = dist.get_rank()
    everyone = gather_results(lambda: _this_rank(rank), timeout=seconds, what="job_status()")
    return JobStatus(
        ranks=tuple(sorted(everyone, key=_sort_key)),
        world_size=len(everyone),
        backend=str(dist.get_backend()),
        flags=tuple(_flags(everyone)),
    )
