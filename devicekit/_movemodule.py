"""How `to_device` moves a module it meets: by the module's own ``.to()``, looked at after.

A module in a batch is moved once, by ``Module.to`` (or its class's own
``.to()``), and its tensors join those the call waits for. A few times per
module, to_device then looks at the module's plain attributes for a tensor
``.to()`` left behind (see `_placement`); the counts live here, with the
counts per class of objects the walk cannot move (`_mover`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._movecalls import (
    call_to,
    calling_to,
    keep_shared,
    returned,
    takes_non_blocking,
    while_calling_to,
)
from ._submodules import held_tensors, named_held, unhashable_note

if TYPE_CHECKING:
    from ._mover import _Mover as Mover

__all__ = [
    "LOOKS_PER_CLASS",
    "call_module",
    "held_before",
    "looks_left",
    "module_looks_left",
    "module_move",
    "set_module_looks",
]

# Objects to_device cannot move: how often each class is still looked inside for tensors.
LOOKS_PER_CLASS = 8
looks_left: weakref.WeakKeyDictionary[type, int] = weakref.WeakKeyDictionary()
# Modules to_device moved with Module.to(): how often each is still looked at for a tensor
# it left behind, per instance (an nn.Sequential holds something else in each).
_module_looks: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def call_module(mover: Mover, module: torch.nn.Module) -> Any:
    move = module_move(module) if not calling_to(module) else _call_base_module_to
    if len(mover.memo) <= 1 and mover.shared is None:
        return move(mover, module)  # the module is the whole obj: no other reference to share
    return keep_shared(mover, module, move)


def module_move(module: torch.nn.Module) -> Callable[[Mover, Any], Any]:
    # A .to() whose signature does not take non_blocking (and which may forget
    # `return self`) is called as any other object's .to() is.
    return _call_module_to if takes_non_blocking(type(module)) else call_to


def _call_module_to(mover: Mover, module: torch.nn.Module) -> Any:
    return _module_to(mover, module, type(module).to)


def _call_base_module_to(mover: Mover, module: torch.nn.Module) -> Any:
    """``Module.to`` itself, for a module whose own ``.to()`` called to_device on it."""
    return _module_to(mover, module, torch.nn.Module.to)


def _module_to(mover: Mover, module: torch.nn.Module, to: Callable[..., Any]) -> Any:
    if mover.unsynced is not None:
        mover.unsynced.update(t.device for t in held_tensors(module))
    # While to_device still looks at its attributes: what it held, by id (no reference, so
    # the tensors Module.to replaces are freed as before), to tell a plain attribute that
    # holds a replaced one from one that never held a registered tensor.
    before = held_before(module) if module_looks_left(module) > 0 else None
    device, non_blocking = mover.device, mover.non_blocking
    try:
        moved = while_calling_to(module, lambda: to(module, device, non_blocking=non_blocking))
    except TypeError as error:
        unhashable_note(error, module)  # else torch's bare "unhashable type"
        raise
    if before is not None:  # to_device looks at its attributes
        mover.modules = [*(mover.modules or ()), (module, before)]
    return returned(mover, module, moved)


def held_before(module: torch.nn.Module) -> dict[int, tuple[str, str]]:
    """The id of each parameter and buffer of ``module``, with its dotted name and kind.

    Read before ``Module.to``, which replaces buffers, and parameters where it
    cannot move them in place (to the meta device): a plain attribute that
    still holds one of these after the move holds the module's old tensor.
    """
    held: dict[int, tuple[str, str]] = {}
    for name, tensor in named_held(module, "_parameters"):
        held[id(tensor)] = (name, "parameter")
    for name, tensor in named_held(module, "_buffers"):
        held.setdefault(id(tensor), (name, "buffer"))
    return held


def module_looks_left(module: torch.nn.Module) -> int:
    """How many more times to_device looks at ``module``'s plain attributes (see above)."""
    try:
        return _module_looks.get(module, LOOKS_PER_CLASS)
    except TypeError:  # a module class with __eq__ and no __hash__: counted by its class
        return looks_left.get(type(module), LOOKS_PER_CLASS)


def set_module_looks(module: torch.nn.Module, looks: int) -> None:
    """Record how many more looks at ``module`` are left."""
    try:
        _module_looks[module] = looks
    except TypeError:  # unhashable: counted by its class
        looks_left[type(module)] = looks
