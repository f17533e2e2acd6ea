"""Objects ``gc.freeze()`` hid, read without moving them between generations.

``find_leaks`` and ``find_batch_size`` freeze every object that exists when
they start (`only_new_objects`), so that a collection or a census inside
walks only what was made since. ``gc.get_objects()`` does not list frozen
objects, and ``gc.unfreeze()``, the only way to make it list them, cannot be
undone exactly: ``gc.freeze()`` freezes every object alive. A census that
unfroze and froze again (for an out-of-memory report, or the CPU's note of
``free_memory``) froze what ``fn`` had made so far too, so ``find_leaks`` no
longer saw it grow; in a process that froze its own objects, a reference
cycle made since became garbage no ``gc.collect()`` would ever free. So
nothing here moves an object between generations:

- what devicekit freezes, it records first: weak references to the tensors
  alive then (`visible_tensors` adds those still alive), and each storage
  with its size then (`grown_bytes`: a census counts only what such a
  storage grew by since, so a view of a tensor made before adds no bytes);
- what the caller froze (a server that calls ``gc.freeze()`` before forking
  its workers) is found by following references (``gc.get_referents``) from
  the objects the collector lists, the loaded modules and the locals of
  the running frames (`_reachable_frozen`: 0.15 s for 170,000 frozen
  objects on a 2-core CPU, 0.5 s for 250,000 with 50,000 tensors). A frozen
  tensor only C++ holds there (a thread-local, a hook kept in C++) is
  missed, and on Python 3.11 and 3.12 one only another thread's running
  frames refer to (see `_running_locals`); a leaf's gradient is read from
  its tensor.
"""

from __future__ import annotations

import gc
import inspect
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "grown_bytes",
    "live_tensors",
    "no_collection",
    "only_new_objects",
    "recording",
    "visible_tensors",
]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# What reading a tensor that has no real storage raises (see _census._UNREADABLE).
_UNREADABLE = (RuntimeError, NotImplementedError, TypeError, ValueError)


@dataclass
class _Before:
    """What existed when devicekit's `only_new_objects` began."""

    # The tensors devicekit froze (none where the caller had frozen objects of its own).
    tensors: list[weakref.ref[torch.Tensor]]
    # StorageImpl address -> (that storage, its bytes then); a storage's Python object
    # lives as long as the storage does, so a dead reference is a storage freed since.
    storages: dict[int, tuple[weakref.ref[Any], int]]
    frozen: int  # gc.get_freeze_count() just after devicekit froze; 0: it froze nothing


_before: _Before | None = None


@contextmanager
def no_collection() -> Iterator[None]:
    """Pause the garbage collector while a census makes its many small tuples.

    Each collection they would trigger walks every tracked object: reading
    shapes cost 1.1 µs per tensor with collections, 0.1 µs without.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def live_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector lists (none it froze). The caller drops the list."""
    objects = gc.get_objects()
    try:
        kinds = {kind for kind in set(map(type, objects)) if issubclass(kind, torch.Tensor)}
        return [obj for obj in objects if type(obj) in kinds]
    finally:
        objects.clear()


def visible_tensors() -> list[torch.Tensor]:
    """Every live tensor, frozen ones too, without unfreezing any. The caller drops the list.

    Call it with the collector paused (`no_collection`).

    Examples:
        >>> import gc, torch
        >>> kept = torch.ones(3)
        >>> gc.freeze()
        >>> any(tensor is kept for tensor in visible_tensors()), gc.get_freeze_count() > 0
        (True, True)
        >>> gc.unfreeze()
    """
    tensors = live_tensors()
    frozen_now = gc.get_freeze_count()
    if frozen_now == 0:
        return tensors
    before = _before
    if before is not None and before.frozen and frozen_now <= before.frozen:
        frozen = [tensor for ref in before.tensors if (tensor := ref()) is not None]
    else:  # the caller froze objects (or froze more inside devicekit's block)
        frozen = _reachable_frozen()
    listed = set(map(id, tensors))
    tensors += [tensor for tensor in frozen if id(tensor) not in listed]
    frozen.clear()
    return tensors


def _reachable_frozen() -> list[torch.Tensor]:
    """The frozen tensors reachable from listed objects, modules and running frames."""
    roots: list[Any] = [sys.modules, gc.garbage, *_running_locals()]
    objects = gc.get_objects()
    try:
        seen = set(map(id, objects))  # listed: their referents start the walk
        frontier = [*gc.get_referents(*objects), *roots]
    finally:
        objects.clear()
        roots.clear()
    found: list[torch.Tensor] = []
    kinds: dict[type, bool] = {}
    while frontier:
        fresh = []
        for obj in frontier:
            if id(obj) not in seen and gc.is_tracked(obj):
                seen.add(id(obj))
                fresh.append(obj)
        frontier.clear()
        for obj in fresh:
            kind = type(obj)
            tensor = kinds.get(kind)
            if tensor is None:
                tensor = kinds[kind] = issubclass(kind, torch.Tensor)
            if tensor:
                found.append(obj)
                frontier += _gradient(obj)  # C++ holds a leaf's gradient: no referent shows it
        frontier += gc.get_referents(*fresh)
        fresh.clear()
    return found


