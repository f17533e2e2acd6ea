"""to_device on containers that are not plain: each is rebuilt, and the input is never written."""

from __future__ import annotations

import array
import collections
import dataclasses
import gc
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, ClassVar

import pytest
import torch

import devicekit as dk

from .conftest import run_python

META = torch.device("meta")


class Lazy(MutableMapping[int, Any]):
    """Builds each value when it is read, as a lazy loader does: nothing holds it after."""

    def __init__(self) -> None:
        self.set: dict[int, Any] = {}

    def __getitem__(self, key: int) -> Any:
        if key in self.set:
            return self.set[key]
        return torch.zeros(key) if key % 2 else "label"

    def __setitem__(self, key: int, value: Any) -> None:
        self.set[key] = value

    def __delitem__(self, key: int) -> None:
        del self.set[key]

    def __iter__(self) -> Iterator[int]:
        return iter(range(1, 9))

    def __len__(self) -> int:
        return 8


def test_values_built_on_access_are_each_moved_as_themselves() -> None:
    # The memo is keyed by id(): a value freed during the walk must not lend its id.
    # Several of them: each mapping's values must outlive its own rebuild, too.
    for moved in dk.to_device([Lazy(), Lazy(), Lazy()], META):
        assert [tuple(moved[key].shape) for key in (1, 3, 5, 7)] == [(1,), (3,), (5,), (7,)]
        assert all(moved[key].is_meta for key in (1, 3, 5, 7))
        assert [moved[key] for key in (2, 4, 6, 8)] == ["label"] * 4


class Store(MutableMapping[str, Any]):
    """A MutableMapping whose items live in a dict attribute: a shallow copy shares it."""

    def __init__(self, **items: Any) -> None:
        self._data = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Journal(dict[str, Any]):
    """A dict subclass that notes each write in a list attribute."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[str] = []

    def __setitem__(self, key: str, value: Any) -> None:
        self.writes.append(key)
        super().__setitem__(key, value)


def test_a_copy_that_shares_storage_never_writes_into_the_input() -> None:
    tensor = torch.ones(2)
    store = Store(x=tensor, label="a")
    moved = dk.to_device(store, META)
    assert type(moved) is Store
    assert moved["x"].is_meta
    assert moved["label"] == "a"
    assert store["x"] is tensor  # the input still holds its own tensor
    journal = Journal(x=tensor)
    moved_journal = dk.to_device(journal, META)
    assert journal.writes == []
    assert moved_journal.writes == ["x"]
    assert moved_journal["x"].is_meta


class Box:
    def __init__(self) -> None:
        self.items: dict[str, Any] = {}


class Boxed(MutableMapping[str, Any]):
    """Its storage is one object further than a shallow copy reaches."""

    def __init__(self, **items: Any) -> None:
        self.box = Box()
        self.box.items.update(items)

    def __getitem__(self, key: str) -> Any:
        return self.box.items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.box.items[key] = value

    def __delitem__(self, key: str) -> None:
        del self.box.items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.box.items)

    def __len__(self) -> int:
        return len(self.box.items)


def test_a_copy_that_still_writes_into_the_input_is_put_back_and_refused() -> None:
    tensor = torch.ones(2)
    boxed = Boxed(x=tensor)
    with pytest.raises(TypeError, match=r"cannot copy a .*Boxed without changing it.*__copy__"):
        dk.to_device(boxed, META)
    assert boxed["x"] is tensor


class FrozenDict(dict[str, Any]):
    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError("immutable")

    def __copy__(self) -> FrozenDict:
        return self  # immutable, so its copy is itself


@dataclasses.dataclass(frozen=True)
class FrozenCopiesItself:
    x: torch.Tensor

    def __copy__(self) -> FrozenCopiesItself:
        return self


def test_a_class_whose_copy_is_itself_is_rebuilt_not_written() -> None:
    tensor = torch.ones(2)
    frozen = FrozenDict(x=tensor)
    moved = dk.to_device(frozen, META)
    assert moved is not frozen
    assert type(moved) is FrozenDict
    assert moved["x"].is_meta
    assert frozen["x"] is tensor
    record = FrozenCopiesItself(tensor)
    moved_record = dk.to_device(record, META)
    assert moved_record is not record
    assert moved_record.x.is_meta
    assert record.x is tensor


class Tagged(set[Any]):
    def __init__(self, name: str, items: Any = ()) -> None:
        super().__init__(items)
        self.name = name


class FrozenTagged(frozenset[Any]):
    name = "class default"


def test_set_subclasses_keep_their_items_and_attributes() -> None:
    tensor = torch.ones(2)
    moved = dk.to_device(Tagged("inputs", [tensor, "label"]), META)
    assert type(moved) is Tagged
    assert moved.name == "inputs"
    assert len(moved) == 2
    assert "label" in moved
    assert all(item.is_meta for item in moved if isinstance(item, torch.Tensor))
    frozen = FrozenTagged([tensor])
    frozen.name = "mine"  # type: ignore[misc]
    moved_frozen = dk.to_device(frozen, META)
    assert type(moved_frozen) is FrozenTagged
    assert moved_frozen.name == "mine"
    assert next(iter(moved_frozen)).is_meta


class AttrDict(dict[str, Any]):
    """Items readable as attributes, as EasyDict and ml_collections do."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def test_a_key_named_to_is_not_a_to_method() -> None:
    batch = AttrDict(x=torch.ones(2), to=lambda device: None)
    moved = dk.to_device(batch, META)
    assert type(moved) is AttrDict
    assert moved["x"].is_meta  # moved as a mapping, not through the "to" item


