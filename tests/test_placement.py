from __future__ import annotations

import collections
import dataclasses
import io
import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import devicekit as dk
from devicekit import _placement

from .conftest import GPU_COUNT, FakeAccelerator

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


@pytest.mark.parametrize("leaf", [1, 2.5, "text", b"bytes", None, int, 1j, object()])
def test_everything_else_is_returned_unchanged(leaf: object) -> None:
    assert dk.to_device([leaf], META)[0] is leaf


def test_classes_with_a_to_attribute_are_leaves() -> None:
    # nn.Linear.to is a function on the class; calling it would fail.
    assert dk.to_device([torch.nn.Linear], META)[0] is torch.nn.Linear


# --- sharing and cycles --------------------------------------------------------------


def test_shared_tensors_stay_shared() -> None:
    shared = torch.ones(2)
    moved = dk.to_device({"a": shared, "b": [shared], "c": Pair(shared, shared)}, META)
    assert moved["a"] is moved["b"][0] is moved["c"].left is moved["c"].right


def test_shared_containers_stay_shared() -> None:
    inner = [torch.ones(1)]
    moved = dk.to_device({"a": inner, "b": inner}, META)
    assert moved["a"] is moved["b"]


def test_tensors_already_there_are_not_copied() -> None:
    tensor = torch.ones(1)
    assert dk.to_device({"t": tensor}, "cpu")["t"] is tensor


def test_cycles_raise_with_the_path() -> None:
    looped: dict[str, Any] = {"x": [torch.ones(1)]}
    looped["x"].append(looped)
    with pytest.raises(
        ValueError,
        match=r"to_device\(\) cannot move a structure that contains itself: obj\['x'\]\[1\] is obj",
    ):
        dk.to_device(looped, META)


def test_cycle_through_a_dataclass() -> None:
    batch = Batch(torch.ones(1), {})
    batch.meta["self"] = batch
    with pytest.raises(ValueError, match=r"obj\.meta\['self'\] is obj\."):
        dk.to_device(batch, META)


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
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize(("forced", "expected"), [(None, True), (True, True), (False, False)])
def test_copies_to_a_device_are_non_blocking_unless_forced(
    forced: bool | None, expected: bool
) -> None:
    _Spy.seen = []
    dk.to_device([torch.ones(1).as_subclass(_Spy)], META, non_blocking=forced)
    assert _Spy.seen == [expected]


# --- load ------------------------------------------------------------------------------


def _saved_as_if_on(location: str, monkeypatch: pytest.MonkeyPatch, path: Path) -> Path:
    """Write a checkpoint whose storages claim to come from ``location`` (say cuda:1)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: location)
        torch.save({"w": torch.arange(4.0), "step": 7}, path)
    return path


def test_load_a_cuda1_checkpoint_anywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = _saved_as_if_on("cuda:1", monkeypatch, tmp_path / "ckpt.pt")
    if GPU_COUNT < 2:  # the problem devicekit solves: plain torch.load cannot place it
        with pytest.raises(RuntimeError):
            torch.load(path, weights_only=True)
    state = dk.load(path)
    assert state["step"] == 7
    assert state["w"].device == dk.try_gpu()
    assert torch.equal(state["w"].cpu(), torch.arange(4.0))


def test_load_to_an_explicit_device(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert on(META, dk.load(tmp_path / "w.pt", META)["w"])
    assert on(META, dk.load(tmp_path / "w.pt", map_location="meta")["w"])


def test_load_defaults_to_weights_only(tmp_path: Path) -> None:
    # An arbitrary class could run code when unpickled; weights_only refuses it.
    torch.save({"batch": Batch(torch.ones(1), {})}, tmp_path / "code.pt")
    with pytest.raises(Exception, match=r"(?i)weights.only"):
        dk.load(tmp_path / "code.pt", "cpu")
    assert type(dk.load(tmp_path / "code.pt", "cpu", weights_only=False)["batch"]) is Batch


def test_load_rejects_device_and_map_location_together() -> None:
    with pytest.raises(TypeError, match="takes device or map_location, not both"):
        dk.load(io.BytesIO(), "cpu", map_location="cpu")


# --- data_parallel ---------------------------------------------------------------------


def test_data_parallel_without_gpus_returns_the_module_moved(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_placement, "try_all_gpus", lambda: [torch.device("cpu")])
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        result = dk.data_parallel(model)
    assert result is model
    assert on("cpu", model.weight)
    assert caplog.records == []


def test_data_parallel_on_one_device_does_not_wrap() -> None:
    model = torch.nn.Linear(2, 2)
    assert dk.data_parallel(model, [META]) is model
    assert on(META, model.weight)


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
def test_load_a_gpu_checkpoint_to_the_cpu(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(3.0, device="cuda")}, tmp_path / "gpu.pt")
    state = dk.load(tmp_path / "gpu.pt", "cpu")
    assert on("cpu", state["w"])
    assert torch.equal(state["w"], torch.arange(3.0))


@pytest.mark.gpu
def test_data_parallel_with_one_gpu_moves_without_wrapping() -> None:
    model = dk.data_parallel(torch.nn.Linear(2, 2), [0])
    assert isinstance(model, torch.nn.Linear)
    assert model.weight.device == torch.device("cuda", 0)
