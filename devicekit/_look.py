"""A look inside any object: what it holds, read from its storage, never by its code.

`to_device()` returns an object it cannot move as it is, and says so when that
leaves a tensor behind (`tensor_elsewhere()`); `assert_same_device()` reads
what any object holds (`object_attributes()`), since a check that skipped it
would vouch for tensors it never saw. Both only look: an instance's
``__dict__`` and slots are read through Python's own descriptors, so no
property, ``__getattr__`` or container method of the object's class runs, and
a look that fails is no answer, never an error. Each dict, set or deque is read
in one go, in C (`snapshot`), so another thread writing it cannot cut a look
short: where it does all the same, twice, that is said (`Changed`), never
taken for all there was. A builtin container of plain values (a tokenizer's
vocabulary, a dataset's labels) is told apart in bulk, by `_lookbulk`.
"""

from __future__ import annotations

import array
import collections
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import Any

import torch

from ._format import shorten
from ._lookpandas import Unreadable, pandas_kind, pandas_parts, shown_attribute
from ._shortrepr import ShortRepr, unprintable
from ._tree import ITEMS_ONLY

__all__ = [
    "INDEX",
    "KEY",
    "MEMBER",
    "NOTHING_INSIDE",
    "OPAQUE",
    "UNREAD",
    "Changed",
    "class_attribute",
    "class_namespace",
    "key_text",
    "module_attributes",
    "object_attributes",
    "snapshot",
    "tensor_elsewhere",
]


# Not looked inside (object_attributes(), assert_same_device()): what they hold is code
# and its globals, not data.
OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
# A weak proxy holds nothing of its own, and a dead one raises ReferenceError at any
# question, isinstance() included: only its exact type is asked.
_PROXIES = frozenset(weakref.ProxyTypes)
# A class's own namespace and its MRO, read without its metaclass (whose __getattribute__
# or properties could run code of the user's own).
class_namespace: Callable[[type], Mapping[str, Any]] = type.__dict__["__dict__"].__get__
_class_mro: Callable[[type], tuple[type, ...]] = type.__dict__["__mro__"].__get__
# Python's own readers of an instance's __dict__: a getset (classes written in Python),
# or a member (SimpleNamespace, some C types). A property named __dict__ is neither.
_STORAGE_READERS = (types.GetSetDescriptorType, types.MemberDescriptorType)
_dict_readers: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()
_slot_readers: weakref.WeakKeyDictionary[type, tuple[tuple[str, Any], ...]] = (
    weakref.WeakKeyDictionary()
)


def object_attributes(obj: object, *, limit: int | None = None) -> list[tuple[str, Any]]:
    """Everything an object holds by name: the entries of its ``__dict__``, then its slots.

    For a look, never a move, inside an object `children()` does not know (a
    class of your own, a transformers ``DynamicCache``): it reads the instance's
    own storage through Python's own descriptors, so no property (one named
    ``__dict__`` too), ``__getattr__`` or ``__getattribute__`` of the class
    runs, and it never raises: what it cannot read is not there. Names
    ``__like_this__`` are Python's or a library's, and left out; so is
    everything in a class, a Python module or a function (code and its
    globals, not data), and a weak proxy (what it refers to is another's).
    Empty for an object with neither (a number, a ``torch.dtype``). Each path
    suffix is ``.name``. ``limit``: at most that many of each are returned,
    counted after those left out.

    Raises:
        RuntimeError: Another thread changed the ``__dict__`` while it was
            read, and again when it was read once more: a part of it would
            pass for the whole.

    Examples:
        >>> import torch
        >>> class Holder:
        ...     def __init__(self) -> None:
        ...         self.x = torch.ones(1)
        >>> object_attributes(Holder())
        [('.x', tensor([1.]))]
    """
    try:
        return [(f".{name}", value) for name, value in _attributes(obj, limit)]
    except Changed:
        raise RuntimeError(
            f"another thread changed the attributes of a {type(obj).__name__} while they "
            "were read, twice: they cannot be looked at. Read them when no thread writes them."
        ) from None


