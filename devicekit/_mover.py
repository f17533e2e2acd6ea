"""The walk behind `to_device`: one pass over a nested structure, each tensor moved once.

A `_Mover` holds one target and copy policy, the memo that keeps shared things
shared (and finds cycles), and the walk itself: `_walk`, a closure that
rebuilds plain dicts, lists and tuples inline, since they hold nearly every
batch. Every other container goes to `_rebuild` or `_records`; an object with
its own ``.to()`` (a module, a storage, a user's class) is moved by it
(`_movecalls`; a module by `_movemodule`, which also keeps its tensors one with
the batch's), but a Hugging Face ``BatchEncoding`` (a ``UserDict``) and a
``PackedSequence``, which the walk rebuilds (`_own_to_or_rebuild`).

Each thread keeps one mover per target and policy and reuses it (`borrow`);
`to_device` borrows one, walks, turns `Cycle` into a ``ValueError`` that
names the path, and calls `_Mover.finish` to wait for copies to the host and
forget the call.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping, MappingView, MutableSequence
from typing import Any

import torch

from ._accelerators import CPU, META, synchronize
from ._look import Changed, key_text, tensor_elsewhere
from ._movecalls import (
    ELSEWHERE,
    KEY_HELD,
    LAZY,
    OPTIMIZERS,
    UNCHANGED,
    DictKey,
    ModuleFirst,
    Unmoved,
    array_stray,
    call_to,
    calling_to,
    has_to_method,
    held_view,
    keep_shared,
    optimizer_stray,
    proxy_to,
    waits_for,
)
from ._movemodule import LOOKS_PER_CLASS, call_module, looks_left, module_move
from ._rebuild import (
    PACKED_TO,
    rebuild_mapping,
    rebuild_packed_sequence,
    rebuild_sequence,
    rebuild_set,
    rebuild_tuple,
)
from ._records import rebuild_dataclass, rebuild_record
from ._refcounts import ONCE_IN_DICT, ONCE_IN_LIST
from ._tree import is_dataclass_instance, is_record, slot_names

__all__ = ["Cycle", "ModuleFirst", "borrow"]  # what to_device uses: private, not devicekit's API

_Tensor = torch.Tensor
_CPU, _META_DEVICE = CPU, META
_LEAVES = frozenset({str, bytes, int, float, complex, bool, type(None)})


# How a tensor's device is compared with the target, cheapest first: reading
# tensor.device builds a new torch.device object (55 ns); tensor.is_cpu does not (30 ns).
_HOST, _CUDA, _META, _SAME_DEVICE = range(4)
_FX_PROXY = torch.fx.Proxy
_PROXIES = frozenset(weakref.ProxyTypes)  # their class reads as the referent's: type() does not
_BUSY = object()  # in the memo while a container is being rebuilt: meeting it again is a cycle
_NUMPY_ARRAYS = frozenset({("numpy", "ndarray"), ("numpy", "void")})  # looked in by dtype


def _describe_target(device: torch.device) -> tuple[int, int | None, bool]:
    """How tensors are compared with ``device``, its index, and whether it is the host."""
    if device == _CPU:  # resolve_device made it canonical
        return _HOST, None, True
    if device == _META_DEVICE:
        return _META, None, False
    if device.type == "cuda" and device.index is not None:
        return _CUDA, device.index, False
    return _SAME_DEVICE, device.index, False


_targets: dict[torch.device, tuple[int, int | None, bool]] = {}  # a handful of devices at most


class _Mover:
    """One target and copy policy: the walk (a closure over this state), and a call's memo.

    Building the walk's closures costs about 2 µs, a sixth of moving a batch of
    a dozen small tensors, so each thread keeps one mover per target and policy
    and reuses it (see `borrow()`); `finish()` empties it for the next
    call.
    """

    __slots__ = (
        "busy",
        "device",
        "kept",
        "memo",
        "modules",
        "move",
        "non_blocking",
        "returned_none",
        "shared",
        "unmoved",
        "unsynced",
    )

    def __init__(self, device: torch.device, non_blocking: bool | None) -> None:
        self.device = device
        target = _targets.get(device)
        if target is None:
            target = _targets[device] = _describe_target(device)
        kind, index, to_host = target
        # A non-blocking copy to the host may be read before it lands: only when
        # forced, and then synchronized before to_device returns.
        self.non_blocking = (not to_host) if non_blocking is None else non_blocking
        self.memo: dict[int, Any] = {}  # id(original) -> moved; keeps shared things shared
        # Sources of non-blocking copies to the host, which must be waited for.
        self.unsynced: set[torch.device] | None = set() if self.non_blocking and to_host else None
        self.returned_none: list[type] | None = None  # classes whose .to() returned None
        # Left as they were, with a tensor inside: (class, path, how: UNCHANGED...).
        self.unmoved: list[tuple[type, str, Unmoved]] | None = None
        # Moved, not looked at enough yet: each with what it held before (held_before).
        self.modules: list[tuple[torch.nn.Module, dict[int, tuple[str, str]]]] | None = None
        # What moving a module inside the batch made: id(module or its old tensor) -> moved.
        self.shared: dict[int, Any] | None = None
        self.kept: list[Any] = []  # objects made during the call: alive while memo has their id
        self.busy = False  # a call is walking with it (a .to() may call to_device again)
        self.move: Callable[[Any], Any] = _walk(self, kind, index)

    def container(self, obj: Any, rebuild: Callable[[_Mover, Any], Any]) -> Any:
        """Rebuild ``obj`` once, however often it is reached; raise Cycle if it contains itself."""
        key = id(obj)
        memo = self.memo
        done = memo.get(key)
        if done is not None:
            if done is _BUSY:
                raise Cycle
            return done  # reached twice: one rebuilt container, shared as in the input
        memo[key] = _BUSY
        result = memo[key] = rebuild(self, obj)
        return result

    def other(self, obj: Any) -> Any:
        """Everything but tensors and plain dicts, lists and tuples."""
        # A class, even one with a .to attribute (nn.Linear.to); a weak proxy, whose class
        # reads as its referent's (a dict's, a module's): not moved, as the look skips it.
        if isinstance(obj, type) or type(obj) in _PROXIES:
            return obj
        if isinstance(obj, torch.nn.Module):
            return self.container(obj, call_module)  # once, however often reached
        if isinstance(obj, _FX_PROXY):  # a tensor as torch.fx.symbolic_trace sees it
            return self.container(obj, proxy_to)  # the move, recorded in the graph
        # An object whose own .to() is what called to_device on it is moved as what it is.
        has_to = has_to_method(type(obj))
        own_to = has_to and calling_to(obj)
        if has_to and not own_to:
            return self.container(obj, _own_to_or_rebuild(obj))
        if isinstance(obj, Mapping):
            return self.container(obj, rebuild_mapping)
        if isinstance(obj, tuple):
            return self.container(obj, rebuild_tuple)
        if isinstance(obj, MutableSequence):  # a list subclass, a deque, a UserList (no str)
            return self.container(obj, rebuild_sequence)
        if isinstance(obj, (set, frozenset)):
            return self.container(obj, rebuild_set)
        if is_dataclass_instance(obj):
            return self.container(obj, rebuild_dataclass)
        if is_record(obj):  # a SimpleNamespace, an attrs instance, a pydantic model
            return self.container(obj, rebuild_record)
        if isinstance(obj, MappingView):
            return held_view(self, obj)
        if own_to and (hasattr(obj, "__dict__") or next(slot_names(type(obj)), None)):
            return self.container(obj, rebuild_record)  # every attribute moved, on a copy
        return self.unchanged(obj)

    def unchanged(self, obj: Any, how: Unmoved | None = None) -> Any:
        """``obj``, which to_device cannot move; noted where it leaves a tensor behind.

        Each class is looked inside a few times at most (a fresh transformers
        ``DynamicCache`` holds no tensor yet), so an object met every step
        costs one dict lookup once its class is known. The look reads storage
        and runs none of the object's code; where it fails all the same (a
        tensor subclass whose ``device`` raises), it found nothing, and the
        class is not looked inside again: ``obj`` is returned as it always was.
        A look another thread's writes spoiled is no look: the next one counts.
        A numpy array is looked inside only where it holds Python objects
        (``dtype=object``), each such array until one warns: one of numbers
        costs a check of its dtype. ``how``: why ``obj`` is as it was
        (`UNCHANGED`, `OWN_TO`, `LAZY`, `ELSEWHERE`), for the warning; None to
        find out, only while its class is looked at (`_why_unmoved` costs 0.8 µs).
        An iterator's items are not made yet, nor a future's value: each is
        told of once per class, with nothing to look at.
        """
        cls = type(obj)
        looks = looks_left.get(cls, LOOKS_PER_CLASS)
        if looks <= 0:
            return obj
        array = (cls.__module__, cls.__qualname__) in _NUMPY_ARRAYS
        if how is None:
            how = UNCHANGED if array else _why_unmoved(obj)
        if how in (LAZY, ELSEWHERE):  # nothing to look at: tell once
            looks_left[cls] = 0
            self.unmoved = [*(self.unmoved or ()), (cls, "", how)]
        else:
            try:
                if array:
                    path = array_stray(obj, self.device)
                elif isinstance(obj, OPTIMIZERS):  # or a scheduler, which holds one
                    path = optimizer_stray(obj, self.device)
                else:
                    path = tensor_elsewhere(obj, self.device)
            except Changed:  # another thread was writing it: no answer, and no look either
                return obj
            except Exception:  # noqa: BLE001 - a look that fails finds nothing, and stops
                path, looks = None, 1
            if array and path is None:
                return obj  # numbers, or objects all on the target: the next array is looked at
            looks_left[cls] = 0 if path is not None else looks - 1
            if path is not None:
                self.unmoved = [*(self.unmoved or ()), (cls, path, how)]
        return obj

    def key(self, mapping: dict[Any, Any], key: Any) -> None:
        """Note a dict's key that holds a tensor off the target: keys are never moved.

        Keys that are not str nor a plain value (a tuple, a tensor) are looked at
        as one class: a few times at most, then never again, as `unchanged`.
        """
        looks = looks_left.get(DictKey, LOOKS_PER_CLASS)
        if looks <= 0:
            return
        try:
            path = tensor_elsewhere(key, self.device)
        except Exception:  # noqa: BLE001 - a look that fails finds nothing, and stops
            path, looks = None, 1
        looks_left[DictKey] = 0 if path is not None else looks - 1
        if path is not None:
            where = f"[key {key_text(key)}]{path}"
            self.unmoved = [*(self.unmoved or ()), (type(mapping), where, KEY_HELD)]

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` until the call ends (see `Walk.keep`)."""
        self.kept.append(obj)

    def again(self, obj: Any, module: torch.nn.Module) -> Any:
        """Walk ``obj`` again from the start, ``module`` moved first (see `ModuleFirst`).

        What moving modules made is kept (a module moved in place is not moved
        twice, and the tensors it replaced still map to its new ones); the
        copies the first walk made are dropped. Each module is moved first
        once at most, so this ends.
        """
        while True:
            memo = self.memo
            memo.clear()
            memo.update(self.shared or ())
            key = id(module)
            if key not in memo:
                memo[key] = _BUSY
                memo[key] = keep_shared(self, module, module_move(module))
            try:
                return self.move(obj)
            except ModuleFirst as first:
                module = first.module

    def finish(self) -> None:
        """Wait for the copies to the host the call left in flight, and forget the call."""
        if self.unsynced:
            for source in self.unsynced:
                synchronize(source)
            self.unsynced.clear()
        self.memo.clear()  # lets go of every moved tensor
        self.kept.clear()
        self.returned_none = None
        self.unmoved = None
        self.modules = None
        self.shared = None
        self.busy = False


