"""`assert_same_device`: every tensor on one device, or an error saying where each is."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Set
from typing import Any

import torch

from ._checkfix import (
    ATTRIBUTE,
    MOVED,
    Held,
    Path,
    attribute_fix,
    inside,
    mismatch_message,
    render,
)
from ._checkrefusals import refuse_misspelled_device, refuse_unwalkable
from ._checkwalk import Unread, collect
from ._devices import DeviceLike, resolve_device
from ._errors import DeviceMismatchError
from ._format import article
from ._frames import caller_stacklevel
from ._shortrepr import short_repr
from ._unread import unread

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
    values, each counted once however deep (a dict's keys, checked too,
    count with its values): a tokenizer's 150,000-entry vocabulary costs
    about 15 ms. One holding more (a dataset, a logger) is a ``ValueError``,
    not a pass for tensors never seen. The dicts, lists and records given
    are checked whole. A pandas ``DataFrame``, ``Series`` or ``Index`` is
    read through pandas's own API: its values and labels of ``object``
    dtype, the plain ones in bulk (paths such as ``df['emb'].iloc[0]``). An
    argument it cannot look inside at all (a C extension's object, a
    ``weakref.ref``) is named with why: alone, in the ``ValueError``; beside
    other tensors, in a ``RuntimeWarning``, once per name and class. So is
    such an object met inside an argument, by its path, where it may hold
    the user's tensors: a ``torch.ScriptObject`` (a quantized module's packed
    weights, ``model.0._packed_params._packed_params``) or a third-party C
    extension's object, never a weak reference or Python's, numpy's or
    torch's own (a ``datetime``, a ``grad_fn``, a process group). A
    dict's keys are checked wherever its values are, and a tensor in one is
    named by its device and size
    (``batch[key tensor(..., device='cpu', size=(3,))]``); since
    ``to_device()`` moves a dict's values, never its keys, the fix for one
    given as it is says to make the dict again with its keys where they
    belong.

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
            10,000,000 values in its lists, dicts, tuples and sets), pandas
            raised while a pandas object was read, or ``device`` is malformed.
        TypeError: An argument is a generator, an iterator, a dict view, a
            class, a module or a function, or a keyword argument is named
            ``arg0``, ``arg1``... like a positional one (one of the two would
            go unchecked); an argument is a ``torch.device``, or a keyword
            close to ``device`` (``devce='cpu'``, ``Device=0``) is given a
            device: it holds no tensor, and the device meant went unchecked.
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
        refuse_misspelled_device(name, obj)
        refuse_unwalkable(name, obj)
    where: dict[torch.device, list[Path]] = defaultdict(list)
    owners: dict[str, set[torch.device]] = defaultdict(set)  # each argument's devices
    held: dict[str, list[Held]] = {}  # tensors in objects to_device() returns unchanged
    # Where the tensors are, but for those a module holds as plain attributes: a module
    # may keep one elsewhere on purpose (see _warn_attributes), so alone they only warn.
    # An argument whose only tensors are such attributes has nothing else to be judged by.
    core: dict[torch.device, int] = defaultdict(int)
    # Each argument's tensors on meta, of those moved with it, and how many those are: a
    # module with values beside its meta ones must not be told to_empty() (see _fix).
    on_meta: dict[str, tuple[list[Path], int]] = {}
    # The objects inside each argument it could not look inside at all (a ScriptObject
    # holding a quantized module's weights): never passed off as holding no tensor.
    within: dict[str, list[Unread]] = {}
    for name, obj in named.items():
        holders: dict[int, str] = {}  # each holder's path, made once
        collected = collect(obj, name, within.setdefault(name, []))
        alone = all(holder is not None and holder[2] is ATTRIBUTE for _, _, holder in collected)
        for path, tensor, holder in collected:
            on = tensor.device
            where[on].append(path)
            if alone or holder is None or holder[2] is not ATTRIBUTE:
                core[on] += 1
            if holder is None or holder[2] is MOVED:
                owners[name].add(on)
                metas, count = on_meta.get(name, ([], 0))
                if on.type == "meta":
                    metas.append(path)
                on_meta[name] = (metas, count + 1)
            else:
                at = holders.get(id(holder))
                if at is None:
                    at = holders[id(holder)] = render(holder[0])
                held.setdefault(name, []).append((on, at, holder[1], holder[2], path))
    # The arguments with no tensor it could not look inside at all, and why.
    unread = _unread_arguments(named, owners.keys() | held.keys())
    unread |= _unread_within(within)
    if not where:
        raise ValueError(_no_tensor(unread, named))
    if len(where) == 1 and (expected is None or expected in where):
        device = next(iter(where))
        _warn_unread(unread, device)
        return device
    if len(core) == 1 and (expected is None or expected in core):
        device = next(iter(core))
        _warn_attributes(held, device, named)
        _warn_unread(unread, device)
        return device
    said = f"device={short_repr(device)}" if isinstance(device, (str, int)) else "device="
    raise DeviceMismatchError(
        mismatch_message(where, owners, named, expected, said=said, held=held, on_meta=on_meta)
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
        module = named[name] if holder == name else None
        fix = attribute_fix(holder, module, inside(holder, [path for _, _, path in strays]))
        warnings.warn(
            f"assert_same_device(): every tensor is on {device} but for what {holder} holds as "
            f"plain attributes ({shown}{more}), which {holder}.to() does not move. Where the "
            f"forward uses one, {fix}; some modules keep such a copy on purpose and move it "
            "when they use it (transformers' rotary embeddings keep original_inv_freq so).",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


# What it could not look inside, by the text that names it (an argument's name, or paths
# inside one): its class, why, and the name it is warned of once by (its first path).
_Unreadable = dict[str, tuple[type, str, str]]


def _unread_arguments(named: dict[str, Any], holding: Set[str]) -> _Unreadable:
    """Each argument not in ``holding`` (no tensor found) it could not look inside."""
    found: _Unreadable = {}
    for name, obj in named.items():
        if name not in holding:
            why = unread(obj)
            if why is not None:
                found[name] = (type(obj), why, name)
    return found


_SHOWN_UNREAD = 3  # paths named per class of objects it could not look inside


def _unread_within(within: dict[str, list[Unread]]) -> _Unreadable:
    """The objects inside the arguments it could not look inside, by class.

    Keyed by their paths (``arg0.0._packed_params._packed_params``): the first
    few of each class in each argument, and ``... and N more``.
    """
    found: _Unreadable = {}
    for records in within.values():
        by_class: dict[type, list[Unread]] = {}
        for record in records:
            by_class.setdefault(record[1], []).append(record)
        for cls, same in by_class.items():
            shown = ", ".join(render(path) for path, _, _ in same[:_SHOWN_UNREAD])
            more = len(same) - _SHOWN_UNREAD
            at = f"{shown} and {more} more" if more > 0 else shown
            found[at] = (cls, same[0][2], render(same[0][0]))
    return found


def _no_tensor(unread: _Unreadable, named: dict[str, Any]) -> str:
    """The error for arguments with no tensor: it names what it could not look inside."""
    found = f"assert_same_device() found no tensor in {', '.join(named) or 'its arguments'}"
    if not unread:
        return f"{found}; pass the tensors, modules or batches to check"
    return (
        f"{found}, but it could not look inside {_listed(unread)}, so it cannot say "
        "there is none. Pass the tensors to check themselves, or a dict or list of them."
    )


def _listed(unread: _Unreadable) -> str:
    """Each object not looked inside, with its class and why: ``x (a Foo: ...)``.

    Several of one class inside an argument are named together:
    ``arg0.0.packed, arg0.1.packed (ScriptObjects: ...)``.
    """
    listed = []
    for at, (cls, why, first) in unread.items():
        kind = cls.__name__
        one = at == first
        listed.append(f"{at} ({f'{article(kind)} {kind}' if one else f'{kind}s'}: {why})")
    return "; ".join(listed)


_warned_unread: set[tuple[str, int]] = set()  # (argument's name or first path, class id) told


def _warn_unread(unread: _Unreadable, device: torch.device) -> None:
    """Warn of what it could not look inside, where every tensor seen is on ``device``.

    Once per argument name (or first path inside one) and class: a check run
    every step warns once.
    """
    new = {
        at: entry for at, entry in unread.items() if (entry[2], id(entry[0])) not in _warned_unread
    }
    if not new:
        return
    if len(_warned_unread) < _WARNED_AT_MOST:
        _warned_unread.update((first, id(cls)) for cls, _, first in new.values())
    warnings.warn(
        f"assert_same_device(): every tensor it saw is on {device}, but it could not look "
        f"inside {_listed(new)}: a tensor there would go unchecked. Pass the tensors "
        "to check themselves, or a dict or list of them.",
        RuntimeWarning,
        stacklevel=caller_stacklevel(),
    )