@dataclasses.dataclass
class Route:
    x: torch.Tensor
    to: Callable[[Any], str] = str  # a field whose default is a callable class attribute


def test_a_dataclass_field_named_to_is_not_a_to_method() -> None:
    moved = dk.to_device(Route(torch.ones(2)), META)
    assert type(moved) is Route
    assert moved.x.is_meta  # moved as a dataclass, not replaced by str(META)
    assert moved.to is str


def test_a_debugger_tracing_the_import_does_not_break_sharing() -> None:
    # A trace function that reads frame.f_locals (a debugger's variables view) adds a
    # reference to each local while the reference counts are calibrated at import.
    result = run_python(
        """
        import json, sys, torch

        def tracer(frame, event, arg):
            frame.f_locals
            return tracer

        sys.settrace(tracer)
        from devicekit import _mover
        sys.settrace(None)
        import devicekit as dk

        shared = torch.ones(3)
        batch = [shared, [shared]]
        del shared
        moved = dk.to_device(batch, "meta")
        print(json.dumps({"shared": moved[0] is moved[1][0]}))
        """
    )
    assert result == {"shared": True}


class Named(collections.OrderedDict[str, Any]):
    def __init__(self, name: str, *args: Any) -> None:
        super().__init__(*args)
        self.name = name


class Defaulted(collections.defaultdict[str, Any]):
    def __init__(self, name: str) -> None:
        super().__init__(list)
        self.name = name


def test_subclasses_with_their_own_init_are_copied_without_calling_it() -> None:
    named = Named("batch", [("b", torch.ones(1)), ("a", torch.ones(1))])
    moved = dk.to_device(named, META)
    assert type(moved) is Named
    assert moved.name == "batch"
    assert list(moved) == ["b", "a"]
    assert all(value.is_meta for value in moved.values())
    defaulted = Defaulted("counts")
    defaulted["x"].append(torch.ones(1))
    moved_defaulted = dk.to_device(defaulted, META)
    assert (type(moved_defaulted), moved_defaulted.name) == (Defaulted, "counts")
    assert moved_defaulted.default_factory is list
    assert moved_defaulted["x"][0].is_meta


def test_chain_maps_are_copied_their_own_way() -> None:
    tensor = torch.ones(1)
    chain = collections.ChainMap({}, {"x": tensor})
    moved = dk.to_device(chain, META)
    assert type(moved) is collections.ChainMap
    assert moved["x"].is_meta
    assert chain.maps == [{}, {"x": tensor}]  # the input, untouched