def _attributes(obj: object, limit: int | None) -> list[tuple[str, Any]]:
    """`object_attributes()` with bare names; runs no code of the object's.

    Raises `Changed` where another thread changes the ``__dict__`` while it is
    read, twice: a partial list would pass tensors never seen.
    """
    found: list[tuple[str, Any]] = []
    cls = type(obj)
    if cls in _PROXIES or issubclass(cls, OPAQUE):
        return found
    try:
        reader = _dict_readers.get(cls, UNREAD)
        if reader is UNREAD:
            reader = _dict_readers[cls] = _dict_reader(cls)
        state: Any = None if reader is None else reader.__get__(obj, cls)
        if issubclass(type(state), dict):
            found.extend(_named_entries(state, limit))
        readers = _slot_readers.get(cls)
        if readers is None:
            readers = _slot_readers[cls] = tuple(_slot_descriptors(cls))
        slots = 0
        for name, slot in readers:
            if limit is not None and slots >= limit:
                break
            try:
                found.append((name, slot.__get__(obj, cls)))
            except AttributeError:  # a slot never set has no value, and is not counted
                continue
            slots += 1
    except Changed:
        raise
    except Exception:  # noqa: BLE001 - storage that cannot be read holds nothing to look at
        pass
    return found


def _named_entries(state: dict[Any, Any], limit: int | None) -> list[tuple[str, Any]]:
    """Up to ``limit`` entries of an instance's ``__dict__``, Python's own names left out.

    ``limit`` counts the entries kept, so names ``__like_this__`` first in the
    dict cannot use it up and hide the rest: the entries are read again, twice
    as many each time, until enough are kept or the dict ends.
    """
    wanted = limit
    while True:
        entries = snapshot(dict.items, state, wanted)  # dict's own, not an override
        kept = [
            (str.__str__(name), value)  # a str subclass's as a str
            for name, value in entries
            if issubclass(type(name), str)
            and not (str.startswith(name, "__") and str.endswith(name, "__"))
        ]
        if limit is None or wanted is None or len(kept) >= limit or len(entries) < wanted:
            return kept[:limit]
        wanted *= 2


# What every module's instance holds (the registries, hooks, flags): torch's bookkeeping,
# which module.to() sees to, not state of the user's.
# And a traced module's own (torch.jit.trace): the compiled module behind it, which holds
# the same parameters, and which module.to() moves with them.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"_actual_script_module"}
# The attribute a forward pre-hook sets again before every call names itself in one of
# these: WeightNorm and SpectralNorm (torch.nn.utils) say ``name``, pruning ``_tensor_name``.
_HOOK_TARGETS = (".name", "._tensor_name")


