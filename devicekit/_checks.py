"""`assert_same_device`: every tensor on one device, or an error saying where each is."""

from __future__ import annotations

import types
import warnings
from collections import defaultdict
from collections.abc import ItemsView, Iterable, Iterator, KeysView, ValuesView
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from ._checkfix import ATTRIBUTE, KEPT, MOVED, Held, Holder, Path, mismatch_message, render
from ._devices import DeviceLike, resolve_device
from ._errors import DeviceMismatchError
from ._frames import caller_stacklevel
from ._look import NOTHING_INSIDE, OPAQUE, module_attributes, object_attributes
from ._lookbulk import array_elements, bulk_children, bulk_look, plain_class_ids
from ._mover import _has_to_method
from ._options import short_repr
from ._tree import children, container_attributes, iter_children

__all__ = ["assert_same_device"]


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
    tokenizer's 150,000-entry vocabulary costs about 15 ms. One holding more
    (a dataset, a logger) is a ``ValueError``, not a pass for tensors never
    seen. The dicts, lists and records given are checked whole (a dict's
    values, as ``to_device()`` moves them, not its keys).

    A module's plain attributes are looked inside by the same rules: what its
    instance (or a submodule's) holds besides parameters, buffers and
    submodules (``self.pos = torch.randn(16, 8)``, a cache, a vocabulary),
    which ``module.to()`` does not move. One left behind is named with a
    path such as ``model.pos`` or ``model.encoder.layers.0.cache`` and a fix
    that registers it (what [`check_module()`][devicekit.check_module] says
    for each): in the error where any other tensor is astray too, or where
    the argument holds no other tensor; else in a ``RuntimeWarning``, once
    per argument and stray, and the check passes, since a module may keep
    such a copy elsewhere on purpose and move it when it uses it
    (transformers' rotary embeddings keep ``original_inv_freq`` so, in the
    4.x releases). Up to 4,096 objects are read there per argument, and past
    them the rest is left unread, not refused (a loss history kept on the
    model must not make a check run every step ever slower). Not looked at again: torch's own bookkeeping, a
    submodule or parameter referred to twice (moved in place), an attribute
    a forward pre-hook makes again (``weight`` after ``weight_norm``), plain
    values and functions. This costs about 3 to 4 µs per module (a 12-layer
    transformers Qwen2 or BERT, 160 to 230 modules: about 1 ms, where
    parameters and buffers alone took 0.25 to 0.35 ms).
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
    where: dict[torch.device, list[Path]] = defaultdict(list)
    owners: dict[str, set[torch.device]] = defaultdict(set)  # each argument's devices
    held: dict[str, list[Held]] = {}  # tensors in objects to_device() returns unchanged
    # Where the tensors are, but for those a module holds as plain attributes: a module
    # may keep one elsewhere on purpose (see _warn_attributes), so alone they only warn.
    # An argument whose only tensors are such attributes has nothing else to be judged by.
    core: dict[torch.device, int] = defaultdict(int)
    for name, obj in named.items():
        holders: dict[int, str] = {}  # each holder's path, made once
        collected = _collect(obj, name)
        alone = all(holder is not None and holder[2] is ATTRIBUTE for _, _, holder in collected)
        for path, tensor, holder in collected:
            on = tensor.device
            where[on].append(path)
            if alone or holder is None or holder[2] is not ATTRIBUTE:
                core[on] += 1
            if holder is None or holder[2] is MOVED:
                owners[name].add(on)
            else:
                at = holders.get(id(holder))
                if at is None:
                    at = holders[id(holder)] = render(holder[0])
                held.setdefault(name, []).append((on, at, holder[1], holder[2], path))
    if not where:
        raise ValueError(
            f"assert_same_device() found no tensor in {', '.join(named) or 'its arguments'}; "
            "pass the tensors, modules or batches to check"
        )
    if len(where) == 1 and (expected is None or expected in where):
        return next(iter(where))
    if len(core) == 1 and (expected is None or expected in core):
        device = next(iter(core))
        _warn_attributes(held, device, named)
        return device
    said = f"device={short_repr(device)}" if isinstance(device, (str, int)) else "device="
    raise DeviceMismatchError(
        mismatch_message(where, owners, named, expected, said=said, held=held)
    )


_warned: set[tuple[int, str]] = set()  # (id of the argument, first stray's path) told
_WARNED_AT_MOST = 1024


def _warn_attributes(
    held: dict[str, list[Held]], device: torch.device, named: dict[str, Any]
) -> None:
    """Warn of the tensors modules hold as plain attributes off ``device``, every other on it.

    ``module.to()`` leaves a plain attribute where it is, so one left behind is
    a bug where the forward uses it, and none where the module keeps a copy on
    purpose and moves it when it needs it (transformers' rotary embeddings keep
    ``original_inv_freq`` so, in the 4.x releases): the check cannot tell which,
    so it names them, and passes.
    """
    for name, tensors in held.items():
        strays = [
            (on, holder, path)
            for on, holder, _, kind, path in tensors
            if kind is ATTRIBUTE and on != device
        ]
        if not strays:
            continue
        shown = ", ".join(f"{render(path)}: {on}" for on, _, path in strays[:3])
        more = f" and {len(strays) - 3} more" if len(strays) > 3 else ""
        holder = strays[0][1]
        # Once per argument and stray, not per call: a check run every step, over a list
        # that grows ("and N more"), would warn at each (and fill __warningregistry__).
        first = (id(named[name]), render(strays[0][2]))
        if first in _warned:
            continue
        if len(_warned) < _WARNED_AT_MOST:
            _warned.add(first)
        warnings.warn(
            f"assert_same_device(): every tensor is on {device} but for what {holder} holds as "
            f"plain attributes ({shown}{more}), which {holder}.to() does not move. Where the "
            "forward uses one, register it with self.register_buffer() in the module holding "
            f"it (dk.check_module({holder}) names the fix for each); some modules keep such a "
            "copy on purpose and move it when they use it (transformers' rotary embeddings "
            "keep original_inv_freq so).",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


# Objects read one by one inside the objects the check does not otherwise know, per
# argument: a cache or a batch holds a few thousand; a dataset or a logger millions, and
# then the check says it stopped rather than pass what it never saw. Containers given as
# they are (dicts, lists, records of tensors) are checked whole, however large.
_LOOK_BUDGET = 100_000
# Values read in bulk there, in C (_lookbulk.bulk_look()): the builtin lists, tuples, dicts and
# sets of plain values (str, numbers, None...), which hold no tensor, are passed over so,
# not read one by one: a tokenizer's 150,000-entry vocabulary, a dataset's labels. About
# 20 to 120 ns a value, measured (best of 5, 2-core machine, load average 1.0): 14 ms for
# that vocabulary (its keys read too: 300,000 values), 28 ms for 1.28 million int labels,
# 0.45 s for those and 1.28 million (path, label) pairs besides, 0.35 s for 10 million
# ints and str-to-int entries: so much plain data costs a second at most.
_BULK_BUDGET = 10_000_000
# A module's attributes that are code (OPAQUE: never looked inside), by their class's id().
_CODE = frozenset(map(id, OPAQUE))


# Objects read one by one inside the plain attributes of an argument's modules. A stray
# there only warns (see _warn_attributes), so past this the rest is not read, rather than
# refused: a model may keep a loss history or a trainer, and a check run every step must
# not grow with it. A model's own (a config, a cache, a mask) are a few hundred.
_ATTRIBUTE_BUDGET = 4096


class _Budget:
    """What is left to read inside the objects of one argument: one by one, and in bulk."""

    __slots__ = ("attributes", "bulk", "objects")

    def __init__(self) -> None:
        self.objects = _LOOK_BUDGET
        self.bulk = _BULK_BUDGET
        self.attributes = _ATTRIBUTE_BUDGET

    def spend(self, holder: Holder, name: str) -> bool:
        """Count one object read inside ``holder``; False once modules' attributes are spent.

        Raises:
            ValueError: Past ``_LOOK_BUDGET`` inside other objects: not a pass.
        """
        if holder[2] is ATTRIBUTE:
            self.attributes -= 1
            return self.attributes >= 0
        self.objects -= 1
        if self.objects < 0:
            raise ValueError(_too_many(name, holder, f"{_LOOK_BUDGET:,} objects"))
        return True


class _Listed:
    """The tensors found so far, by ``id()``, read from the walk's list as they are asked for."""

    __slots__ = ("ids", "upto")

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.upto = 0

    def again(self, tensor: torch.Tensor, found: list[Any], parameter: type) -> bool:
        """Whether ``tensor`` is a parameter found already, under another name.

        A plain reference to one (``self.groups = [self.fc.weight]``): ``module.to()``
        moves it in place, so it is where that one is, and it is listed once.
        """
        if not isinstance(tensor, parameter):
            return False
        self.ids.update(id(entry[1]) for entry in found[self.upto :])
        self.upto = len(found)
        return id(tensor) in self.ids


def _collect(obj: object, name: str) -> list[tuple[Path, torch.Tensor, Holder | None]]:
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
    found: list[tuple[Path, torch.Tensor, Holder | None]] = []
    seen: dict[int, object] = {}
    left = _Budget()
    tensor_class, module_class, parameter_class = torch.Tensor, torch.nn.Module, torch.nn.Parameter
    listed = _Listed()
    stack: list[tuple[Iterator[tuple[str, Any]], Path | None, Holder | None]] = [
        (iter(((name, obj),)), None, None)
    ]
    while stack:
        elements, parent, holder = stack[-1]
        for suffix, child in elements:
            if holder is not None and not left.spend(holder, name):
                # The rest of the modules' plain attributes: left unread (see _Budget).
                while stack and stack[-1][2] is not None and stack[-1][2][2] is ATTRIBUTE:
                    stack.pop()
                break
            cls = type(child)
            if cls in NOTHING_INSIDE:
                continue
            if cls is tensor_class or isinstance(child, tensor_class):
                if holder is None or not listed.again(child, found, parameter_class):
                    found.append(((parent, suffix), child, holder))
                continue
            if id(child) in seen:
                continue
            path: Path = (parent, suffix)
            if isinstance(child, module_class):
                seen[id(child)] = child
                found.extend(((path, f".{n}"), p, holder) for n, p in child.named_parameters())
                found.extend(((path, f".{n}"), b, holder) for n, b in child.named_buffers())
                attributes = _module_attributes(child, seen)
                if not attributes:
                    continue
                stack.append((iter(attributes), path, holder or (path, cls.__name__, ATTRIBUTE)))
                break
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
    obj: object, path: Path, holder: Holder | None, left: _Budget, name: str
) -> tuple[Iterable[tuple[str, Any]], Holder | None] | None:
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
                f"assert_same_device() cannot check {render(path)}: {error}"
            ) from None
        if bulk is not None:
            read, plain = bulk
            if holder[2] is ATTRIBUTE and read > left.bulk:
                return None  # a module's attribute: not read further, not refused (see above)
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
            return elements, holder or (path, type(obj).__name__, KEPT)
        try:
            attributes = object_attributes(obj, limit=left.objects + 1)
        except RuntimeError as error:  # another thread kept changing it: no partial pass
            raise RuntimeError(
                f"assert_same_device() cannot check {render(path)}: {error}"
            ) from None
        if not attributes:
            return None
        if holder is None:
            cls = type(obj)
            holder = (path, cls.__name__, MOVED if _has_to_method(cls) else KEPT)
        return attributes, holder
    if isinstance(obj, PackedSequence):
        # torch keeps batch_sizes on the CPU by design (PackedSequence.to() leaves it
        # there: the packed RNN kernels read it on the host); the indices follow data.
        return (item for item in items if item[0] != ".batch_sizes"), holder
    return items, holder


def _module_attributes(module: torch.nn.Module, seen: dict[int, object]) -> list[tuple[str, Any]]:
    """The plain attributes of ``module`` and its submodules, those that may hold a tensor.

    What `module_attributes()` finds (``module.to()`` leaves it where it is),
    with a dotted path as a parameter's (``.encoder.layers.0.cache``), but for
    plain values (a number, a str, a dtype), which hold none and are not
    counted, and for functions and classes (an activation, ``F.relu``), whose
    insides are not looked at anywhere. Every submodule is marked seen: a plain reference to one (a
    back-reference) is moved with the model, not looked at again.
    """
    found: list[tuple[str, Any]] = []
    plain = plain_class_ids() | _CODE
    for prefix, submodule in module.named_modules():
        seen[id(submodule)] = submodule
        dotted = f".{prefix}." if prefix else "."
        found.extend(
            (f"{dotted}{attr}", value)
            for attr, value in module_attributes(submodule)
            if id(type(value)) not in plain
        )
    return found


def _too_many(name: str, holder: Holder, what: str) -> str:
    at, kind = render(holder[0]), holder[1]
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
