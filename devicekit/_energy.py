"""GPU energy from NVML's cumulative counter: joules per call and average watts.

``nvmlDeviceGetTotalEnergyConsumption`` (Volta and newer) gives the energy
the board has used since the driver loaded, in millijoules; the difference of
two reads is the energy between them. The driver updates that counter every
20 to 100 ms, so a read can lag by up to one update period, and a window of
a few periods could be off by tens of percent. Energy is therefore computed
only over windows of at least `MIN_WINDOW` seconds (a 100 ms period is
then at most 10% of the window), and is ``None`` otherwise.

The counter covers the whole board: another process on the GPU counts too
(``Measurement.trustworthy`` says when one was there), and so does every MIG
instance of a GPU, which is why NVML does not offer it for a MIG instance.

What reads as unknown (None), never as a number: a read NVML answers with an
error, or with ``NVML_VALUE_NOT_AVAILABLE`` (2**64 - 1 mJ, which would read as
18 PJ); and a window over which the counter went down (the driver reloaded
and it restarted from 0; an unsigned 64-bit count of millijoules wraps only
after 585,000 years at 1 kW) or did not move at all (a GPU draws tens of
watts even idle, so a counter that stands still for a second is not being
updated, and 0 J would be a wrong answer).
"""

from __future__ import annotations

from typing import Any

import torch

from ._gpus import nvml_handle
from ._nvml import read_energy

__all__ = ["MIN_WINDOW", "EnergyCounter", "energy_counter", "energy_use"]

MIN_WINDOW = 1.0  # seconds: ten of the counter's slowest update periods


class EnergyCounter:
    """One GPU's cumulative energy counter."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def read(self) -> float | None:
        """Joules used since the driver loaded; None where NVML does not say."""
        return read_energy(self.handle)  # None for NVML_VALUE_NOT_AVAILABLE too


def energy_counter(device: torch.device) -> EnergyCounter | None:
    """The energy counter of the CUDA ``device`` (torch's numbering), or None without one.

    Never starts CUDA: the GPU is found through NVML.

    Examples:
        >>> import torch
        >>> energy_counter(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda" or device.index is None:
        return None
    handle = nvml_handle(device.index)
    if handle is None:
        return None
    counter = EnergyCounter(handle)
    return counter if counter.read() is not None else None


def energy_use(
    before: float | None, after: float | None, seconds: float, calls: int
) -> tuple[float | None, float | None]:
    """Joules per call and average watts over a window, or (None, None) when it is too short.

    Examples:
        >>> energy_use(100.0, 700.0, seconds=2.0, calls=1000)
        (0.6, 300.0)
        >>> energy_use(100.0, 130.0, seconds=0.1, calls=50)  # shorter than the counter's steps
        (None, None)
        >>> energy_use(100.0, 100.0, seconds=2.0, calls=1000)  # a counter that stood still
        (None, None)
    """
    if before is None or after is None or seconds < MIN_WINDOW or calls < 1 or after <= before:
        return None, None
    joules = after - before
    return joules / calls, joules / seconds
