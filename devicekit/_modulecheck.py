"""`check_module`: what ``module.to()`` will leave behind, found before it does.

A module moves what it registers: parameters, buffers and submodules. A
tensor or module kept in a plain attribute (a list, a dict, a dataclass, a
hidden ``nn.Parameter``) stays where it was made, and the first forward on
another device fails far from the cause. `check_module` walks those
attributes and says, for each, how to register it.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ._census import storage_identity
from ._format import plural
from ._look import Changed, module_attributes
from ._lookbulk import bulk_children, bulk_look
from ._tree import container_attributes, iter_children

__all__ = ["check_module"]


class _Registered:
    """What ``module.to()`` moves in the tree under inspection, by ``id()``.

    Each set is built the first time a plain attribute needs it, so a clean
    module pays for none of them.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    @functools.cached_property
    def modules(self) -> frozenset[int]:
        return frozenset(map(id, self._module.modules()))

    @functools.cached_property
    def parameters(self) -> frozenset[int]:
        return frozenset(map(id, self._module.parameters()))

    @functools.cached_property
    def buffers(self) -> dict[int, str]:
        """``id()`` -> dotted name, for the message."""
        return {id(buffer): name for name, buffer in self._module.named_buffers()}

    @functools.cached_property
    def memory(self) -> dict[int, str]:
        """Each parameter's and buffer's memory (its storage) -> dotted name."""
        owners: dict[int, str] = {}
        named = [*self._module.named_parameters(), *self._module.named_buffers()]
        for name, tensor in reversed(named):  # the first name wins, as in named_parameters()
            key = storage_identity(tensor)
            if key is not None:
                owners[key] = name
        return owners


