"""``to_device`` while ``torch.compile`` traces it: a walk that dynamo can follow.

The eager walk (`_mover`) counts references (``sys.getrefcount``), keeps a
mover per thread (``threading.local``) and weak dictionaries. Dynamo traces
none of those: a compiled step that moved its batch broke its graph three
times, and ``fullgraph=True`` refused it. While dynamo traces, `traced_move`
rebuilds what nearly every batch is made of (plain dicts, lists, tuples and
namedtuples) and moves each tensor with the same copy policy, a tensor reached
twice once. A batch that holds anything else goes whole to the eager walk,
through ``torch.compiler.disable``: a graph break there, as before, and
eager's result, its sharing included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._tree import is_namedtuple

__all__ = ["traced_move"]

_LEAVES = (str, bytes, int, float, complex, bool, type(None))
_outside_graph: Callable[..., Any] = torch.compiler.disable  # unannotated in torch
_DEPTH = 8  # deeper nesting (a cycle, most likely) goes to the eager walk: dynamo recurses


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
    if not _plain(obj):  # the whole batch to the eager walk: one memo, eager's result
        options = {} if non_blocking is None else {"non_blocking": non_blocking}
        return _outside_graph(eager)(obj, device, **options)
    # The copy policy of to_device: a copy to the host blocks (here always, so it is
    # safe to read with no synchronize to trace); any other copy does not, unless forced.
    keyword = device.type != "cpu" and non_blocking is not False
    # (original, moved): a tensor reached twice is moved once. Compared with `is`, never
    # by id(): dynamo guards on an id, so every new batch would compile the step again.
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            for original, moved in seen:
                if original is item:
                    return moved
            moved = item.to(device, non_blocking=True) if keyword else item.to(device)
            seen.append((item, moved))
            return moved
        cls = type(item)
        if cls is dict:
            return {name: move(value) for name, value in item.items()}
        if cls is list:
            return [move(value) for value in item]
        if cls is tuple:
            return tuple(move(value) for value in item)
        if _namedtuple(item):  # made by its own __new__ (dynamo in torch 2.6 skips _make)
            return cls(*[move(value) for value in item])
        return item  # a leaf: _plain let nothing else through

    return move(obj)


def _namedtuple(obj: Any) -> bool:
    """Whether ``obj`` is a namedtuple of a class made so, not of a subclass of one."""
    return is_namedtuple(obj) and type(obj).__bases__ == (tuple,)


def _plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` is made of tensors, leaves and plain containers only, not too deep.

    Read while dynamo traces (once per graph, not per call). Anything else
    sends the whole batch to the eager walk: a tensor it shares with a plain
    part is then moved once, and a module's parameter comes back as the
    module's own, as eager gives them. Nesting deeper than `_DEPTH` (a cycle:
    dynamo in torch 2.6 takes no ``id()`` of a dict) gets eager's answer too,
    ``ValueError`` for a cycle.
    """
    if isinstance(obj, torch.Tensor):
        return type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter)
    if isinstance(obj, _LEAVES):
        return True
    cls = type(obj)
    if cls is not dict and cls is not list and cls is not tuple and not _namedtuple(obj):
        return False
    if depth >= _DEPTH:
        return False
    values = obj.values() if cls is dict else obj
    return all(_plain(value, depth + 1) for value in values)