class Audited(collections.OrderedDict[str, Any]):
    """An OrderedDict subclass whose __setitem__ needs its own state."""

    def __init__(self, *args: Any) -> None:
        self.audit: list[str] = []
        super().__init__(*args)

    def __setitem__(self, key: str, value: Any) -> None:
        self.audit.append(key)
        super().__setitem__(key, value)


class ReadOnlyOrdered(collections.OrderedDict[str, Any]):
    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError("read-only")


class SlottedJournal(dict[str, Any]):
    __slots__ = ("__private", "writes")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.writes: list[str] = []
        self.__private = "kept"

    def __setitem__(self, key: str, value: Any) -> None:
        self.writes.append(key)
        super().__setitem__(key, value)

    def private(self) -> str:
        return self.__private


def test_subclasses_with_state_in_setitem_or_slots_leave_the_input_alone() -> None:
    tensor = torch.ones(1)
    audited = Audited([("a", tensor)])
    audited.audit.clear()
    moved = dk.to_device(audited, META)
    assert (audited.audit, moved.audit, moved["a"].is_meta) == ([], ["a"], True)
    frozen = ReadOnlyOrdered()
    for key in ("b", "a"):
        collections.OrderedDict.__setitem__(frozen, key, tensor)  # as its own code fills it
    read_only = dk.to_device(frozen, META)
    assert type(read_only) is ReadOnlyOrdered
    assert list(read_only) == ["b", "a"]
    assert read_only["a"].is_meta
    journal = SlottedJournal({"x": tensor})
    moved_journal = dk.to_device(journal, META)
    assert journal.writes == []  # the slot's list is the copy's own
    assert moved_journal.writes == ["x"]
    assert moved_journal.private() == "kept"  # a private slot, under its mangled name


class Built(list[Any]):
    """Yields values it builds as it goes, as a lazy sequence does."""

    def __iter__(self) -> Iterator[Any]:
        return (torch.zeros(k) if k % 2 else "label" for k in range(1, 9))


class BuiltTuple(tuple[Any, ...]):
    def __iter__(self) -> Iterator[Any]:
        return (torch.zeros(k) if k % 2 else "label" for k in range(1, 9))


def test_items_built_by_a_sequence_subclass_are_each_moved_as_themselves() -> None:
    for moved in dk.to_device([Built([0]), Built([0]), BuiltTuple([0]), BuiltTuple([0])], META):
        stored = list.__iter__(moved) if isinstance(moved, list) else tuple.__iter__(moved)
        tensors = [item for item in stored if isinstance(item, torch.Tensor)]  # what it holds
        assert [tuple(tensor.shape) for tensor in tensors] == [(1,), (3,), (5,), (7,)]
        assert all(tensor.is_meta for tensor in tensors)


class NamedFrozen(frozenset[Any]):
    def __new__(cls, name: str, items: Any = ()) -> NamedFrozen:
        made = super().__new__(cls, items)
        made.name = name  # type: ignore[attr-defined]
        return made


class WithTo(type):
    def to(cls, device: Any) -> None:  # a metaclass's method: the class has it, not instances
        raise AssertionError("never called on an instance")


class Configured(metaclass=WithTo):
    pass


def test_frozenset_subclass_with_its_own_new_and_a_metaclass_to() -> None:
    moved = dk.to_device(NamedFrozen("inputs", [torch.ones(1)]), META)
    assert (type(moved), moved.name, len(moved)) == (NamedFrozen, "inputs", 1)  # type: ignore[attr-defined]
    assert next(iter(moved)).is_meta
    configured = Configured()
    assert dk.to_device(configured, META) is configured  # no .to of its own: left as it is


# --- tuple subclasses ------------------------------------------------------------------

_Point = collections.namedtuple("_Point", "x y")


class TaggedPoint(_Point):
    """A namedtuple subclass without ``__slots__ = ()``: its instances have a __dict__."""


class ScaledPoint(collections.namedtuple("ScaledPoint", "x y")):
    __slots__ = ()

    def __new__(cls, x: Any, y: Any, *, scale: int) -> ScaledPoint:
        return super().__new__(cls, x * scale, y * scale)


class Labelled(tuple[Any, ...]):
    label: str

    def __new__(cls, items: Any, label: str) -> Labelled:
        made = super().__new__(cls, items)
        made.label = label
        return made


