"""What `assert_same_device`'s walk cannot look inside, and why: for its errors and warnings.

An argument in which the walk found no tensor may still hold some where
Python cannot read them: a C extension's object, a ``torch.ScriptObject``
(a quantized module's packed weights), an object behind a ``__dict__``
property, a weak reference. The check names such an object instead of
saying there is no tensor (`unread`); met inside an argument, only those
that may hold the user's tensors are named (`unread_inside`).
"""

from __future__ import annotations

import array
import decimal
import functools
import re
import sys
import threading
import types
import weakref
from typing import Any

import torch

from ._look import NOTHING_INSIDE, class_attribute
from ._lookbulk import plain_class_ids
from ._lookpandas import pandas_kind
from ._tree import iter_children

__all__ = ["unread", "unread_inside"]


# Python's own objects whose storage shows nothing, and that hold no tensor.
_NO_TENSOR_INSIDE = (torch.Tensor, torch.nn.Module, bytearray, array.array, memoryview)


@functools.cache
def _holding_nothing() -> frozenset[type]:
    """Python's and torch's classes with no readable storage that can hold no tensor.

    Named one by one: a module's own C objects may hold tensors all the same
    (a ``grad_fn`` its saved tensors, a ``torch.ScriptObject`` packed weights,
    a ``ContextVar`` its default), and those are named as not looked inside.
    """
    names = ("Generator", "finfo", "iinfo", "qscheme", "Stream", "Event", "Size")
    torch_own = {
        getattr(torch, name) for name in names if isinstance(getattr(torch, name, None), type)
    }
    return frozenset({
        slice, type(Ellipsis), type(NotImplemented), decimal.Decimal, re.Pattern, re.Match,
        type(threading.Lock()), type(threading.RLock()), *torch_own,
    })  # fmt: skip


def _is_numpy(cls: type) -> bool:
    """Whether ``cls`` is numpy's (an array is read by its dtype; a Generator holds none)."""
    module = getattr(cls, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] == "numpy"


def unread(obj: object) -> str | None:
    """Why the walk could not look inside argument ``obj`` at all; None where it could.

    For an argument in which it found no tensor: a class whose instances keep
    what they hold where Python cannot read it (a C extension's), or behind a
    property named ``__dict__`` (never run), and a weak reference (not
    followed). A plain value, a container, a record, a numpy array (read by
    its dtype) and a pandas object (read through pandas) were looked inside.
    """
    cls = type(obj)
    if cls in NOTHING_INSIDE or id(cls) in plain_class_ids() or isinstance(obj, _NO_TENSOR_INSIDE):
        return None
    if isinstance(obj, weakref.ref):
        return "a weak reference, which the check does not follow"
    if pandas_kind(cls) is not None or iter_children(obj) is not None:
        return None
    if cls in _holding_nothing() or _is_numpy(cls):
        return None
    if cls is torch.ScriptObject:  # torch's own (not a ScriptModule's _c, read elsewhere)
        return _script_object(obj)
    storage = class_attribute(cls, "__dict__")
    if type(storage) in (types.GetSetDescriptorType, types.MemberDescriptorType):
        return None
    if storage is not None:
        return "its __dict__ is a property, which the check does not run"
    if class_attribute(cls, "__slots__") is not None:  # a Python class: its slots were read
        return None
    return "it keeps what it holds where Python cannot read it, as a C extension's objects do"


def _script_object(obj: Any) -> str:
    """Why a ``torch.ScriptObject`` is not looked inside, with its TorchScript class."""
    try:
        kind = f"this {obj._type().qualified_name().rsplit('.', 1)[-1]}"
    except Exception:  # noqa: BLE001 - its class name is only shown, never needed
        kind = "it"
    return (
        f"torch keeps what {kind} holds in C++, where Python cannot read it, as it keeps a "
        "quantized module's packed weights"
    )


def unread_inside(obj: object) -> str | None:
    """Why the walk could not look inside ``obj``, met inside an argument; None where it could.

    As `unread()`, but None for what an argument's insides hold by the way and
    a check would name to no purpose: a weak reference (a back-pointer, not
    followed), and Python's, numpy's and torch's own C objects (a
    ``datetime``, a ``ContextVar``, a ``grad_fn``, a process group), their
    machinery. A ``torch.ScriptObject`` is named all the same: torch keeps a
    quantized module's packed weights in one. So is a third-party C
    extension's object (a pybind11 class holding tensors of its own).
    """
    if isinstance(obj, weakref.ref):
        return None
    if type(obj) is not torch.ScriptObject:
        module = getattr(type(obj), "__module__", None)
        root = module.split(".")[0] if isinstance(module, str) else "builtins"
        if root in _OWN_ROOTS or root in sys.stdlib_module_names:
            return None
    return unread(obj)


# The packages whose C objects are machinery, never a store of the user's tensors: torch
# and Python's own (a stdlib module's), numpy's (read by dtype), where they are met inside.
_OWN_ROOTS = frozenset({"builtins", "torch", "numpy"})
