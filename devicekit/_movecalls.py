"""What `_mover`'s walk calls to move an object that moves itself: its own ``.to()``.

An object with its own ``.to()`` is moved by it (with ``non_blocking=True``
where the copy policy asks for it and the ``.to()`` takes it), and so is a
module, by ``Module.to`` or its class's override; a Hugging Face
``BatchEncoding`` and a ``PackedSequence`` are rebuilt by the walk instead
(`_mover`). Three things make that more than a call:

- What ``.to()`` returns. One that moves in place and forgets ``return self``
  returns None: the walk keeps the object, and `to_device` warns once per
  class (`returned`). One that moves a mapping's top-level values only may
  leave a tensor in a nested value: `to_device` looks, as it looks inside
  objects it cannot move.
- A ``.to()`` that calls ``to_device`` on its object (``return
  dk.to_device(self, device)``): the walk it starts finds that object's
  ``.to()`` running (`calling_to`) and moves the object as what it is.
- A module's tensors met elsewhere in the batch (``{"w": model.weight, "m":
  model}``). A tensor reached twice is moved once, whatever the order: the
  batch's reference must come back as the module's own moved tensor, not as a
  copy of its own, or an update to one no longer reaches the other. A module
  met *after* one of its tensors was copied is too late: the copy is already
  in the result. So the walk starts again, that module moved first
  (`ModuleFirst`); then each of its tensors is found in the memo (or already
  on the target, where ``Module.to`` moved it in place). Batches without
  modules never pay for this: the bookkeeping runs only where a module is met
  inside a container, and a second walk only where one of its tensors was met
  before it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any, Final, Literal

import torch

from ._accelerators import CPU, META
from ._errors import TensorCopyError, add_note
from ._format import qualified_name
from ._look import key_text, tensor_elsewhere
from ._lookbulk import array_elements
from ._submodules import named_submodules

if TYPE_CHECKING:
    from ._mover import _Mover

__all__ = [
    "ELSEWHERE",
    "KEY_HELD",
    "LAZY",
    "OPTIMIZERS",
    "OWN_TO",
    "UNCHANGED",
    "DictKey",
    "HeldView",
    "ModuleFirst",
    "Unmoved",
    "array_stray",
    "call_to",
    "calling_to",
    "has_to_method",
    "held_view",
    "keep_shared",
    "optimizer_stray",
    "proxy_to",
    "returned",
    "takes_non_blocking",
    "waits_for",
    "while_calling_to",
]

# Why a tensor stayed where it was, for to_device's warning: in an object returned as it
# is, in what an object's own .to() returned, or in a dict's key (never moved); or why
# none could be seen: an iterator makes its items as it runs, a future or a Ray object
# reference stands for a value made elsewhere (`waits_for`).
Unmoved = Literal["unchanged", "own .to()", "key", "lazy", "elsewhere"]
UNCHANGED: Final = "unchanged"
OWN_TO: Final = "own .to()"
KEY_HELD: Final = "key"
LAZY: Final = "lazy"
ELSEWHERE: Final = "elsewhere"
# References read inside a numpy array of objects, as inside any object (tensor_elsewhere).
_ARRAY_LOOKS = 256
# References read inside a dict view's items, besides the items themselves (held_view).
_VIEW_LOOKS = 256


def waits_for(cls: type) -> tuple[str, str] | None:
    """The name of ``cls`` and how to get its value, where it is a future; else None.

    A future, or a Ray ``ObjectRef``, holds no tensor to_device could see:
    its value is made elsewhere. Modules are not imported for this: where one
    is not imported yet, none of its objects exists.

    Examples:
        >>> import concurrent.futures
        >>> waits_for(concurrent.futures.Future), waits_for(list)
        (('concurrent.futures.Future', 'future.result()'), None)
    """
    if (cls.__module__, cls.__qualname__) == ("ray", "ObjectRef"):
        return "ray.ObjectRef", "ray.get(ref)"
    for module, get in _FUTURES:
        imported = sys.modules.get(module)
        if imported is not None and issubclass(cls, imported.Future):
            # By its public name (asyncio.Task, not _asyncio.Task), where the module has one.
            public = getattr(imported, cls.__qualname__, None) is cls
            return f"{module}.{cls.__qualname__}" if public else qualified_name(cls), get
    return None


# Where futures live (torch.futures is imported with torch), and how to get their value.
_FUTURES = (
    ("torch.futures", "future.wait()"),
    ("asyncio", "await future"),
    ("concurrent.futures", "future.result()"),
)


class DictKey:
    """Dicts' keys, counted in `_mover`'s looks per class as one class of their own."""


class ModuleFirst(Exception):
    """Raised inside the walk: ``module`` was met after one of its tensors was copied alone.

    `to_device` walks again from the start with the module moved first
    (`_Mover.again`).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