def test_tuple_subclasses_keep_their_attributes_and_skip_their_new() -> None:
    tensor = torch.ones(2)
    point = TaggedPoint(tensor, "y")
    point.source = "shard-7"  # type: ignore[attr-defined]
    moved = dk.to_device(point, META)
    assert (type(moved), moved.source, moved.y) == (TaggedPoint, "shard-7", "y")  # type: ignore[attr-defined]
    assert moved.x.is_meta
    assert point.x is tensor
    scaled = dk.to_device(ScaledPoint(tensor, 3, scale=2), META)  # its __new__ needs scale=
    assert (type(scaled), scaled.y) == (ScaledPoint, 6)  # stored as is, not scaled again
    assert scaled.x.is_meta
    labelled = dk.to_device(Labelled([tensor], "a"), META)  # its __new__ needs a label
    assert (type(labelled), labelled.label) == (Labelled, "a")
    assert labelled[0].is_meta
    shape = dk.to_device([torch.Size([2, 3])], META)[0]  # a C subclass: its own constructor
    assert (type(shape), shape) == (torch.Size, (2, 3))


# --- ChainMap ------------------------------------------------------------------------


class Scope(collections.ChainMap[str, Any]):
    def __init__(self, name: str, *maps: Any) -> None:
        super().__init__(*maps)
        self.name = name


def test_a_chain_map_keeps_each_map_in_its_place() -> None:
    overrides, defaults = {"x": torch.ones(2)}, {"mask": torch.ones(2)}
    chain = collections.ChainMap(overrides, defaults)
    moved = dk.to_device({"chain": chain, "defaults": defaults}, META)
    result = moved["chain"]
    assert type(result) is collections.ChainMap
    assert [list(m) for m in result.maps] == [["x"], ["mask"]]  # nothing copied into maps[0]
    assert result.maps[1] is moved["defaults"]  # a map shared with the rest stays shared
    assert result.parents["mask"].is_meta
    assert result.new_child()["mask"] is result["mask"]
    with pytest.raises(KeyError, match="first mapping"):
        del result["mask"]  # a later map's item, as in the input: no old tensor uncovered
    assert chain.maps[0] is overrides
    assert chain.maps[1] is defaults
    assert list(overrides) == ["x"]  # the input's maps, untouched
    assert not overrides["x"].is_meta
    assert not defaults["mask"].is_meta
    scope = dk.to_device(Scope("eval", {"y": torch.ones(1)}), META)  # made without its __init__
    assert (type(scope), scope.name, scope["y"].is_meta) == (Scope, "eval", True)


# --- read-only and weak mappings -------------------------------------------------------


class Config(Mapping[str, Any]):
    """Read-only, built from keywords: ``Config(mapping)`` is not a copy of it."""

    def __init__(self, name: str = "default", **items: Any) -> None:
        self.name, self._items = name, dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Schema(Config):
    def __init__(self, items: dict[str, Any], version: int) -> None:
        super().__init__("schema", **items)


class Wrapping(Config):
    """Takes a mapping, and wraps each value: its values are never the moved ones."""

    def __init__(self, items: dict[str, Any]) -> None:
        self.name, self._items = "wrapped", {key: [value] for key, value in items.items()}


def test_a_read_only_mapping_its_constructor_cannot_rebuild_is_refused() -> None:
    config = Config("run1", x=torch.ones(2))
    with pytest.raises(
        TypeError,
        match=r"cannot rebuild the read-only mapping tests\.test_rebuild\.Config: "
        r"Config\(mapping_of_moved_values\) returned one with the keys \[\] instead of "
        r"\['x'\]\. Give Config a \.to\(device\) method, or a constructor that takes a mapping",
    ):
        dk.to_device(config, META)
    with pytest.raises(
        TypeError, match=r"Schema\(mapping_of_moved_values\) raised TypeError"
    ) as info:
        dk.to_device(Schema({"x": torch.ones(1)}, version=2), META)
    assert isinstance(info.value.__cause__, TypeError)  # the constructor's own error
    assert "version" in str(info.value.__cause__)
    wrapped = dk.to_device(Wrapping({"x": torch.ones(1)}), META)  # same keys: accepted
    assert wrapped["x"][0][0].is_meta


