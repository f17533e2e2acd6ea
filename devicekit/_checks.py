"""Finding what is on the wrong device, and what ``module.to()`` will leave behind."""

from __future__ import annotations

import functools
import sys
from collections import defaultdict
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import Any

import torch

from ._census import storage_identity
from ._devices import DeviceLike, resolve_device
from ._errors import DeviceMismatchError
from ._format import plural
from ._tree import children, iter_tensors

__all__ = ["assert_same_device", "check_module"]

_SHOWN_PER_DEVICE = 5  # paths listed per device before "... and N more"


def assert_same_device(
    *objs: Any, device: DeviceLike | None = None, **named_objs: Any
) -> torch.device:
    """Check that every tensor in the arguments is on one device, and return that device.

    Walks the same structures as [`to_device()`][devicekit.to_device], and a module's parameters
    and buffers. Positional arguments are named ``arg0``, ``arg1``...; keyword
    arguments by their names, so ``assert_same_device(model=model,
    batch=batch)`` reports paths such as ``model.fc.weight`` and
    ``batch['labels']``. ``device=`` is the device expected, never an object
    to check.

    A generator or other iterator, and a dict view (``d.values()``), given as
    an argument is refused: checking an iterator's tensors would use it up,
    and a view is not walked (`to_device()` returns both unchanged). Inside an
    argument, they are left unchecked, as `to_device()` leaves them unmoved.

    Args:
        *objs: Tensors, modules, or nested structures holding them.
        device: The device every tensor must be on: a [`DeviceLike`][devicekit.DeviceLike]
            (``"cuda"`` is the current CUDA device; CUDA is not initialized to
            find it). Default: whichever device they share.
        **named_objs: The same as ``objs``, named for the error message.

    Returns:
        The one device every tensor is on.

    Raises:
        DeviceMismatchError: Tensors are on more than one device, or on one
            other than ``device``. The message lists each device with the
            paths on it, the strays first, and ends with a fix.
        ValueError: The arguments hold no tensor, or contain themselves, or
            ``device`` is malformed.
        TypeError: An argument is a generator, an iterator or a dict view, or
            a keyword argument is named ``arg0``, ``arg1``... like a
            positional one (one of the two would go unchecked).
        RecursionError: An argument nests deeper than Python's recursion limit.
        DeviceNotFoundError: This torch build or machine has no ``device``.

    Examples:
        >>> import torch, devicekit as dk
        >>> model = torch.nn.Linear(2, 1)
        >>> dk.assert_same_device(model=model, batch={"x": torch.ones(2)})
        device(type='cpu')
        >>> dk.assert_same_device(model=model, device="meta")
        Traceback (most recent call last):
        ...
        devicekit.DeviceMismatchError: expected every tensor on meta (device='meta'), found them on 1 device: cpu (2 tensors)
          model.weight: cpu
          model.bias: cpu
        Fix: move everything to meta: model.to('meta').
    """  # noqa: E501 - the expected output is one line
    expected = None if device is None else resolve_device(device, name="device")
    named = {f"arg{index}": obj for index, obj in enumerate(objs)}
    for name in named.keys() & named_objs.keys():  # the keyword would hide the positional
        raise TypeError(
            f"assert_same_device() got {name} twice: as positional argument {name[3:]} (which "
            f"it names {name}) and as a keyword; give the keyword argument another name"
        )
    named |= named_objs
    for name, obj in named.items():
        _refuse_unwalkable(name, obj)
    where: dict[torch.device, list[str]] = defaultdict(list)
    owners: dict[str, set[torch.device]] = defaultdict(set)  # each argument's devices
    for name, obj in named.items():
        try:
            for path, tensor in iter_tensors(obj, name):
                where[tensor.device].append(path)
                owners[name].add(tensor.device)
        except RecursionError:
            # Counting the depth in the walk would cost every call; Python counts it anyway.
            raise RecursionError(_too_deep(name)) from None
    if not where:
        raise ValueError(
            f"assert_same_device() found no tensor in {', '.join(named) or 'its arguments'}; "
            "pass the tensors, modules or batches to check"
        )
    if len(where) == 1 and (expected is None or expected in where):
        return next(iter(where))
    said = f"device={device!r}" if isinstance(device, (str, int)) else "device="
    raise DeviceMismatchError(_mismatch_message(where, owners, named, expected, said))


