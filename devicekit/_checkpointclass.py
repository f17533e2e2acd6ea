"""A checkpoint that names a class this program lacks: `missing_class()`.

Pickle saves an object by its class's name, not its code. A training script
that saves an object of a class it defines itself (``torch.save(model)``, a
``Config`` dataclass) writes ``__main__.Config``, and ``__main__`` is
whichever script runs: another script that loads it has no such class. With
``weights_only=False`` the unpickler says only *"Can't get attribute 'Config'
on <module '__main__' ...>"*; with ``weights_only=True`` torch refuses the
class and advises that re-running with ``weights_only=False`` "will likely
succeed", which it will not. `missing_class` tells both, names the class and
says how to provide it, or to save plain data instead.
"""

from __future__ import annotations

import pickle
import re
import sys

__all__ = ["missing_class"]

# How pickle says the class a checkpoint names is missing, and how a weights_only
# refusal names the class it met (its module and name, joined by dots).
_CANT_GET = re.compile(r"Can't get attribute '([^']+)' on <module '([^']+)'")
_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_PLAIN = "save a state_dict() and plain types (dict, list, str, numbers), which load anywhere"
_MISSING = object()


def missing_class(error: BaseException) -> str | None:
    """Which class the checkpoint names that this program lacks, and the fix; None if not that.

    Of an ``AttributeError`` or a ``ModuleNotFoundError`` from the unpickler,
    or of a ``weights_only`` refusal (an ``UnpicklingError``) of a class that
    this program lacks too.
    For a refusal, only modules already imported are looked in: importing
    one that an untrusted file names would run its code.

    Examples:
        >>> missing_class(AttributeError("Can't get attribute 'Config' on <module '__main__'>"))
        "the checkpoint holds a __main__.Config, ... Define or import Config in the script ..."
        >>> missing_class(AttributeError("'NoneType' object has no attribute 'x'")) is None
        True
    """
    if isinstance(error, ModuleNotFoundError) and error.name:
        return (
            f"the checkpoint holds an object of a class from the module {error.name}, which "
            "this program cannot import (pickle saves an object by its class's name, not its "
            f"code). Install {error.name}, or run from the folder of the code that saved it (or "
            f"add that folder to sys.path), or {_PLAIN}"
        )
    if isinstance(error, AttributeError):
        found = _CANT_GET.search(str(error))
        if found is None:
            return None
        name, module = found.groups()
        return f"{_lacks(module, name)}. {_provide(module, name)}, or {_PLAIN}"
    found = _GLOBAL.search(str(error)) if isinstance(error, pickle.UnpicklingError) else None
    if found is None:
        return None
    dotted = found.group(1)
    module = next((m for m in _prefixes(dotted) if m in sys.modules), None)
    if module is None:
        return None
    name = dotted[len(module) + 1 :]
    target: object = sys.modules[module]
    for part in name.split("."):
        target = getattr(target, part, _MISSING)
    if target is not _MISSING:
        return None  # torch's advice holds: the class is here
    return (
        f"{_lacks(module, name)}; weights_only=True does not load it, and weights_only=False "
        "would fail too (torch's advice that it will likely succeed does not hold here): "
        f"both need the class. {_provide(module, name)}; then, if you trust the file, allow "
        f"it with torch.serialization.add_safe_globals([{name}]) or pass weights_only=False. "
        f"Or {_PLAIN}"
    )


def _prefixes(dotted: str) -> list[str]:
    """The module names a dotted name may start with, the longest first.

    Examples:
        >>> _prefixes("a.b.C")
        ['a.b', 'a']
    """
    parts = dotted.split(".")
    return [".".join(parts[:count]) for count in range(len(parts) - 1, 0, -1)]


def _lacks(module: str, name: str) -> str:
    """That the checkpoint holds a class ``module`` lacks, and how that comes about."""
    file = getattr(sys.modules.get(module), "__file__", None)
    where = f" ({file})" if isinstance(file, str) else ""
    if module == "__main__":
        return (
            f"the checkpoint holds a __main__.{name}, a class of the script that saved it "
            "(pickle saves an object by its class's name, not its code), but this program's "
            f"__main__{where} has no {name}"
        )
    return (
        f"the checkpoint holds a {module}.{name}, but the module {module}{where} has no "
        f"{name}: it was renamed, moved or removed since the checkpoint was saved (pickle "
        "saves an object by its class's name, not its code)"
    )


def _provide(module: str, name: str) -> str:
    """How to give ``module`` the class back."""
    if module == "__main__":
        return f"Define or import {name} in the script you run, before load()"
    return f"Make {module}.{name} importable again (an alias in {module} will do)"