class CpuOnly(dict[str, Any]):
    """Validates what it is given: its refusal is its own rule, not a read-only class's."""

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise TypeError(f"{key!r} must stay on the cpu")  # the type read-only ones raise
        super().__setitem__(key, value)


class ShapeChecked(collections.UserList[Any]):
    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise ValueError("no meta tensors")
        super().__setitem__(index, value)


class FrozenError(Exception):
    pass


class Sealed(dict[str, Any]):
    """Read-only with an error of its own: rebuilt, whatever it raises."""

    def __setitem__(self, key: str, value: Any) -> None:
        raise FrozenError(f"{type(self).__name__} is sealed")


def test_a_class_that_refuses_a_moved_value_raises_its_own_error_with_a_note() -> None:
    tensor = torch.ones(2)
    checked = CpuOnly(a=tensor, n=1)
    with pytest.raises(TypeError, match="'a' must stay on the cpu") as info:
        dk.to_device(checked, META)
    note = "\n".join(info.value.__notes__)
    assert "moves a tests.test_rebuild.CpuOnly by setting each moved value into a copy" in note
    assert "CpuOnly.__setitem__, which refused item 'a'" in note
    assert "not a read-only class" in note
    assert "Move its tensors yourself, as CpuOnly allows, or give CpuOnly a .to(device)" in note
    assert checked == {"a": tensor, "n": 1}
    assert checked["a"] is tensor  # the input is untouched
    with pytest.raises(ValueError, match="no meta tensors") as info:
        dk.to_device(ShapeChecked([1, torch.ones(1)]), META)
    assert "ShapeChecked.__setitem__, which refused item 1" in "\n".join(info.value.__notes__)


def test_read_only_dict_subclasses_are_rebuilt_whatever_they_raise() -> None:
    from torch.fx.immutable_collections import immutable_dict

    tensor = torch.ones(1)
    for frozen in (Sealed(x=tensor, n=3), immutable_dict(x=tensor, n=3)):
        moved = dk.to_device(frozen, META)
        assert type(moved) is type(frozen)
        assert moved["x"].is_meta
        assert moved["n"] == 3
        assert frozen["x"] is tensor


class FrozenConfig(collections.UserDict[str, Any]):
    """Read-only, and not a dict: to_device cannot tell its refusal from a validating one."""

    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is read-only")


