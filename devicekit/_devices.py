"""Choosing devices: the i-th accelerator or the CPU, every accelerator, this rank's device.

"Accelerator" is what ``torch.accelerator`` reports for this torch build: CUDA
(which includes ROCm), XPU or MPS. Nothing here initializes CUDA: device counts
come from ``torch.cuda.device_count()``, which asks NVML and honours
``CUDA_VISIBLE_DEVICES`` without starting the CUDA driver. (Where NVML is
missing, torch itself falls back to the CUDA runtime; devicekit cannot avoid
that, but it still leaves ``torch.cuda.is_initialized()`` False.)
"""

from __future__ import annotations

import functools
import inspect
import operator
import os

import torch

from ._errors import DeviceNotFoundError
from ._visible import torch_cuda_initialized

__all__ = ["local_device", "try_all_gpus", "try_gpu"]

_CPU = torch.device("cpu")


@functools.cache
def accelerator_type() -> str | None:
    """The accelerator this torch build supports (``"cuda"``, ``"xpu"``, ``"mps"``...), or None.

    This is a property of the build, read without touching any device.
    """
    if "check_available" in inspect.signature(torch.accelerator.current_accelerator).parameters:
        accelerator = torch.accelerator.current_accelerator()  # torch >= 2.7: the build only
        return None if accelerator is None else accelerator.type
    # torch 2.6 asks the runtime (cudaGetDeviceCount, which starts the driver and
    # poisons fork) and raises without a device, so read the build flags instead.
    if torch.version.cuda or torch.version.hip:  # ROCm is "cuda" to torch too
        return "cuda"
    if torch.xpu._is_compiled():
        return "xpu"
    return "mps" if torch.backends.mps.is_built() else None


def accelerator_count() -> int:
    """How many accelerator devices this process can see, without initializing any of them."""
    kind = accelerator_type()
    if kind is None:
        return 0
    if kind == "mps":
        # MPS has at most one device; is_available() does not create a context.
        return 1 if torch.backends.mps.is_available() else 0
    # torch.cuda.device_count() asks NVML first, so it does not poison fork and it
    # re-reads CUDA_VISIBLE_DEVICES on every call until CUDA is initialized.
    return int(torch.get_device_module(kind).device_count())


def current_cuda_device() -> torch.device | None:
    """The current CUDA device if CUDA is already initialized, else None.

    Asking torch for the current device when CUDA has not started would start
    it; before that, nothing can have chosen a device other than ``cuda:0``.
    """
    return torch.device("cuda", torch.cuda.current_device()) if torch_cuda_initialized() else None


def check_index(value: object, *, name: str) -> int:
    """Return ``value`` as a non-negative int, or raise an error that names it.

    Accepts anything with ``__index__`` (numpy integers too) except ``bool``,
    which is almost always a mistake (``try_gpu(True)`` is not device 1).
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a non-negative int, got the bool {value!r}")
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be a non-negative int, got {value!r} of type {type(value).__name__}"
        ) from None
    if index < 0:
        raise ValueError(f"{name} must be a non-negative int, got {index}; the first device is 0")
    return index


def try_gpu(i: int = 0) -> torch.device:
    """Return the i-th accelerator device if it exists, else the CPU.

    Works the same on CUDA, ROCm, XPU and MPS builds, and never initializes
    CUDA, so it is safe to call before forking or before changing
    ``CUDA_VISIBLE_DEVICES``.

    Args:
        i: Index of the accelerator among the devices this process can see.

    Returns:
        ``torch.device("cuda", i)`` (or ``xpu``/``mps``) when that device exists,
        otherwise ``torch.device("cpu")``.

    Raises:
        TypeError: ``i`` is not an int (``bool`` is rejected too).
        ValueError: ``i`` is negative.

    Examples:
        >>> import devicekit as dk
        >>> device = dk.try_gpu()
        >>> device in dk.try_all_gpus()
        True
        >>> dk.try_gpu(1000)
        device(type='cpu')
    """
    index = check_index(i, name="try_gpu(i)")
    kind = accelerator_type()
    if kind is not None and index < accelerator_count():
        return torch.device(kind, index)
    return _CPU


def try_all_gpus() -> list[torch.device]:
    """Return every accelerator device this process can see, or ``[cpu]`` when there is none.

    The list is never empty, so ``devices[0]`` is always a usable device.

    Examples:
        >>> import devicekit as dk
        >>> devices = dk.try_all_gpus()
        >>> len(devices) >= 1
        True
        >>> all(d.type == devices[0].type for d in devices)
        True
    """
    kind = accelerator_type()
    count = accelerator_count()
    if kind is None or count == 0:
        return [_CPU]
    return [torch.device(kind, index) for index in range(count)]


def local_device() -> torch.device:
    """Return this process's device under torchrun, made current; else :func:`try_gpu`.

    Under ``torchrun`` (or any launcher of ``torch.distributed.elastic``)
    ``LOCAL_RANK`` is set, and rank ``r`` gets accelerator ``r``, which becomes
    the current device (``torch.cuda.set_device``) so that NCCL and
    ``torch.cuda.current_device()`` agree with it. On a machine without an
    accelerator every rank gets the CPU (use the ``gloo`` backend).

    Returns:
        The device for this rank.

    Raises:
        ValueError: ``LOCAL_RANK`` is not a non-negative integer.
        DeviceNotFoundError: ``LOCAL_RANK`` is larger than the number of visible
            devices. devicekit never wraps the rank around silently: two ranks
            on one GPU would halve its speed without a word.

    Examples:
        >>> import devicekit as dk
        >>> dk.local_device() == dk.try_gpu()  # no LOCAL_RANK outside torchrun
        True
    """
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        return try_gpu()
    try:
        rank = check_index(int(raw.strip()), name="LOCAL_RANK")
    except ValueError:
        raise ValueError(
            f"LOCAL_RANK must be a non-negative integer, got {raw!r}; torchrun sets it for "
            "each process, so unset it when you are not launching with torchrun"
        ) from None
    kind = accelerator_type()
    count = accelerator_count()
    if kind is None or count == 0:
        return _CPU
    if rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        scope = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        raise DeviceNotFoundError(
            f"LOCAL_RANK={rank} but this process sees only {count} {kind} device(s){scope}. "
            f"Start at most {count} processes per node (torchrun --nproc_per_node={count}); "
            "if your launcher already gives each process its own GPU, use dk.try_gpu() instead."
        )
    device = torch.device(kind, rank)
    module = torch.get_device_module(kind)
    if hasattr(module, "set_device"):  # MPS has a single device and no set_device
        module.set_device(device)
    return device