class HeldView(Exception):
    """Raised inside the walk: a dict view holds a tensor not on the target.

    `to_device` turns it into a ``TypeError`` that names where the view is.
    """

    def __init__(self, view: Any, path: str) -> None:
        super().__init__()
        self.view = view
        self.path = path  # of the tensor in list(view): "[0]", "[1][1]" (an item's value)


def held_view(mover: _Mover, view: Any) -> Any:
    """``view`` (``batch.values()``, a ``KeysView``...) where it holds nothing to move.

    A view shows its dict, which `to_device` never changes: it cannot be
    rebuilt to show moved tensors, and a list instead would change the type
    without a word. So a view that holds a tensor (or a module's) not on the
    target raises `HeldView`; one that holds none (a dict's str keys, values
    already there) is returned as it is, as before. Each item is read, and up
    to 256 references inside them, each time: a view in a batch is rare, and
    this runs for no other object.
    """
    try:
        items = list(view)  # a Mapping's ItemsView runs its __iter__ and __getitem__
        path = tensor_elsewhere(items, mover.device, looks=len(items) + _VIEW_LOOKS, modules=True)
    except RecursionError:
        raise  # the walk is too deep: to_device says so
    except Exception:  # noqa: BLE001 - a look that fails finds nothing, as for any object
        return view
    if path is not None:
        raise HeldView(view, path)
    return view


def _held(module: torch.nn.Module) -> list[tuple[Any, str, torch.Tensor]]:
    """Each parameter and buffer of ``module`` and its submodules, with the registry and name.

    Read from the registries themselves (``named_parameters()`` builds a
    dotted name per tensor, at 2.5 times the cost): after ``Module.to``, which
    moves in place, each registry holds the tensor that replaced the one listed.
    A registry is read with ``items()`` and ``[name]`` only, which every one
    has: a ``dict`` for most modules, torch's ``OrderedDictWrapper`` for a
    TorchScript module (``torch.jit.script``, ``torch.jit.trace``).
    """
    held = []
    for _, submodule in named_submodules(module):
        for registry in (submodule._parameters, submodule._buffers):
            for name, tensor in registry.items():
                if tensor is not None:
                    held.append((registry, name, tensor))
    return held


def keep_shared(mover: _Mover, module: torch.nn.Module, move: Callable[[_Mover, Any], Any]) -> Any:
    """``move(mover, module)``, keeping the module's tensors one with the rest of the batch's.

    Before the move: where the walk already copied one of the module's
    tensors on its own, raise `ModuleFirst`. After it: each parameter or
    buffer the move replaced (``Module.to`` replaces buffers, and parameters
    where it cannot move them in place, as to ``meta``) is entered in the memo
    as the module's new one, so a later reference to it in the batch comes
    back as that very tensor. The replaced tensors are kept until the call
    ends: the memo is keyed by ``id()``.
    """
    memo, shared = mover.memo, mover.shared
    held = _held(module)
    for _, _, tensor in held:
        key = id(tensor)
        if key in memo and (shared is None or key not in shared):
            raise ModuleFirst(module)  # copied alone earlier: too late to share it
    result = move(mover, module)
    if shared is None:
        shared = mover.shared = {}
    shared[id(module)] = result
    if result is module:  # moved in place (an override that returns a copy is its own)
        for registry, name, old in held:
            try:
                # Not .get(): a TorchScript module's registries are torch's own
                # OrderedDictWrapper, which has items() and [] only.
                new = registry[name]
            except KeyError:  # an override of .to() that dropped it: nothing to share
                continue
            if new is not None and new is not old and id(old) not in memo:
                memo[id(old)] = shared[id(old)] = new
                mover.keep(old)
    return result