def _own_to_or_rebuild(obj: Any) -> Callable[[_Mover, Any], Any]:
    """How to move an object with its own ``.to()``: by calling it, or rebuilt by the walk.

    transformers' ``BatchEncoding.to`` (a ``UserDict``'s) changes it in place,
    and copies a tensor it holds twice twice: rebuilt as a mapping (a copy
    with its attributes, ``.data`` holding the moved items), the input stays
    as it was, and the memo keeps tensors shared, inside it and with the rest
    of the batch. ``PackedSequence.to`` copies its tensors on their own:
    rebuilt as it rebuilds itself, with the memo. Any other ``.to()`` has the
    last word, a ``UserDict``'s too: it may keep a tensor where it must stay
    (lengths on the host, for ``pack_padded_sequence``).
    """
    if isinstance(obj, UserDict) and _is_batch_encoding_to(getattr(type(obj), "to", None)):
        return rebuild_mapping
    if type(obj).to is PACKED_TO:
        return rebuild_packed_sequence
    return call_to


def _is_batch_encoding_to(to: object) -> bool:
    """Whether ``to`` is transformers' ``BatchEncoding.to`` (its own, not a subclass's)."""
    module = getattr(to, "__module__", None)
    return (
        getattr(to, "__qualname__", None) == "BatchEncoding.to"
        and isinstance(module, str)
        and module.startswith("transformers.")
    )


