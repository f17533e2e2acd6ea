"""``data_parallel``: one script for one GPU, several, or none."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch

from ._accelerators import try_all_gpus
from ._devices import DeviceLike, resolve_devices
from ._errors import TensorCopyError
from ._keywords import suggest_keywords
from ._shortrepr import short_repr
from ._submodules import not_a_module

__all__ = ["data_parallel"]

logger = logging.getLogger("devicekit")


_warned_data_parallel = False


@suggest_keywords
def data_parallel(
    module: torch.nn.Module, devices: Sequence[DeviceLike] | DeviceLike | None = None
) -> torch.nn.Module:
    """Wrap ``module`` in ``nn.DataParallel`` when there are several GPUs; else just move it.

    With two or more devices, the module goes to the first and is wrapped in
    ``nn.DataParallel`` over all of them. With one device or none, the module
    is moved to that device (or [`try_gpu()`][devicekit.try_gpu]) and returned unwrapped, so
    the same script runs everywhere. The first time it wraps, it logs (with
    ``logging``, at WARNING) that ``DistributedDataParallel`` is faster.

    Args:
        module: The model.
        devices: The devices to use: a list or tuple of
            [`DeviceLike`][devicekit.DeviceLike], the first gathering the outputs (not
            a set, which has no order), or one device. Default:
            [`try_all_gpus()`][devicekit.try_all_gpus].

    A module already wrapped (the cell that wrapped it, run again) is
    unwrapped first, so the result is never ``DataParallel`` in
    ``DataParallel`` (whose state-dict keys would read ``module.module.``).

    Returns:
        ``nn.DataParallel(module)`` or ``module`` itself, moved (or, where its
        class's ``.to()`` returns a moved copy, that copy).

    Raises:
        TypeError: ``devices`` is a set (it has no order, and the first device
            gathers the outputs): pass a list or tuple.
        ValueError: ``devices`` is empty, names a device twice (``[0, 0]``,
            ``["cuda", "cuda:0"]``), mixes device types, or is the meta
            device (which would drop the module's weights).
        DeviceNotFoundError: One of ``devices`` does not exist here.
        TensorCopyError: ``module`` holds tensors on the meta device (no values
            to copy): ``module.to_empty(device=...)`` first.

    Examples:
        >>> import torch, devicekit as dk
        >>> model = dk.data_parallel(torch.nn.Linear(2, 2), ["cpu"])
        >>> type(model).__name__, model.weight.device
        ('Linear', device(type='cpu'))
    """
    global _warned_data_parallel  # noqa: PLW0603 - a once-per-process flag
    if not isinstance(module, torch.nn.Module):
        raise not_a_module(module, call="data_parallel(module)")
    if isinstance(module, torch.nn.DataParallel):  # a notebook cell run again: wrap the model
        module = module.module
    if isinstance(devices, AbstractSet):  # a set, a frozenset, a dict's keys()
        raise TypeError(
            f"data_parallel() needs devices as a list or tuple, got a {type(devices).__name__} "
            f"({short_repr(devices)}): a set has no order, and the first device is where "
            "nn.DataParallel gathers the outputs, so it would depend on hashing. Pass a list "
            "in the order you mean, the gathering device first: devices=[0, 1]"
        )
    targets = try_all_gpus() if devices is None else resolve_devices(devices)
    if not targets:
        raise ValueError("data_parallel() needs at least one device, got an empty list")
    kinds = sorted({d.type for d in targets})
    if len(kinds) > 1:
        raise ValueError(f"data_parallel() needs devices of one type, got {', '.join(kinds)}")
    if kinds == ["meta"]:  # moved there in place, the model's weights would be gone
        raise ValueError(
            f"devices={devices!r}: data_parallel() runs the model, and the meta device holds "
            "no values: the module would be moved there in place, its weights lost. Pass "
            "GPUs or 'cpu'; to build a model without memory, use "
            "torch.device('meta') directly and module.to_empty(device=...) later"
        )
    twice = next((d for n, d in enumerate(targets) if d in targets[:n]), None)
    if twice is not None and twice.type != "cpu":  # the CPU is never wrapped
        raise ValueError(
            f"devices={short_repr(devices)} names {twice} twice: nn.DataParallel would run "
            "two replicas on that GPU, each on its share of the batch, for no gain; list "
            "each GPU once"
        )
    _refuse_meta_tensors(module, targets[0])
    module = _moved(module, targets[0])
    if len(targets) < 2 or targets[0].type == "cpu":
        return module
    if not _warned_data_parallel:
        _warned_data_parallel = True
        logger.warning(
            "nn.DataParallel runs one process with a thread per GPU and is slower than "
            "DistributedDataParallel; for multi-GPU training launch with torchrun and put "
            "each rank on dk.local_device()."
        )
    return torch.nn.DataParallel(module, device_ids=targets)


def _moved(module: torch.nn.Module, target: torch.device) -> torch.nn.Module:
    """``module.to(target)``'s result: the module itself, or the copy its own ``.to()`` made.

    A ``.to()`` that moves in place and returns None (a common slip in an
    override) leaves the module itself, moved.
    """
    moved: object = module.to(target)  # an override may return None, or something else
    if moved is None:
        return module
    if not isinstance(moved, torch.nn.Module):
        raise TypeError(
            f"data_parallel() moves the model with its own .to({str(target)!r}), which "
            f"returned a {type(moved).__name__}, not a module. Make "
            f"{type(module).__qualname__}.to() return the moved module (self, or its copy)"
        )
    return moved


def _refuse_meta_tensors(module: torch.nn.Module, target: torch.device) -> None:
    """A `TensorCopyError` for a module built on the meta device: torch's own is a bare one."""
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    name = next((name for name, tensor in named if tensor.is_meta), None)
    if name is not None:
        there = str(target)
        raise TensorCopyError(
            f"data_parallel() cannot move module.{name} to {there!r}: it is on the meta device, "
            "which holds no values to copy. For a model built on meta, call "
            f"module.to_empty(device={there!r}) and load its weights, then pass it"
        )
