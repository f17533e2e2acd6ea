"""to_device with a dict view (batch.values(), .items(), .keys()) in obj.

A view shows its dict, which to_device never changes: it cannot be rebuilt to show
the moved tensors, and a list in its place would change its type without a word.
Before, one was returned as it was, its tensors left behind, with no warning.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _mover

META = torch.device("meta")


def _batch() -> dict[str, Any]:
    return {"input_ids": torch.ones(2, 3), "labels": torch.zeros(2)}


@pytest.mark.parametrize(
    ("view", "kind", "inside", "method"),
    [
        (lambda b: b.values(), "dict_values", "[0]", "values"),
        (lambda b: b.items(), "dict_items", "[0][1]", "items"),
        (lambda b: collections.OrderedDict(b).values(), "odict_values", "[0]", "values"),
        (lambda b: collections.UserDict(b).items(), "ItemsView", "[0][1]", "items"),
    ],
    ids=["values", "items", "OrderedDict", "UserDict"],
)
def test_a_dict_view_holding_a_tensor_off_the_target_is_refused(
    view: Any, kind: str, inside: str, method: str
) -> None:
    batch = _batch()
    with pytest.raises(TypeError) as caught:
        dk.to_device(view(batch), META)
    assert str(caught.value) == (
        f"to_device() cannot move obj, a dict view ({kind}): it holds a tensor not on meta "
        f"(list(obj){inside}), and a dict view cannot be rebuilt: it shows its dict, which "
        "to_device() never changes, and a list in its place would change its type without "
        f"a word. Pass the dict itself, to_device(batch, device), and take .{method}() of "
        "what it returns (or list(...) of the view, where a list is what you need)."
    )
    assert all(t.is_cpu for t in batch.values())  # nothing changed
    moved = dk.to_device(batch, META)  # what the message says, and the mover is free again
    assert all(t.is_meta for t in moved.values())
    assert not any(mover.busy for mover in _mover._local.movers.values())


@dataclasses.dataclass
class Holder:
    views: Any


def test_a_view_inside_obj_is_named_by_its_path() -> None:
    batch = _batch()
    with pytest.raises(TypeError, match=r"cannot move obj\['x'\]\[1\]\['v'\], a dict view "):
        dk.to_device({"x": [torch.ones(1), {"v": batch.values()}]}, META)
    with pytest.raises(TypeError, match=r"cannot move obj\.views, a dict view \(dict_items\)"):
        dk.to_device(Holder(batch.items()), META)


def test_a_view_holding_a_module_off_the_target_is_refused_and_the_module_left() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"not on meta \(list\(obj\)\[0\]\.weight\)"):
        dk.to_device({"model": model}.values(), META)
    assert model.weight.is_cpu


def test_a_keys_view_of_tensors_says_keys_are_never_moved() -> None:
    with pytest.raises(TypeError, match=r"A dict's keys are never moved: key the dict by str"):
        dk.to_device({torch.ones(1): "a"}.keys(), META)


def test_a_view_with_nothing_to_move_is_returned_as_it_is() -> None:
    batch = _batch()
    keys = batch.keys()
    assert dk.to_device(keys, META) is keys  # str keys: nothing is left behind
    values = batch.values()
    assert dk.to_device(values, "cpu") is values  # already on the target
    moved = dk.to_device({"x": torch.ones(1), "names": keys}, META)
    assert moved["names"] is keys
    assert moved["x"].is_meta


class _Unreadable(Mapping[str, Any]):
    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("no")

    def __iter__(self) -> Iterator[str]:
        return iter(["a"])

    def __len__(self) -> int:
        return 1


def test_a_view_that_cannot_be_read_is_returned_as_it_is() -> None:
    view = _Unreadable().values()  # as any object whose look fails: found nothing
    assert dk.to_device(view, META) is view


def test_a_view_before_a_cycle_is_named_without_looping() -> None:
    from devicekit._tree import path_of  # here: the rest of this file runs on older trees

    batch = _batch()
    looped: dict[str, Any] = {"v": batch.values()}
    looped["self"] = looped
    with pytest.raises(TypeError, match=r"cannot move obj\['v'\], a dict view"):
        dk.to_device(looped, META)
    assert path_of(looped, batch, "obj") is None  # not in it: no loop either
    assert path_of(looped, looped["v"], "obj") == "obj['v']"
