"""Which workers a map starts: a slot per device, ``workers_per_device`` times over.

A slot is a GPU's index as this process numbers it, or ``"cpu"``. With
``devices=None`` the slots are every visible GPU, or, with none, one CPU per
core this process may use (its affinity, not the machine's count). Slots are
repeated round-robin, so a map with fewer items than slots still spreads over
every device, and refused past a limit, before a list of that size is built.
"""

from __future__ import annotations

import itertools
import os

from ._accelerators import try_all_gpus
from ._devices import resolve_devices
from ._format import plural
from ._options import check_count

__all__ = ["usable_cpus", "worker_slots", "workers_per_device_count"]


def worker_slots(
    devices: object,
    workers_per_device: int,
    *,
    caller: str = "gpu_map()",
    most: int | None = None,
) -> list[str | int]:
    """The slots of the workers to start: ``most`` at most (a map's items), if given."""
    if devices is None:
        targets = [device for device in try_all_gpus() if device.type == "cuda"]
        if not targets:
            cpu: list[str | int] = ["cpu"]
            return _at_most_max(cpu * usable_cpus(), workers_per_device, caller, most)
    else:
        targets = resolve_devices(devices, name="devices")
    slots: list[str | int] = []
    for position, device in enumerate(targets):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"devices[{position}]={str(device)!r}: {caller} runs its workers on CUDA GPUs "
                "or on the CPU; pass CUDA devices or 'cpu'"
            )
        slots.append("cpu" if device.type == "cpu" else int(device.index))
    if not slots:
        raise ValueError(
            f"{caller} needs at least one device, got devices=[]; pass devices=None for every "
            "visible GPU (or the CPU), or name one"
        )
    return _at_most_max(slots, workers_per_device, caller, most)


_MAX_WORKERS = 1024  # each a process that imports torch: hundreds of MB of memory each


def _at_most_max(
    slots: list[str | int], per_device: int, caller: str, most: int | None
) -> list[str | int]:
    """Each slot ``per_device`` times, round-robin, ``most`` at most; refused past `_MAX_WORKERS`.

    Round-robin, not device by device: gpu_map starts only as many workers as it
    has items, a prefix of these, and that prefix must spread over every device.
    """
    count = len(slots) * per_device
    one_per_item = most is not None and most < count  # no more workers than items
    if one_per_item:
        count = int(most or 0)
    if count > _MAX_WORKERS:  # before a list of a billion is built
        if len(slots) > _MAX_WORKERS:
            fix = (
                f"Name at most {_MAX_WORKERS} devices (a device named twice gets two workers; "
                f"{len(slots):,} were named)"
            )
        else:
            fix = (
                f"Use fewer workers per device: at most {_MAX_WORKERS // len(slots)} on "
                f"{plural(len(slots), 'device')} (1 to 4 keeps a GPU busy)"
            )
        started = f"{count:,} worker processes" + (", one per item" if one_per_item else "")
        raise ValueError(
            f"workers_per_device={per_device} on {plural(len(slots), 'device')} would start "
            f"{started}, each importing torch; {caller} starts at most {_MAX_WORKERS}. {fix}"
        )
    return list(itertools.islice(itertools.cycle(slots), count))


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or a job's share).

    ``os.cpu_count()`` counts the machine's: under ``taskset`` or a batch job given
    4 of 128 cores, it gave 128 CPU workers, each importing torch, for 4 cores.
    """
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def workers_per_device_count(value: object) -> int:
    """``workers_per_device``, checked."""
    return check_count(value, name="workers_per_device", minimum=1)