class LateKey(collections.UserDict[str, Any]):
    """Takes every key but "b"."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "b":
            raise ValueError("b is fixed")
        super().__setitem__(key, value)


def test_the_note_on_a_refusal_says_only_what_was_checked() -> None:
    # It said "It takes other values, so this is its own rule, not a read-only class" of a
    # first item it never checked another value of.
    frozen = FrozenConfig()
    frozen.data.update(x=torch.ones(1))
    with pytest.raises(TypeError, match="FrozenConfig is read-only") as info:
        dk.to_device(frozen, META)
    note = "\n".join(info.value.__notes__)
    assert "FrozenConfig.__setitem__, which refused item 'x'. Move its tensors yourself" in note
    assert "takes other values" not in note
    late = LateKey()
    late.data.update(a=torch.ones(1), b=torch.ones(1))
    with pytest.raises(ValueError, match="b is fixed") as info:
        dk.to_device(late, META)
    note = "\n".join(info.value.__notes__)
    assert "which refused item 'b'. It takes other values, so this is its own rule" in note


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class MetaRefused(dict[Any, Any]):
    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise TypeError("its tensors stay on the cpu")
        super().__setitem__(key, value)


def test_a_refused_key_whose_repr_raises_keeps_the_class_s_own_error() -> None:
    # The repr in the note raised inside the handler, and its RuntimeError replaced this one.
    key = Unprintable()
    with pytest.raises(TypeError, match="its tensors stay on the cpu") as info:
        dk.to_device(MetaRefused({key: torch.ones(1)}), META)
    note = "\n".join(info.value.__notes__)
    assert "which refused item <tests.test_rebuild.Unprintable object at 0x" in note


class Handle:
    """Something a WeakKeyDictionary can hold a weak reference to."""


def test_weak_value_dictionaries_are_refused_and_weak_key_ones_moved() -> None:
    tensor = torch.ones(1)
    cache = weakref.WeakValueDictionary({"k": tensor})
    with pytest.raises(
        TypeError,
        match=r"cannot move a weakref\.WeakValueDictionary: it holds its values weakly.*"
        r"to_device\(dict\(the_mapping\), device\)",
    ):
        dk.to_device({"cache": cache}, META)
    assert cache["k"] is tensor
    handle = Handle()
    registry = weakref.WeakValueDictionary({"a": handle})  # nothing in it moves: copied
    copied = dk.to_device({"x": tensor, "registry": registry}, META)["registry"]
    assert type(copied) is weakref.WeakValueDictionary
    assert dict(copied) == {"a": handle}
    weak_keys = weakref.WeakKeyDictionary({handle: tensor})
    moved = dk.to_device(weak_keys, META)
    gc.collect()
    assert type(moved) is weakref.WeakKeyDictionary
    assert moved[handle].is_meta  # its values are held strongly: still there
    assert weak_keys[handle] is tensor


# --- deques and other mutable sequences --------------------------------------------------


class Ring(collections.deque[Any]):
    def __init__(self, name: str, items: Any = (), maxlen: int | None = None) -> None:
        super().__init__(items, maxlen)
        self.name = name


class Frames(MutableSequence[Any]):
    """A user's mutable sequence, with its items in a list attribute."""

    def __init__(self, name: str, items: Any = ()) -> None:
        self.name, self._items = name, list(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self._items[index] = value

    def __delitem__(self, index: Any) -> None:
        del self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def insert(self, index: int, value: Any) -> None:
        self._items.insert(index, value)


def test_deques_and_mutable_sequences_keep_their_type_and_state() -> None:
    tensor = torch.ones(1)
    recent: collections.deque[Any] = collections.deque([tensor, "label"], maxlen=3)
    moved = dk.to_device(recent, META)
    assert (type(moved), moved.maxlen, moved[1]) == (collections.deque, 3, "label")
    assert moved[0].is_meta
    assert recent[0] is tensor
    ring = dk.to_device(Ring("recent", [tensor], maxlen=2), META)  # made without its __init__
    assert (type(ring), ring.name, ring.maxlen, ring[0].is_meta) == (Ring, "recent", 2, True)
    user = collections.UserList([tensor])
    assert dk.to_device(user, META)[0].is_meta
    assert user[0] is tensor
    frames = Frames("clip", [tensor, "label"])
    moved_frames = dk.to_device(frames, META)
    assert (type(moved_frames), moved_frames.name, moved_frames[1]) == (Frames, "clip", "label")
    assert moved_frames[0].is_meta
    assert frames[0] is tensor  # its list was copied before the copy was written
    looped: collections.deque[Any] = collections.deque([tensor])
    looped.append(looped)
    with pytest.raises(ValueError, match="contains itself"):
        dk.to_device(looped, META)


class ListBox:
    """Not a record: to_device neither walks into it nor copies it."""

    def __init__(self, items: Any) -> None:
        self.items = list(items)


class BoxedFrames(MutableSequence[Any]):
    """Its storage is one object further than a shallow copy reaches."""

    def __init__(self, items: Any = ()) -> None:
        self.box: Any = ListBox(items)

    def __getitem__(self, index: Any) -> Any:
        return self.box.items[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self.box.items[index] = value

    def __delitem__(self, index: Any) -> None:
        del self.box.items[index]

    def __len__(self) -> int:
        return len(self.box.items)

    def insert(self, index: int, value: Any) -> None:
        raise NotImplementedError


def test_a_sequence_copy_that_writes_into_the_input_is_put_back_and_refused() -> None:
    tensor = torch.ones(1)
    boxed = BoxedFrames([tensor])
    with pytest.raises(
        TypeError,
        match=r"cannot copy a .*BoxedFrames without changing it: setting item 0 of its copy",
    ):
        dk.to_device(boxed, META)
    assert boxed[0] is tensor


def test_storage_held_in_a_record_is_rebuilt_as_an_attribute_before_items_are_written() -> None:
    # The namespace is an attribute the copy moves (a copy of its own, its list rebuilt)
    # before its items are written: nothing is written into the input's.
    tensor = torch.ones(1)
    boxed = BoxedFrames([tensor, "label"])
    boxed.box = types.SimpleNamespace(items=[tensor, "label"])
    moved = dk.to_device(boxed, META)
    assert moved[0].is_meta
    assert moved[1] == "label"
    assert moved.box is not boxed.box
    assert boxed[0] is tensor


class Clip(Sequence[Any]):
    """A read-only sequence: documented as returned unchanged."""

    def __init__(self, items: Any) -> None:
        self._items = list(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


def test_byte_arrays_and_read_only_sequences_are_returned_unchanged() -> None:
    data, numbers, clip = bytearray(b"abc"), array.array("f", [1.0]), Clip([torch.ones(1)])
    with pytest.warns(RuntimeWarning, match=r"Clip as it is: .* \(Clip\._items\[0\]\)"):
        moved = dk.to_device([data, numbers, clip, range(3)], META)  # its tensor stays behind
    assert moved[0] is data  # mutable sequences of numbers: no copy, nothing to move
    assert moved[1] is numbers
    assert moved[2] is clip
    assert moved[3] == range(3)


def test_a_pydantic_model_copied_without_its_own_copy_keeps_its_private_values_apart() -> None:
    # Its __copy__ returns itself, so the copy is made without it and shares the
    # input's __pydantic_private__ dict: the moved values go into a new one.
    pydantic = pytest.importorskip("pydantic")

    class Model(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, frozen=True)
        x: torch.Tensor
        _cache: torch.Tensor | None = pydantic.PrivateAttr(default=None)

        def model_post_init(self, context: Any) -> None:
            self._cache = self.x * 2

        def __copy__(self) -> Model:
            return self

    model = Model(x=torch.ones(1))
    private = model.__pydantic_private__
    moved = dk.to_device(model, META)
    assert moved is not model
    assert isinstance(moved._cache, torch.Tensor)
    assert moved._cache.is_meta
    assert model.__pydantic_private__ is private
    assert isinstance(model._cache, torch.Tensor)
    assert model._cache.device.type == "cpu"


class SelfDict(dict[str, Any]):
    """The attribute-dict recipe: the instance is its own ``__dict__``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__ = self


def test_a_dict_that_is_its_own_dict_comes_back_its_own_dict() -> None:
    # Before, the copy's __dict__ was a second dict: r.mask = t wrote no item, and
    # r["z"] = 3 no attribute, silently, even where nothing moved.
    for target in (META, torch.device("cpu")):
        batch = SelfDict(x=torch.ones(2), y=1)
        moved = dk.to_device(batch, target)
        assert type(moved) is SelfDict
        assert moved.__dict__ is moved
        assert moved.x is moved["x"]
        assert moved.x.device == target
        moved.mask = torch.ones(1)
        assert "mask" in moved
        assert "mask" not in batch
        assert batch.__dict__ is batch
        assert batch["x"].device.type == "cpu"


class TensorList(list[Any]):
    """Checks each item it is given, as a list that checks shapes does."""

    def __setitem__(self, index: Any, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"TensorList holds tensors only, got {type(value).__name__}")
        super().__setitem__(index, value)


class FrozenList(list[Any]):
    def _read_only(self, *args: Any) -> None:
        raise TypeError("FrozenList is read-only")

    __setitem__ = __delitem__ = append = extend = insert = _read_only  # type: ignore[assignment]


class IndexChecked(list[Any]):
    """Checks an item set by index, and says so: a slice assignment skipped its check."""

    checked: ClassVar[list[int]] = []

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, int):
            IndexChecked.checked.append(index)
        super().__setitem__(index, value)


def test_a_list_subclass_gets_each_moved_item_by_index_with_its_own_setitem() -> None:
    # Before, `result[:] = moved` handed __setitem__ a list: refused by TensorList,
    # a read-only list's raw error with no note, and an index check never run.
    tensors = [torch.ones(2), torch.ones(3)]
    moved = dk.to_device(TensorList(tensors), META)
    assert type(moved) is TensorList
    assert [t.is_meta for t in moved] == [True, True]
    frozen = FrozenList(tensors)
    moved_frozen = dk.to_device(frozen, META)
    assert type(moved_frozen) is FrozenList
    assert [t.is_meta for t in moved_frozen] == [True, True]
    assert [t.device.type for t in frozen] == ["cpu", "cpu"]
    IndexChecked.checked = []
    moved_checked = dk.to_device(IndexChecked([torch.ones(1), "label", torch.ones(1)]), META)
    assert IndexChecked.checked == [0, 2]  # the items that moved, each by its index
    assert moved_checked[1] == "label"


def test_a_list_subclass_that_refuses_a_moved_item_says_which_and_keeps_the_input() -> None:
    class ShapeChecked(list[Any]):
        def __setitem__(self, index: Any, value: Any) -> None:
            if value.shape != (2,):
                raise ValueError(f"item {index} must have shape (2,)")
            super().__setitem__(index, value)

    given = ShapeChecked([torch.ones(2)])
    list.append(given, torch.ones(3))  # past its check, as a loader may build it
    with pytest.raises(ValueError, match=r"item 1 must have shape") as caught:
        dk.to_device(given, META)
    assert "__setitem__, which refused item 1" in caught.value.__notes__[0]
    assert [t.device.type for t in given] == ["cpu", "cpu"]


class HidesPrivate(dict[str, Any]):
    """Shows only its public entries, as a batch that keeps private ones does."""

    def keys(self) -> Any:
        return [key for key in dict.keys(self) if not key.startswith("_")]

    def items(self) -> Any:
        return [(key, self[key]) for key in self.keys()]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


def test_entries_a_dict_subclass_hides_are_kept_and_moved() -> None:
    # Before, the copy lost them (dict.update reads a subclass's own keys()), so
    # moved["_mask"] raised KeyError.
    batch = HidesPrivate(x=torch.ones(2), _mask=torch.ones(2), _name="train")
    moved = dk.to_device(batch, META)
    assert type(moved) is HidesPrivate
    assert list(dict.keys(moved)) == ["x", "_mask", "_name"]
    assert moved["x"].is_meta
    assert moved["_mask"].is_meta
    assert moved["_name"] == "train"
    assert batch["_mask"].device.type == "cpu"


def test_struct_sequences_keep_the_fields_outside_their_tuple_part() -> None:
    # Before: cls(items) set time.struct_time's tm_zone to None and made os.stat_result's
    # float st_mtime an int, and sys.version_info raised tuple.__new__'s "is not safe".
    import os
    import sys
    import time

    local, stat = time.localtime(), os.stat(".")
    moved = dk.to_device({"t": local, "s": stat, "v": sys.version_info}, "cpu")
    assert moved["t"].tm_zone == local.tm_zone
    assert moved["t"].tm_gmtoff == local.tm_gmtoff
    assert moved["s"].st_mtime == stat.st_mtime  # a float, not the tuple part's int
    assert moved["v"] is sys.version_info  # cannot be made again: nothing in it moved
    # A tensor inside, in the tuple part and outside it: both moved, the rest kept.
    t = torch.ones(1)
    held = time.struct_time((t, 2, 3, 4, 5, 6, 7, 8, 9), {"tm_zone": t, "tm_gmtoff": 60})
    copy = dk.to_device(held, META)
    assert type(copy) is time.struct_time
    assert copy.tm_year.device == META
    assert copy.tm_zone is copy.tm_year  # one tensor, moved once
    assert copy.tm_gmtoff == 60
    assert tuple(copy)[1:] == (2, 3, 4, 5, 6, 7, 8, 9)


def test_a_struct_sequence_with_tensors_is_rebuilt_and_one_already_there_is_itself() -> None:
    found = torch.max(torch.randn(3, 2), 0)
    moved = dk.to_device(found, META)
    assert type(moved) is type(found)
    assert moved.values.device == META
    assert moved.indices.device == META
    assert dk.to_device(found, "cpu") is found  # immutable: nothing to copy