def check_module(module: torch.nn.Module) -> list[str]:
    """Find tensors and modules that ``module.to(...)`` will not move.

    ``Module.to`` moves parameters, buffers and registered submodules only. A
    tensor kept as a plain attribute (``self.mask = torch.ones(3)``), or
    tensors and modules kept in a plain ``list`` or ``dict`` attribute, stay
    where they are, and the model fails later with a device mismatch. This
    reports each such attribute with the device it is on and the fix.

    Not reported, because ``module.to()`` does move them: a plain reference to
    a module or a parameter registered elsewhere in ``module`` (both are
    moved in place, so ``self.groups = [self.fc.weight]`` follows; only a
    move to ``meta`` makes new parameters), and an attribute a forward
    pre-hook recomputes on every call (``weight`` after
    ``torch.nn.utils.weight_norm``, ``spectral_norm`` or pruning). A plain
    reference to a registered *buffer* is reported: ``module.to()`` replaces
    buffers, so the reference keeps the old tensor. The walk takes time in
    proportion to the module's size, and a plain attribute that contains
    itself is looked inside once. Builtin lists, tuples, dicts and sets of
    plain values (str, numbers...) inside plain attributes hold no tensor,
    and are passed over in bulk, in C, as
    [`assert_same_device()`][devicekit.assert_same_device] does: a
    tokenizer's 150,000-entry vocabulary costs about 15 ms, not 0.65 s.

    Args:
        module: The model to inspect (all its submodules are inspected too).

    Returns:
        One readable finding per attribute; empty when ``module.to()`` moves
        everything.

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
        raise TypeError(f"check_module() needs a torch.nn.Module, got {type(module).__name__}")
    registered = _Registered(module)
    findings: list[str] = []
    for prefix, submodule in module.named_modules():
        for attr, value in module_attributes(submodule):
            finding = _describe(attr, value, registered)
            if finding is not None:
                findings.append(f"{prefix}.{attr}: {finding}" if prefix else f"{attr}: {finding}")
    return findings


def _describe(attr: str, value: object, registered: _Registered) -> str | None:
    if isinstance(value, torch.Tensor):
        return _describe_tensor(attr, value, registered)
    if isinstance(value, torch.nn.Module):  # set with object.__setattr__ or through __dict__
        if id(value) in registered.modules:
            return None  # a back-reference to a module the tree registers: moved with it
        return (
            f"a {type(value).__name__} module held as a plain attribute, not registered; "
            "module.to() will not move it. Assign it with self.<name> = module to register it."
        )
    if iter_children(value) is None:  # lazily: a vocabulary's 150,000 paths are not made
        return None
    modules, tensors = _leaves(value, registered)
    kind = type(value).__name__
    a_kind = f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"
    if modules:
        return _describe_modules(attr, a_kind, isinstance(value, Mapping), modules)
    if tensors:
        return _describe_tensors(attr, a_kind, isinstance(value, Mapping), tensors)
    return None


def _describe_tensor(attr: str, value: torch.Tensor, registered: _Registered) -> str | None:
    if id(value) in registered.parameters:
        return None  # Module.to() moves a parameter in place: this reference follows
    buffer = registered.buffers.get(id(value))
    if buffer is not None:
        return (
            f"the buffer {buffer!r} held again as a plain attribute; module.to() replaces "
            f"buffers with moved copies, so this one stays the old {value.device} tensor. "
            "Read the buffer through its module instead (a @property can keep this name)."
        )
    key = storage_identity(value)
    owner = None if key is None else registered.memory.get(key)
    if owner is not None:  # a view (self.row = self.fc.weight[0]): a buffer would be a copy
        return (
            f"a {value.device} tensor held as a plain attribute that shares its memory with "
            f"{owner!r} (a view or an alias of it); module.to() gives {owner!r} new memory, "
            f"so this one stays the old {value.device} tensor. Compute it from {owner!r} "
            "where it is used, in forward() or a @property."
        )
    if isinstance(value, torch.nn.Parameter):  # object.__setattr__ hid it from the module
        return (
            f"an nn.Parameter on {value.device} held as a plain attribute, not registered; "
            f"module.to() will not move it, and module.parameters() (so the optimizer) and "
            f"state_dict() leave it out. Register it: self.{attr} = nn.Parameter(...) (a "
            "plain assignment registers it; object.__setattr__ does not), or "
            f"self.register_parameter({attr!r}, ...) in its place."
        )
    return (
        f"a {value.device} tensor held as a plain attribute; module.to() will not move it. "
        f"Use self.register_buffer({attr!r}, ...) (or nn.Parameter if it should be trained)."
    )


def _describe_modules(attr: str, a_kind: str, mapping: bool, modules: list[_Leaf]) -> str:
    shape = _shape(modules)
    if shape == "flat":
        fix = f"Use {'nn.ModuleDict' if mapping else 'nn.ModuleList'}."
    elif shape == "nested":
        fix = (
            "Use nn.ModuleDict for each dict in it and nn.ModuleList for each list, nested "
            "in the same shape (they are modules, so they nest)."
        )
    else:
        fix = (
            "Register each one with self.add_module(name, module), e.g. "
            f"self.add_module({_derived(attr, modules[0].path)!r}, ...)."
        )
    return (
        f"{a_kind} holding {plural(len(modules), 'module')} as a plain attribute; "
        f"module.to() will not move them and their parameters are not registered. {fix}"
    )


def _describe_tensors(attr: str, a_kind: str, mapping: bool, tensors: list[_Leaf]) -> str:
    devices = ", ".join(sorted({str(leaf.value.device) for leaf in tensors}))
    trained = sum(isinstance(leaf.value, torch.nn.Parameter) for leaf in tensors)
    every = trained == len(tensors)
    held = plural(len(tensors), "nn.Parameter" if every else "tensor")
    lost = ""
    if trained:
        them = "them" if every else f"its {plural(trained, 'nn.Parameter')}"
        lost = f", and module.parameters() (so the optimizer) and state_dict() leave {them} out"
    container = "nn.ParameterDict" if mapping else "nn.ParameterList"
    shape = _shape(tensors)
    if shape != "flat":
        first = tensors[0]
        trainable = isinstance(first.value, torch.nn.Parameter)
        call = "register_parameter" if trainable else "register_buffer"
        each = (
            ", with self.register_parameter() for an nn.Parameter and self.register_buffer() "
            "for the others"
            if trained and not every
            else ""
        )
        fix = (
            "nn.ParameterDict and nn.ParameterList register only the tensors directly in them, "
            f"not those inside {'nested containers' if shape == 'nested' else a_kind}: "
            "register each tensor under a name made from its place, e.g. "
            f"self.{call}({_derived(attr, first.path)!r}, ...){each}."
        )
    elif every:
        fix = f"Use {container} to register them."
    elif trained:
        fix = (
            f"Use {container} for trainable tensors, or register each one: "
            "self.register_parameter() for an nn.Parameter, self.register_buffer() for the others."
        )
    else:
        fix = (
            f"Use {container} for trainable tensors, or register each one with "
            "self.register_buffer()."
        )
    return (
        f"{a_kind} of {held} on {devices} held as a plain attribute; module.to() will not move "
        f"them{lost}. {fix}"
    )


def _shape(leaves: Sequence[_Leaf]) -> str:
    """How deep the leaves sit in their container.

    ``"flat"``: each is an item of the container itself (what nn.ParameterDict,
    nn.ParameterList, nn.ModuleDict and nn.ModuleList hold); ``"nested"``: items
    of items; ``"other"``: some are attributes (a dataclass's fields) or set members.
    """
    if not all(leaf.items_only for leaf in leaves):
        return "other"
    return "flat" if all(leaf.depth == 1 for leaf in leaves) else "nested"


def _derived(attr: str, path: str) -> str:
    """A name for ``register_buffer()`` made from an attribute and a path in it."""
    return re.sub(r"\W+", "_", f"{attr}{path}").strip("_") or attr


class _Leaf(NamedTuple):
    """A tensor or module found in a plain attribute, and where."""

    path: str
    """Its path in the attribute (``['a'][0]``)."""
    value: Any
    depth: int
    """How many containers down: 1 for an item of the attribute itself."""
    items_only: bool
    """Whether every step down was to an item (``[key]``), none to an attribute or set member."""


def _leaves(value: object, registered: _Registered) -> tuple[list[_Leaf], list[_Leaf]]:
    """The modules and tensors inside a plain container that ``module.to()`` will not move.

    Each object is visited once, so a container that holds itself (or one
    object twice) ends the walk instead of raising or counting twice; the walk
    uses its own stack, so depth is no limit.
    """
    modules: list[_Leaf] = []
    tensors: list[_Leaf] = []
    seen: set[int] = set()
    stack = [_Leaf("", value, 0, True)]
    while stack:
        leaf = stack.pop()
        item = leaf.value
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if id(item) not in registered.parameters:
                tensors.append(leaf)
        elif isinstance(item, torch.nn.Module):
            if id(item) not in registered.modules:
                modules.append(leaf)
        else:
            stack.extend(
                _Leaf(
                    leaf.path + suffix, child, leaf.depth + 1, leaf.items_only and suffix[0] == "["
                )
                for suffix, child in reversed(_elements(item))
            )
    return modules, tensors


def _elements(item: object) -> list[tuple[str, Any]]:
    """What the walk reads inside ``item``: its elements, but none that are plain data.

    A builtin list, tuple, dict or set of plain values (a tokenizer's
    vocabulary, its merges) holds no tensor, and is passed over in bulk, in C
    (`bulk_look()`): 150,000 entries in milliseconds, where reading each one
    took half a second. One that holds something else as well is read
    without its plain values (`bulk_children()`).
    """
    try:
        bulk = bulk_look(item, sys.maxsize)  # no budget: the walk reads the whole module
        if bulk is None:
            return list(iter_children(item) or ())
        if bulk[1]:  # nothing inside but what its instance was given, if anything
            return [(f".{name}", value) for name, value in container_attributes(item)]
        return list(bulk_children(item))
    except Changed as error:  # another thread kept changing it: no finding from a part
        raise RuntimeError(
            f"check_module() cannot look inside a plain attribute: {error}"
        ) from None