def _refuse_unwalkable(name: str, obj: object) -> None:
    """Refuse an argument whose tensors the walk would miss without a word: an iterator, a view."""
    if not isinstance(obj, (Iterator, KeysView, ValuesView, ItemsView)):
        return
    if children(obj) is not None:
        return  # a container that is also an iterator is walked as a container
    kind = type(obj).__name__
    if isinstance(obj, Iterator):  # a generator, map(), zip(), iter(list)...
        raise TypeError(
            f"assert_same_device() cannot check {name}, a {kind}, without consuming it: "
            "checking its tensors would use it up (to_device() returns it unchanged and not "
            "consumed for the same reason). Pass a list of its items, list(...), and use that "
            "list afterwards, or check each item as it comes."
        )
    if isinstance(obj, (KeysView, ValuesView, ItemsView)):
        raise TypeError(
            f"assert_same_device() cannot check {name}, a {kind} view: a dict view is not "
            "walked (to_device() returns it unchanged, with its tensors where they were). Pass "
            "the dict itself, or list(...) of the view."
        )


def _too_deep(name: str) -> str:
    return (
        f"assert_same_device() cannot check {name}: it nests containers deeper than Python's "
        f"recursion limit (sys.getrecursionlimit() is {sys.getrecursionlimit()}) allows. Raise "
        "the limit with sys.setrecursionlimit(), or flatten the structure. (If it is not that "
        "deep, an attribute read in the walk recursed without end: the original error is this "
        "one's __context__.)"
    )


def _mismatch_message(
    where: dict[torch.device, list[str]],
    owners: dict[str, set[torch.device]],
    named: dict[str, Any],
    expected: torch.device | None = None,
    said: str = "device=",
) -> str:
    # Strays first: the tensors off the expected device, else the smallest groups.
    groups = sorted(where.items(), key=lambda item: (item[0] == expected, len(item[1])))
    found = ", ".join(f"{device} ({_count(paths)})" for device, paths in groups)
    if expected is None:
        lines = [f"expected every tensor on one device, found {len(groups)}: {found}"]
    else:
        lines = [
            f"expected every tensor on {expected} ({said}), found them on "
            f"{plural(len(groups), 'device')}: {found}"
        ]
    for device, paths in groups:
        lines.extend(f"  {path}: {device}" for path in paths[:_SHOWN_PER_DEVICE])
        if len(paths) > _SHOWN_PER_DEVICE:
            lines.append(f"  ... and {len(paths) - _SHOWN_PER_DEVICE} more on {device}")
    lines.extend(_fix(where, owners, named, expected))
    return "\n".join(lines)


def _fix(
    where: dict[torch.device, list[str]],
    owners: dict[str, set[torch.device]],
    named: dict[str, Any],
    expected: torch.device | None = None,
) -> list[str]:
    """What to run: every argument that is not all on the target, moved there."""
    if expected is not None:
        target = expected  # the caller said where: even meta (a model built without weights)
    else:
        # The target is where the work should run: the accelerator that holds the most,
        # else the CPU. Never meta: its tensors hold no values, so nothing can run there.
        accelerators = [device for device in where if device.type not in ("cpu", "meta")]
        target = max(
            accelerators, key=lambda device: len(where[device]), default=torch.device("cpu")
        )
    stuck = target.type != "meta"  # meta tensors cannot be copied anywhere else: no data
    steps = []
    for name, devices in owners.items():
        if devices == {target}:
            continue
        on_meta = stuck and torch.device("meta") in devices
        if isinstance(named[name], torch.nn.Module):
            if on_meta:
                steps.append(f"{name}.to_empty(device='{target}'), then load its weights")
            else:
                steps.append(f"{name}.to('{target}')")
        elif on_meta:
            steps.append(f"make {name} again on {target} (its meta tensors hold no values to copy)")
        else:
            steps.append(f"{name} = dk.to_device({name}, '{target}')")
    fix = [f"Fix: move everything to {target}: {'; '.join(steps)}."]
    if stuck and torch.device("meta") in where:
        fix.append(
            "Tensors on meta hold no values (shapes only): make them on a real device, or "
            "materialize a model with to_empty() and load its weights."
        )
    return fix