def _why_unmoved(obj: object) -> Unmoved:
    """Why to_device returns ``obj`` as it is: `LAZY`, `ELSEWHERE` or `UNCHANGED`."""
    if isinstance(obj, Iterator):  # a generator, map(): moving its items would use it up
        return LAZY
    return ELSEWHERE if waits_for(type(obj)) else UNCHANGED  # a future: its value is elsewhere


_local = threading.local()  # per thread: target (and forced policy) -> its _Mover


def borrow(device: torch.device, non_blocking: bool | None) -> _Mover:
    """This thread's mover for the target, or a new one while that one is in use."""
    movers: dict[Any, _Mover] | None = getattr(_local, "movers", None)
    if movers is None:
        movers = _local.movers = {}
    key = device if non_blocking is None else (device, non_blocking)  # usually the device
    mover = movers.get(key)
    if mover is None:
        mover = movers[key] = _Mover(device, non_blocking)
    elif mover.busy:  # to_device inside a .to() that to_device called
        mover = _Mover(device, non_blocking)
    mover.busy = True
    return mover


class Cycle(Exception):
    """Raised inside the walk; to_device turns it into a ValueError with the path."""


def _walk(mover: _Mover, kind: int, index: int | None) -> Callable[[Any], Any]:  # noqa: PLR0915 - one closure, its loops written out
    """The walk of one call, as a closure: its state is in local cells, not attributes.

    This is the hot path of every training step. Plain dicts, lists and tuples
    hold nearly every batch, so their loops are written out here, and so is the
    move of each tensor inside them: on a batch of small tensors a Python call
    per element costs more than the copy (docs/benchmarks.md has the numbers).
    What is left costs about 0.2 µs per tensor: the class check, the reference
    count that spares a tensor nothing else holds the memo, and, until a
    container's first copy, the check that returns a tensor already there.
    """
    device, non_blocking, memo = mover.device, mover.non_blocking, mover.memo
    get = memo.get
    count = sys.getrefcount
    inline = mover.unsynced is None  # copies to the host that must be waited for: not inline
    # torch parses a keyword argument for every call (0.13 µs): pass non_blocking only
    # where it changes something, a copy that is not to the meta device.
    keyword = non_blocking and kind != _META
    # Closure cells, not globals, in the loops below: each read is a few ns cheaper.
    tensor_class, once_in_list, once_in_dict = _Tensor, ONCE_IN_LIST, ONCE_IN_DICT
    to_cuda, to_host, to_meta = kind == _CUDA, kind == _HOST, kind == _META

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True) if keyword else tensor.to(device)

    def here(tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on the target already (the loops below inline this)."""
        if kind == _HOST:
            return tensor.is_cpu
        if kind == _CUDA:
            return tensor.is_cuda and tensor.get_device() == index
        if kind == _META:
            return tensor.is_meta
        return bool(tensor.device == device)

    def move_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if here(tensor):
            return tensor  # itself, so sharing holds without the memo
        moved: torch.Tensor | None = get(id(tensor))
        if moved is None:
            moved = memo[id(tensor)] = copy(tensor)
            if mover.unsynced is not None:
                mover.unsynced.add(tensor.device)
        return moved

    def move(obj: Any) -> Any:
        cls = obj.__class__
        if cls is not dict and cls is not list and cls is not tuple:
            if cls is tensor_class or isinstance(obj, tensor_class):
                return move_tensor(obj)
            return obj if cls in _LEAVES else mover.other(obj)
        key = id(obj)
        done = get(key)
        if done is not None:
            if done is _BUSY:
                raise Cycle
            return done  # reached twice: one rebuilt container, shared as in the input
        memo[key] = _BUSY
        result = memo[key] = rebuild(obj, cls)
        return result

    def rebuild(obj: Any, cls: type) -> Any:  # noqa: PLR0912 - the hot path, written out
        """A plain dict, list or tuple, rebuilt; children nothing else holds skip the memo.

        A container only its parent holds cannot be reached twice, nor start a
        cycle (the first member of a cycle the walk reaches is held by its parent
        and by the back edge, so it goes through ``move``, memo and all).
        """
        result: Any
        # Once one tensor of a container needs a copy, its siblings almost surely do:
        # .to() itself returns a tensor that is already there, so the check is skipped.
        copying = False
        if cls is dict:
            result = {}
            for name, value in obj.items():
                if name.__class__ is not str and name.__class__ not in _LEAVES:
                    mover.key(obj, name)  # a tensor as a key (never moved) is warned of
                vcls = value.__class__
                if vcls is not tensor_class or not inline:
                    if (vcls is dict or vcls is list or vcls is tuple) and count(
                        value
                    ) <= once_in_dict:
                        result[name] = rebuild(value, vcls)
                    else:
                        result[name] = move(value)
                elif not copying and (
                    (value.is_cuda and value.get_device() == index) if to_cuda
                    else value.is_cpu if to_host
                    else value.is_meta if to_meta
                    else value.device == device
                ):  # fmt: skip
                    result[name] = value
                elif count(value) <= once_in_dict:  # this dict alone holds it
                    copying = True
                    moved = value.to(device, non_blocking=True) if keyword else value.to(device)
                    result[name] = moved
                else:
                    moved = get(id(value))
                    if moved is None:
                        moved = memo[id(value)] = copy(value)
                    result[name] = moved
            return result
        result = []
        append = result.append
        for value in obj:
            vcls = value.__class__
            if vcls is not tensor_class or not inline:
                if (vcls is dict or vcls is list or vcls is tuple) and count(value) <= once_in_list:
                    append(rebuild(value, vcls))
                else:
                    append(move(value))
            elif not copying and (
                (value.is_cuda and value.get_device() == index) if to_cuda
                else value.is_cpu if to_host
                else value.is_meta if to_meta
                else value.device == device
            ):  # fmt: skip
                append(value)
            elif count(value) <= once_in_list:  # this list alone holds it
                copying = True
                append(value.to(device, non_blocking=True) if keyword else value.to(device))
            else:
                moved = get(id(value))
                if moved is None:
                    moved = memo[id(value)] = copy(value)
                append(moved)
        return tuple(result) if cls is tuple else result

    return move
