"""Where each tensor was made: the recorder `find_leaks` runs while it calls ``fn``.

A ``TorchFunctionMode`` that notes, for every tensor a torch function
returns, the first line of the user's own code on the stack (and the line of
an installed package inside it, if any). It stays out of ``torch.compile``'s
way: while Dynamo traces, it does nothing (a frame walk would break the graph),
so tensors made by compiled code have no line.
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._frames import is_installed, is_user

__all__ = ["CreationSites", "Site"]

# Where a tensor was made: (the user's own line, the line in an installed package that
# made it when the user's line called into one, else None).
Site = tuple[str, "str | None"]

_OWN, _LIBRARY, _SKIPPED, _GENERATED = range(4)
# Code that torch.compile generated: FX graphs have no file, Inductor writes its own.
_FX_GRAPH = "<eval_with_key>"
_INDUCTOR_CACHE = os.sep + "torchinductor_"


def _kind(filename: str) -> int:
    """Whose code a frame in ``filename`` runs: the user's, a library's, torch's or generated."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if filename.startswith(_FX_GRAPH) or _INDUCTOR_CACHE in filename:
        return _GENERATED
    if cache and filename.startswith(os.path.join(cache, "")):
        return _GENERATED
    if not is_user(filename):
        return _SKIPPED
    return _LIBRARY if is_installed(filename) else _OWN


class CreationSites(TorchFunctionMode):
    """Notes the user's line for every tensor a torch function returns while it is active.

    Sites are kept in a plain dict keyed by ``id(tensor)``, each with a weak
    reference that tells the tensor from a later one at the same address:
    a census looks up every live tensor, and torch's weak-key dictionaries
    cost 4 µs a look-up there (10,000 tensors leaked per call: 9 s for 12
    calls, against 0.26 s for the calls alone). Entries of dead tensors are
    dropped whenever the dict has doubled since the last sweep.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[int, tuple[weakref.ref[torch.Tensor], Site]] = {}
        self._sweep_at = _FIRST_SWEEP
        self._kinds: dict[str, int] = {}  # filename -> _kind(filename), asked once per file

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        # Dynamo traces this method into every graph torch.compile makes while it is active:
        # the frame walk below would break the graph (an error under fullgraph=True).
        # Compiled code is left as it is, and its tensors have no line.
        if torch.compiler.is_compiling():
            return result
        # In-place ops return their input, and getters (.grad, .data) an existing tensor:
        # neither creates one, so neither is a creation site.
        if getattr(func, "__name__", "") == "__get__" or (args and result is args[0]):
            return result
        if isinstance(result, torch.Tensor):
            self._note(result)
        elif isinstance(result, (tuple, list)):
            for item in result:
                if isinstance(item, torch.Tensor):
                    self._note(item)
        return result

    def _note(self, tensor: torch.Tensor) -> None:
        seen = self.sites.get(id(tensor))
        if seen is not None and seen[0]() is tensor:
            return  # an existing tensor returned again: its first line stays
        where = self._site(sys._getframe(2))  # skip _note and __torch_function__
        if where is None:
            return
        if len(self.sites) >= self._sweep_at:
            self.sites = {key: entry for key, entry in self.sites.items() if entry[0]() is not None}
            self._sweep_at = max(_FIRST_SWEEP, 2 * len(self.sites))
        self.sites[id(tensor)] = (weakref.ref(tensor), where)

    def _site(self, frame: types.FrameType | None) -> Site | None:
        """The first frame of the user's own code, and the library line inside, if any."""
        library = None
        kinds = self._kinds
        while frame is not None:
            filename = frame.f_code.co_filename
            kind = kinds.get(filename)
            if kind is None:
                kind = kinds[filename] = _kind(filename)
            if kind == _OWN:
                return f"{filename}:{frame.f_lineno}", library
            if kind == _LIBRARY and library is None:
                library = f"{filename}:{frame.f_lineno}"
            elif kind == _GENERATED:
                return None  # made by compiled code: no line of the user's made it
            frame = frame.f_back
        # Only installed packages' code on the stack (a console script): the library line.
        return None if library is None else (library, None)

    def site(self, tensor: torch.Tensor) -> Site | None:
        """Where ``tensor`` was created; None when it was not seen."""
        entry = self.sites.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None


_FIRST_SWEEP = 2**16  # entries before the first sweep of dead tensors' (a few MB)