def _count(paths: list[str]) -> str:
    return "1 tensor" if len(paths) == 1 else f"{len(paths)} tensors"


# Attributes every module has (hooks, flags, the registries themselves): not user state.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
# The attribute a forward pre-hook recomputes before every call names itself in one of
# these: WeightNorm and SpectralNorm (torch.nn.utils) say ``name``, pruning ``_tensor_name``.
_HOOK_TARGETS = ("name", "_tensor_name")


class _Registered:
    """What ``module.to()`` moves in the tree under inspection, by ``id()``.

    Each set is built the first time a plain attribute needs it, so a clean
    module pays for none of them.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    @functools.cached_property
    def modules(self) -> frozenset[int]:
        return frozenset(map(id, self._module.modules()))

    @functools.cached_property
    def parameters(self) -> frozenset[int]:
        return frozenset(map(id, self._module.parameters()))

    @functools.cached_property
    def buffers(self) -> dict[int, str]:
        """``id()`` -> dotted name, for the message."""
        return {id(buffer): name for name, buffer in self._module.named_buffers()}

    @functools.cached_property
    def memory(self) -> dict[int, str]:
        """Each parameter's and buffer's memory (its storage) -> dotted name."""
        owners: dict[int, str] = {}
        named = [*self._module.named_parameters(), *self._module.named_buffers()]
        for name, tensor in reversed(named):  # the first name wins, as in named_parameters()
            key = storage_identity(tensor)
            if key is not None:
                owners[key] = name
        return owners


def check_module(module: torch.nn.Module) -> list[str]:
    """Find tensors and modules that ``module.to(...)`` will not move.

    ``Module.to`` moves parameters, buffers and registered submodules only. A
    tensor kept as a plain attribute (``self.mask = torch.ones(3)``), or
    tensors and modules kept in a plain ``list`` or ``dict`` attribute, stay
    where they are, and the model fails later with a device mismatch. This
    reports each such attribute with the device it is on and the fix.

    Not reported, because ``module.to()`` does move them: a plain reference to
    a module or a parameter registered elsewhere in ``module`` (both are
    moved in place, so ``self.groups = [self.fc.weight]`` follows; only a
    move to ``meta`` makes new parameters), and an attribute a forward
    pre-hook recomputes on every call (``weight`` after
    ``torch.nn.utils.weight_norm``, ``spectral_norm`` or pruning). A plain
    reference to a registered *buffer* is reported: ``module.to()`` replaces
    buffers, so the reference keeps the old tensor. The walk takes time in
    proportion to the module's size, and a plain attribute that contains
    itself is looked inside once.

    Args:
        module: The model to inspect (all its submodules are inspected too).

    Returns:
        One readable finding per attribute; empty when ``module.to()`` moves
        everything.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.

    Examples:
        >>> import torch, devicekit as dk
        >>> class Scaled(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.scale = torch.ones(1)
        >>> for finding in dk.check_module(Scaled()):
        ...     print(finding)
        scale: a cpu tensor held as a plain attribute; module.to() will not move it. Use self.register_buffer('scale', ...) (or nn.Parameter if it should be trained).
    """  # noqa: E501 - the expected output is one line
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"check_module() needs a torch.nn.Module, got {type(module).__name__}")
    registered = _Registered(module)
    findings: list[str] = []
    for prefix, submodule in module.named_modules():
        recomputed = _recomputed(submodule)
        for attr, value in vars(submodule).items():
            if attr in _MODULE_INTERNALS or attr in recomputed:
                continue
            finding = _describe(attr, value, registered)
            if finding is not None:
                findings.append(f"{prefix}.{attr}: {finding}" if prefix else f"{attr}: {finding}")
    return findings


def _recomputed(module: torch.nn.Module) -> set[str]:
    """The attributes the module's forward pre-hooks set again before every call."""
    names = set()
    for hook in module._forward_pre_hooks.values():
        for field in _HOOK_TARGETS:
            name = getattr(hook, field, None)
            if isinstance(name, str):
                names.add(name)
    return names


def _describe(attr: str, value: object, registered: _Registered) -> str | None:
    if isinstance(value, torch.Tensor):
        if id(value) in registered.parameters:
            return None  # Module.to() moves a parameter in place: this reference follows
        buffer = registered.buffers.get(id(value))
        if buffer is not None:
            return (
                f"the buffer {buffer!r} held again as a plain attribute; module.to() replaces "
                f"buffers with moved copies, so this one stays the old {value.device} tensor. "
                "Read the buffer through its module instead (a @property can keep this name)."
            )
        key = storage_identity(value)
        owner = None if key is None else registered.memory.get(key)
        if owner is not None:  # a view (self.row = self.fc.weight[0]): a buffer would be a copy
            return (
                f"a {value.device} tensor held as a plain attribute that shares its memory with "
                f"{owner!r} (a view or an alias of it); module.to() gives {owner!r} new memory, "
                f"so this one stays the old {value.device} tensor. Compute it from {owner!r} "
                "where it is used, in forward() or a @property."
            )
        return (
            f"a {value.device} tensor held as a plain attribute; module.to() will not move it. "
            f"Use self.register_buffer({attr!r}, ...) (or nn.Parameter if it should be trained)."
        )
    if isinstance(value, torch.nn.Module):  # set with object.__setattr__ or through __dict__
        if id(value) in registered.modules:
            return None  # a back-reference to a module the tree registers: moved with it
        return (
            f"a {type(value).__name__} module held as a plain attribute, not registered; "
            "module.to() will not move it. Assign it with self.<name> = module to register it."
        )
    if children(value) is None:
        return None
    modules, tensors = _leaves(value, registered)
    kind = type(value).__name__
    if modules:
        fix = "nn.ModuleDict" if isinstance(value, dict) else "nn.ModuleList"
        return (
            f"a {kind} holding {plural(len(modules), 'module')} as a plain attribute; "
            f"module.to() will not move them and their parameters are not registered. Use {fix}."
        )
    if tensors:
        devices = ", ".join(sorted({str(t.device) for t in tensors}))
        fix = "nn.ParameterDict" if isinstance(value, dict) else "nn.ParameterList"
        return (
            f"a {kind} of {plural(len(tensors), 'tensor')} on {devices} held as a plain attribute; "
            f"module.to() will not move them. Use {fix} for trainable tensors, or register "
            "each one with self.register_buffer()."
        )
    return None


def _leaves(
    value: object, registered: _Registered
) -> tuple[list[torch.nn.Module], list[torch.Tensor]]:
    """The modules and tensors inside a plain container that ``module.to()`` will not move.

    Each object is visited once, so a container that holds itself (or one
    object twice) ends the walk instead of raising or counting twice; the walk
    uses its own stack, so depth is no limit.
    """
    modules: list[torch.nn.Module] = []
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if id(item) not in registered.parameters:
                tensors.append(item)
        elif isinstance(item, torch.nn.Module):
            if id(item) not in registered.modules:
                modules.append(item)
        else:
            stack.extend(child for _, child in reversed(children(item) or []))
    return modules, tensors