_STORAGES = (torch.UntypedStorage, torch.TypedStorage)


# Per thread: the objects whose own .to() to_device is calling. A .to() written as
# `return dk.to_device(self, device)` reaches to_device with the object again, which
# then moves it as what it is (a dataclass, a mapping, its attributes), not by
# calling that .to() once more, for ever.
_calling = threading.local()


def calling_to(obj: Any) -> bool:
    """Whether ``obj``'s own ``.to()`` is running, called by `to_device` on this thread."""
    ids: set[int] | None = getattr(_calling, "ids", None)
    return ids is not None and id(obj) in ids


def while_calling_to(obj: Any, call: Callable[[], Any]) -> Any:
    """``call()``, with ``obj`` marked as one whose own ``.to()`` is running."""
    ids: set[int] | None = getattr(_calling, "ids", None)
    if ids is None:
        ids = _calling.ids = set()
    ids.add(id(obj))
    try:
        return call()
    finally:
        ids.discard(id(obj))


def proxy_to(mover: _Mover, proxy: torch.fx.Proxy) -> Any:
    """``proxy.to(device)``, as for a tensor: returned unchanged, the move left the graph.

    A copy to the host blocks in the graph, whatever ``non_blocking`` says: eager
    synchronizes once before returning, which a traced graph would not.
    """
    if mover.non_blocking and mover.device not in (META, CPU):
        return proxy.to(mover.device, non_blocking=True)
    return proxy.to(mover.device)


def call_to(mover: _Mover, obj: Any) -> Any:
    """``obj.to(device)``: an object's own ``.to()``, with a note where it raises.

    With ``non_blocking=True`` where the copy policy makes the copy
    non-blocking and the ``.to()`` takes that keyword (or ``**kwargs``), as a
    module's is called: copies to an accelerator stay non-blocking. A copy to
    the host is asked for blocking, even with ``non_blocking=True``: to_device
    waits once for the devices of the copies it made itself, and cannot see
    where the tensors inside an object come from, to wait for them.
    """
    # A storage's .to() takes the device by keyword only (.to(device) raised TypeError).
    storage = isinstance(obj, _STORAGES)
    device = mover.device
    kwargs: dict[str, Any] = {}
    if mover.non_blocking and mover.unsynced is None and takes_non_blocking(type(obj)):
        kwargs = _NON_BLOCKING
    try:
        if storage:
            moved = obj.to(device=device, **kwargs)
        else:
            moved = while_calling_to(obj, lambda: obj.to(device, **kwargs))
    except RecursionError:
        raise  # the walk is too deep: to_device says so
    except Exception as error:
        # The traceback ends in the user's own .to(), far from the to_device() call.
        cls = type(obj)
        if storage:  # torch's own: the fix is not to give it another .to()
            there = str(mover.device)
            raise TensorCopyError(
                f"to_device() cannot move a {qualified_name(cls)} to {there!r}: its "
                f".to(device={there!r}) raised {type(error).__name__}: {error}. Move the tensor "
                "that holds the storage instead (tensor.to(device)), or keep it where it is"
            ) from error
        called = f"{str(mover.device)!r}{', non_blocking=True' if kwargs else ''}"
        add_note(
            error,
            f"devicekit: to_device() moves a {qualified_name(cls)} by calling its own "
            f".to({called}), which raised this. If {cls.__qualname__}.to() takes "
            "other arguments or means something else (a unit conversion), move its tensors "
            "yourself, or give it a .to(device) that moves them and returns the result.",
        )
        raise
    result = returned(mover, obj, moved)
    if isinstance(result, Mapping) and not isinstance(result, torch.nn.Module):
        # A mapping's .to() may move its top-level values only: a tensor in a nested
        # list stays. Looked for as inside an object the walk cannot move (bounded, a few
        # times per class). Other classes' .to() may keep a tensor on the host on
        # purpose: theirs is the last word.
        mover.unchanged(result, OWN_TO)
    return result


