"""Moving things to a device: nested batches, modules, checkpoints, DataParallel."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from ._devices import DeviceLike, resolve_device, resolve_devices, try_all_gpus, try_gpu
from ._tree import describe_cycle, is_dataclass_instance, is_namedtuple

__all__ = ["data_parallel", "load", "to_device"]

T = TypeVar("T")

logger = logging.getLogger("devicekit")

_Tensor = torch.Tensor
_LEAVES = frozenset({str, bytes, int, float, complex, bool})


class _Mover:
    """One :func:`to_device` call: the target, the copy policy, and what was already moved."""

    __slots__ = ("active", "device", "forced", "memo", "to_host", "unsynced")

    def __init__(self, device: torch.device, non_blocking: bool | None) -> None:
        self.device = device
        self.forced = non_blocking
        self.to_host = device.type == "cpu"
        self.memo: dict[int, Any] = {}  # id(original) -> moved; keeps shared things shared
        self.active: set[int] = set()  # containers on the current path, to catch cycles
        self.unsynced: set[torch.device] = set()  # sources of non-blocking copies to the host

    def non_blocking(self) -> bool:
        # A non-blocking copy to the host may be read before it lands: only when
        # forced, and then synchronized before to_device returns.
        return (not self.to_host) if self.forced is None else self.forced

    # The walk is the hot path of every training step: few calls per element.
    def move(self, obj: Any) -> Any:
        if isinstance(obj, _Tensor):
            return self.tensor(obj)
        cls = type(obj)
        if cls is dict:
            return self.container(obj, _rebuild_dict)
        if cls is list or cls is tuple:
            return self.container(obj, _rebuild_sequence)
        if cls in _LEAVES or obj is None:
            return obj
        return self.other(obj)

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.device
        if source == self.device:
            return tensor  # itself, so sharing holds without the memo
        moved: torch.Tensor | None = self.memo.get(id(tensor))
        if moved is None:
            non_blocking = self.non_blocking()
            moved = tensor.to(self.device, non_blocking=non_blocking)
            if non_blocking and self.to_host:
                self.unsynced.add(source)
            self.memo[id(tensor)] = moved
        return moved

    def container(self, obj: Any, rebuild: Any) -> Any:
        key = id(obj)
        done = self.memo.get(key)
        if done is not None:
            return done
        if key in self.active:
            raise _Cycle
        self.active.add(key)
        result = rebuild(self, obj)
        self.active.discard(key)
        self.memo[key] = result
        return result

    def other(self, obj: Any) -> Any:
        if isinstance(obj, type):
            return obj  # a class, even one with a .to attribute (nn.Linear.to)
        if isinstance(obj, torch.nn.Module):
            if self.non_blocking() and self.to_host:
                self.unsynced.update(t.device for t in obj.parameters())
                self.unsynced.update(t.device for t in obj.buffers())
            return obj.to(self.device, non_blocking=self.non_blocking())
        to = getattr(obj, "to", None)
        if callable(to):
            return self.container(obj, lambda _, o: o.to(self.device))
        if isinstance(obj, Mapping):
            return self.container(obj, _rebuild_mapping)
        if isinstance(obj, tuple):
            return self.container(obj, _rebuild_tuple)
        if isinstance(obj, list):
            return self.container(obj, _rebuild_list_subclass)
        if isinstance(obj, (set, frozenset)):
            return self.container(obj, lambda m, o: type(o)(m.move(x) for x in o))
        if is_dataclass_instance(obj):
            return self.container(obj, _rebuild_dataclass)
        return obj

    def synchronize(self) -> None:
        for source in self.unsynced:
            if source.type != "cpu":
                torch.get_device_module(source.type).synchronize(source)


class _Cycle(Exception):
    """Raised inside the walk; to_device turns it into a ValueError with the path."""


# Plain dict, list and tuple hold nearly every batch: tensors are handled inline,
# one call each instead of two.
def _rebuild_dict(mover: _Mover, obj: dict[Any, Any]) -> dict[Any, Any]:
    move, tensor = mover.move, mover.tensor
    return {k: tensor(v) if isinstance(v, _Tensor) else move(v) for k, v in obj.items()}


def _rebuild_sequence(
    mover: _Mover, obj: list[Any] | tuple[Any, ...]
) -> list[Any] | tuple[Any, ...]:
    move, tensor = mover.move, mover.tensor
    items = [tensor(v) if isinstance(v, _Tensor) else move(v) for v in obj]
    return items if type(obj) is list else tuple(items)


def _rebuild_mapping(mover: _Mover, obj: Mapping[Any, Any]) -> Any:
    moved = {key: mover.move(value) for key, value in obj.items()}
    if isinstance(obj, dict):
        # A shallow copy keeps the subclass and its state (a defaultdict's
        # default_factory, an OrderedDict's order); then every value is replaced.
        result = copy.copy(obj)
        result.update(moved)
        return result
    return type(obj)(moved)  # type: ignore[call-arg]


def _rebuild_list_subclass(mover: _Mover, obj: list[Any]) -> list[Any]:
    result = copy.copy(obj)
    result[:] = [mover.move(item) for item in obj]
    return result


def _rebuild_tuple(mover: _Mover, obj: tuple[Any, ...]) -> tuple[Any, ...]:
    items = [mover.move(item) for item in obj]
    if type(obj) is tuple:
        return tuple(items)
    if is_namedtuple(obj):
        return type(obj)(*items)
    return type(obj)(items)  # other tuple subclasses, such as torch.return_types


def _rebuild_dataclass(mover: _Mover, obj: Any) -> Any:
    # Every field, init=False ones too, on a copy: frozen instances are rebuilt,
    # never mutated, and __post_init__ does not run again.
    result = copy.copy(obj)
    missing = object()
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name, missing)
        if value is not missing:
            object.__setattr__(result, field.name, mover.move(value))
    return result


def to_device(obj: T, device: DeviceLike | None = None, *, non_blocking: bool | None = None) -> T:
    """Return ``obj`` with every tensor inside it moved to ``device``.

    Walks nested structures and keeps their types: ``dict`` and every other
    ``Mapping`` (an ``OrderedDict`` keeps its order, a ``defaultdict`` its
    ``default_factory``), ``list``, ``tuple``, namedtuples, ``set`` and
    ``frozenset``, and dataclasses (every field, on a copy, so frozen ones work
    and the original is untouched). Objects with their own ``.to(device)``
    method are moved by it; modules are moved in place, as ``Module.to`` does.
    Anything else is returned unchanged. A tensor reached twice is moved once,
    so shared tensors stay shared.

    Copies *to an accelerator* are non-blocking; copies *to the host* are
    blocking, because the host may read a non-blocking copy before it has
    landed. ``non_blocking=True`` makes every copy non-blocking and, when some
    went to the host, synchronizes once before returning; ``False`` makes every
    copy blocking.

    Args:
        obj: A tensor, module, or any nesting of the containers above.
        device: Where to move it: a :data:`DeviceLike` (``"cuda:1"``, ``1``,
            a ``torch.device``; ``"cuda"`` is the current CUDA device).
            Default: :func:`try_gpu`.
        non_blocking: ``None`` for the safe policy above, or ``True`` or
            ``False`` to force it.

    Returns:
        A structure of the same shape and types, holding the moved tensors.

    Raises:
        ValueError: ``obj`` contains itself, or ``device`` is malformed.
        DeviceNotFoundError: This torch build or machine has no such device.

    Examples:
        >>> import torch, devicekit as dk
        >>> batch = {"x": torch.ones(2), "pairs": [(torch.zeros(1), "label")]}
        >>> moved = dk.to_device(batch, "meta")
        >>> moved["x"].device, moved["pairs"][0][0].device, moved["pairs"][0][1]
        (device(type='meta'), device(type='meta'), 'label')
    """
    target = try_gpu() if device is None else resolve_device(device)
    mover = _Mover(target, non_blocking)
    try:
        result = mover.move(obj)
    except _Cycle:
        raise ValueError(
            f"to_device() cannot move a structure that contains itself: "
            f"{describe_cycle(obj, 'obj')}. Break the cycle, or give the object a .to() method."
        ) from None
    mover.synchronize()
    return result  # type: ignore[no-any-return]


def load(path: str | os.PathLike[str], device: DeviceLike | None = None, **kwargs: Any) -> Any:
    """``torch.load`` onto ``device``, whatever device the checkpoint was saved from.

    A checkpoint saved on ``cuda:1`` loads on a CPU-only or one-GPU machine:
    every tensor is mapped to ``device``. ``weights_only=True`` is the default,
    so loading never runs code from the file; pass ``weights_only=False`` only
    for files you trust.

    Args:
        path: The file to load (or anything ``torch.load`` accepts).
        device: Where the tensors go, a :data:`DeviceLike`. Default: :func:`try_gpu`.
        **kwargs: Passed to ``torch.load`` (``weights_only``, ``mmap``...).

    Returns:
        What ``torch.load`` returns, with its tensors on ``device``.

    Raises:
        TypeError: Both ``device`` and ``map_location`` were given.
        DeviceNotFoundError: This torch build or machine has no such device.

    Examples:
        >>> import io, torch, devicekit as dk
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> _ = buffer.seek(0)
        >>> dk.load(buffer, "cpu")
        {'w': tensor([1., 1.])}
    """
    if "map_location" in kwargs:
        if device is not None:
            raise TypeError("load() takes device or map_location, not both; pass only device")
        map_location = kwargs.pop("map_location")
    else:
        map_location = try_gpu() if device is None else resolve_device(device)
    kwargs.setdefault("weights_only", True)
    return torch.load(path, map_location=map_location, **kwargs)


_warned_data_parallel = False


def data_parallel(
    module: torch.nn.Module, devices: Sequence[DeviceLike] | DeviceLike | None = None
) -> torch.nn.Module:
    """Wrap ``module`` in ``nn.DataParallel`` when there are several GPUs; else just move it.

    With two or more devices, the module goes to the first and is wrapped in
    ``nn.DataParallel`` over all of them. With one device or none, the module
    is moved to that device (or :func:`try_gpu`) and returned unwrapped, so
    the same script runs everywhere. The first time it wraps, it logs (with
    ``logging``, at WARNING) that ``DistributedDataParallel`` is faster.

    Args:
        module: The model.
        devices: The devices to use: a list of :data:`DeviceLike`, or one
            device. Default: :func:`try_all_gpus`.

    Returns:
        ``nn.DataParallel(module)`` or ``module`` itself, moved.

    Raises:
        ValueError: ``devices`` is empty, or mixes device types.
        DeviceNotFoundError: One of ``devices`` does not exist here.

    Examples:
        >>> import torch, devicekit as dk
        >>> model = dk.data_parallel(torch.nn.Linear(2, 2), ["cpu"])
        >>> type(model).__name__, model.weight.device
        ('Linear', device(type='cpu'))
    """
    global _warned_data_parallel  # noqa: PLW0603 - a once-per-process flag
    targets = try_all_gpus() if devices is None else resolve_devices(devices)
    if not targets:
        raise ValueError("data_parallel() needs at least one device, got an empty list")
    kinds = sorted({d.type for d in targets})
    if len(kinds) > 1:
        raise ValueError(f"data_parallel() needs devices of one type, got {', '.join(kinds)}")
    module.to(targets[0])
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
