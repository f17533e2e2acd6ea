"""to_device on containers that are not plain: each is rebuilt, and the input is never written."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, MutableMapping
from typing import Any

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
        from devicekit import _placement
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
