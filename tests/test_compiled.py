"""to_device inside a function torch.compile traces: no graph break, eager's results."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import devicekit as dk

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402 - after the skip

META = torch.device("meta")
Pair = collections.namedtuple("Pair", "label tensor")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def _breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("device", ["meta", META, "cpu"])
def test_a_compiled_step_moves_its_batch_in_one_graph(device: Any) -> None:
    # Before: sys.getrefcount and the per-thread mover broke the graph three times,
    # and fullgraph=True refused the step ("Dynamo does not know how to trace").
    @torch.compile(backend="eager", fullgraph=True)
    def step(batch: dict[str, Any]) -> tuple[Any, ...]:
        moved = dk.to_device(batch, device)
        return moved["x"] + 1, moved["y"][0] * 2, moved["pair"], moved["y"][1] is moved["x"]

    t = torch.ones(2)
    x, y, pair, shared = step({"x": t, "y": [torch.ones(3), t], "pair": Pair("a", t)})
    target = torch.device(device)
    assert x.device == target
    assert y.device == target
    assert type(pair) is Pair
    assert pair.label == "a"
    assert pair.tensor.device == target
    assert shared is True  # a tensor reached twice is moved once, as eager does
    assert _breaks() == 0


def test_a_compiled_step_gives_what_eager_gives_with_a_tensor_held_twice_or_not() -> None:
    def step(batch: dict[str, Any]) -> bool:
        moved = dk.to_device(batch, META)
        return moved["a"] is moved["b"][0]

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    t = torch.ones(1)
    shared, apart = {"a": t, "b": (t,)}, {"a": t, "b": (torch.ones(1),)}
    assert compiled(shared) is step(shared) is True
    assert compiled(apart) is step(apart) is False  # dynamo guards on the aliasing


def test_what_the_traced_walk_does_not_rebuild_is_moved_eagerly_outside_the_graph() -> None:
    @torch.compile(backend="eager")
    def step(batch: dict[str, Any]) -> Any:
        return dk.to_device(batch, META)

    moved = step({"record": Batch(torch.ones(1)), "x": torch.ones(1), "n": 3})
    assert type(moved["record"]) is Batch
    assert moved["record"].x.device == META  # moved, by the eager walk
    assert moved["x"].device == META
    assert moved["n"] == 3
    assert _breaks() > 0  # the eager walk runs outside the graph


def test_eager_calls_never_take_the_traced_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit import _placement

    def refuse(*args: object) -> None:
        raise AssertionError("the traced walk ran in eager mode")

    monkeypatch.setattr(_placement, "traced_move", refuse)
    moved = dk.to_device({"x": torch.ones(1)}, META)
    assert moved["x"].device == META


def test_the_default_device_is_resolved_in_a_full_graph() -> None:
    # Before: try_gpu() and resolve_device() read the machine (accelerator_type's
    # inspect.signature, the device count), which dynamo cannot trace: fullgraph=True
    # refused dk.to_device(batch) ("Unsupported: Observed exception").
    @torch.compile(backend="eager", fullgraph=True)
    def step(batch: dict[str, Any]) -> Any:
        return dk.to_device(batch)["x"] + 1

    assert step({"x": torch.ones(1)}).device == dk.try_gpu()
    assert _breaks() == 0


def test_a_device_this_machine_lacks_is_refused_while_tracing_with_the_same_words() -> None:
    @torch.compile(backend="eager", fullgraph=True)
    def step(batch: dict[str, Any]) -> Any:
        return dk.to_device(batch, "cuda:7")

    with pytest.raises(Exception, match=r"device='cuda:7' .*(no CUDA support|does not exist)"):
        step({"x": torch.ones(1)})


def test_a_batch_with_anything_else_is_moved_whole_by_the_eager_walk_as_eager_moves_it() -> None:
    # A review found a first version mixing the two walks: a tensor shared by a plain
    # part and a dataclass came back as two copies, a module's parameter as a plain tensor.
    linear = torch.nn.Linear(2, 2)
    t = torch.ones(1)

    def step(batch: dict[str, Any]) -> tuple[bool, bool, type]:
        moved = dk.to_device(batch, META)
        return moved["t"] is moved["d"].x, moved["w"] is moved["m"].weight, type(moved["w"])

    batch = {"t": t, "d": Batch(t), "m": linear, "w": linear.weight}
    assert torch.compile(step, backend="eager")(batch) == (True, True, torch.nn.Parameter)


def test_a_batch_that_contains_itself_gets_eager_s_error_while_tracing() -> None:
    looped: list[Any] = [torch.ones(1)]
    looped.append(looped)

    @torch.compile(backend="eager")
    def step(batch: list[Any]) -> Any:
        return dk.to_device(batch, META)

    with pytest.raises(ValueError, match=r"contains itself: obj\[1\] is obj"):
        step(looped)


def test_a_step_given_its_device_as_a_string_compiles_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A review found the traced call filling the cache of parsed strings, which dynamo
    # guarded on, so the second call compiled the step again; and the walk's memo took
    # id() of each tensor, which dynamo guards on too: each new batch compiled it again.
    from devicekit import _devices

    monkeypatch.setattr(_devices, "_strings_read", {})  # as in a fresh process
    graphs: list[Any] = []

    def counting(graph: Any, inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    @torch.compile(backend=counting)
    def step(batch: dict[str, Any]) -> Any:
        return dk.to_device(batch, "meta")["x"] + 1

    for _ in range(3):
        step({"x": torch.ones(1)})
    assert len(graphs) == 1