# Python 3.11 and 3.12 keep a function frame's locals, once read, in a dict on the frame,
# which holds every value until the frame reads them again or ends (PEP 667 ended that).
_KEPT = sys.version_info < (3, 13)


def _snapshot_refs() -> int:
    """``sys.getrefcount`` of a frame's locals dict that only the frame and `_locals` hold."""
    local = sys._getframe().f_locals
    return sys.getrefcount(local)


_ALONE = _snapshot_refs() if _KEPT else 0


def _running_locals() -> list[Any]:
    """What the locals of every running frame hold: no referent of a running frame shows it.

    Where reading them leaves a copy on the frame (3.11, 3.12), only this
    thread's frames are read, and the copy is emptied when no one else holds
    it and no trace or profile function runs (one may write it back): left
    full, it kept what the function dropped after the census alive.
    """
    values: list[Any] = []
    here = threading.get_ident()
    clear = sys.gettrace() is None and sys.getprofile() is None
    for thread, top in getattr(sys, "_current_frames", dict)().items():
        if _KEPT and thread != here:
            continue  # another thread may be inside its tracer, between read and write-back
        frame = top
        while frame is not None:
            if frame.f_globals is not globals():  # this module's frames hold no frozen tensor
                values += _locals(frame, clear=clear)
            frame = frame.f_back
    return values


def _locals(frame: types.FrameType, *, clear: bool) -> list[Any]:
    """The values of ``frame``'s locals; with ``clear``, the copy read left on it emptied."""
    local = frame.f_locals
    values = list(local.values())
    if (
        clear
        and _KEPT
        and frame.f_code.co_flags & inspect.CO_OPTIMIZED  # else f_locals is a namespace
        and sys.getrefcount(local) <= _ALONE
    ):
        local.clear()  # the next read of the frame's locals fills it again
    return values


def _gradient(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``[tensor.grad]`` of a plain leaf tensor that has one, else ``[]``."""
    if type(tensor) not in _PLAIN:
        return []  # a subclass's attributes may run its own code
    try:
        grad = tensor._grad if tensor.is_leaf else None  # .grad of a non-leaf warns
    except _UNREADABLE:
        return []
    return [] if grad is None else [grad]


@contextmanager
def only_new_objects(
    parts: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
) -> Iterator[None]:
    """Hide every object that exists now from the garbage collector until the block ends.

    ``gc.freeze()`` moves them to a generation that collections skip and
    ``gc.get_objects()`` does not list, so a collection or a census inside
    walks only what was made since (0.27 s per collection on a 2-core machine
    with torch imported, before; 0.01 s after). Where the caller froze objects
    of its own, nothing is frozen (unfreezing at the end would undo theirs).
    Either way the storages alive now are recorded (see `grown_bytes`), and
    the tensors frozen, for `visible_tensors`. ``parts``: the tensors whose
    storages hold a tensor's data (a sparse tensor's indices and values).
    Inside another such block, nothing more happens.
    """
    global _before  # noqa: PLW0603 - one record per process, while the block runs
    if _before is not None:
        yield
        return
    mine = gc.get_freeze_count() == 0
    if mine:
        gc.collect()
    with no_collection():
        tensors = live_tensors() if mine else visible_tensors()
        before = _Before([], _storages(tensors, parts), 0)
        if mine:
            before.tensors = [ref for tensor in tensors if (ref := _weak(tensor)) is not None]
        tensors.clear()
    if mine:
        gc.freeze()
        before.frozen = gc.get_freeze_count()
    _before = before
    try:
        yield
    finally:
        _before = None
        if mine:
            gc.unfreeze()


def _weak(tensor: torch.Tensor) -> weakref.ref[torch.Tensor] | None:
    try:
        return weakref.ref(tensor)
    except TypeError:  # a subclass with __slots__ and no __weakref__
        return None


def _storages(
    tensors: list[torch.Tensor], parts: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
) -> dict[int, tuple[weakref.ref[Any], int]]:
    """StorageImpl address -> (the storage, its bytes now), for every storage ``tensors`` view."""
    storages: dict[int, tuple[weakref.ref[Any], int]] = {}
    for tensor in tensors:
        plain = type(tensor) in _PLAIN and tensor.layout == torch.strided and not tensor.is_nested
        for part in (tensor,) if plain else parts(tensor):
            try:
                storage = part.untyped_storage()
                key = storage._cdata
                if key not in storages:  # views of one storage
                    storages[key] = (weakref.ref(storage), storage.nbytes())
            except _UNREADABLE:
                continue
    return storages


def recording() -> bool:
    """Whether an `only_new_objects` block runs: `grown_bytes` then knows the storages before."""
    return _before is not None


def grown_bytes(storage: Any, size: int) -> int:
    """Of ``storage``'s ``size`` bytes, those that were not there when `only_new_objects` began.

    All of them for a storage made since; for one alive then, what it grew
    by (``resize_``), usually 0: a view of a tensor made before adds no memory.
    """
    before = _before
    if before is None:
        return size
    try:
        seen = before.storages.get(int(storage._cdata))
    except _UNREADABLE:
        return size
    if seen is None or seen[0]() is not storage:  # made since (at a freed one's address)
        return size
    return max(size - seen[1], 0)