def array_stray(array: Any, device: torch.device) -> str | None:
    """The path of a tensor off ``device`` in a numpy array of Python objects, or None.

    None for an array of numbers (its dtype says so). Up to 256 elements are
    read, each as `tensor_elsewhere` reads inside an object, and named as
    `assert_same_device` names them (``.flat[2]``, a record's ``['name']``).
    """
    elements = array_elements(array)
    if elements is None:
        return None
    named = list(islice(elements, _ARRAY_LOOKS))
    found = tensor_elsewhere([value for _, value in named], device, looks=_ARRAY_LOOKS)
    if found is None:
        return None
    index, _, inside = found[1:].partition("]")  # "[2].x": element 2, then what is in it
    return named[int(index)][0] + inside


OPTIMIZERS = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)


def optimizer_stray(obj: Any, device: torch.device) -> str | None:
    """The path of a tensor off ``device`` in an optimizer's state (a scheduler's), or None.

    Its counters (0-d tensors on the host) are left out: torch keeps Adam's
    ``step`` and NAdam's ``mu_product`` there on purpose, where it is not
    ``capturable``, so an optimizer made after the model moved, as the advice
    says, would be warned of all the same.
    """
    optimizer, held = (
        (obj, "") if isinstance(obj, torch.optim.Optimizer) else (obj.optimizer, ".optimizer")
    )
    for param, values in list(optimizer.state.items()):
        for name, value in list(values.items()):
            # A 0-d tensor on the host is a counter torch keeps there (Adam's step,
            # NAdam's mu_product), not state left behind.
            kept = isinstance(value, torch.Tensor) and value.is_cpu and not value.ndim
            found = None if kept else tensor_elsewhere(value, device)
            if found is not None:
                return f"{held}.state[{key_text(param)}][{name!r}]{found}"
    return None


def returned(mover: _Mover, obj: Any, moved: Any) -> Any:
    """What ``obj.to()`` returned, or ``obj`` itself where that was None."""
    if moved is None:
        # It moved itself in place and forgot to return self (Lightning keeps it too).
        mover.returned_none = [*(mover.returned_none or ()), type(obj)]
        return obj
    return moved


_non_blocking_taken: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
_NON_BLOCKING: Final[dict[str, Any]] = {"non_blocking": True}  # unpacked: never written to


def takes_non_blocking(cls: type) -> bool:
    """Whether a class's ``.to`` takes ``non_blocking=`` (``Module.to`` does), read once per class.

    Hugging Face and Lightning models override ``.to`` with ``*args, **kwargs``:
    they take it, and their copies to a GPU stay non-blocking; so does any
    other class's ``.to`` that names ``non_blocking`` (a storage's).
    """
    known = _non_blocking_taken.get(cls)
    if known is None:
        to = getattr(cls, "to", None)
        if to is torch.nn.Module.to:
            known = True
        else:
            try:
                parameters = inspect.signature(to).parameters.values()  # type: ignore[arg-type]
            except (TypeError, ValueError):  # a signature Python cannot read: not assumed
                parameters = ()  # type: ignore[assignment]
            known = any(
                p.name == "non_blocking" or p.kind is inspect.Parameter.VAR_KEYWORD
                for p in parameters
            )
        _non_blocking_taken[cls] = known
    return known


def has_to_method(cls: type) -> bool:
    """Whether the class defines ``.to`` itself, or a base class does.

    Not an instance's "to" key (an attribute-style dict), nor a metaclass's
    ``to`` (which the class has, and its instances do not), nor a dataclass
    field named ``to`` (whose callable default is a class attribute too).
    """
    return (
        callable(getattr(cls, "to", None))
        and any("to" in vars(k) for k in cls.__mro__)
        and not _is_field(cls, "to")
    )


def _is_field(cls: type, name: str) -> bool:
    return dataclasses.is_dataclass(cls) and any(f.name == name for f in dataclasses.fields(cls))
