"""What ``to_device`` warns of: what it could not move, and what a module left behind.

Each warning names the place in the object and the fix, once per class (and
path): a ``.to()`` that returned None (the object moved itself), an object
returned as it is that holds tensors (a ``.to()`` that ignores the device, a
class the walk cannot rebuild, a dict key), and a module's plain tensor
attributes that ``Module.to`` does not move (or that still hold the
parameters it replaced). A class is marked as told only once its warning
has been shown: a warning made an error (``-W error``) is raised again at
the next call, not passed over.
"""

from __future__ import annotations

import warnings
from itertools import islice
from typing import Any, NamedTuple

import torch

from ._checkfix import attribute_fix
from ._format import article, qualified_name
from ._frames import caller_stacklevel
from ._look import OPAQUE, Changed, module_attributes, tensor_elsewhere
from ._lookbulk import plain_class_ids
from ._lookpandas import pandas_kind
from ._movecalls import ELSEWHERE, KEY_HELD, LAZY, OWN_TO, DictKey, Unmoved, waits_for
from ._movemodule import looks_left, module_looks_left, set_module_looks
from ._submodules import held_tensors, named_submodules
from ._tree import iter_tensors

__all__ = ["warn_left_behind", "warn_returned_none", "warn_unmoved"]


_warned_returned_none: set[type] = set()


