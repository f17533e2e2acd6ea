"""``to_device``: move every tensor in a batch, a module or a checkpoint to a device.

The walk itself, the state one call keeps and the copy policy (which copies
are non-blocking) are `_mover`'s; this module takes the one-tensor call
without a walk, and turns what the walk meets (a cycle, a structure too deep, a
tensor on the meta device) into errors that name the place in ``obj`` and the
fix. What it could not move, and what a module left behind, are warned of by
`_movewarn`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, ItemsView, KeysView
from typing import TypeVar

import torch

from ._accelerators import CPU, META, try_gpu
from ._compiled import traced_move
from ._devices import DeviceLike, resolve_device
from ._errors import TensorCopyError, add_note
from ._movecalls import (
    HeldView,
)
from ._mover import Cycle, ModuleFirst, borrow
from ._movewarn import warn_left_behind, warn_returned_none, warn_unmoved
from ._options import check_flag
from ._tree import describe_cycle, iter_tensors, path_of

__all__ = ["to_device"]

T = TypeVar("T")

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling  # True only while dynamo traces the call
# resolve_device returns these very objects for the CPU and meta: compare by identity
# (reading a torch.device's .type builds a new string each time, about 0.4 µs).
_CPU, _META_DEVICE = CPU, META


def to_device(  # noqa: PLR0912 - the hot path: each call saved is measured
    obj: T, device: DeviceLike | None = None, *, non_blocking: bool | None = None
) -> T:
    """Return ``obj`` with every tensor inside it moved to ``device``.

    Walks nested structures and rebuilds each container so that it keeps its
    type and its meaning:

    - ``dict``, ``list``, ``tuple``, namedtuples, ``torch.return_types``,
      ``set`` and ``frozenset``: the same type, elements moved. Tuple
      subclasses keep their attributes, and are made without calling their
      ``__new__`` (whose signature is their own; ``torch.Size`` and
      ``torch.return_types`` are made by their own constructor).
    - ``OrderedDict`` keeps its order, ``defaultdict`` its ``default_factory``,
      ``Counter`` its counts (never added twice), ``ChainMap`` its chain (each
      of its maps moved, so writes and deletions still go to the first).
    - Other mappings: a ``dict`` subclass or ``MutableMapping`` (a Hugging
      Face ``ModelOutput``, a ``UserDict``) is shallow-copied (its own way if
      its class defines one, else without calling its ``__init__``) and each
      moved value is set with its own ``__setitem__`` (``update`` is never
      called: ``ModelOutput`` refuses it, ``Counter`` adds); a read-only
      mapping is rebuilt as ``type(m)(moved_items)``, and refused with
      ``TypeError`` when that does not give back its type with the same keys.
      A ``WeakValueDictionary`` whose values move is refused (it would come
      back empty); one whose values stay is copied.
    - ``deque`` (with its ``maxlen``), ``UserList`` and other mutable
      sequences: copied as mappings are, each moved item set by index;
      ``bytearray`` and ``array.array`` are returned as they are.
    - ``set`` and ``frozenset`` subclasses keep their type and attributes.
    - Dataclasses, frozen or not: a shallow copy with every field moved,
      ``init=False`` fields too, and every other attribute the instance holds
      (what ``__post_init__`` set, ``self.mask = self.x > 0``, private ones
      too), as a field is; ``__post_init__`` does not run again, and
      ``functools.cached_property`` values are dropped from the copy (they
      were computed from the old tensors) so they are computed again.
      ``SimpleNamespace``, ``attrs`` instances and pydantic models (their
      private attributes too) are copied the same way.
    - Objects with their own ``.to(device)`` method are moved by it (with
      ``non_blocking=True`` for a non-blocking copy to an accelerator, where it
      takes that keyword), modules whose class overrides ``.to`` too; one
      whose ``.to()`` returns None is kept (it moved itself), with a warning
      once per class. But a ``UserDict`` (a Hugging Face ``BatchEncoding``,
      whose ``.to()`` changes it in place) is copied as other mappings are,
      and a ``PackedSequence`` is made as its ``.to()`` makes it, its tensors
      moved by the walk: the input stays as it was, shared tensors shared. A ``.to()``
      that returns ``to_device(self, device)`` works: the object is then
      moved as what it is (a dataclass, a mapping, each attribute of a copy).
    - Other modules are moved in place, as ``Module.to`` does (TorchScript
      modules, ``torch.fx`` graph modules and ``torch.compile``'s too). A tensor
      kept as a plain attribute (not a buffer), which ``Module.to`` leaves
      where it is, is warned of once per module class where it is left off
      the target (``RuntimeWarning``, with its path and the fix).

    A dict view (``batch.values()``) cannot be rebuilt: one that holds a
    tensor not on ``device`` is refused with ``TypeError`` (pass the dict
    itself), one that holds none (a dict's str keys) is returned as it is.
    An iterator (a generator, ``map()``) is returned as it is, with a warning
    once per class: moving its items would run it and use it up; so is a
    future or a Ray ``ObjectRef``, whose value is made elsewhere.
    Anything else (a ``range``, your own read-only ``Sequence``) is returned
    unchanged, and the input is never modified
    (except modules, and objects whose ``.to()`` moves them in place): a copy
    whose writes would reach the input (shared storage) is refused with
    ``TypeError``, the input put back. A
    tensor reached twice is moved once, so shared tensors stay shared, and a
    tensor already on ``device`` is returned as is. A parameter or buffer of a
    module in the batch comes back as the module's own moved one, in whichever
    order the two are met (where the tensor comes first, the walk starts again
    with the module moved first). Any other tensor is copied as its own
    ``.to()`` copies it: an ``nn.Parameter`` comes back as a plain tensor, and
    a tensor that requires grad as a non-leaf (``grad_fn=ToCopyBackward0``, no
    ``.grad``) whose gradients flow back to the original.

    Copies *to an accelerator* are non-blocking; copies *to the host* are
    blocking, because the host may read a non-blocking copy before it has
    landed. ``non_blocking=True`` makes every copy non-blocking and, when some
    went to the host, synchronizes once before returning; ``False`` makes every
    copy blocking.

    Args:
        obj: A tensor, module, or any nesting of the containers above.
        device: Where to move it: a [`DeviceLike`][devicekit.DeviceLike] (``"cuda:1"``, ``1``,
            a ``torch.device``; ``"cuda"`` is the current CUDA device).
            Default: [`try_gpu()`][devicekit.try_gpu].
        non_blocking: ``None`` for the safe policy above, or ``True`` or
            ``False`` to force it.

    Returns:
        A structure of the same shape and types, holding the moved tensors.

    Raises:
        ValueError: ``obj`` contains itself, or ``device`` is malformed.
        TypeError: A mapping or sequence in ``obj`` cannot be copied without
            changing it, a read-only mapping cannot be rebuilt from its items,
            or ``obj`` holds a ``WeakValueDictionary`` whose values move, or a
            dict view (``batch.values()``) that holds a tensor not on ``device``.
        RecursionError: ``obj`` nests deeper than Python's recursion limit.
        DeviceNotFoundError: This torch build or machine has no such device.
        TensorCopyError: A tensor cannot be copied to ``device``: one on the
            ``meta`` device holds no values to copy, and torch has no copy of
            a nested (strided) or quantized tensor to some devices.

    Examples:
        >>> import collections, torch, devicekit as dk
        >>> batch = {"x": torch.ones(2), "pairs": [(torch.zeros(1), "label")]}
        >>> moved = dk.to_device(batch, "meta")
        >>> moved["x"].device, moved["pairs"][0][0].device, moved["pairs"][0][1]
        (device(type='meta'), device(type='meta'), 'label')
        >>> dk.to_device(collections.Counter(tokens=3), "meta")
        Counter({'tokens': 3})
        >>> dk.to_device(collections.deque([torch.ones(1)], maxlen=2), "meta")
        deque([tensor(..., device='meta', size=(1,))], maxlen=2)
    """
    target = try_gpu() if device is None else resolve_device(device)
    if type(obj) is _Tensor and non_blocking is None:  # type(): a dead proxy's __class__ raises
        # One tensor, the most common call: no walk, no mover. The same policy.
        if obj.device == target:  # type: ignore[attr-defined]
            return obj
        try:  # free unless it raises (Python 3.11+)
            if target is _CPU or target is _META_DEVICE:  # no keyword for torch to parse
                return obj.to(target)  # type: ignore[attr-defined,no-any-return]
            return obj.to(target, non_blocking=True)  # type: ignore[attr-defined,no-any-return]
        except NotImplementedError as error:
            _raise_unsupported(error, obj, target)
            raise
    if non_blocking is not None:
        check_flag(non_blocking, name="non_blocking", none=_NON_BLOCKING_DEFAULT)
    if _is_compiling():  # torch.compile is tracing this call: a walk dynamo can follow
        return traced_move(obj, target, non_blocking, to_device)  # type: ignore[no-any-return]
    mover = borrow(target, non_blocking)
    try:
        try:
            result = mover.move(obj)
        except ModuleFirst as first:  # a module met after one of its tensors: walk again
            result = mover.again(obj, first.module)
        returned_none, unmoved, modules = mover.returned_none, mover.unmoved, mover.modules
    except Cycle:
        raise ValueError(
            f"to_device() cannot move a structure that contains itself: "
            f"{describe_cycle(obj, 'obj')}. Break the cycle, or give the object a .to() method."
        ) from None
    except RecursionError:
        # Counting the depth in the walk would cost every call; Python counts it anyway.
        raise RecursionError(_too_deep()) from None
    except HeldView as held:
        raise TypeError(_view_refused(obj, held, target)) from None
    except ReferenceError as error:  # Python's bare "weakly-referenced object no longer exists"
        if str(error) == _DEAD_PROXY and _DEAD_PROXY_NOTE not in getattr(error, "__notes__", ()):
            add_note(error, _DEAD_PROXY_NOTE)  # once, though to_device calls may nest
        raise
    except NotImplementedError as error:
        _raise_unsupported(error, obj, target)
        raise
    finally:
        mover.finish()
    if returned_none is not None:
        warn_returned_none(returned_none)
    if unmoved is not None:
        warn_unmoved(unmoved, target)
    if modules is not None:
        warn_left_behind(modules, target)
    return result  # type: ignore[no-any-return]


_DEAD_PROXY = "weakly-referenced object no longer exists"  # a proxy's error, not a .to()'s own
_DEAD_PROXY_NOTE = (
    "devicekit: to_device() met a weak proxy (weakref.proxy) in obj whose object no longer "
    "exists, and cannot tell what it was. Take it out of the batch, or keep its object "
    "alive while the batch is moved."
)


def _view_refused(obj: object, held: HeldView, target: torch.device) -> str:
    """Why a dict view in ``obj`` that holds a tensor off ``target`` is refused, and the fix."""
    view = held.view
    kind = type(view).__name__
    try:
        where = path_of(obj, view, "obj")
    except Exception:  # noqa: BLE001 - a mapping whose items() raises now: say less
        where = None
    at = where or f"the {kind} in obj"
    if isinstance(view, KeysView):
        fix = (
            "A dict's keys are never moved: key the dict by str or int, keep the tensors "
            "among its values, and pass the dict itself"
        )
    else:
        method = "items" if isinstance(view, ItemsView) else "values"
        fix = (
            f"Pass the dict itself, to_device(batch, device), and take .{method}() of what it "
            "returns (or list(...) of the view, where a list is what you need)"
        )
    return (
        f"to_device() cannot move {at}, a dict view ({kind}): it holds a tensor not on {target} "
        f"(list({at}){held.path}), and a dict view cannot be rebuilt: it shows its dict, "
        f"which to_device() never changes, and a list in its place would change its type "
        f"without a word. {fix}."
    )


def _raise_unsupported(error: NotImplementedError, obj: object, target: torch.device) -> None:
    """Raise a `TensorCopyError` for torch's NotImplementedError of a copy: tensor and fix.

    A tensor on the meta device holds no values to copy ("Cannot copy out of
    meta tensor"); a nested (strided) or quantized tensor has no copy to some
    devices (``meta``): "Could not run 'aten::_to_copy' with arguments from
    the 'NestedTensorMeta' backend". Any other returns: the caller raises it as it is.
    """
    text, there = str(error), str(target)
    torch_said = f" (torch: {text.splitlines()[0] if text else type(error).__name__})"
    if "meta tensor" in text:
        path = _first(obj, lambda t: t.is_meta) or "a tensor in obj"
        raise TensorCopyError(
            f"to_device(obj, {there!r}) cannot move {path}: it is on the meta device, which "
            f"holds no values to copy. Make it again on {there!r}; for a model built on meta, "
            f"call model.to_empty(device={there!r}), then load its weights{torch_said}"
        ) from error
    if "Could not run" not in text:
        return
    for kind, test, fix in _NO_COPY:

        def astray(tensor: torch.Tensor, test: Callable[[torch.Tensor], bool] = test) -> bool:
            return test(tensor) and tensor.device != target

        found = _first(obj, astray)
        if found is not None:
            raise TensorCopyError(
                f"to_device(obj, {there!r}) cannot move {found}: torch has no copy of a {kind} "
                f"tensor to {there}. Leave it out of what you move, or {fix}{torch_said}"
            ) from error


# Tensors torch cannot copy to every device: what they are, how to tell, and the fix.
_NO_COPY: list[tuple[str, Callable[[torch.Tensor], bool], str]] = [
    ("nested", lambda t: t.is_nested, "make it with layout=torch.jagged, which moves there"),
    (
        "quantized",
        lambda t: t.is_quantized,
        # Not "quantize it there": quantize_per_tensor of a meta tensor gives a float one.
        "move its .dequantize() instead, a float tensor (quantize it again only where torch "
        "has quantized tensors: the CPU, and CUDA for some operations)",
    ),
    ("sparse", lambda t: t.layout != torch.strided, "move its .to_dense()"),
]


def _first(obj: object, test: Callable[[torch.Tensor], bool]) -> str | None:
    """The path of the first tensor in ``obj`` that passes ``test``; "a tensor in obj" if unsure."""
    try:
        return next((p for p, t in iter_tensors(obj, "obj") if test(t)), None)
    except Exception:  # noqa: BLE001 - a structure iter_tensors cannot walk: say less
        return "a tensor in obj"


_NON_BLOCKING_DEFAULT = "the default: non-blocking to an accelerator, blocking to the host"


def _too_deep() -> str:
    return (
        "to_device() cannot move obj: it nests containers deeper than Python's recursion limit "
        f"(sys.getrecursionlimit() is {sys.getrecursionlimit()}) allows. A level of plain "
        "dicts, lists or tuples takes one frame or two; any other container (a dataclass, an "
        "OrderedDict, a deque...) five to eight. Raise the limit with sys.setrecursionlimit(), "
        "or flatten the structure. (If obj is not that deep, a .to() or __copy__ it calls "
        "recursed without end: the original error is this one's __context__.)"
    )
