"""Which accelerator this torch build has, and how many of its devices this process sees.

Nothing here initializes CUDA: counts come from ``torch.cuda.device_count()``,
which asks NVML and honours ``CUDA_VISIBLE_DEVICES`` without starting the CUDA
driver. (Where NVML is missing, torch itself falls back to the CUDA runtime;
devicekit cannot avoid that, but it still leaves ``torch.cuda.is_initialized()``
False.) `_devices` stands on this to read device arguments; `try_gpu()` and
`try_all_gpus()` are its public face.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._options import check_index, is_tensor
from ._shortrepr import short_repr
from ._visible import torch_cuda_initialized

__all__ = [
    "CPU",
    "META",
    "accelerator_count",
    "accelerator_type",
    "current_cuda_device",
    "default_cuda_device",
    "synchronize",
    "try_all_gpus",
    "try_gpu",
]

CPU = torch.device("cpu")
"""The canonical CPU device: `resolve_device()` returns this very object for the CPU."""
META = torch.device("meta")
"""The canonical meta device, as `CPU`."""


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


def default_cuda_device() -> torch.device:
    """The current CUDA device; ``cuda:0`` before CUDA starts (nothing can have chosen another).

    What ``"cuda"`` without an index means.
    """
    return current_cuda_device() or torch.device("cuda", 0)


def synchronize(device: torch.device) -> None:
    """Wait for everything queued on ``device``; nothing to wait for on the CPU or meta.

    One place for it because the backends differ: ``torch.mps.synchronize()``
    takes no device (MPS has one), the others take it.
    """
    kind = device.type
    if kind in ("cpu", "meta"):
        return
    module = torch.get_device_module(kind)
    if kind == "mps":
        module.synchronize()
    else:
        module.synchronize(device)


F = TypeVar("F", bound=Callable[..., Any])


def constant_when_traced(function: F) -> F:
    """Have ``torch.compile`` call ``function`` as it is, while tracing, and keep its result.

    What ``torch.compiler.assume_constant_result`` does, its one attribute set
    here: importing it imports dynamo (1 s), which devicekit never does. For
    what reads the machine (the device count, an accelerator's type), whose
    code dynamo cannot trace: a step compiled with ``fullgraph=True`` was
    refused. Nothing changes outside tracing.
    """
    vars(function)["_dynamo_marked_constant"] = True
    return function


@constant_when_traced
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
        TypeError: ``i`` is not an int: a bool, a tensor (its value is never
            read as an index), a float, a string or a device are refused,
            each with what to pass instead.
        ValueError: ``i`` is negative.

    Examples:
        >>> import devicekit as dk
        >>> device = dk.try_gpu()
        >>> device in dk.try_all_gpus()
        True
        >>> dk.try_gpu(1000)
        device(type='cpu')
    """
    if i.__class__ is int and i >= 0:  # the usual call: no check to build
        index = i
    else:
        index = check_index(i, name="try_gpu(i)", fix=_try_gpu_fix(i))
    kind = accelerator_type()
    if kind is not None and index < accelerator_count():
        return torch.device(kind, index)
    return CPU


def _try_gpu_fix(i: object) -> str:
    """What to pass to ``try_gpu`` instead of ``i``, for the error that refuses it."""
    if isinstance(i, torch.device) or (isinstance(i, str) and _is_device(i)):
        device = torch.device(i)
        use = f"try_gpu takes an index, not a device: use {short_repr(str(device))} as it is"
        if device.type in ("cpu", "meta"):
            return use
        index = 0 if device.index is None else device.index
        return f"{use}, or dk.try_gpu({index}) for accelerator {index} (the CPU when there is none)"
    if is_tensor(i):
        return "use tensor.device as it is for the device a tensor is on, or an int: dk.try_gpu(0)"
    if isinstance(i, float) and math.isfinite(i) and i.is_integer() and i >= 0:
        return f"pass the int: dk.try_gpu({int(i)})"
    if isinstance(i, str) and i.strip().isascii() and i.strip().isdigit():
        return f"pass the int: dk.try_gpu({int(i.strip())})"
    return "pass an int index such as dk.try_gpu(0), or nothing for the first accelerator"


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


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
        return [CPU]
    return [torch.device(kind, index) for index in range(count)]
