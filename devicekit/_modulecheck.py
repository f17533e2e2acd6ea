"""`check_module`: what ``module.to()`` will leave behind, found before it does.

A module moves what it registers: parameters, buffers and submodules. A
tensor or module kept in a plain attribute (a list, a dict, a dataclass, a
hidden ``nn.Parameter``) stays where it was made, and the first forward on
another device fails far from the cause. `check_module` walks those
attributes (here) and says, for each, how to register it, as code that runs
as written (`_modulefix`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ._keywords import suggest_keywords
from ._look import Changed, key_text, module_attributes
from ._lookbulk import bulk_children, bulk_look, plain_class_ids
from ._modulefix import KEY, Leaf, Places, Registered
from ._submodules import named_held, named_submodules, not_a_module, unhashable
from ._tree import container_attributes, iter_children

__all__ = ["check_module", "torch_bookkeeping"]


@suggest_keywords
def check_module(module: torch.nn.Module) -> list[str]:
    """Find tensors and modules that ``module.to(...)`` will not move.

    ``Module.to`` moves parameters, buffers and registered submodules only. A
    tensor kept as a plain attribute (``self.mask = torch.ones(3)``), or
    tensors and modules kept in a plain ``list`` or ``dict`` attribute, stay
    where they are, and the model fails later with a device mismatch. This
    reports each such attribute with the device it is on and the fix, as code
    that runs as written (for a parameter of a module kept so: register that module).

    Not reported, because ``module.to()`` does move them: a plain reference to
    a module or a parameter registered elsewhere in ``module`` (both are
    moved in place, so ``self.groups = [self.fc.weight]`` follows; only a
    move to ``meta`` makes new parameters), and an attribute a forward
    pre-hook recomputes on every call (``weight`` after
    ``torch.nn.utils.weight_norm``, ``spectral_norm`` or pruning), and what a
    module's own ``_apply`` moves (torchmetrics' ``Metric`` moves its states
    so): such a module's ``_apply`` is called once with a function that
    returns each tensor as it is, to see what it reaches. A plain
    reference to a registered *buffer* is reported: ``module.to()`` replaces
    buffers, so the reference keeps the old tensor. So is a plain list of
    ``nn.Parameter`` objects that are not the module's, with both fixes where
    the module has a parameter of the same shape and dtype: never registered
    (``nn.ParameterList``), or left from before a move that made new
    parameters (``.to('meta')``, ``.to_empty()``: make the list again). Not
    reported: a torch wrapper's own list of its module's parameters
    (``DistributedDataParallel._module_parameters``). A ``torch.ScriptObject``
    held as a plain attribute (a quantized module's packed weights), which
    ``module.to()`` leaves where it is, is named as not looked inside. The
    walk takes time in proportion to the module's size, and a plain attribute
    that contains itself is looked inside once. Builtin lists, tuples, dicts and sets of
    plain values (str, numbers...) inside plain attributes hold no tensor,
    and are passed over in bulk, in C, as
    [`assert_same_device()`][devicekit.assert_same_device] does: a
    tokenizer's 150,000-entry vocabulary costs about 15 ms, not 0.65 s.

    Args:
        module: The model to inspect (all its submodules are inspected too).

    Returns:
        One readable finding per attribute, and one per module whose class
        torch cannot walk (``__eq__`` without ``__hash__``, as a ``@dataclass``
        has); empty when ``module.to()`` moves everything.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.

    Examples:
        >>> import torch, devicekit as dk
        >>> class Scaled(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.scale = torch.ones(1)
        >>> for finding in dk.check_module(Scaled()):
        ...     print(finding)
        scale: a cpu tensor held as a plain attribute; module.to() will not move it. Use self.register_buffer('scale', ...) (or nn.Parameter if it should be trained).
    """  # noqa: E501 - the expected output is one line
    if not isinstance(module, torch.nn.Module):
        raise not_a_module(module, call="check_module(module)")
    registered = Registered(module)
    held = []  # every attribute walked first: a reference may come before its module
    # The tree module.to() walks, then the trees of modules found held as plain attributes:
    # what those hold is reported in the same pass (a hidden module in a hidden ModuleList).
    trees: list[tuple[str, torch.nn.Module]] = [("", module)]
    seen: set[int] = set()
    findings: list[str] = []
    told: set[type] = set()  # each class once: a ModuleList of 12 would say it 12 times
    for prefix, submodule in _walk(trees, seen):
        wrong = unhashable(submodule)
        if wrong is not None and type(submodule) not in told:
            told.add(type(submodule))
            findings.append(f"{prefix or 'the model'}: {wrong}")
        reached: frozenset[int] = frozenset()
        if _applies_its_own(type(submodule)):
            probed = _reached_by_apply(submodule)  # what its own _apply moves, it chooses
            if probed is None:
                continue  # the probe failed: nothing is claimed of what it holds
            reached = probed
        for attr, value in module_attributes(submodule):
            if not _walked(submodule, attr, value):
                # Nothing inside it to read (read lazily: a vocabulary's paths are not made),
                # but for what it cannot read, which is named (a ScriptObject's packed weights).
                findings.extend(_unreadable(prefix, attr, value, reached))
                continue
            modules, tensors = _leaves(value, registered, reached)  # a module, unless registered
            if modules or tensors:
                where = f"{prefix}.{attr}" if prefix else attr
                for leaf in modules:  # registered nowhere: module.to() moves none of its tensors
                    for name, tensor in named_held(leaf.value, "_parameters", "_buffers"):
                        registered.loose.setdefault(id(tensor), f"{where}{leaf.path}.{name}")
                    trees.append((f"{where}{leaf.path}", leaf.value))
                held.append((where, attr, value, submodule, modules, tensors))
    taken: dict[int, set[str]] = {}  # each module's names, and those suggested in it
    for where, attr, value, submodule, modules, tensors in held:
        if id(submodule) not in taken:
            taken[id(submodule)] = set(dir(submodule))
        places = Places(
            attr,
            value,
            taken[id(submodule)],
            registered,
            where=where,
            owner=type(submodule).__name__,
        )
        findings.append(f"{where}: {places.describe(modules, tensors)}")
    return findings


def torch_bookkeeping(module: torch.nn.Module, attr: str, value: object) -> bool:
    """Whether ``attr`` is a torch wrapper's own list of its module's parameters.

    ``DistributedDataParallel._module_parameters``: torch's, never the user's
    to register, so neither `check_module` nor `assert_same_device` advises on
    it (after a move that makes new parameters it keeps the old ones, as the
    wrapper itself does: wrap a model after moving it).
    """
    if not attr.startswith("_") or type(value) not in (list, tuple):
        return False
    module_name = type(module).__module__
    return (
        isinstance(module_name, str)
        and module_name.startswith("torch.")
        and isinstance(value, (list, tuple))
        and all(isinstance(item, torch.nn.Parameter) for item in value)
    )


def _walked(module: torch.nn.Module, attr: str, value: object) -> bool:
    """Whether plain attribute ``attr`` of ``module`` may hold what `_leaves` finds."""
    if torch_bookkeeping(module, attr, value):
        return False
    return isinstance(value, (torch.Tensor, torch.nn.Module)) or iter_children(value) is not None


def _unreadable(prefix: str, attr: str, value: object, reached: frozenset[int]) -> list[str]:
    """The finding, if any, for a ``torch.ScriptObject`` held as a plain attribute.

    What it holds is in C++, where `check_module` cannot look; ``module.to()``
    moves only what a module registers, so it leaves the object, and any tensor
    in it, where it is (a quantized module's packed weights are kept so). Empty
    where the module has an ``_apply`` of its own (``reached``), which may move
    it (nothing is claimed of what it moves), and for any other object.
    """
    if type(value) is not torch.ScriptObject or reached:
        return []
    where = f"{prefix}.{attr}" if prefix else attr
    try:
        kind = f" ({value._type().qualified_name().rsplit('.', 1)[-1]})"
    except Exception:  # noqa: BLE001 - its class name is only shown, never needed
        kind = ""
    return [
        f"{where}: a torch.ScriptObject{kind} held as a plain attribute; check_module cannot "
        "look inside it (torch keeps what it holds in C++, as it keeps a quantized module's "
        "packed weights), and module.to() will not move it or any tensor in it. Where the "
        "forward uses tensors in it, make it again on the device the model is moved to."
    ]


def _applies_its_own(cls: type[torch.nn.Module]) -> bool:
    """Whether ``cls`` moves itself with an ``_apply`` of its own, not torch's.

    ``Module.to()`` runs ``_apply`` on each module: one written outside torch
    (torchmetrics' ``Metric``, which moves the states it keeps as plain
    attributes) decides what moves, so what it moves is found by calling it
    (`_reached_by_apply`). torch's own (``RNNBase``'s) moves what ``Module``'s
    does, and more of its own parameters only.
    """
    owner = next((klass for klass in cls.__mro__ if "_apply" in vars(klass)), torch.nn.Module)
    return not owner.__module__.startswith("torch.")


def _reached_by_apply(module: torch.nn.Module) -> frozenset[int] | None:
    """The tensors ``module``'s own ``_apply`` hands to the function it is given, by ``id()``.

    ``Module.to()`` moves a tensor by that function: called with one that
    returns each tensor as it is (as ``.to()`` to where a tensor already is
    does), ``_apply`` moves nothing and shows what it would move. None where
    it raises: then nothing is claimed of what the module holds.
    """
    reached: set[int] = set()

    def probe(tensor: torch.Tensor) -> torch.Tensor:
        reached.add(id(tensor))
        return tensor

    apply: Callable[[Callable[[torch.Tensor], torch.Tensor]], object] = module._apply
    try:
        apply(probe)
    except Exception:  # noqa: BLE001 - a probe that fails tells nothing, and claims nothing
        return None
    return frozenset(reached)


def _walk(
    trees: list[tuple[str, torch.nn.Module]], seen: set[int]
) -> Iterator[tuple[str, torch.nn.Module]]:
    """Each module of each tree in ``trees`` (which may grow meanwhile) once, with its path."""
    for root_path, root in trees:  # a list iterator sees the trees appended while it runs
        for prefix, submodule in named_submodules(root):
            if id(submodule) not in seen:
                seen.add(id(submodule))
                yield ".".join(part for part in (root_path, prefix) if part), submodule


def _leaves(
    value: object, registered: Registered, reached: frozenset[int] = frozenset()
) -> tuple[list[Leaf], list[Leaf]]:
    """The modules and tensors inside a plain container that ``module.to()`` will not move.

    Each object is visited once, so a container that holds itself (or one
    object twice) ends the walk instead of raising or counting twice; the walk
    uses its own stack, so depth is no limit.
    """
    modules: list[Leaf] = []
    tensors: list[Leaf] = []
    seen: set[int] = set()
    stack = [Leaf("", value, 0, True, None, False)]
    while stack:
        leaf = stack.pop()
        item = leaf.value
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if id(item) not in registered.parameters and id(item) not in reached:
                tensors.append(leaf)
        elif isinstance(item, torch.nn.Module):
            if id(item) not in registered.modules:
                modules.append(leaf)
        else:
            elements = _elements(item)
            keys: frozenset[int] = frozenset()
            if isinstance(item, Mapping) and any(s.startswith(KEY) for s, _ in elements):
                keys = frozenset(map(id, dict.keys(item) if isinstance(item, dict) else item))
            stack.extend(
                Leaf(
                    leaf.path + suffix,
                    child,
                    leaf.depth + 1,
                    leaf.items_only and suffix[0] == "[",
                    leaf,
                    leaf.in_key or (suffix.startswith(KEY) and id(child) in keys),
                )
                for suffix, child in reversed(elements)
            )
    return modules, tensors


def _elements(item: object) -> list[tuple[str, Any]]:
    """What the walk reads inside ``item``: its elements, but none that are plain data.

    A builtin list, tuple, dict or set of plain values (a tokenizer's
    vocabulary, its merges) holds no tensor, and is passed over in bulk, in C
    (`bulk_look()`): 150,000 entries in milliseconds, where reading each one
    took half a second. One that holds something else as well is read
    without its plain values (`bulk_children()`), its keys too, as another
    mapping's are (a ``UserDict``'s).
    """
    try:
        bulk = bulk_look(item, sys.maxsize)  # no budget: the walk reads the whole module
        if bulk is None:
            found = list(iter_children(item) or ())
            if isinstance(item, Mapping):
                plain = plain_class_ids()
                found += [(f"{KEY}{key_text(k)}]", k) for k in item if id(type(k)) not in plain]
            return found
        if bulk[1]:  # nothing inside but what its instance was given, if anything
            return [(f".{name}", value) for name, value in container_attributes(item)]
        return list(bulk_children(item))
    except Changed as error:  # another thread kept changing it: no finding from a part
        raise RuntimeError(
            f"check_module() cannot look inside a plain attribute: {error}"
        ) from None
