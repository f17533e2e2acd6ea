"""``to_device`` while ``torch.compile`` traces it: a walk that dynamo can follow.

The eager walk (`_mover`) counts references (``sys.getrefcount``), keeps a
mover per thread (``threading.local``) and weak dictionaries. Dynamo traces
none of those: a compiled step that moved its batch broke its graph three
times, and ``fullgraph=True`` refused it. While dynamo traces, `traced_move`
rebuilds what nearly every batch is made of (plain dicts, lists, tuples and
namedtuples) and moves each tensor with the same copy policy, a tensor reached
twice once. Anything else is handed to the eager walk through
``torch.compiler.disable``: a graph break there, as before, never a result
that differs from eager's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["traced_move"]

_LEAVES = (str, bytes, int, float, complex, bool, type(None))
_outside_graph: Callable[..., Any] = torch.compiler.disable  # unannotated in torch


def traced_move(
    obj: Any,
    device: torch.device,
    non_blocking: bool | None,
    eager: Callable[..., Any],
) -> Any:
    """``obj`` with every tensor moved to ``device``, as `to_device` does, in a form dynamo traces.

    ``eager``: `to_device` itself, run outside the graph for an object this walk
    does not rebuild (a dataclass, a module, a ``dict`` subclass...).
    """
    # The copy policy of to_device: a copy to the host blocks (here always, so it is
    # safe to read with no synchronize to trace); any other copy does not, unless forced.
    keyword = device.type != "cpu" and non_blocking is not False
    memo: dict[int, torch.Tensor] = {}  # id -> moved: a tensor reached twice, one copy

    def move(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            key = id(item)
            if key not in memo:
                memo[key] = item.to(device, non_blocking=True) if keyword else item.to(device)
            return memo[key]
        cls = type(item)
        if cls is dict:
            return {name: move(value) for name, value in item.items()}
        if cls is list:
            return [move(value) for value in item]
        if cls is tuple:
            return tuple(move(value) for value in item)
        if cls.__bases__ == (tuple,) and isinstance(getattr(cls, "_fields", None), tuple):
            # A namedtuple, not a subclass: made by its own __new__, which takes the
            # fields (dynamo in torch 2.6 does not trace its _make).
            return cls(*[move(value) for value in item])
        if isinstance(item, _LEAVES):
            return item
        options = {} if non_blocking is None else {"non_blocking": non_blocking}
        return _outside_graph(eager)(item, device, **options)

    return move(obj)