def module_attributes(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """A module's plain attributes: what its instance holds that ``module.to()`` leaves alone.

    The entries of its ``__dict__`` and its slots (`object_attributes()`, so no
    code of the module's runs), but for torch's own bookkeeping (``_parameters``,
    ``_buffers``, ``_modules``, the hooks, ``training``...) and for an attribute
    a forward pre-hook sets again before every call (``weight`` after
    ``torch.nn.utils.weight_norm``, ``spectral_norm`` or pruning). Its
    submodules' are not included: each module is asked for its own. For
    `check_module()` and `assert_same_device()`, which look at the same ones.
    Bare names (names that are not an exact ``str`` are left out), in the
    order they were set.

    Examples:
        >>> import torch
        >>> class Scaled(torch.nn.Linear):
        ...     def __init__(self) -> None:
        ...         super().__init__(1, 1)
        ...         self.scale = torch.ones(1)
        >>> module_attributes(Scaled())
        [('in_features', 1), ('out_features', 1), ('scale', tensor([1.]))]
    """
    cls = type(module)
    readers = _module_readers.get(cls)
    if readers is None:
        readers = _module_readers[cls] = (_dict_reader(cls), tuple(_slot_descriptors(cls)))
    dict_reader, slots = readers
    found: list[tuple[str, Any]] = []
    state: Any
    try:
        state = None if dict_reader is None else dict_reader.__get__(module, cls)
    except Exception:  # noqa: BLE001 - storage that cannot be read holds nothing to look at
        state = None
    if issubclass(type(state), dict):
        # torch's own entries (about 17 of a module's 20) left out in C, by a set
        # difference, with no bytecode where another thread could change the dict: the
        # few left are read in Python, in the order they were set.
        names: Any = dict.keys(state) - _MODULE_INTERNALS
        if len(names) > 1:
            names = tuple(filter(names.__contains__, dict.keys(state)))
        for name in names:
            if type(name) is not str or (name[:2] == "__" and name[-2:] == "__"):
                continue  # Python's or a library's, or not a name
            value = dict.get(state, name, UNREAD)
            if value is not UNREAD:  # unless another thread just deleted it
                found.append((name, value))
    for name, slot in slots:
        try:
            found.append((name, slot.__get__(module, cls)))
        except AttributeError:  # a slot never set has no value
            continue
    hooks = dict.get(state, "_forward_pre_hooks") if issubclass(type(state), dict) else None
    if type(hooks) in (dict, collections.OrderedDict) and hooks:
        recomputed = {
            value
            for hook in tuple(dict.values(hooks))  # in C, in one go
            for name, value in object_attributes(hook)
            if name in _HOOK_TARGETS and type(value) is str
        }
        found = [(name, value) for name, value in found if name not in recomputed]
    return found


_module_readers: weakref.WeakKeyDictionary[type, tuple[Any, tuple[tuple[str, Any], ...]]] = (
    weakref.WeakKeyDictionary()
)


class Changed(RuntimeError):
    """A container another thread changed while it was read, twice.

    Never leaves devicekit: `assert_same_device()` raises a ``RuntimeError``
    naming the path instead, and `to_device()` takes it for no look at all.
    """


def snapshot(read: Callable[[Any], Any], container: Any, limit: int | None) -> tuple[Any, ...]:
    """The first ``limit`` of what ``read(container)`` yields, read in one go.

    ``tuple(islice(...))`` runs in C, with no bytecode between items where
    another thread could change the container (a loop in Python raised
    "changed size during iteration" midway, and a partial list was taken for
    the whole). Where that happens all the same (a finalizer the read set
    off), it is read once more, then `Changed` is raised.
    """
    try:
        return tuple(islice(read(container), limit))
    except RuntimeError:
        pass
    try:
        return tuple(islice(read(container), limit))
    except RuntimeError:
        raise Changed(
            f"another thread changed a {type(container).__name__} while it was read, twice"
        ) from None


UNREAD = object()


def _dict_reader(cls: type) -> Any:
    """The descriptor that reads ``cls``'s instances' ``__dict__``, or None if not Python's own.

    The first ``__dict__`` in its MRO: Python's getset (or member), or a class's
    own property (None: reading it would run that code).
    """
    for klass in _class_mro(cls):
        entry = class_namespace(klass).get("__dict__")
        if entry is not None:
            return entry if type(entry) in _STORAGE_READERS else None
    return None


def _slot_descriptors(cls: type) -> Iterator[tuple[str, Any]]:
    """Each slot's name and the member descriptor that reads it (never a property)."""
    for klass in _class_mro(cls):
        namespace = class_namespace(klass)
        slots = namespace.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            private = name.startswith("__") and not name.endswith("__")
            stored = f"_{klass.__name__.lstrip('_')}{name}" if private else name
            reader = namespace.get(stored)
            dunder = stored.startswith("__") and stored.endswith("__")
            if type(reader) is types.MemberDescriptorType and not dunder:
                yield stored, reader


# How tensor_elsewhere() reached each object: the path suffix is made only for the path
# it returns.
KEY, INDEX, MEMBER, _NAME, _SUFFIX = range(5)  # _SUFFIX: the key is the suffix itself
# Nothing inside to look at: exact types, asked before anything else (weak proxies hold
# nothing of their own, and a dead one raises ReferenceError at any other question).
NOTHING_INSIDE = frozenset(
    {str, bytes, int, float, complex, bool, type(None), range, *weakref.ProxyTypes}
)
_Module = torch.nn.Module
_NOT_OPENED = (str, bytes, bytearray, array.array, *OPAQUE)
# The builtin containers whose items tensor_elsewhere() reads, each with its own reader
# (a subclass's __iter__ or items() is its code, and is not run).
_ITEM_READERS: tuple[tuple[type, Any, int], ...] = (
    (dict, dict.items, KEY),
    (list, list.__iter__, INDEX),
    (tuple, tuple.__iter__, INDEX),
    (collections.deque, collections.deque.__iter__, INDEX),
    (set, set.__iter__, MEMBER),
    (frozenset, frozenset.__iter__, MEMBER),
)


def tensor_elsewhere(
    obj: object, device: torch.device, *, looks: int = 256, modules: bool = False
) -> str | None:
    """The path of a tensor inside ``obj`` that is not on ``device``, or None.

    A bounded look into what an object holds: ``looks`` references read at
    most in all, each object looked inside once, so an object that holds a
    dataset of a million items costs what 256 of them cost. It reads storage,
    never runs code of the objects it meets: a dict's, list's, tuple's,
    deque's or set's items (a subclass's too, read as its base class stores
    them), and every object's instance attributes and slots
    (`object_attributes()`); a pandas object's values of ``object`` dtype,
    ``df['emb'].iloc[0]``, through pandas (`_lookpandas`). For ``to_device``,
    which returns an object it cannot move unchanged, to say so when that
    leaves tensors behind. A module
    met on the way is looked inside only with ``modules`` (its parameters,
    buffers, submodules and plain attributes): for the plain attributes of a
    module ``Module.to()`` moved, where a module kept in a list stays behind.

    Raises what reading a tensor's ``device`` raises (a tensor subclass may
    run code for it): the caller treats it as nothing found. A container that
    another thread changes while it is read is read once more, then
    `Changed` (a ``RuntimeError``) is raised: no answer, and no look either.

    Examples:
        >>> import torch
        >>> class Cache:
        ...     def __init__(self) -> None:
        ...         self.layers = [{"keys": torch.ones(1)}]
        >>> tensor_elsewhere(Cache(), torch.device("meta"))
        ".layers[0]['keys']"
        >>> tensor_elsewhere(Cache(), torch.device("cpu")) is None
        True
    """
    seen: set[int] = set()
    kept: list[object] = []  # alive while the look runs, so no id() in seen is reused
    links: list[tuple[int, int, Any]] = []  # how each object was reached: (parent, kind, key)
    queue: collections.deque[tuple[int, Any]] = collections.deque([(-1, obj)])
    left = looks
    while queue:
        link, item = queue.popleft()
        cls = type(item)
        if cls in NOTHING_INSIDE or id(item) in seen:
            continue
        seen.add(id(item))
        kept.append(item)
        if issubclass(cls, torch.Tensor):
            if item.device != device:
                return _path(links, link)
            continue
        module = issubclass(cls, _Module)
        if left <= 0 or (not modules if module else issubclass(cls, _NOT_OPENED)):
            continue  # a module only where asked (see above)
        held = _module_held(item, left) if module else _held(item, cls, left)
        for kind, key, child in islice(held, left):
            left -= 1
            links.append((link, kind, key))
            queue.append((len(links) - 1, child))
    return None


def _module_held(module: torch.nn.Module, limit: int) -> Iterator[tuple[int, Any, Any]]:
    """What ``module`` holds, by name: its parameters, buffers, submodules, plain attributes."""
    state = vars(module)
    for registry in ("_parameters", "_buffers", "_modules"):
        entries = state.get(registry)
        if type(entries) is dict:
            for name, value in snapshot(dict.items, entries, limit):
                if value is not None:
                    yield _NAME, name, value
    yield from ((_NAME, name, value) for name, value in module_attributes(module))


def _held(item: object, cls: type, limit: int) -> Iterator[tuple[int, Any, Any]]:
    """What ``item`` holds, read from its storage (a pandas object's, through pandas)."""
    frame = pandas_kind(cls)
    if frame is not None:  # its block managers hold nothing storage can show
        try:
            parts = pandas_parts(item, frame, limit, key_text)[0]
        except Unreadable:  # pandas raised: nothing found here
            parts = []
        for path, step, values in parts:
            yield from ((_SUFFIX, f"{path}{step}[{at}]", value) for at, value in enumerate(values))
        named = ((shown_attribute(name), value) for name, value in _attributes(item, limit))
        yield from ((_NAME, name, value) for name, value in named if name is not None)
        return
    for base, read, kind in _ITEM_READERS:
        if issubclass(cls, base):
            entries = snapshot(read, item, limit)  # in one go: see snapshot
            if kind == KEY:
                yield from ((kind, key, value) for key, value in entries)
            else:
                names = class_attribute(cls, "_fields") if base is tuple else None
                if isinstance(names, tuple):  # a namedtuple: its fields by name
                    yield from (
                        (_NAME, name, value) for name, value in zip(names, entries, strict=False)
                    )
                else:
                    yield from ((kind, index, value) for index, value in enumerate(entries))
            if cls in ITEMS_ONLY:
                return
            break
    yield from ((_NAME, name, value) for name, value in _attributes(item, limit))


def class_attribute(cls: type, name: str) -> Any:
    """``cls.name`` as a class defines it (no metaclass code runs), or None."""
    for klass in _class_mro(cls):
        value = class_namespace(klass).get(name)
        if value is not None:
            return value
    return None


def _path(links: list[tuple[int, int, Any]], link: int) -> str:
    """The path suffix of the object reached by ``links[link]``, from the object looked in."""
    suffixes = []
    while link >= 0:
        link, kind, key = links[link]
        suffixes.append(
            f"[{key_text(key)}]"
            if kind == KEY
            else f"[{key}]"
            if kind == INDEX
            else f"{{{key}}}"
            if kind == MEMBER
            else key
            if kind == _SUFFIX
            else f".{key}"
        )
    return "".join(reversed(suffixes))


# How many characters a path gives a key that is not a str (a tuple, a tensor).
_KEY_SHOWN = 60
# Keys written as they are, with no reprlib: a short repr, or a str (never cut).
_AS_THEY_ARE = frozenset({str, bool, float, type(None)})
_INT_BITS = 128  # an int of fewer bits has at most 39 digits


def key_text(key: object) -> str:
    """How a path names a dict's key: a str by its repr, anything else in one short line.

    A tensor used as a key (alone or in a tuple) is named as torch prints a
    meta tensor, by its device and size, never by its values, which torch
    prints over many lines: ``x[tensor(..., device='cpu', size=(3,))]`` is
    the value under it, ``x[key tensor(..., device='cpu', size=(3,))]`` the
    key itself. Other keys are their repr, cut to 60 characters (a str is
    never cut, so ``batch['labels']`` reads as written). Never raises: a key
    whose repr raises is named by its type and address.

    Examples:
        >>> import torch
        >>> key_text("labels"), key_text(3), key_text((1, torch.ones(2, 3)))
        ("'labels'", '3', "(1, tensor(..., device='cpu', size=(2, 3)))")
    """
    if type(key) in _AS_THEY_ARE or (type(key) is int and key.bit_length() < _INT_BITS):
        return repr(key)
    try:
        text = _KeyRepr(_KEY_SHOWN).repr(key)
    except Exception:  # noqa: BLE001 - each part is guarded; this is the last word
        text = unprintable(key)
    return shorten(text, _KEY_SHOWN)


class _KeyRepr(ShortRepr):
    """`short_repr()`'s reader, with a tensor shown by its device and size alone."""

    def repr_instance(self, x: object, level: int) -> str:
        """A tensor as torch shows a meta tensor; anything else as `short_repr()` does."""
        if isinstance(x, torch.Tensor):
            try:
                return f"tensor(..., device='{x.device}', size={tuple(x.shape)})"
            except Exception:  # noqa: BLE001 - a subclass whose device or shape raises
                return unprintable(x)
        return super().repr_instance(x, level)
