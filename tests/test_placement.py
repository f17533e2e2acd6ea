from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import pytest
import torch

import devicekit as dk
from devicekit import _dataparallel, _movecalls, _movemodule, _mover, _movewarn, _refcounts
from devicekit._tree import children

from .conftest import FakeAccelerator

META = torch.device("meta")


def on(device: torch.device | str, obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.device == torch.device(device)


class Pair(NamedTuple):
    left: torch.Tensor
    right: Any


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    cached: torch.Tensor | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cached", self.x * 2)


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    x: torch.Tensor


class HasTo:
    """A user type with its own .to(), such as HF's BatchEncoding."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.calls: list[torch.device] = []

    def to(self, device: torch.device) -> HasTo:
        self.calls.append(device)
        return HasTo(self.tensor.to(device))


# --- containers keep their types -----------------------------------------------------


def test_tensor() -> None:
    assert on(META, dk.to_device(torch.ones(2), META))


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_device_given_as_string_or_device(device: str | torch.device) -> None:
    assert on(META, dk.to_device(torch.ones(1), device))


def test_dict_list_tuple_nesting() -> None:
    batch = {"a": [torch.ones(1), (torch.zeros(2), 3, "text", None)], "b": {"c": torch.ones(3)}}
    moved = dk.to_device(batch, META)
    assert type(moved) is dict
    assert type(moved["a"]) is list
    assert type(moved["a"][1]) is tuple
    assert on(META, moved["a"][0])
    assert on(META, moved["a"][1][0])
    assert moved["a"][1][1:] == (3, "text", None)
    assert on(META, moved["b"]["c"])
    assert on("cpu", batch["a"][0])  # the input is not changed


def test_ordered_dict_keeps_order() -> None:
    ordered = collections.OrderedDict([("z", torch.ones(1)), ("a", torch.ones(1))])
    moved = dk.to_device(ordered, META)
    assert type(moved) is collections.OrderedDict
    assert list(moved) == ["z", "a"]
    assert all(on(META, t) for t in moved.values())


def test_defaultdict_keeps_its_factory() -> None:
    counts: collections.defaultdict[str, Any] = collections.defaultdict(list)
    counts["x"] = torch.ones(1)
    moved = dk.to_device(counts, META)
    assert type(moved) is collections.defaultdict
    assert moved.default_factory is list
    assert on(META, moved["x"])
    assert moved["missing"] == []


def test_other_mappings_are_rebuilt_with_their_type() -> None:
    proxy = types.MappingProxyType({"x": torch.ones(1)})
    moved = dk.to_device(proxy, META)
    assert type(moved) is types.MappingProxyType
    assert on(META, moved["x"])
    user = collections.UserDict({"x": torch.ones(1)})
    assert on(META, dk.to_device(user, META)["x"])


def test_namedtuple_and_nested_namedtuple() -> None:
    pair = Pair(torch.ones(1), Pair(torch.ones(1), "leaf"))
    moved = dk.to_device(pair, META)
    assert type(moved) is Pair
    assert type(moved.right) is Pair
    assert on(META, moved.left)
    assert on(META, moved.right.left)
    assert moved.right.right == "leaf"


def test_structseq_from_torch_return_types() -> None:
    result = torch.max(torch.randn(3, 2), dim=0)
    moved = dk.to_device(result, META)
    assert type(moved) is type(result)
    assert on(META, moved.values)
    assert on(META, moved.indices)


def test_sets_of_tensors() -> None:
    moved = dk.to_device({torch.ones(1)}, META)
    assert type(moved) is set
    assert all(on(META, t) for t in moved)
    frozen = dk.to_device(frozenset({torch.ones(1), torch.zeros(1)}), META)
    assert type(frozen) is frozenset
    assert len(frozen) == 2
    assert all(on(META, t) for t in frozen)


def test_list_subclass_keeps_type_and_state() -> None:
    class Tagged(list):  # type: ignore[type-arg]
        tag = "kept"

    items = Tagged([torch.ones(1)])
    items.tag = "instance"  # type: ignore[misc]
    moved = dk.to_device(items, META)
    assert type(moved) is Tagged
    assert moved.tag == "instance"
    assert on(META, moved[0])


def test_dataclass_is_rebuilt_not_mutated() -> None:
    batch = Batch(torch.ones(1), {"mask": torch.zeros(1)})
    moved = dk.to_device(batch, META)
    assert type(moved) is Batch
    assert moved is not batch
    assert on(META, moved.x)
    assert on(META, moved.meta["mask"])
    assert on("cpu", batch.x)


def test_a_batch_already_there_shares_no_container_with_the_input() -> None:
    # The docs' rule: a write into the result never reaches the input, on any device,
    # so a script behaves alike on the host and on a GPU; tensors come back as themselves.
    t = torch.ones(1)
    batch = {
        "x": [t],
        "d": Batch(t, {"mask": t}),
        "od": collections.OrderedDict(a=t),
        "q": collections.deque([t]),
    }
    moved = dk.to_device(batch, "cpu")
    assert moved is not batch
    for key in ("x", "d", "od", "q"):
        assert moved[key] is not batch[key]
    assert moved["d"].meta is not batch["d"].meta
    moved["x"].append(t)
    moved["d"].meta["new"] = t
    assert batch["x"] == [t]
    assert list(batch["d"].meta) == ["mask"]
    assert moved["x"][0] is t
    assert moved["d"].x is t


def test_frozen_dataclass_moves_every_field_including_init_false() -> None:
    frozen = Frozen(torch.ones(2))
    moved = dk.to_device(frozen, META)
    assert type(moved) is Frozen
    assert on(META, moved.x)
    assert on(META, moved.cached)  # init=False fields are not skipped
    assert on("cpu", frozen.x)


def test_slotted_frozen_dataclass() -> None:
    moved = dk.to_device(Slotted(torch.ones(1)), META)
    assert type(moved) is Slotted
    assert on(META, moved.x)


@dataclasses.dataclass
class Masked:
    """What ``__post_init__`` often computes: attributes that are not fields."""

    x: torch.Tensor

    def __post_init__(self) -> None:
        self.mask = self.x > 0
        self.alias = self.x  # one tensor under two names
        self._cache = {"squares": [self.x * self.x]}
        self.label = "a"

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


def test_attributes_that_are_not_fields_are_moved_with_the_fields() -> None:
    batch = Masked(torch.ones(2))
    cache = batch._cache
    assert on("cpu", batch.doubled)  # cached on the input
    moved = dk.to_device(batch, META)
    assert on(META, moved.x)
    assert on(META, moved.mask)  # not left on the CPU beside a moved x
    assert moved.alias is moved.x  # shared as in the input
    assert on(META, moved._cache["squares"][0])
    assert moved.label == "a"
    assert "doubled" not in vars(moved)  # dropped, not moved: computed again
    assert on(META, moved.doubled)
    assert dk.assert_same_device(moved) == META  # nothing inside it stayed behind
    assert on("cpu", batch.mask)  # the input is untouched
    assert batch._cache is cache
    assert on("cpu", cache["squares"][0])


def test_an_attribute_shares_its_tensor_with_the_rest_of_the_batch() -> None:
    batch = Masked(torch.ones(2))
    moved: dict[str, Any] = dk.to_device({"batch": batch, "mask": batch.mask}, META)
    assert moved["mask"] is moved["batch"].mask


@dataclasses.dataclass(frozen=True)
class FrozenMasked:
    x: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask", self.x > 0)


class CacheSlot:
    __slots__ = ("_cache",)
    _cache: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class SlottedMasked(CacheSlot):
    x: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cache", self.x > 0)


def test_frozen_and_slotted_dataclasses_move_their_other_attributes() -> None:
    frozen = FrozenMasked(torch.ones(1))
    moved = dk.to_device(frozen, META)
    assert on(META, moved.mask)  # type: ignore[attr-defined]
    assert on("cpu", frozen.mask)  # type: ignore[attr-defined]
    slotted = SlottedMasked(torch.ones(1))
    moved_slotted = dk.to_device(slotted, META)
    assert on(META, moved_slotted._cache)  # a slot of a base class, not a field
    assert on("cpu", slotted._cache)


T = TypeVar("T")


@dataclasses.dataclass
class Typed(Generic[T]):
    x: torch.Tensor


def test_python_s_own_attributes_are_not_the_user_s_state() -> None:
    box = Typed[int](torch.ones(1))  # sets box.__orig_class__, Python's own
    assert [suffix for suffix, _ in children(box) or []] == [".x"]
    moved = dk.to_device(box, META)
    assert moved.__orig_class__ is box.__orig_class__  # type: ignore[attr-defined]
    assert on(META, moved.x)


@dataclasses.dataclass
class Holder:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.model = torch.nn.Linear(1, 1)


def test_a_module_held_as_an_attribute_is_moved_as_a_field_holding_it_would_be() -> None:
    holder = Holder(torch.ones(1))
    moved = dk.to_device(holder, META)
    assert moved.model is holder.model  # moved in place, as Module.to does
    assert on(META, holder.model.weight)


@dataclasses.dataclass
class Node:
    children: list[Node]

    def __post_init__(self) -> None:
        for child in self.children:
            child._parent = self  # type: ignore[attr-defined]


def test_a_back_reference_in_an_attribute_is_a_cycle_named_by_its_path() -> None:
    # The copy's children would point back at the input, with its old tensors.
    with pytest.raises(ValueError, match=r"obj\.children\[0\]\._parent is obj\."):
        dk.to_device(Node([Node([])]), META)


# --- container subclasses: what they hold besides their items ----------------------------


class BatchDict(dict[str, Any]):
    pass


class BatchList(list[Any]):
    pass


class BatchTuple(tuple[Any, ...]):
    pass


class BatchSet(set[Any]):
    pass


class BatchFrozenSet(frozenset[Any]):
    pass


class BatchUserDict(collections.UserDict[str, Any]):
    pass


class BatchUserList(collections.UserList[Any]):
    pass


class BatchOrdered(collections.OrderedDict[str, Any]):
    pass


class BatchDefault(collections.defaultdict[str, Any]):
    pass


class BatchCounter(collections.Counter[str]):
    pass


class BatchDeque(collections.deque[Any]):
    pass


class BatchChain(collections.ChainMap[str, Any]):
    pass


class BatchPoint(collections.namedtuple("BatchPoint", "x y")):
    """Without ``__slots__ = ()``: its instances have a __dict__."""


CONTAINERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "dict": lambda x: BatchDict(x=x),
    "list": lambda x: BatchList([x]),
    "tuple": lambda x: BatchTuple([x]),
    "set": lambda x: BatchSet([x]),
    "frozenset": lambda x: BatchFrozenSet([x]),
    "UserDict": lambda x: BatchUserDict(x=x),
    "UserList": lambda x: BatchUserList([x]),
    "OrderedDict": lambda x: BatchOrdered(x=x),
    "defaultdict": lambda x: BatchDefault(list, x=x),
    "Counter": lambda x: BatchCounter({"x": x}),
    "deque": lambda x: BatchDeque([x]),
    "ChainMap": lambda x: BatchChain({"x": x}),
    "namedtuple": lambda x: BatchPoint(x, "label"),
    "exact OrderedDict": lambda x: collections.OrderedDict(x=x),  # takes attributes too
    "exact Counter": lambda x: collections.Counter({"x": x}),
}


@pytest.mark.parametrize("make", CONTAINERS.values(), ids=CONTAINERS.keys())
def test_container_subclasses_move_what_they_hold_besides_their_items(
    make: Callable[[torch.Tensor], Any],
) -> None:
    x = torch.ones(2)
    batch = make(x)
    batch.lengths = torch.tensor([2])
    batch._cache = {"sums": [torch.ones(1)]}
    batch.label = "a"
    moved = dk.to_device(batch, META)
    assert type(moved) is type(batch)
    assert on(META, moved.lengths)  # not left on the CPU beside moved items
    assert on(META, moved._cache["sums"][0])
    assert moved.label == "a"
    assert dk.assert_same_device(moved=moved) == META  # nothing inside it stayed behind
    assert on("cpu", batch.lengths)  # the input is untouched
    assert on("cpu", batch._cache["sums"][0])
    assert all(on("cpu", t) for _, t in dk._tree.iter_tensors(batch, "batch"))


class SlottedBatch(list[Any]):
    __slots__ = ("lengths",)


def test_a_container_subclass_s_slots_are_moved() -> None:
    batch = SlottedBatch([torch.ones(1)])
    batch.lengths = torch.tensor([1])
    moved = dk.to_device(batch, META)
    assert on(META, moved.lengths)
    assert on(META, moved[0])
    assert on("cpu", batch.lengths)


def test_an_attribute_of_a_container_stays_one_object_with_the_item_it_names() -> None:
    batch = BatchDict(x=torch.ones(2), tokens=[torch.zeros(1)])
    batch.first = batch["x"]  # type: ignore[attr-defined]
    batch.tokens = batch["tokens"]  # type: ignore[attr-defined]  # a list: copied if unshared
    moved = dk.to_device({"batch": batch, "x": batch["x"]}, META)
    assert moved["batch"].first is moved["batch"]["x"] is moved["x"]
    assert moved["batch"].tokens is moved["batch"]["tokens"]
    assert on(META, moved["batch"].tokens[0])


class SelfDict(dict[str, Any]):
    """The attribute-dict idiom whose __dict__ is the dict itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__ = self


def test_a_dict_that_is_its_own_dict_has_its_attributes_moved_with_its_items() -> None:
    batch = SelfDict(x=torch.ones(1), nested={"y": torch.ones(1)})
    moved = dk.to_device(batch, META)
    assert on(META, moved["x"])
    assert moved.x is moved["x"]  # not the input's CPU tensor, read as an attribute
    assert moved.nested is moved["nested"]
    assert [suffix for suffix, _ in children(batch) or []] == ["['x']", "['nested']"]


class CountsTo:
    """An item with its own .to(): counts how often it is moved."""

    calls = 0

    def to(self, device: torch.device) -> CountsTo:
        CountsTo.calls += 1
        return CountsTo()


@pytest.mark.parametrize("make", [BatchUserDict, BatchUserList])
def test_what_a_user_dict_or_list_keeps_its_items_in_is_not_an_attribute(
    make: Callable[[Any], Any],
) -> None:
    # UserDict and UserList keep their items in self.data: the items, moved once,
    # never an attribute besides them (nor a second path to them for the checks).
    CountsTo.calls = 0
    tensor, item = torch.ones(1), CountsTo()
    batch = make({"t": tensor, "item": item} if make is BatchUserDict else [tensor, item])
    batch.note = torch.ones(1)
    moved = dk.to_device(batch, META)
    assert CountsTo.calls == 1
    assert on(META, moved.note)
    keys = list(batch) if make is BatchUserDict else [0, 1]
    assert [moved.data[key] for key in keys] == [moved[key] for key in keys]
    assert moved.data is not batch.data
    assert batch.data[keys[0]] is tensor
    suffixes = [suffix for suffix, _ in children(batch) or []]
    assert suffixes == (["['t']", "['item']", ".note"] if make is BatchUserDict else
                        ["[0]", "[1]", ".note"])  # fmt: skip


class ReadOnly(Mapping[str, Any]):
    """Read-only, its items in an attribute: rebuilt by its constructor from its items."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_a_read_only_mapping_is_looked_inside_through_its_items_alone() -> None:
    # Its constructor makes its attributes from the items: they are not more of it.
    frozen = ReadOnly({"x": torch.ones(1)})
    assert [suffix for suffix, _ in children(frozen) or []] == ["['x']"]
    assert dk.assert_same_device(dk.to_device(frozen, META)) == META


class Tree(list[Any]):
    pass


def test_a_container_attribute_that_points_back_is_a_cycle_named_by_its_path() -> None:
    # The copy's child would point back at the input, with its old tensors.
    root, child = Tree([torch.ones(1)]), Tree()
    root.append(child)
    child.parent = root  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"obj\[1\]\.parent is obj\."):
        dk.to_device(root, META)


class Scored(dict[str, Any]):
    @functools.cached_property
    def total(self) -> torch.Tensor:
        return torch.stack(list(self.values())).sum(0)


class TypedBatch(dict[str, Any], Generic[T]):
    pass


def test_a_container_s_cached_properties_are_dropped_and_dunders_left_alone() -> None:
    scored = Scored(a=torch.ones(2))
    assert on("cpu", scored.total)  # cached on the input
    moved = dk.to_device(scored, META)
    assert "total" not in vars(moved)  # dropped, not moved: computed again
    assert on(META, moved.total)
    typed = TypedBatch[int](x=torch.ones(1))  # sets typed.__orig_class__, Python's own
    assert [suffix for suffix, _ in children(typed) or []] == ["['x']"]
    assert dk.to_device(typed, META).__orig_class__ is typed.__orig_class__  # type: ignore[attr-defined]


def test_objects_with_their_own_to_method() -> None:
    obj = HasTo(torch.ones(1))
    moved = dk.to_device({"enc": obj}, META)
    assert obj.calls == [META]
    assert on(META, moved["enc"].tensor)


def test_modules_are_moved_in_place() -> None:
    model = torch.nn.Linear(2, 2)
    moved = dk.to_device({"model": model}, META)
    assert moved["model"] is model
    assert on(META, model.weight)


class Namespace(types.SimpleNamespace):
    def __init__(self, required: str, **values: Any) -> None:  # not what copying calls
        super().__init__(required=required, **values)


def test_simple_namespaces_are_copied_with_every_attribute_moved() -> None:
    shared = torch.ones(1)
    batch = types.SimpleNamespace(x=shared, y=shared, label="a", nested=[torch.zeros(1)])
    moved = dk.to_device(batch, META)
    assert type(moved) is types.SimpleNamespace
    assert on(META, moved.x)
    assert moved.y is moved.x
    assert moved.label == "a"
    assert on(META, moved.nested[0])
    assert batch.x is shared
    assert on("cpu", batch.nested[0])
    own = dk.to_device(Namespace("r", t=torch.ones(1)), META)
    assert type(own) is Namespace
    assert own.required == "r"
    assert on(META, own.t)
    assert "batch.x: cpu" in _mismatch(batch=batch, other=moved)  # assert_same_device looks in


def _mismatch(**named: Any) -> str:
    with pytest.raises(dk.DeviceMismatchError) as raised:
        dk.assert_same_device(**named)
    return str(raised.value)


def test_attrs_instances_move_every_attribute() -> None:
    attrs = pytest.importorskip("attrs")

    @attrs.frozen
    class Frozen:
        x: torch.Tensor
        y: int = 1
        z: torch.Tensor = attrs.field(init=False, factory=lambda: torch.zeros(1))

    @attrs.define(slots=False)
    class Cached:
        x: torch.Tensor

        @functools.cached_property
        def double(self) -> torch.Tensor:
            return self.x * 2

    frozen = Frozen(torch.ones(1))
    moved = dk.to_device({"batch": frozen}, META)["batch"]
    assert type(moved) is Frozen
    assert moved.y == 1
    assert on(META, moved.x)
    assert on(META, moved.z)
    assert on("cpu", frozen.x)
    assert on("cpu", frozen.z)
    cached = Cached(torch.ones(1))
    assert on("cpu", cached.double)
    assert on(META, dk.to_device(cached, META).double)  # computed again from the moved x


def test_pydantic_models_move_fields_and_extras_and_keep_what_was_set() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Model(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, extra="allow", frozen=True)
        x: torch.Tensor
        n: int = 2
        mask: torch.Tensor | None = None

    model = Model(x=torch.ones(1), mask=None, extra_tensor=torch.zeros(1))
    moved = dk.to_device([model], META)[0]
    assert type(moved) is Model
    assert moved.n == 2
    assert moved.mask is None
    assert on(META, moved.x)
    assert on(META, moved.extra_tensor)
    assert "extra_tensor" not in vars(moved)  # an extra stays an extra
    assert moved.model_fields_set == model.model_fields_set == {"x", "mask", "extra_tensor"}
    assert on("cpu", model.x)
    assert on("cpu", model.extra_tensor)


def test_attrs_and_pydantic_records_move_what_they_hold_besides_their_fields() -> None:
    attrs = pytest.importorskip("attrs")
    pydantic = pytest.importorskip("pydantic")

    @attrs.define(slots=False)
    class Record:
        x: torch.Tensor

        def __attrs_post_init__(self) -> None:
            self.mask = self.x > 0

    class Model(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        x: torch.Tensor
        _cache: torch.Tensor | None = pydantic.PrivateAttr(default=None)

        def model_post_init(self, context: Any) -> None:
            self._cache = self.x * 2

    record, model = Record(torch.ones(1)), Model(x=torch.ones(1))
    moved_record, moved_model = dk.to_device([record, model], META)
    assert on(META, moved_record.mask)
    assert on(META, moved_model._cache)  # a private attribute, in __pydantic_private__
    assert on("cpu", record.mask)
    assert on("cpu", model._cache)


@pytest.mark.parametrize("leaf", [1, 2.5, "text", b"bytes", None, int, 1j, object()])
def test_everything_else_is_returned_unchanged(leaf: object) -> None:
    assert dk.to_device([leaf], META)[0] is leaf


def test_classes_with_a_to_attribute_are_leaves() -> None:
    # nn.Linear.to is a function on the class; calling it would fail.
    assert dk.to_device([torch.nn.Linear], META)[0] is torch.nn.Linear


# --- every container keeps its meaning ------------------------------------------------


@dataclasses.dataclass
class OutputLike(collections.OrderedDict):  # type: ignore[type-arg]
    """What transformers' ModelOutput is: a dataclass-backed OrderedDict that refuses update().

    Its items are its non-None fields, mirrored as attributes; the real class
    is tested in tests/compat.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: tuple[torch.Tensor, ...] | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setattr__(self, name: str, value: Any) -> None:
        if value is not None and name in {f.name for f in dataclasses.fields(self)}:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("You cannot use ``update`` on an OutputLike instance.")

    def setdefault(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("You cannot use ``setdefault`` on an OutputLike instance.")

    def __reduce__(self) -> Any:
        callable_, _, *rest = super().__reduce__()
        return (callable_, tuple(getattr(self, f.name) for f in dataclasses.fields(self)), *rest)


def test_model_output_style_mappings_keep_items_and_attributes_in_step() -> None:
    output = OutputLike(loss=torch.tensor(1.0), logits=torch.ones(2, 3))
    output.hidden = (torch.zeros(2), torch.zeros(2))
    moved = dk.to_device(output, META)
    assert type(moved) is OutputLike
    assert list(moved) == ["loss", "logits", "hidden"]
    assert on(META, moved.loss)
    assert moved["loss"] is moved.loss  # the item and the attribute are one tensor
    assert moved["logits"] is moved.logits
    assert moved["hidden"] is moved.hidden
    assert all(on(META, t) for t in moved.hidden)
    assert on("cpu", output.loss)  # the original is untouched
    assert on("cpu", output["logits"])


def test_model_output_style_none_fields_stay_absent() -> None:
    moved = dk.to_device(OutputLike(logits=torch.ones(1)), META)
    assert list(moved) == ["logits"]
    assert moved.loss is None


def test_counter_counts_are_not_added_twice() -> None:
    counts = collections.Counter({"cat": 2, "dog": 1})
    counts["scores"] = torch.ones(2)  # type: ignore[assignment]
    moved = dk.to_device(counts, META)
    assert type(moved) is collections.Counter
    assert moved["cat"] == 2
    assert moved["dog"] == 1
    assert on(META, moved["scores"])


def test_subclasses_of_counter_ordered_dict_and_defaultdict() -> None:
    class Tally(collections.Counter):  # type: ignore[type-arg]
        pass

    class Ordered(collections.OrderedDict):  # type: ignore[type-arg]
        pass

    class Grouped(collections.defaultdict):  # type: ignore[type-arg]
        pass

    tally = dk.to_device(Tally({"a": 3}), META)
    assert type(tally) is Tally
    assert tally == {"a": 3}
    ordered = dk.to_device(Ordered([("z", torch.ones(1)), ("a", torch.ones(1))]), META)
    assert type(ordered) is Ordered
    assert list(ordered) == ["z", "a"]
    assert all(on(META, t) for t in ordered.values())
    grouped = Grouped(list, {"x": torch.ones(1)})
    moved = dk.to_device(grouped, META)
    assert type(moved) is Grouped
    assert moved.default_factory is list
    assert on(META, moved["x"])


def test_dict_subclass_with_attribute_mirror_and_state() -> None:
    class AttrDict(dict):  # type: ignore[type-arg]
        """Like easydict: every item is an attribute too."""

        def __setitem__(self, key: str, value: Any) -> None:
            super().__setitem__(key, value)
            object.__setattr__(self, key, value)

    batch = AttrDict()
    batch["x"] = torch.ones(1)
    batch.tag = "kept"  # type: ignore[attr-defined]
    moved = dk.to_device(batch, META)
    assert type(moved) is AttrDict
    assert on(META, moved["x"])
    assert moved.x is moved["x"]  # type: ignore[attr-defined]
    assert moved.tag == "kept"  # type: ignore[attr-defined]
    assert on("cpu", batch.x)  # type: ignore[attr-defined]


def test_read_only_dict_subclass() -> None:
    class Frozen(dict):  # type: ignore[type-arg]
        def __setitem__(self, key: str, value: Any) -> None:
            raise TypeError("Frozen is read-only")

        def __reduce__(self) -> Any:
            return (type(self), (dict(self),))

    moved = dk.to_device(Frozen(x=torch.ones(1), n=3), META)
    assert type(moved) is Frozen
    assert on(META, moved["x"])
    assert moved["n"] == 3


def test_user_mutable_mapping_whose_constructor_takes_other_arguments() -> None:
    class Store(MutableMapping):  # type: ignore[type-arg]
        def __init__(self, name: str) -> None:
            self.name = name
            self.data: dict[str, Any] = {}

        def __getitem__(self, key: str) -> Any:
            return self.data[key]

        def __setitem__(self, key: str, value: Any) -> None:
            self.data[key] = value

        def __delitem__(self, key: str) -> None:
            del self.data[key]

        def __iter__(self) -> Any:
            return iter(self.data)

        def __len__(self) -> int:
            return len(self.data)

        def __copy__(self) -> Store:
            copied = Store(self.name)
            copied.data = dict(self.data)
            return copied

    store = Store("train")
    store["x"] = torch.ones(1)
    moved = dk.to_device(store, META)
    assert type(moved) is Store
    assert moved.name == "train"
    assert on(META, moved["x"])
    assert on("cpu", store["x"])


def test_read_only_user_mapping_is_rebuilt_from_its_items() -> None:
    moved = dk.to_device(ReadOnly({"x": torch.ones(1)}), META)
    assert type(moved) is ReadOnly
    assert on(META, moved["x"])


@dataclasses.dataclass
class WithCache:
    x: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


def test_cached_properties_are_computed_again_on_the_copy() -> None:
    batch = WithCache(torch.ones(2))
    assert on("cpu", batch.doubled)  # cached on the original
    moved = dk.to_device(batch, META)
    assert on(META, moved.x)
    assert on(META, moved.doubled)  # not the original's cached CPU tensor
    assert on("cpu", batch.doubled)


def test_cached_properties_inherited_and_on_dict_subclasses() -> None:
    @dataclasses.dataclass
    class Child(WithCache):
        y: int = 0

    class Scaled(dict):  # type: ignore[type-arg]
        @functools.cached_property
        def total(self) -> torch.Tensor:
            return torch.stack(list(self.values())).sum()

    child = Child(torch.ones(1))
    _ = child.doubled
    assert on(META, dk.to_device(child, META).doubled)
    scaled = Scaled(a=torch.ones(1))
    _ = scaled.total
    assert on(META, dk.to_device(scaled, META).total)


class MovesItself:
    """A common mistake: .to() moves in place and returns None."""

    def __init__(self) -> None:
        self.tensor = torch.ones(1)

    def to(self, device: torch.device) -> None:
        self.tensor = self.tensor.to(device)


def test_an_object_whose_to_returns_none_is_kept_with_one_warning() -> None:
    _movewarn._warned_returned_none.discard(MovesItself)
    first, second = MovesItself(), MovesItself()
    with pytest.warns(RuntimeWarning, match=r"MovesItself\.to\(\) returned None") as caught:
        moved = dk.to_device({"a": first, "b": [first]}, META)
    assert moved["a"] is first
    assert moved["b"][0] is first
    assert on(META, first.tensor)
    assert len(caught) == 1
    assert caught[0].filename == __file__  # it points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dk.to_device(second, META) is second  # once per class
    assert on(META, second.tensor)


class ForgetsToReturn(torch.nn.Module):
    """A common mistake: a .to() override that moves the module and returns None."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 2)
        self.calls: list[dict[str, Any]] = []

    def to(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.append(kwargs)
        super().to(*args, **kwargs)


class TakesOnlyADevice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 2)

    def to(self, device: torch.device) -> TakesOnlyADevice:  # type: ignore[override]
        return super().to(device)  # no non_blocking keyword


def test_a_module_with_its_own_to_is_moved_by_it_as_other_objects_are() -> None:
    _movewarn._warned_returned_none.discard(ForgetsToReturn)
    model = ForgetsToReturn()
    batch: dict[str, Any] = {"model": model, "again": [model]}
    with pytest.warns(RuntimeWarning, match=r"ForgetsToReturn\.to\(\) returned None") as caught:
        moved = dk.to_device(batch, META)
    assert moved["model"] is model  # kept, not None
    assert moved["again"][0] is model
    assert on(META, model.net.weight)
    assert len(caught) == 1
    # It takes **kwargs, so it gets the copy policy, as Module.to would: a Hugging Face
    # or Lightning model stays non-blocking on its way to a GPU.
    assert model.calls == [{"non_blocking": True}]
    device_only = TakesOnlyADevice()
    assert dk.to_device([device_only], META)[0] is device_only
    assert on(META, device_only.net.weight)


def test_tensor_subclasses_are_moved() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    moved = dk.to_device({"w": weight}, META)
    assert on(META, moved["w"])  # what Parameter.to returns, as with a hand-written .to()
    assert on(META, dk.to_device(weight, META))


def test_a_single_tensor_already_there_is_itself() -> None:
    tensor = torch.ones(1)
    assert dk.to_device(tensor, "cpu") is tensor
    assert dk.to_device(tensor, torch.device("cpu")) is tensor


def test_a_single_tensor_follows_the_copy_policy(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    seen: list[tuple[torch.device, bool]] = []
    real_to = torch.Tensor.to

    def spy(self: torch.Tensor, device: torch.device, *, non_blocking: bool = False) -> Any:
        seen.append((device, non_blocking))
        if device.type == "cuda":
            return self  # pretend it moved: there is no GPU here
        return real_to(self, device, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    fake_accelerator("cuda", 1)
    dk.to_device(torch.ones(1), "cuda:0")
    assert on(META, dk.to_device(torch.ones(1), META))
    # To an accelerator: non-blocking. To meta: no keyword (it means nothing there).
    assert seen == [(torch.device("cuda", 0), True), (META, False)]


# --- sharing and cycles --------------------------------------------------------------


def test_shared_tensors_stay_shared() -> None:
    shared = torch.ones(2)
    moved = dk.to_device({"a": shared, "b": [shared], "c": Pair(shared, shared)}, META)
    assert moved["a"] is moved["b"][0] is moved["c"].left is moved["c"].right


def test_shared_containers_stay_shared() -> None:
    inner = [torch.ones(1)]
    moved = dk.to_device({"a": inner, "b": inner}, META)
    assert moved["a"] is moved["b"]


@pytest.fixture(params=[False, True], ids=["params-replaced", "params-kept"])
def swap_params(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Module.to to meta replaces each Parameter; with the swap it keeps each one, as a move
    to CUDA does (param.data = ...): the two ways a module's tensors can follow it."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("module_first", [True, False])
def test_a_module_s_tensor_in_the_batch_is_the_module_s_own_whatever_the_order(
    swap_params: bool, module_first: bool
) -> None:
    # Before, with the tensor first it came back a copy of its own: an update to the
    # module's weight no longer reached the batch's (and buffers never did).
    model = torch.nn.BatchNorm1d(2)
    weight, mean = model.weight, model.running_mean
    batch: dict[str, Any] = {"w": weight, "stats": [mean]}
    batch = {"m": model, **batch} if module_first else {**batch, "m": model}
    moved = dk.to_device(batch, META)
    assert moved["m"] is model
    assert moved["w"] is model.weight
    assert isinstance(moved["w"], torch.nn.Parameter)
    assert moved["stats"][0] is model.running_mean
    assert on(META, model.running_mean)
    assert (model.weight is weight) is swap_params  # as Module.to left it


def test_each_module_keeps_its_tensors_when_the_walk_starts_again() -> None:
    # The second walk (m2's weight came first) must not lose what moving m1 in the first
    # walk made: m1 is not moved twice, and its old weight still maps to its new one.
    m1, m2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    batch = {"m1": m1, "w1": m1.weight, "w2": m2.weight, "m2": m2, "pair": (m2.bias, m1.bias)}
    moved = dk.to_device(batch, META)
    assert moved["w1"] is m1.weight
    assert moved["w2"] is m2.weight
    assert moved["pair"][0] is m2.bias
    assert moved["pair"][1] is m1.bias
    assert all(on(META, t) for t in (*m1.parameters(), *m2.parameters()))


def test_a_module_alone_or_with_no_tensor_of_its_own_in_the_batch_is_walked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real = _mover._Mover.again

    def spy(self: Any, obj: Any, module: torch.nn.Module) -> Any:
        calls.append(module)
        return real(self, obj, module)

    monkeypatch.setattr(_mover._Mover, "again", spy)
    dk.to_device(torch.nn.Linear(2, 2), META)
    dk.to_device({"x": torch.ones(1), "m": torch.nn.Linear(2, 2)}, META)
    assert calls == []
    later = torch.nn.Linear(2, 2)
    dk.to_device([later.bias, later], META)
    assert calls == [later]


def test_tensors_already_there_are_not_copied() -> None:
    tensor = torch.ones(1)
    assert dk.to_device({"t": tensor}, "cpu")["t"] is tensor


def test_a_tensor_already_there_after_a_copied_sibling_is_itself() -> None:
    # After a copy the walk stops asking each sibling where it is (.to() answers that):
    # the one already on the target must still come back as itself, shared or not.
    there, shared_there = torch.ones(1, device=META), torch.ones(1, device=META)
    moved = dk.to_device(
        {"copied": torch.ones(1), "there": there, "shared": shared_there, "again": shared_there},
        META,
    )
    assert moved["copied"].is_meta
    assert moved["there"] is there
    assert moved["shared"] is moved["again"] is shared_there
    as_list = dk.to_device([torch.ones(1), there, [torch.ones(1), there]], META)
    assert as_list[1] is there
    assert as_list[2][1] is there


def test_the_next_call_checks_again_where_each_tensor_is() -> None:
    """Skipping the already-there check after a copy never outlasts the call: a later
    call that copies nothing calls no .to() at all."""
    from torch.overrides import TorchFunctionMode

    calls: list[str] = []

    class CountTo(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if getattr(func, "__name__", "") == "to":
                calls.append("to")
            return func(*args, **(kwargs or {}))

    there = {"a": [torch.ones(1, device=META)], "b": {"c": torch.ones(1, device=META)}}
    with CountTo():
        dk.to_device({"a": [torch.ones(1)], "b": {"c": torch.ones(1)}}, META)
        assert calls == ["to", "to"]
        moved = dk.to_device(there, META)
    assert calls == ["to", "to"]  # none for the tensors already there
    assert moved["a"][0] is there["a"][0]
    assert moved["b"]["c"] is there["b"]["c"]


def test_cycles_raise_with_the_path() -> None:
    looped: dict[str, Any] = {"x": [torch.ones(1)]}
    looped["x"].append(looped)
    with pytest.raises(
        ValueError,
        match=r"to_device\(\) cannot move a structure that contains itself: obj\['x'\]\[1\] is obj",
    ):
        dk.to_device(looped, META)


def test_cycle_through_a_deque_is_named_by_its_path() -> None:
    looped: collections.deque[Any] = collections.deque()
    looped.append({"a": looped})
    with pytest.raises(ValueError, match=r"obj\['x'\]\[0\]\['a'\] is obj\['x'\]\."):
        dk.to_device({"x": looped}, META)


def test_cycle_through_a_dataclass() -> None:
    batch = Batch(torch.ones(1), {})
    batch.meta["self"] = batch
    with pytest.raises(ValueError, match=r"obj\.meta\['self'\] is obj\."):
        dk.to_device(batch, META)


def test_nesting_deeper_than_the_recursion_limit_says_so_and_leaves_the_walk_clean() -> None:
    chain: Any = torch.ones(1)
    for _ in range(sys.getrecursionlimit()):  # five frames a level: far too deep
        chain = Batch(chain, {})
    with pytest.raises(
        RecursionError,
        match=r"^to_device\(\) cannot move obj: it nests containers deeper than Python's "
        r"recursion limit \(sys\.getrecursionlimit\(\) is \d+\) allows\..*"
        r"Raise the limit with sys\.setrecursionlimit\(\), or flatten the structure",
    ) as info:
        dk.to_device(chain, META)
    assert info.value.__cause__ is None
    mover = _mover._local.movers[META]
    assert (mover.busy, mover.memo, mover.kept) == (False, {}, [])
    moved = dk.to_device({"a": Batch(torch.ones(1), {})}, META)  # the same walk, reused
    assert on(META, moved["a"].x)


# --- devices and the copy policy -----------------------------------------------------


def test_default_device_is_try_gpu() -> None:
    assert dk.to_device(torch.ones(1)).device == dk.try_gpu()


def test_int_device_without_accelerator(fake_accelerator: FakeAccelerator) -> None:
    fake_accelerator(None, 0)
    with pytest.raises(
        dk.DeviceNotFoundError, match="device=1 means accelerator 1, but this torch"
    ):
        dk.to_device(torch.ones(1), 1)


@pytest.mark.parametrize("bad", [True, 1.5, [0]])
def test_bad_device_types(bad: object) -> None:
    with pytest.raises(TypeError, match=r"device must be a torch\.device"):
        dk.to_device(torch.ones(1), bad)  # type: ignore[arg-type]


class _Spy(torch.Tensor):
    """Records the non_blocking flag of every .to() call made on it."""

    seen: list[bool | None] = []  # noqa: RUF012 - reset per test

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.to:
            cls.seen.append((kwargs or {}).get("non_blocking"))
            if not any(a.type == "meta" for a in args if isinstance(a, torch.device)):
                return args[0]  # pretend it moved: there is no GPU here to move to
        return super().__torch_function__(func, types, args, kwargs)


def _walk_one(device: torch.device, forced: bool | None) -> None:
    mover = _mover._Mover(device, forced)
    try:
        mover.move([torch.ones(1).as_subclass(_Spy)])
    finally:
        mover.finish()


# None: no keyword at all, which is a blocking copy.
@pytest.mark.parametrize(("forced", "expected"), [(None, True), (True, True), (False, None)])
def test_copies_to_an_accelerator_are_non_blocking_unless_forced(
    forced: bool | None, expected: bool | None
) -> None:
    _Spy.seen = []
    _walk_one(torch.device("cuda", 0), forced)
    assert _Spy.seen == [expected]


def test_copies_to_meta_pass_no_keyword_for_torch_to_parse() -> None:
    # A non_blocking flag means nothing for a meta copy and costs 0.13 µs per tensor.
    _Spy.seen = []
    dk.to_device([torch.ones(1).as_subclass(_Spy)], META)
    assert _Spy.seen == [None]


# --- load ------------------------------------------------------------------------------


# --- data_parallel ---------------------------------------------------------------------


def test_data_parallel_without_gpus_returns_the_module_moved(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_dataparallel, "try_all_gpus", lambda: [torch.device("cpu")])
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        result = dk.data_parallel(model)
    assert result is model
    assert on("cpu", model.weight)
    assert caplog.records == []


def test_data_parallel_on_one_device_does_not_wrap() -> None:
    model = torch.nn.Linear(2, 2)
    assert dk.data_parallel(model, ["cpu"]) is model  # meta, used here before, is refused now
    assert on(torch.device("cpu"), model.weight)


@pytest.mark.parametrize(
    ("devices", "message"),
    [([], "needs at least one device"), (["cpu", "meta"], "needs devices of one type")],
)
def test_data_parallel_rejects_bad_device_lists(devices: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dk.data_parallel(torch.nn.Linear(1, 1), devices)  # type: ignore[arg-type]


# --- on a real GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_round_trip_keeps_values_exact(dtype: torch.dtype) -> None:
    original = {"x": (torch.randn(1000) * 1000).to(dtype), "ys": [torch.arange(10)]}
    on_gpu = dk.to_device(original, "cuda")
    assert on_gpu["x"].is_cuda
    assert on_gpu["ys"][0].is_cuda
    back = dk.to_device(on_gpu, "cpu")
    assert torch.equal(back["x"], original["x"])
    assert torch.equal(back["ys"][0], original["ys"][0])


@pytest.mark.gpu
@pytest.mark.parametrize("non_blocking", [None, True])
def test_copies_to_the_host_are_always_safe_to_read(non_blocking: bool | None) -> None:
    # A large fill keeps the GPU busy, so an unsynchronized read would see old data.
    source = torch.empty(1 << 24, device="cuda")
    for step in range(50):
        source.fill_(float(step))
        moved = dk.to_device({"v": source}, "cpu", non_blocking=non_blocking)["v"]
        assert bool((moved == step).all()), f"step {step}: read before the copy landed"


@pytest.mark.gpu
def test_mismatch_names_the_tensor_left_on_the_cpu() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).cuda()
    batch = {"input": torch.randn(2, 4, device="cuda"), "labels": torch.zeros(2)}
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(model=model, batch=batch)
    message = str(info.value)
    assert "found 2: cpu (1 tensor), cuda:0 (3 tensors)" in message
    assert "  batch['labels']: cpu\n" in message
    assert "  model.0.weight: cuda:0\n" in message


@pytest.mark.gpu
def test_data_parallel_with_one_gpu_moves_without_wrapping() -> None:
    model = dk.data_parallel(torch.nn.Linear(2, 2), [0])
    assert isinstance(model, torch.nn.Linear)
    assert model.weight.device == torch.device("cuda", 0)


SHAPES = ["twice in one list", "twice in one dict", "in a list and a dict", "in a dict and a tuple"]


def _shared_only_inside(shape: str) -> Any:
    """A structure that references one tensor twice, and nothing else references it."""
    shared = torch.ones(2)
    if shape == "twice in one list":
        built: Any = [shared, shared]
    elif shape == "twice in one dict":
        built = {"a": shared, "b": shared}
    elif shape == "in a list and a dict":
        built = [shared, {"x": shared}]
    else:
        built = {"a": shared, "b": (shared,)}
    del shared
    return built


@pytest.mark.parametrize("shape", SHAPES)
def test_the_memo_is_skipped_only_for_tensors_nothing_else_holds(shape: str) -> None:
    # Shared tensors stay shared however they are shared; unshared ones skip the memo.
    moved = dk.to_device(_shared_only_inside(shape), META)
    first, second = (t for _, t in _tensors(moved))
    assert first is second
    fresh = dk.to_device([torch.ones(1), torch.ones(1)], META)
    assert fresh[0] is not fresh[1]
    assert _refcounts.ONCE_IN_LIST >= 0  # the calibration found an exact count here


def _tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    from devicekit._tree import iter_tensors

    return list(iter_tensors(obj, "obj"))


class _MovesItsInsidesWithToDevice:
    """A user object whose .to() calls to_device itself: a call inside a call."""

    def __init__(self, inside: Any) -> None:
        self.inside = inside

    def to(self, device: torch.device) -> _MovesItsInsidesWithToDevice:
        return _MovesItsInsidesWithToDevice(dk.to_device(self.inside, device))


def test_a_call_inside_a_call_gets_its_own_walk() -> None:
    shared = torch.ones(1)
    batch = [shared, _MovesItsInsidesWithToDevice({"x": torch.ones(2), "y": [shared]}), shared]
    moved = dk.to_device(batch, META)
    assert moved[0] is moved[2]  # the outer call's memo survived the inner call
    assert on(META, moved[1].inside["x"])
    assert on(META, moved[1].inside["y"][0])
    # The walk the outer call used is free again, and forgot everything.
    again = dk.to_device(batch, META)
    assert again[0] is not moved[0]


def test_threads_moving_at_once_each_get_their_own_results() -> None:
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for step in range(200):
                value = float(seed * 1000 + step)
                batch = {"a": [torch.full((1,), value)], "b": {"c": torch.full((1,), value)}}
                moved = dk.to_device(batch, META)
                assert on(META, moved["a"][0])
                assert on(META, moved["b"]["c"])
                assert dk.to_device(batch, "cpu")["a"][0].item() == value
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors[0]
    assert not any(thread.is_alive() for thread in threads)


class _Validated(dict):  # type: ignore[type-arg]
    """A dict subclass that checks what it is given: its refusal is an error, not read-only."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if key == "bad":
            raise ValueError(f"{key!r} is not allowed on the meta device")
        super().__setitem__(key, value)


class _FrozenDict(dict):  # type: ignore[type-arg]
    """A read-only dict subclass that copies itself, and refuses assignment with any Exception."""

    def __copy__(self) -> _FrozenDict:
        new = type(self).__new__(type(self))
        dict.update(new, self)
        return new

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Exception(f"You cannot use __setitem__ on a {type(self).__name__} instance.")  # noqa: TRY002


def test_a_read_only_mapping_is_rebuilt_and_a_validating_one_keeps_its_errors() -> None:
    frozen = dk.to_device(_FrozenDict(x=torch.ones(1)), META)
    assert type(frozen) is _FrozenDict
    assert on(META, frozen["x"])
    with pytest.raises(ValueError, match="'bad' is not allowed"):
        dk.to_device(_Validated(ok=torch.ones(1), bad=torch.ones(1)), META)


def test_non_blocking_must_be_a_bool_or_none() -> None:
    # Before, "must be True or False", though None (the default) is taken too.
    for value, shown in [("yes", "'yes' of type str"), (1, "1 of type int")]:
        with pytest.raises(
            TypeError,
            match=r"^non_blocking must be None \(the default: non-blocking to an accelerator, "
            rf"blocking to the host\), True or False, got {shown}$",
        ):
            dk.to_device({"x": torch.ones(1)}, "cpu", non_blocking=value)  # type: ignore[arg-type]


def test_a_tensor_torch_cannot_copy_there_is_named_with_the_fix() -> None:
    # Before, torch's "Could not run 'aten::_to_copy' with arguments from the
    # 'NestedTensorMeta' backend" came alone, with no path and no fix.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype and deprecation warnings
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    for obj, path, kind, fix in [
        ({"x": torch.ones(1), "n": nested}, "obj['n']", "nested", "layout=torch.jagged"),
        (nested, "obj", "nested", "layout=torch.jagged"),
        ([torch.ones(1), (quantized,)], "obj[1][0]", "quantized", ".dequantize()"),
    ]:
        with pytest.raises(dk.TensorCopyError, match="Could not run") as raised:
            dk.to_device(obj, META)
        note = str(raised.value)  # in the message, not a note: log lines show it too
        assert note.startswith(
            f"to_device(obj, 'meta') cannot move {path}: torch has no copy of a "
            f"{kind} tensor to meta. Leave it out of what you move, or "
        )
        assert fix in note
        assert isinstance(raised.value, NotImplementedError)
        assert isinstance(raised.value.__cause__, NotImplementedError)  # torch's own
    # The fix gives what it says: a float tensor there (a quantized one on meta cannot be:
    # quantize_per_tensor of a meta tensor gives a float one, which "quantize it there" hid).
    assert "quantize it again only where torch has quantized tensors" in note
    moved = dk.to_device(quantized.dequantize(), META)
    assert (moved.device, moved.dtype) == (META, torch.float32)


def test_a_meta_tensor_that_cannot_be_copied_is_named_with_the_fix() -> None:
    for obj, path in [
        (torch.empty(2, device="meta"), "obj"),
        ({"a": [1, torch.empty(2, device="meta")]}, "obj['a'][1]"),
        (torch.nn.Linear(2, 2, device="meta"), "obj.weight"),
    ]:
        with pytest.raises(dk.TensorCopyError, match="meta tensor") as raised:
            dk.to_device(obj, "cpu")
        note = str(raised.value)  # before, a note, which str() and log lines left out
        assert f"cannot move {path}: it is on the meta device" in note
        assert "model.to_empty(device='cpu')" in note
        assert "(torch: Cannot copy out of meta tensor; no data!" in note


def test_an_error_raised_by_an_object_s_own_to_names_it() -> None:
    class Quantity:  # a .to() that means something else, with another signature
        def to(self, unit: str, *, strict: bool) -> Quantity:
            return self

    with pytest.raises(TypeError, match="strict") as raised:
        dk.to_device({"q": Quantity()}, META)
    (note,) = raised.value.__notes__
    assert "to_device() moves a " in note
    assert "Quantity by calling its own .to('meta')" in note


# --- objects to_device cannot move ----------------------------------------------------------


def _holder_class() -> type:
    class Holder:  # a class of the user's own, with no .to(): a new class per test
        def __init__(self, tensor: torch.Tensor | None) -> None:
            self.tensor = tensor

    return Holder


def test_an_iterator_is_returned_as_it_is_and_told_of_once_per_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a generator of tensors came back unmoved in silence, where a dict view
    # holding tensors is refused.
    monkeypatch.setattr(_mover, "looks_left", weakref.WeakKeyDictionary())  # none told yet

    def batches() -> Iterator[torch.Tensor]:
        yield torch.ones(1)

    generator = batches()
    with pytest.warns(
        RuntimeWarning, match=r"returned a generator as it is: an iterator makes"
    ) as told:
        assert dk.to_device(generator, META) is generator
    assert told[0].filename == __file__
    assert "list(...)" in str(told[0].message)
    assert next(generator).device.type == "cpu"  # not run by to_device: its item is still there
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        dk.to_device({"x": torch.ones(1), "more": batches()}, META)
    with pytest.warns(RuntimeWarning, match=r"returned a map as it is"):
        moved = dk.to_device({"x": torch.ones(1), "sizes": map(len, ["ab"])}, META)
    assert moved["x"].is_meta


def test_a_future_is_returned_as_it_is_and_told_of_with_how_to_get_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a torch future came back in silence, and a finished concurrent.futures
    # one was told of as an object to give a .to() to.
    monkeypatch.setattr(_mover, "looks_left", weakref.WeakKeyDictionary())  # none told yet
    done: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
    done.set_result(torch.ones(1))
    waited: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    waited.set_result(torch.ones(1))
    with pytest.warns(RuntimeWarning) as told:
        moved = dk.to_device({"done": done, "waited": waited, "x": torch.ones(1)}, META)
    assert moved["done"] is done
    assert moved["waited"] is waited
    assert moved["x"].is_meta
    assert [str(warning.message).split(" as it is")[0] for warning in told] == [
        "to_device() returned a concurrent.futures.Future",
        "to_device() returned a torch.futures.Future",
    ]
    assert "Get the value first (future.result()) and move that." in str(told[0].message)
    assert "(future.wait())" in str(told[1].message)
    assert all(warning.filename == __file__ for warning in told)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        dk.to_device([concurrent.futures.Future()], META)


def test_an_object_it_cannot_move_is_returned_as_it_is_but_not_in_silence() -> None:
    holder = _holder_class()
    held = holder(torch.ones(1))
    with pytest.warns(
        RuntimeWarning,
        match=r"returned a .*Holder as it is: devicekit does not know how to move it, and it "
        r"holds a tensor not on meta \(Holder\.tensor\), which stays where it is\. Move its",
    ) as caught:
        moved = dk.to_device({"h": held, "x": torch.ones(1)}, "meta")
    assert caught[0].filename == __file__  # the caller's line
    assert moved["h"] is held
    assert held.tensor.device.type == "cpu"
    assert moved["x"].is_meta
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        dk.to_device([holder(torch.ones(1))], "meta")


def test_an_object_whose_tensors_are_there_already_is_not_warned_of() -> None:
    holder = _holder_class()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.to_device([holder(torch.ones(1)), holder(None)], "cpu")
    with pytest.warns(RuntimeWarning, match=r"Holder\.tensor"):
        dk.to_device([holder(torch.ones(1))], "meta")  # its class was still looked inside


def test_a_class_is_looked_inside_a_few_times_at_most() -> None:
    # An object met every step (a tokenizer in the batch) costs a lookup, not a walk.
    holder = _holder_class()
    for _ in range(8):
        dk.to_device([holder(None)], "meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.to_device([holder(torch.ones(1))], "meta")


def test_the_look_inside_an_object_it_cannot_move_never_raises() -> None:
    # Each raised from to_device, which returned these objects unchanged before it looked.
    holder = _holder_class()

    class Gone:
        pass

    gone = Gone()
    dead = holder(weakref.proxy(gone))  # type: ignore[arg-type]
    del gone  # ReferenceError at any question to the proxy, isinstance() too

    class Unlistable(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            raise KeyError(key)

        def __len__(self) -> int:
            return 1

        def __iter__(self) -> Iterator[str]:
            raise RuntimeError("cannot list its keys")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for obj in (dead, holder(Unlistable())):  # type: ignore[arg-type]
            assert dk.to_device([obj], "meta")[0] is obj


def test_the_look_inside_an_object_runs_none_of_its_code() -> None:
    ran: list[str] = []

    class Guarded:
        def __init__(self) -> None:
            self.x = torch.ones(1)

        @property  # type: ignore[override]
        def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
            ran.append("__dict__")
            raise RuntimeError("a property named __dict__ ran")

    class Sneaky(dict[str, Any]):
        def items(self) -> Any:
            ran.append("items")
            raise RuntimeError("items() ran")

        def __iter__(self) -> Iterator[str]:
            ran.append("__iter__")
            raise RuntimeError("__iter__ ran")

    holder = _holder_class()
    guarded = Guarded()
    assert dk.to_device([guarded], "meta")[0] is guarded  # its error escaped
    sneaky = holder(Sneaky(x=torch.ones(1)))  # type: ignore[arg-type]
    # A dict subclass's items are read as a dict stores them: the tensor is still found.
    with pytest.warns(RuntimeWarning, match=r"\(Holder\.tensor\['x'\]\)"):
        assert dk.to_device([sneaky], "meta")[0] is sneaky
    assert ran == []


def test_a_look_that_fails_finds_nothing_and_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    holder = _holder_class()

    def fails(obj: object, device: torch.device) -> str | None:
        raise RuntimeError("a tensor subclass whose device raises")

    monkeypatch.setattr(_mover, "tensor_elsewhere", fails)
    held = holder(torch.ones(1))
    assert dk.to_device([held], "meta")[0] is held
    assert _mover.looks_left[holder] == 0


class _Key:
    """A dict key that counts how often its repr was made."""

    reprs = 0

    def __repr__(self) -> str:
        _Key.reprs += 1
        return "key"


class _Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class _CountedList(list[Any]):
    """A list that counts the items its own iteration hands out."""

    pulled = 0

    def __iter__(self) -> Iterator[Any]:
        for item in list.__iter__(self):
            _CountedList.pulled += 1
            yield item


def test_the_look_reads_at_most_its_bound_of_a_huge_container() -> None:
    # It listed every item, with the repr of every key, before its bound counted a thing:
    # 0.3 s per call for an object holding a million-entry dict (the first 8 calls).
    holder = _holder_class()
    big = holder(None)
    big.table = {_Key(): None for _ in range(100_000)}  # type: ignore[attr-defined]
    big.rows = _CountedList([None] * 100_000)  # type: ignore[attr-defined]
    _Key.reprs = _CountedList.pulled = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(8):
            dk.to_device([big], "meta")
    assert _Key.reprs == 0
    assert _CountedList.pulled == 0
    # The one path it names is the only repr made, and one that raises is no error.
    holder = _holder_class()
    with pytest.warns(RuntimeWarning, match=r"\(Holder\.tensor\[key\]\)"):
        dk.to_device([holder({_Key(): torch.ones(1)})], "meta")  # type: ignore[arg-type]
    assert _Key.reprs == 1
    holder = _holder_class()
    with pytest.warns(
        RuntimeWarning, match=r"\(Holder\.tensor\[<tests\.test_placement\._Unprintable ob"
    ):
        dk.to_device([holder({_Unprintable(): torch.ones(1)})], "meta")  # type: ignore[arg-type]


def test_the_look_stops_at_its_bound() -> None:
    holder = _holder_class()
    near, far = [None] * 10 + [torch.ones(1)], [None] * 1000 + [torch.ones(1)]
    with pytest.warns(RuntimeWarning, match=r"\(Holder\.tensor\[10\]\)"):
        dk.to_device([holder(near)], "meta")  # type: ignore[arg-type]
    holder = _holder_class()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # past the 256 references it reads: not found
        dk.to_device([holder(far)], "meta")  # type: ignore[arg-type]


def test_a_look_another_thread_spoiled_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # A race while reading set the class's looks to none left: it was never warned about.
    from devicekit import _look

    holder = _holder_class()

    def changed(obj: object, device: torch.device) -> str | None:
        raise _look.Changed("another thread changed a dict while it was read, twice")

    monkeypatch.setattr(_mover, "tensor_elsewhere", changed)
    held = holder(torch.ones(1))
    assert dk.to_device([held], "meta")[0] is held
    assert holder not in _mover.looks_left
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match=r"Holder\.tensor"):
        dk.to_device([held], "meta")


def _positions_class() -> type[torch.nn.Module]:
    """A fresh module class (the warning is once per class) keeping a plain tensor attribute."""

    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.pos = torch.randn(16, 4)  # a plain attribute: Module.to() leaves it behind

    return Positions


def test_a_plain_tensor_attribute_a_module_move_leaves_behind_is_warned_once_per_class() -> None:
    # It was left behind without a word, and the forward failed with a device mismatch.
    positions = _positions_class()
    with pytest.warns(
        RuntimeWarning,
        match=r"Positions\.pos is not on meta\. Where the forward uses it, fix it as "
        r"dk\.check_module\(model\) says: \"pos: .* Use self\.register_buffer\('pos', \.\.\.\)",
    ):
        model = dk.to_device(positions(), "meta")
    assert model.pos.device.type == "cpu"  # still left where it was: a warning, not a move
    assert _movemodule._module_looks[model] == 0  # never looked at again: a dict lookup per call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.to_device(positions(), "meta")
    nested = torch.nn.Sequential(torch.nn.Linear(4, 4), _positions_class()())
    nested[1].cache = {"keys": [torch.ones(1)]}
    del nested[1].pos
    with pytest.warns(RuntimeWarning, match=r"Sequential\.1\.cache\['keys'\]\[0\] is not on meta"):
        dk.to_device(nested, "meta")


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.blocks = [torch.nn.Linear(2, 2)]  # not registered: Module.to() leaves it


def test_the_warning_for_a_module_kept_in_a_list_says_to_register_the_module() -> None:
    # Before: "register it in its module with self.register_buffer('blocks', ...)", which
    # torch refuses for a list, for the parameters of a module that nn.ModuleList registers.
    with pytest.warns(RuntimeWarning) as told:
        dk.to_device(_Blocks(), "meta")
    said = str(told[0].message)
    assert "_Blocks.blocks[0].weight is not on meta" in said
    assert "register_buffer" not in said
    assert "Use nn.ModuleList." in said


def test_a_clean_module_class_is_looked_at_a_few_times_then_no_more() -> None:
    positions = _positions_class()
    model = positions()
    model.register_buffer("pos", model.__dict__.pop("pos"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(_movemodule.LOOKS_PER_CLASS + 2):
            dk.to_device(model, "cpu")
    assert _movemodule._module_looks[model] == 0  # a dict lookup per call from now on


def test_a_stray_in_a_sequential_is_found_after_clean_ones_were_moved() -> None:
    # Before, the looks were counted by class: after 8 clean nn.Sequential moves (or one
    # warning of a Sequential), no Sequential was looked at again, whatever it held.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(_movemodule.LOOKS_PER_CLASS + 1):
            dk.to_device(torch.nn.Sequential(torch.nn.Linear(2, 2)), "meta")
    stray = torch.nn.Sequential(torch.nn.Linear(2, 2), _positions_class()())
    with pytest.warns(RuntimeWarning, match=r"Sequential\.1\.pos is not on meta"):
        dk.to_device(stray, "meta")


# --- tensors left behind, told (trial 9) ----------------------------------------------------


def test_a_numpy_array_of_objects_holding_a_tensor_is_warned_of() -> None:
    np = pytest.importorskip("numpy")
    _mover.looks_left.pop(np.ndarray, None)  # warned once per class: as if never met
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # arrays of numbers: no look, no warning
        for _ in range(_movemodule.LOOKS_PER_CLASS + 1):  # and they use up no look
            dk.to_device({"a": np.arange(3), "t": torch.ones(1)}, META)
    array = np.array([None, [torch.ones(2)]], dtype=object)
    with pytest.warns(
        RuntimeWarning,
        match=r"returned a numpy\.ndarray as it is: .* holds a tensor not on meta "
        r"\(ndarray\.flat\[1\]\[0\]\), which stays where it is\. Move its tensors yourself, "
        r"keep them in a list \(which it moves\) instead of a numpy array, or make",
    ):
        moved = dk.to_device({"a": array}, META)
    assert moved["a"] is array
    _mover.looks_left.pop(np.ndarray, None)


def test_what_an_object_s_own_to_leaves_in_a_nested_value_is_warned_of() -> None:
    class Encoding(dict):  # type: ignore[type-arg]
        """A mapping whose .to() moves its top-level tensors only."""

        def to(self, device: torch.device) -> Encoding:
            return Encoding({k: v.to(device) if isinstance(v, torch.Tensor) else v
                             for k, v in self.items()})  # fmt: skip

    with pytest.warns(
        RuntimeWarning,
        match=r"moved a .*Encoding with its own \.to\(\), which left a tensor not on meta "
        r"\(Encoding\['pixels'\]\[0\]\) where it was \(a \.to\(\) that moves the "
        r"top-level values only\)",
    ):
        moved = dk.to_device(Encoding(ids=torch.ones(1), pixels=[torch.ones(1)]), META)
    assert on(META, moved["ids"])
    # A PackedSequence keeps batch_sizes on the host on purpose: its .to() has the last word.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = torch.nn.utils.rnn.pack_sequence([torch.ones(2), torch.ones(1)])
        assert dk.to_device(packed, META).batch_sizes.device.type == "cpu"


def test_a_tensor_used_as_a_dict_key_is_warned_of() -> None:
    _mover.looks_left.pop(_movecalls.DictKey, None)
    key = torch.ones(1)
    with pytest.warns(
        RuntimeWarning,
        match=r"moved a dict's values, never its keys, and a key holds a tensor not on meta "
        r"\(dict\[key \(1, tensor\(\.\.\., device='cpu', size=\(1,\)\)\)\]\[1\]\)",
    ):
        moved = dk.to_device({"x": {(1, key): torch.ones(1)}}, META)
    assert next(iter(moved["x"])) == (1, key)
    _mover.looks_left.pop(_movecalls.DictKey, None)


@pytest.mark.parametrize("make", [torch.Tensor.untyped_storage, torch.Tensor.storage])
def test_a_storage_is_moved_by_its_keyword_only_to(make: Any) -> None:
    # Before, to_device called storage.to(device), which takes the device by keyword
    # only: "TypeError: _StorageBase.to() takes 1 positional argument but 2 were given",
    # with a note to give the class a .to(device).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        storage = make(torch.arange(3.0))
    for moved in (dk.to_device(storage, "cpu"), dk.to_device({"s": storage}, "cpu")["s"]):
        assert type(moved) is type(storage)
        assert moved.data_ptr() == storage.data_ptr()  # there already: not copied
    with pytest.raises(dk.TensorCopyError, match=r"cannot move a torch\.storage\.\w+ to 'meta'"):
        dk.to_device(storage, "meta")  # torch's raw AssertionError, before


def test_a_move_traced_by_torch_fx_is_in_the_graph() -> None:
    # Before: symbolic_trace's Proxy was returned unchanged, so the traced module left
    # its input where it was, silently (accelerate's send_to_device records the move).
    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor, batch: dict[str, Any]) -> Any:
            moved = dk.to_device({"x": x, "again": x, **batch}, META)
            return moved["x"] * 2, moved["again"] is moved["x"]

    traced = torch.fx.symbolic_trace(Step(), concrete_args={"batch": {}})
    calls = [node.target for node in traced.graph.nodes if node.op == "call_method"]
    assert calls == ["to"]  # once: the proxy reached twice is one move
    out, shared = traced(torch.ones(2), {})
    assert out.device == META
    assert shared is True


def test_a_traced_move_to_the_host_blocks_whatever_non_blocking_says() -> None:
    # Eager synchronizes once before returning from non_blocking=True to the host;
    # a traced graph has no such step, so its copy to the host must block.
    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return dk.to_device(x, "cpu", non_blocking=True) + 1

    traced = torch.fx.symbolic_trace(Step())
    (move,) = [node for node in traced.graph.nodes if node.target == "to"]
    assert move.kwargs.get("non_blocking", False) is False


# --- objects with their own .to(), warnings, modules' old tensors (trial 46) ---------------


class _LengthsOnTheHost(collections.UserDict):  # type: ignore[type-arg]
    """A UserDict whose .to() keeps its lengths on the host (pack_padded_sequence needs them)."""

    def to(self, device: torch.device) -> _LengthsOnTheHost:
        return _LengthsOnTheHost(x=self["x"].to(device), lengths=self["lengths"])


def test_a_user_dict_with_its_own_to_has_the_last_word() -> None:
    # R20: rebuilding every UserDict with a .to() (for transformers' BatchEncoding, whose
    # .to() moves it in place: tests/compat) moved these lengths too, and
    # pack_padded_sequence later refused them on a GPU. Only BatchEncoding.to is bypassed.
    batch = _LengthsOnTheHost(x=torch.zeros(3, 4), lengths=torch.tensor([3, 2, 1]))
    moved = dk.to_device(batch, META)
    assert on(META, moved["x"])
    assert on("cpu", moved["lengths"])


def test_a_packed_sequence_is_moved_as_its_own_to_moves_it_with_sharing_kept() -> None:
    padded = torch.arange(12.0).reshape(3, 4)
    packed = torch.nn.utils.rnn.pack_padded_sequence(
        padded, torch.tensor([4, 2, 3]), batch_first=True, enforce_sorted=False
    )
    theirs = packed.to("meta")  # type: ignore[arg-type]  # torch types it dtype-only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = dk.to_device(packed, META)
    assert type(ours) is type(theirs)
    for name in ("data", "batch_sizes", "sorted_indices", "unsorted_indices"):
        mine, other = getattr(ours, name), getattr(theirs, name)
        assert (mine.device, mine.shape, mine.dtype) == (other.device, other.shape, other.dtype)
    assert ours.batch_sizes is packed.batch_sizes  # on the host, as its .to() keeps it
    assert on("cpu", packed.data)  # the input is as it was
    # Before, its .to() copied data on its own: the batch's reference came back a second copy.
    moved: dict[str, Any] = dk.to_device(
        {"ps": packed, "d": packed.data, "i": packed.sorted_indices}, META
    )
    assert moved["ps"].data is moved["d"]
    assert moved["ps"].sorted_indices is moved["i"]
    assert dk.to_device(packed, "cpu") is packed  # nothing to move: itself, as its .to()
    plain = torch.nn.utils.rnn.pack_sequence([torch.ones(2), torch.ones(1)])  # no indices
    assert dk.to_device(plain, META).sorted_indices is None


class _TakesNonBlocking:
    seen: list[bool] = []  # noqa: RUF012 - reset per test

    def to(self, device: torch.device, *, non_blocking: bool = False) -> _TakesNonBlocking:
        self.seen.append(non_blocking)
        return self  # pretend it moved: there is no GPU here


class _TakesADeviceOnly:
    def to(self, device: torch.device) -> _TakesADeviceOnly:
        return self


@pytest.mark.parametrize(
    ("device", "forced", "expected"),
    [
        (torch.device("cuda", 0), None, [True]),  # the policy: non-blocking to an accelerator
        (torch.device("cuda", 0), False, [False]),
        (META, None, [True]),
        # To the host it blocks even when forced: to_device cannot see where the object's
        # tensors come from, to wait for them before returning.
        (torch.device("cpu"), True, [False]),
        (torch.device("cpu"), None, [False]),
    ],
)
def test_an_object_s_own_to_gets_the_copy_policy_where_it_takes_non_blocking(
    device: torch.device, forced: bool | None, expected: list[bool]
) -> None:
    # Before, every object's own .to() was called with the device alone: blocking copies.
    _TakesNonBlocking.seen = []
    mover = _mover._Mover(device, forced)
    try:
        mover.move([_TakesNonBlocking(), _TakesADeviceOnly()])  # the second: no keyword
    finally:
        mover.finish()
    assert _TakesNonBlocking.seen == expected


class _ToNone:
    def to(self, device: torch.device) -> None:
        pass


class _Opaque:
    def __init__(self) -> None:
        self.tensor = torch.ones(1)


@pytest.mark.parametrize(
    ("make", "told"),
    [
        (lambda: {"o": _ToNone(), "x": torch.ones(1)}, r"_ToNone\.to\(\) returned None"),
        (lambda: {"o": _Opaque(), "x": torch.ones(1)}, r"returned a .*_Opaque as it is"),
        (lambda: {(1, torch.ones(1)): 1}, r"a key holds a tensor not on meta"),
        (_positions_class(), r"Positions\.pos is not on meta"),  # each call: a new model
    ],
    ids=["returned None", "left unchanged", "dict key", "module attribute"],
)
def test_once_per_class_warnings_made_errors_are_raised_again_not_passed_over(
    make: Callable[[], Any], told: str
) -> None:
    # Before, each class was marked told before warnings.warn ran: under
    # simplefilter("error") the first call raised and the second passed in silence.
    _movewarn._warned_returned_none.discard(_ToNone)
    for cls in (_Opaque, _movecalls.DictKey):
        _movemodule.looks_left.pop(cls, None)
    batch = make()
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match=told):
                dk.to_device(batch, META)
    with pytest.warns(RuntimeWarning, match=told):
        dk.to_device(batch, META)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.to_device(batch, META)  # told once: never again
    _movemodule.looks_left.pop(_movecalls.DictKey, None)


class _KeepsItsOwnParameters(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.decay = [self.fc.weight]  # a plain list of its own parameters


class _KeepsItsOwnBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(2))
        self.held = {"scale": self.scale}  # a buffer: Module.to() always replaces those


def test_an_attribute_holding_the_module_s_replaced_parameters_is_told_so() -> None:
    # Before: "held as a plain attribute; module.parameters() and state_dict() leave them
    # out. Use nn.ParameterList": they were registered, and Module.to() made new ones.
    _movewarn._warned_left.clear()  # told once per class and path: as if never told
    model = _KeepsItsOwnParameters()
    with pytest.warns(RuntimeWarning) as told:
        dk.to_device(model, META)
    said = str(told[0].message)
    assert (
        "_KeepsItsOwnParameters.decay[0] is the module's old parameter fc.weight, not on meta"
        in said
    )
    assert "read it through the module (model.fc.weight)" in said
    assert "build _KeepsItsOwnParameters.decay again after moving the model" in said
    assert "ParameterList" not in said
    with pytest.warns(
        RuntimeWarning,
        match=r"_KeepsItsOwnBuffer\.held\['scale'\] is the module's old buffer scale, not on "
        r"meta\. Where it is used, read it through the module \(model\.scale\)",
    ):
        dk.to_device(_KeepsItsOwnBuffer(), "meta")
    # A parameter that was never registered keeps check_module's advice.
    never = torch.nn.Linear(2, 2)
    never.__dict__["extra"] = [torch.nn.Parameter(torch.ones(1))]
    with pytest.warns(RuntimeWarning, match=r"Use nn\.ParameterList"):
        dk.to_device(never, META)


def test_distributed_data_parallel_s_own_bookkeeping_is_not_warned_of(
    tmp_path: Path,
) -> None:
    # Before: "DistributedDataParallel._module_parameters[0] is not on meta", torch's own.
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dk.to_device({"model": wrapped}, META)
        assert on(META, wrapped.module.weight)
    finally:
        dist.destroy_process_group()
