"""`assert_same_device`: every tensor on one device, or an error saying where each is."""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, Sized, ValuesView
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from ._devices import DeviceLike, resolve_device
from ._errors import DeviceMismatchError
from ._format import plural
from ._look import NOTHING_INSIDE, OPAQUE, object_attributes
from ._lookbulk import array_elements, bulk_children, bulk_look
from ._mover import _has_to_method
from ._options import short_repr
from ._tree import children, container_attributes, iter_children

__all__ = ["assert_same_device"]

_SHOWN_PER_DEVICE = 5  # paths listed per device before "... and N more"
_SHOWN_HOLDERS = 3  # objects to_device() leaves alone named in a fix, per argument


def assert_same_device(
    *objs: Any, device: DeviceLike | None = None, **named_objs: Any
) -> torch.device:
    """Check that every tensor in the arguments is on one device, and return that device.

    Walks the same structures as [`to_device()`][devicekit.to_device], a
    module's parameters and buffers, and, since a check must not vouch for
    tensors it never saw, inside every other object too: its instance
    attributes and slots (a class of your own, a transformers ``DynamicCache``,
    whose tensors are at ``cache.layers[0].keys``), which ``to_device()``
    returns unchanged. Each object is looked at once, so one that refers back
    to itself is no error, and any depth is walked (a chain of objects through
    ``self.next``). Inside such an object, up to 100,000 objects are read one
    by one (a numpy array of ``dtype=object`` element by element), and its
    builtin lists, tuples, dicts and sets of plain values (str, numbers,
    None, numpy scalars and arrays of numbers), and of such containers in
    turn, which hold no tensor, are passed over in bulk, up to 10,000,000
    values (a dict's keys, checked too, count with its values): a
    tokenizer's 150,000-entry vocabulary costs about 3 ms. One holding more
    (a dataset, a logger) is a ``ValueError``, not a pass for tensors never
    seen. The dicts, lists and records given are checked whole (a dict's
    values, as ``to_device()`` moves them, not its keys).
    A ``PackedSequence``'s ``batch_sizes`` is not checked: torch keeps it on
    the CPU on purpose.

    Positional arguments are named ``arg0``, ``arg1``...; keyword
    arguments by their names, so ``assert_same_device(model=model,
    batch=batch)`` reports paths such as ``model.fc.weight`` and
    ``batch['labels']``. ``device=`` is the device expected, never an object
    to check.

    A generator or other iterator, and a dict view (``d.values()``), given as
    an argument is refused: checking an iterator's tensors would use it up,
    and a view is not walked (`to_device()` returns both unchanged). So is a
    class, a Python module or a function, whose insides are not looked at.
    Inside an argument, all of these are left unchecked.

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
        ValueError: The arguments hold no tensor, an object the check looks
            inside attribute by attribute holds more than 100,000 objects (or
            10,000,000 values in its lists, dicts, tuples and sets), or
            ``device`` is malformed.
        TypeError: An argument is a generator, an iterator, a dict view, a
            class, a module or a function, or a keyword argument is named
            ``arg0``, ``arg1``... like a positional one (one of the two would
            go unchecked).
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
    where: dict[torch.device, list[_Path]] = defaultdict(list)
    owners: dict[str, set[torch.device]] = defaultdict(set)  # each argument's devices
    held: dict[str, list[_Held]] = {}  # tensors in objects to_device() returns unchanged
    for name, obj in named.items():
        holders: dict[int, str] = {}  # each holder's path, made once
        for path, tensor, holder in _collect(obj, name):
            on = tensor.device
            where[on].append(path)
            if holder is None or holder[2]:
                owners[name].add(on)
            else:
                at = holders.get(id(holder))
                if at is None:
                    at = holders[id(holder)] = _render(holder[0])
                held.setdefault(name, []).append((on, at, holder[1], path))
    if not where:
        raise ValueError(
            f"assert_same_device() found no tensor in {', '.join(named) or 'its arguments'}; "
            "pass the tensors, modules or batches to check"
        )
    if len(where) == 1 and (expected is None or expected in where):
        return next(iter(where))
    said = f"device={short_repr(device)}" if isinstance(device, (str, int)) else "device="
    raise DeviceMismatchError(
        _mismatch_message(where, owners, named, expected, said=said, held=held)
    )


# Where a tensor is: (where its container is, or None for an argument; its suffix there).
# Made into text only for the paths a message shows: a check that passes makes none, and
# a chain 100,000 objects deep costs no 100,000 ever longer strings.
_Path = tuple["_Path | None", str]
# The outermost object around a tensor that children() does not know, looked inside
# attribute by attribute: its path, its class's name, and whether it has a .to() (then
# that .to() is to_device()'s whole say, and the fix moves the argument).
_Holder = tuple[_Path, str, bool]
# A tensor inside an object that to_device() returns unchanged: its device, the object's
# path and class name, and the tensor's path.
_Held = tuple[torch.device, str, str, _Path]
# Objects read one by one inside the objects the check does not otherwise know, per
# argument: a cache or a batch holds a few thousand; a dataset or a logger millions, and
# then the check says it stopped rather than pass what it never saw. Containers given as
# they are (dicts, lists, records of tensors) are checked whole, however large.
_LOOK_BUDGET = 100_000
# Values read in bulk there, in C (_lookbulk.bulk_look()): the builtin lists, tuples, dicts and
# sets of plain values (str, numbers, None...), which hold no tensor, are passed over so,
# not read one by one: a tokenizer's 150,000-entry vocabulary, a dataset's labels. About
# 20 to 100 ns a value, measured: 3 ms for that vocabulary, 26 ms for 1.28 million int
# labels, 0.3 s for those and 1.28 million (path, label) pairs besides, about 1 s for 10
# million values, on a busy 2-core machine: so much plain data costs a second at most.
_BULK_BUDGET = 10_000_000


class _Budget:
    """What is left to read inside the objects of one argument: one by one, and in bulk."""

    __slots__ = ("bulk", "objects")

    def __init__(self) -> None:
        self.objects = _LOOK_BUDGET
        self.bulk = _BULK_BUDGET


def _collect(obj: object, name: str) -> list[tuple[_Path, torch.Tensor, _Holder | None]]:
    """Every tensor in argument ``obj``, with its path and holder, each object looked at once.

    ``holder`` is the outermost object around the tensor that `children()` does
    not know (neither a container ``to_device()`` rebuilds nor a record), for
    the fix; else None. Depth first, in the order of each object's elements,
    with a stack of iterators, not a frame per level: any depth is walked.
    ``seen`` keeps each object it names alive, so no ``id()`` is reused while
    the walk runs. Inside a holder, elements are read as they are reached and
    counted: past ``_LOOK_BUDGET`` of them, a ``ValueError`` says so. A builtin
    container there is first read in bulk (`bulk_look()`): its plain values are
    passed over, counted against ``_BULK_BUDGET``, and only the rest read one by
    one.
    """
    found: list[tuple[_Path, torch.Tensor, _Holder | None]] = []
    seen: dict[int, object] = {}
    left = _Budget()
    tensor_class, module_class = torch.Tensor, torch.nn.Module
    stack: list[tuple[Iterator[tuple[str, Any]], _Path | None, _Holder | None]] = [
        (iter(((name, obj),)), None, None)
    ]
    while stack:
        elements, parent, holder = stack[-1]
        for suffix, child in elements:
            if holder is not None:
                left.objects -= 1
                if left.objects < 0:
                    raise ValueError(_too_many(name, holder, f"{_LOOK_BUDGET:,} objects"))
            cls = type(child)
            if cls in NOTHING_INSIDE:
                continue
            if cls is tensor_class or isinstance(child, tensor_class):
                found.append(((parent, suffix), child, holder))
                continue
            if id(child) in seen:
                continue
            path: _Path = (parent, suffix)
            if isinstance(child, module_class):
                seen[id(child)] = child
                found.extend(((path, f".{n}"), p, holder) for n, p in child.named_parameters())
                found.extend(((path, f".{n}"), b, holder) for n, b in child.named_buffers())
                continue
            opened = _open(child, path, holder, left, name)
            if opened is None:
                continue
            seen[id(child)] = child
            stack.append((iter(opened[0]), path, opened[1]))
            break  # its elements first, then the rest of this one's
        else:
            stack.pop()
    return found


def _open(
    obj: object, path: _Path, holder: _Holder | None, left: _Budget, name: str
) -> tuple[Iterable[tuple[str, Any]], _Holder | None] | None:
    """What the walk reads inside ``obj`` and the holder around it, or None for nothing.

    Outside a holder, as the argument was given: its elements whole, listed
    before they are walked (`children()`). Inside one, read as they are
    reached, but for the plain values of a builtin container, passed over in
    bulk; past ``_BULK_BUDGET`` of those, a ``ValueError`` says so.
    """
    if holder is not None:
        try:
            bulk = bulk_look(obj, left.bulk)
        except RuntimeError as error:  # another thread kept changing it: no partial pass
            raise RuntimeError(
                f"assert_same_device() cannot check {_render(path)}: {error}"
            ) from None
        if bulk is not None:
            read, plain = bulk
            left.bulk -= read
            if left.bulk < 0:
                raise ValueError(
                    _too_many(
                        name,
                        holder,
                        f"{_BULK_BUDGET:,} values in its lists, dicts, tuples and sets",
                    )
                )
            if plain:  # its items hold nothing to read: what its instance was given, if any
                return ((f".{key}", value) for key, value in container_attributes(obj)), holder
            return bulk_children(obj), holder  # its attributes too
    items = children(obj) if holder is None else iter_children(obj)
    if items is None:
        elements = array_elements(obj)  # a numpy array of dtype=object: each element
        if elements is not None:  # to_device() returns it unchanged: a holder
            return elements, holder or (path, type(obj).__name__, False)
        try:
            attributes = object_attributes(obj, limit=left.objects + 1)
        except RuntimeError as error:  # another thread kept changing it: no partial pass
            raise RuntimeError(
                f"assert_same_device() cannot check {_render(path)}: {error}"
            ) from None
        if not attributes:
            return None
        if holder is None:
            cls = type(obj)
            holder = (path, cls.__name__, _has_to_method(cls))
        return attributes, holder
    if isinstance(obj, PackedSequence):
        # torch keeps batch_sizes on the CPU by design (PackedSequence.to() leaves it
        # there: the packed RNN kernels read it on the host); the indices follow data.
        return (item for item in items if item[0] != ".batch_sizes"), holder
    return items, holder


def _render(path: _Path) -> str:
    """A path as text: ``batch['h'][0].x``."""
    suffixes = []
    node: _Path | None = path
    while node is not None:
        node, suffix = node
        suffixes.append(suffix)
    return "".join(reversed(suffixes))


def _too_many(name: str, holder: _Holder, what: str) -> str:
    at, kind = _render(holder[0]), holder[1]
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return (
        f"assert_same_device() cannot check {name}: {at} is {article} {kind}, which it looks "
        f"inside attribute by attribute, and it holds more than {what} (counting "
        "what they hold in turn: a dataset, a logger?). The check stops there rather than "
        "pass tensors it never saw. Pass the tensors to check themselves, or a dict or list "
        f"of them, instead of {at}."
    )


def _refuse_unwalkable(name: str, obj: object) -> None:
    """Refuse an argument whose tensors the walk would miss without a word.

    An iterator, a dict view, a class, a Python module, a function.
    """
    if isinstance(obj, OPAQUE):
        kind = (
            "class"
            if isinstance(obj, type)
            else "module"
            if isinstance(obj, types.ModuleType)
            else "function"
        )
        label = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?")
        raise TypeError(
            f"assert_same_device() cannot check {name}, a {kind} ({label}): it does "
            "not look inside classes, Python modules or functions, so their tensors (a "
            "global, a closure, a class attribute) would go unchecked. Pass the tensors "
            "themselves, or the object or module instance that holds them."
        )
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


def _mismatch_message(
    where: dict[torch.device, list[_Path]],
    owners: dict[str, set[torch.device]],
    named: dict[str, Any],
    expected: torch.device | None = None,
    *,
    said: str = "device=",
    held: dict[str, list[_Held]] | None = None,
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
        lines.extend(f"  {_render(path)}: {device}" for path in paths[:_SHOWN_PER_DEVICE])
        if len(paths) > _SHOWN_PER_DEVICE:
            lines.append(f"  ... and {len(paths) - _SHOWN_PER_DEVICE} more on {device}")
    lines.extend(_fix(where, owners, named, expected, held))
    return "\n".join(lines)


def _fix(
    where: Mapping[torch.device, Sized],
    owners: dict[str, set[torch.device]],
    named: dict[str, Any],
    expected: torch.device | None = None,
    held: dict[str, list[_Held]] | None = None,
) -> list[str]:
    """What to run: every argument that is not all on the target, moved there.

    ``owners`` has each argument's devices but for its tensors in ``held``:
    those inside an object ``to_device()`` returns unchanged, which only the
    user can move (or make again) where they belong.
    """
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
    for name, obj in named.items():
        devices = owners.get(name, set())
        steps.extend(_held_steps(name, (held or {}).get(name, []), target))
        if devices <= {target}:
            continue
        on_meta = stuck and torch.device("meta") in devices
        if isinstance(obj, torch.nn.Module):
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


def _held_steps(name: str, held: list[_Held], target: torch.device) -> list[str]:
    """The steps for the strays of ``name`` inside objects that ``to_device()`` leaves alone."""
    objects: dict[str, tuple[str, list[torch.device], list[_Path]]] = {}
    for device, holder, kind, path in held:
        if device != target:
            _, devices, paths = objects.setdefault(holder, (kind, [], []))
            devices.append(device)
            paths.append(path)
    steps = []
    for holder, (kind, devices, paths) in list(objects.items())[:_SHOWN_HOLDERS]:
        if target.type != "meta" and torch.device("meta") in devices:
            steps.append(
                f"make {holder} again on {target} (it is a {kind}, which dk.to_device() "
                "returns unchanged, and its meta tensors hold no values to copy)"
            )
        else:
            more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
            steps.append(
                f"move the tensors in {holder} ({_render(paths[0])}{more}) to {target} yourself, "
                f"or make it there (it is a {kind}, which dk.to_device() returns unchanged)"
            )
    if len(objects) > _SHOWN_HOLDERS:
        steps.append(f"the same for {len(objects) - _SHOWN_HOLDERS} more objects in {name}")
    return steps


def _count(paths: Sized) -> str:
    return "1 tensor" if len(paths) == 1 else f"{len(paths)} tensors"
