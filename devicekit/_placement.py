"""``to_device``: move every tensor in a batch, a module or a checkpoint to a device.

The walk itself, the state one call keeps and the copy policy (which copies
are non-blocking) are `_mover`'s; this module takes the one-tensor call
without a walk, and turns what the walk meets (a cycle, a structure too deep, a
tensor on the meta device, a ``.to()`` that returned None) into errors and
warnings that name the place in ``obj`` and the fix.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, ItemsView, KeysView
from typing import TypeVar

import torch

from ._accelerators import CPU, META, try_gpu
from ._checkfix import attribute_fix
from ._compiled import traced_move
from ._devices import DeviceLike, resolve_device
from ._errors import TensorCopyError, add_note
from ._format import article, qualified_name
from ._frames import caller_stacklevel
from ._look import OPAQUE, Changed, module_attributes, tensor_elsewhere
from ._lookbulk import plain_class_ids
from ._lookpandas import pandas_kind
from ._movecalls import ELSEWHERE, KEY_HELD, LAZY, OWN_TO, HeldView, Unmoved, waits_for
from ._movemodule import module_looks_left, set_module_looks
from ._mover import Cycle, ModuleFirst, borrow
from ._options import check_flag
from ._submodules import named_submodules
from ._tree import describe_cycle, iter_tensors, path_of

__all__ = ["to_device"]

T = TypeVar("T")

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling  # True only while dynamo traces the call
# resolve_device returns these very objects for the CPU and meta: compare by identity
# (reading a torch.device's .type builds a new string each time, about 0.4 µs).
_CPU, _META_DEVICE = CPU, META


_warned_returned_none: set[type] = set()


def _warn_returned_none(classes: list[type]) -> None:
    for cls in dict.fromkeys(classes):
        if cls in _warned_returned_none:
            continue
        _warned_returned_none.add(cls)
        name = qualified_name(cls)
        warnings.warn(
            f"{name}.to() returned None; to_device() kept the object itself, assuming it moved "
            f"in place. Make {cls.__qualname__}.to() return self (or its moved copy). "
            "This warning is shown once per class.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


_TRANSFORMERS_CACHE = " (a model's cache: run the model there, or pass use_cache=False)"


def _warn_unmoved(unmoved: list[tuple[type, str, Unmoved]], target: torch.device) -> None:
    # Once per class and kind: _mover looks inside a class no more once it found a tensor.
    for (cls, how), path in {(cls, how): path for cls, path, how in unmoved}.items():
        name = cls.__name__
        if how == KEY_HELD:
            what = (
                f"moved a {name if cls is dict else qualified_name(cls)}'s values, never its "
                "keys, and a key holds a "
                f"tensor not on {target} ({name}{path}), which stays where it is. Key it by "
                "a str or an int instead, and keep the tensor among the values"
            )
        elif how == LAZY:
            shown = name if cls.__module__ == "builtins" else qualified_name(cls)
            what = (
                f"returned {article(shown)} {shown} as it is: an iterator makes its items as "
                "it runs, so to_device cannot move them without running it and using it up. "
                "Pass a list of its items instead (list(...)), or move each item as it comes"
            )
        elif how == ELSEWHERE:
            shown, get = waits_for(cls) or (qualified_name(cls), "")
            what = (
                f"returned {article(shown)} {shown} as it is: it stands for a value made "
                "elsewhere, which to_device cannot move without waiting for it. Get the "
                f"value first ({get}) and move that"
            )
        elif how == OWN_TO:
            what = (
                f"moved a {qualified_name(cls)} with its own .to(), which left a tensor not "
                f"on {target} ({name}{path}) where it was (a BatchEncoding's .to() moves its "
                "top-level values only). Move that value yourself, or keep such tensors at "
                "the top level"
            )
        else:
            if cls.__module__ == "numpy":
                fix = "keep them in a list (which it moves) instead of a numpy array"
            elif (kind := pandas_kind(cls)) is not None:  # a .to() is not the user's to add
                fix = _pandas_fix(kind, target)
            else:
                fix = f"give {name} a .to(device) that returns the moved object"
            cache = _TRANSFORMERS_CACHE if cls.__module__.startswith("transformers.") else ""
            advice = f"Move its tensors yourself, {fix}, or make it on {target} in the first place"
            if cls.__module__.startswith("torch."):  # torch's own class: no .to() to add
                advice = _torch_fix(cls, target)
            what = (
                f"returned a {qualified_name(cls)} as it is: devicekit does not know how to "
                f"move it, and it holds a tensor not on {target} ({name}{path}), which stays "
                f"where it is. {advice}{cache}"
            )
        finds = "" if how in (LAZY, ELSEWHERE) else " dk.assert_same_device() finds such tensors."
        warnings.warn(
            f"to_device() {what}.{finds} This warning is shown once per class.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


# Plain attributes of a moved module looked at per look, and references read inside each:
# a model's are a few per module (a config, a cache), read once per class.
_ATTRIBUTES_PER_LOOK = 4096
_REFERENCES_PER_ATTRIBUTE = 64
_CODE = frozenset(map(id, OPAQUE))


_warned_left: set[tuple[type, str]] = set()  # (class, path) told by _warn_left_behind
_WARNED_AT_MOST = 1024


def _warn_left_behind(modules: list[torch.nn.Module], target: torch.device) -> None:
    """Warn where ``Module.to()`` left a plain tensor attribute elsewhere.

    Each module is looked at a few times at most (`_mover.unchanged` does the
    same for objects, by class), so a model moved at every step costs a dict
    lookup per call once it is known. Each stray is told once per class and
    path, however many models of that class hold it.
    """
    for module in {id(module): module for module in modules}.values():
        cls = type(module)
        looks = module_looks_left(module)
        if looks <= 0:
            continue
        try:
            path = _plain_tensor_elsewhere(module, target)
        except Changed:  # another thread was writing it: no answer, and no look either
            continue
        except Exception:  # noqa: BLE001 - a look that fails finds nothing, and stops
            path, looks = None, 1
        set_module_looks(module, 0 if path is not None else looks - 1)
        if path is None:
            continue
        # Once per class and path: each new model of a class with the same stray looks once.
        if (cls, path) in _warned_left:
            continue
        if len(_warned_left) < _WARNED_AT_MOST:
            _warned_left.add((cls, path))
        fix = attribute_fix("model", module, [path])  # check_module's own, where it has one
        warnings.warn(
            f"to_device() moved a {qualified_name(cls)} with Module.to(), which leaves a "
            f"tensor kept as a plain attribute where it is: {cls.__name__}.{path} is not on "
            f"{target}. Where the forward uses it, {fix}. Some modules keep such a copy "
            "elsewhere on purpose and move it when they use it (transformers' rotary "
            "embeddings keep original_inv_freq so). This warning is shown once per module "
            "class and attribute path.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


def _plain_tensor_elsewhere(module: torch.nn.Module, target: torch.device) -> str | None:
    """The path of a tensor in a plain attribute of ``module`` not on ``target``.

    Bounded: up to `_ATTRIBUTES_PER_LOOK` attributes that are not plain values,
    `_REFERENCES_PER_ATTRIBUTE` references read inside each (`tensor_elsewhere()`).
    """
    skip = plain_class_ids() | _CODE
    left = _ATTRIBUTES_PER_LOOK
    for prefix, submodule in named_submodules(module):
        for attr, value in module_attributes(submodule):
            if id(type(value)) in skip:
                continue
            left -= 1
            if left < 0:
                return None
            # A module kept in a plain attribute (a list of layers) is not moved either.
            inside = tensor_elsewhere(value, target, looks=_REFERENCES_PER_ATTRIBUTE, modules=True)
            if inside is not None:
                return f"{prefix}.{attr}{inside}" if prefix else f"{attr}{inside}"
    return None


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
    - Objects with their own ``.to(device)`` method are moved by it, modules
      whose class overrides ``.to`` too; one whose ``.to()`` returns None is
      kept (it moved itself), with a warning once per class. A ``.to()``
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
        _warn_returned_none(returned_none)
    if unmoved is not None:
        _warn_unmoved(unmoved, target)
    if modules is not None:
        _warn_left_behind(modules, target)
    return result  # type: ignore[no-any-return]


_DEAD_PROXY = "weakly-referenced object no longer exists"  # a proxy's error, not a .to()'s own
_DEAD_PROXY_NOTE = (
    "devicekit: to_device() met a weak proxy (weakref.proxy) in obj whose object no longer "
    "exists, and cannot tell what it was. Take it out of the batch, or keep its object "
    "alive while the batch is moved."
)


def _torch_fix(cls: type, target: torch.device) -> str:
    """How to have one of torch's own classes on ``target``: no .to() is yours to add there."""
    if issubclass(cls, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
        optimizer = issubclass(cls, torch.optim.Optimizer)
        held = "" if optimizer else " (a scheduler holds its optimizer)"
        return (
            f"An optimizer's state follows its parameters{held}: make it after moving the "
            "model, or load_state_dict() into one made then (which moves the state to each "
            "parameter's device)"
        )
    move = f"move each batch as it comes, dk.to_device(batch, {str(target)!r})"
    if issubclass(cls, torch.utils.data.DataLoader):
        return f"A DataLoader hands out batches on the host, where its workers make them: {move}"
    if issubclass(cls, torch.utils.data.Dataset):
        return f"A dataset's items stay on the host, where a DataLoader reads them: {move}"
    return (
        f"torch's {cls.__name__} has no .to() to call: move the tensors it holds yourself, or "
        f"make it from tensors on {target}"
    )


def _pandas_fix(kind: str, target: torch.device) -> str:
    """How to move the tensors of a pandas object yourself, onto ``target``.

    A pattern, not code to paste: the label shown in the path may not be one
    to type back (``np.int64(0)``), and the frame may sit inside the batch.
    """
    move = f".map(lambda t: t.to({str(target)!r}))"
    if kind == "DataFrame":
        return f"a column of them with df[column] = df[column]{move}"
    if kind == "Series":
        return f"with series = series{move}"
    return "keep them in a list or dict of tensors (which it moves)"


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