def warn_returned_none(classes: list[type]) -> None:
    for cls in dict.fromkeys(classes):
        if cls in _warned_returned_none:
            continue
        name = qualified_name(cls)
        warnings.warn(
            f"{name}.to() returned None; to_device() kept the object itself, assuming it moved "
            f"in place. Make {cls.__qualname__}.to() return self (or its moved copy). "
            "This warning is shown once per class.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )
        # Marked once told: a warning the filters turned into an error was not told, and
        # is raised again at the next call, not passed over in silence.
        _warned_returned_none.add(cls)


_TRANSFORMERS_CACHE = " (a model's cache: run the model there, or pass use_cache=False)"


def warn_unmoved(unmoved: list[tuple[type, str, Unmoved]], target: torch.device) -> None:
    # Once per class and kind: _mover looks inside a class no more once it found a tensor,
    # unless the warning raised (below).
    told = {(cls, how): path for cls, path, how in unmoved}
    for index, ((cls, how), path) in enumerate(told.items()):
        try:
            _warn_one_unmoved(cls, how, path, target)
        except BaseException:
            # The filters made it an error (simplefilter("error")): not told, so each class
            # from this one on is looked at again, and told at the next call, not passed
            # over in silence. (Dicts' keys are looked at as one class, DictKey.)
            for untold, kind in list(told)[index:]:
                looks_left.pop(DictKey if kind == KEY_HELD else untold, None)
            raise


def _warn_one_unmoved(cls: type, how: Unmoved, path: str, target: torch.device) -> None:
    """Warn that to_device left a tensor behind in ``cls`` (at ``path``), and why (``how``)."""
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
            f"on {target} ({name}{path}) where it was (a .to() that moves the top-level "
            "values only). Move that value yourself, or keep such tensors at "
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
# torch's DistributedDataParallel keeps its wrapped module's parameters and buffers in
# plain attributes of its own (_module_parameters, modules_buffers): its bookkeeping, not
# a stray; the wrapped module itself is registered (.module), and looked at as any.
_DDP = torch.nn.parallel.DistributedDataParallel
_DDP_PUBLIC_BOOKKEEPING = frozenset({"modules_buffers", "named_module_buffers"})
# Tensors read inside the attribute that holds a stray, to tell the module's old ones.
_TENSORS_READ = 64


class _Stray(NamedTuple):
    """A tensor off the target in a plain attribute of a moved module."""

    path: str  # of the tensor, inside the module: "decay[0]", "encoder.0.cache['keys']"
    attribute: str  # of the attribute that holds it: "decay", "encoder.0.cache"
    value: Any  # the attribute's value


def warn_left_behind(
    modules: list[tuple[torch.nn.Module, dict[int, tuple[str, str]]]], target: torch.device
) -> None:
    """Warn where ``Module.to()`` left a plain tensor attribute elsewhere.

    Each module is looked at a few times at most (`_mover.unchanged` does the
    same for objects, by class), so a model moved at every step costs a dict
    lookup per call once it is known. Each stray is told once per class and
    path, however many models of that class hold it; marked told once the
    warning returns (a warning the filters made an error is told again).
    Each module comes with what it held before the move (`held_before`): a
    stray that is one of those is the module's old tensor, which ``Module.to``
    replaced, and is told so.
    """
    for module, before in {id(module): (module, before) for module, before in modules}.values():
        cls = type(module)
        looks = module_looks_left(module)
        if looks <= 0:
            continue
        try:
            stray = _plain_tensor_elsewhere(module, target)
        except Changed:  # another thread was writing it: no answer, and no look either
            continue
        except Exception:  # noqa: BLE001 - a look that fails finds nothing, and stops
            stray, looks = None, 1
        if stray is None:
            set_module_looks(module, looks - 1)
            continue
        # Once per class and path: each new model of a class with the same stray looks once.
        if (cls, stray.path) not in _warned_left:
            warnings.warn(
                _left_behind_message(module, stray, before, target),
                RuntimeWarning,
                stacklevel=caller_stacklevel(),
            )
            if len(_warned_left) < _WARNED_AT_MOST:
                _warned_left.add((cls, stray.path))
        set_module_looks(module, 0)


def _left_behind_message(
    module: torch.nn.Module,
    stray: _Stray,
    before: dict[int, tuple[str, str]],
    target: torch.device,
) -> str:
    """What a stray is and its fix: the module's old tensor, or one never registered."""
    cls = type(module)
    where = f"{cls.__name__}.{stray.path}"
    replaced = _replaced(module, stray.value, before)
    if replaced is not None:
        # check_module's advice (nn.ParameterList) would be wrong: these were registered,
        # and the module holds their replacements; the attribute holds the old ones.
        name, kind = replaced
        when = (
            "it always does for buffers"
            if kind == "buffer"
            else "it does so where it cannot move them in place, as to the meta device"
        )
        return (
            f"to_device() moved a {qualified_name(cls)} with Module.to(), which made new "
            f"{kind}s on {target} in place of its old ones ({when}); a plain attribute "
            f"still holds an old one: {where} is the module's old {kind} {name}, not on "
            f"{target}. Where it is used, read it through the module (model.{name}), or "
            f"build {cls.__name__}.{stray.attribute} again after moving the model. An optimizer "
            "made before the move holds the old parameters too: make it after. This warning "
            "is shown once per module class and attribute path."
        )
    fix = attribute_fix("model", module, [stray.path])  # check_module's own, where it has one
    return (
        f"to_device() moved a {qualified_name(cls)} with Module.to(), which leaves a "
        f"tensor kept as a plain attribute where it is: {where} is not on "
        f"{target}. Where the forward uses it, {fix}. Some modules keep such a copy "
        "elsewhere on purpose and move it when they use it (transformers' rotary "
        "embeddings keep original_inv_freq so). This warning is shown once per module "
        "class and attribute path."
    )


def _replaced(
    module: torch.nn.Module, value: Any, before: dict[int, tuple[str, str]]
) -> tuple[str, str] | None:
    """The name and kind of a tensor in ``value`` the module held before its move, not now.

    ``before`` holds ids (`held_before`): such a tensor is alive, held by
    ``value``, so its id is its own. Up to `_TENSORS_READ` tensors are read.
    """
    if not before:
        return None
    try:
        held = [id(tensor) for _, tensor in islice(iter_tensors(value, ""), _TENSORS_READ)]
    except Exception:  # noqa: BLE001 - an attribute that cannot be walked: the general advice
        return None
    held = [key for key in held if key in before]
    if not held:
        return None
    now = {id(tensor) for tensor in held_tensors(module)}  # read only here: a stray is rare
    return next((before[key] for key in held if key not in now), None)


def _plain_tensor_elsewhere(module: torch.nn.Module, target: torch.device) -> _Stray | None:
    """The first tensor in a plain attribute of ``module`` not on ``target``, or None.

    Bounded: up to `_ATTRIBUTES_PER_LOOK` attributes that are not plain values,
    `_REFERENCES_PER_ATTRIBUTE` references read inside each (`tensor_elsewhere()`).
    A ``DistributedDataParallel``'s own bookkeeping is left out.
    """
    skip = plain_class_ids() | _CODE
    left = _ATTRIBUTES_PER_LOOK
    for prefix, submodule in named_submodules(module):
        ddp = isinstance(submodule, _DDP)
        for attr, value in module_attributes(submodule):
            if id(type(value)) in skip:
                continue
            if ddp and (attr.startswith("_") or attr in _DDP_PUBLIC_BOOKKEEPING):
                continue
            left -= 1
            if left < 0:
                return None
            # A module kept in a plain attribute (a list of layers) is not moved either.
            inside = tensor_elsewhere(value, target, looks=_REFERENCES_PER_ATTRIBUTE, modules=True)
            if inside is not None:
                attribute = f"{prefix}.{attr}" if prefix else attr
                return _Stray(f"{attribute}{inside}", attribute, value)
    return None


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
