"""A module's submodules and tensors, read from its registries without hashing a module.

torch's ``named_modules()`` (and so ``parameters()``, ``buffers()`` and their
named forms) keeps the modules it has seen in a ``set``. A module class that
defines ``__eq__`` and no ``__hash__`` (a ``@dataclass`` module, whose
``eq=True`` default sets ``__hash__`` to None) cannot go in one, and the walk
raises a bare ``TypeError: unhashable type``. ``Module.to`` itself never
hashes the module it is called on, so ``model.to(device)`` works for one
whose submodules hash: devicekit's own walks must not fail where it works.
They keep the modules seen by ``id()`` instead, in torch's order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

from ._errors import add_note
from ._format import plural
from ._shortrepr import got

__all__ = [
    "held_tensors",
    "named_held",
    "named_submodules",
    "not_a_module",
    "unhashable",
    "unhashable_note",
]


def named_submodules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``module.named_modules()``: each module once, depth first, with its dotted path.

    Examples:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [path for path, _ in named_submodules(model)]
        ['', '0', '1']
    """
    try:
        return list(module.named_modules())  # torch's own walk: 1.4x faster than the one below
    except TypeError:  # a module that cannot be hashed: walked again, keyed by id()
        pass
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    while stack:
        path, submodule = stack.pop()
        if id(submodule) in seen:  # reached by a second path: the first one names it
            continue
        seen.add(id(submodule))
        found.append((path, submodule))
        children = [
            (f"{path}.{name}" if path else name, child)
            for name, child in submodule._modules.items()
            if child is not None
        ]
        stack.extend(reversed(children))  # the first child is walked first
    return found


def named_held(
    module: torch.nn.Module, *kinds: Literal["_parameters", "_buffers"]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.named_parameters()``, then ``named_buffers()``, as ``kinds`` name them.

    Each tensor once per kind, under its first name; the modules walked once.
    """
    submodules = named_submodules(module)
    for kind in kinds:
        seen: set[int] = set()
        for path, submodule in submodules:
            for name, tensor in getattr(submodule, kind).items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    yield (f"{path}.{name}" if path else name), tensor


def held_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Each parameter, then each buffer, of ``module`` and its submodules, once."""
    return (tensor for _, tensor in named_held(module, "_parameters", "_buffers"))


def not_a_module(value: object, *, call: str) -> TypeError:
    """The error of ``call`` (``"check_module(module)"``) given ``value``, which is no module.

    Examples:
        >>> print(not_a_module(torch.nn.Linear, call="check_module(module)"))
        check_module(module) needs a torch.nn.Module, got the class Linear itself; make one \
and pass it: check_module(Linear(...))
    """
    name = call.split("(", 1)[0]
    modules = _modules_in(value)
    if isinstance(value, type) and issubclass(value, torch.nn.Module):
        fix = f"got the class {value.__name__} itself; make one and pass it: "
        fix += f"{name}({value.__name__}(...))"
    elif isinstance(value, torch.Tensor):
        fix = f"got a tensor; pass the model that uses it: {name}(model)"
    elif modules:
        fix = (
            f"got a {type(value).__name__} of {plural(modules, 'module')}; pass one at a time: "
            f"[{name}(each) for each in "
            f"{'models.values()' if isinstance(value, dict) else 'models'}]"
        )
    else:
        fix = f"got {got(value)}; pass the model: {name}(model)"
    return TypeError(f"{call} needs a torch.nn.Module, {fix}")


def _modules_in(value: object) -> int:
    """How many modules a list, tuple or dict of nothing but modules holds; else 0."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)) or not value:
        return 0
    return len(value) if all(isinstance(each, torch.nn.Module) for each in value) else 0


def unhashable_note(error: TypeError, module: torch.nn.Module) -> None:
    """Add the fix to ``error`` (torch's own walk failed) where an unhashable module caused it."""
    if "unhashable type" not in str(error):
        return
    for path, submodule in named_submodules(module)[1:]:  # Module.to never hashes the root
        wrong = unhashable(submodule)
        if wrong is not None:
            add_note(error, f"{path}: {wrong}")
            break


def unhashable(module: torch.nn.Module) -> str | None:
    """What is wrong with ``module``'s class, and the fix, where it cannot be hashed; else None."""
    cls = type(module)
    hash_method: object = cls.__hash__  # None where __eq__ is defined alone
    if hash_method is not None:
        return None
    return (
        f"{cls.__name__} defines __eq__ and no __hash__ (a @dataclass does, unless eq=False); "
        "torch keeps the modules it walks in a set, so .parameters() (so an optimizer) and "
        ".to() of a model that holds it raise TypeError. Declare it "
        "@dataclass(eq=False), or add `__hash__ = torch.nn.Module.__hash__` to class "
        + cls.__name__
    )
