"""An object's own ``.to()`` that calls ``to_device`` on the object itself: no recursion.

devicekit's advice for a class it cannot move is "give it a .to(device)", and the
shortest such method is ``return dk.to_device(self, device)``. Before, that
recursed until Python's limit, and the error said to raise the limit.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any

import pytest
import torch

import devicekit as dk

META = torch.device("meta")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str = "train"
    calls: int = 0

    def to(self, device: Any) -> Batch:
        self.calls += 1
        return dk.to_device(self, device)


class Plain:
    def __init__(self) -> None:
        self.x = torch.ones(1)
        self.count = 3

    def to(self, device: Any) -> Plain:
        return dk.to_device(self, device)


class Slotted:
    __slots__ = ("x",)

    def __init__(self) -> None:
        self.x = torch.ones(1)

    def to(self, device: Any) -> Slotted:
        return dk.to_device(self, device)


class Items(dict[str, Any]):
    def to(self, device: Any) -> Items:
        return dk.to_device(self, device)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def to(self, *args: Any, **kwargs: Any) -> Net:  # type: ignore[override]
        return dk.to_device(self, args[0] if args else kwargs["device"])


def test_a_to_that_calls_to_device_on_itself_moves_the_object_as_what_it_is() -> None:
    batch = Batch(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing "left behind", nothing "returned as it is"
        moved = dk.to_device(batch, META)
        direct = batch.to(META)
        plain = dk.to_device(Plain(), META)
        slotted = dk.to_device(Slotted(), META)
        items = dk.to_device(Items(x=torch.ones(1)), META)
    for result in (moved, direct):
        assert type(result) is Batch
        assert result.x.is_meta
        assert result.label == "train"
    assert batch.x.device.type == "cpu"  # a copy: the input is as it was
    # Its .to() ran once for to_device(batch), and twice for batch.to(): the user's call,
    # then to_device's, which found it running and moved the batch as a dataclass.
    assert batch.calls == 3
    assert type(plain) is Plain
    assert plain.x.is_meta
    assert plain.count == 3
    assert slotted.x.is_meta
    assert type(items) is Items
    assert items["x"].is_meta


def test_one_such_object_reached_twice_is_moved_once() -> None:
    batch = Batch(torch.ones(2))
    moved = dk.to_device({"batch": batch, "again": [batch]}, META)
    assert moved["batch"] is moved["again"][0]
    assert batch.calls == 1


def test_a_module_whose_to_calls_to_device_on_itself_is_moved_in_place() -> None:
    for move in (lambda net: dk.to_device(net, META), lambda net: net.to(META)):
        net = Net()
        assert move(net) is net
        assert net.layer.weight.is_meta


def test_another_thread_calling_the_same_object_s_to_is_not_confused() -> None:
    # Which objects' .to() is running is kept per thread: while one thread is inside
    # the object's .to(), another thread's to_device calls that .to() as usual.
    inside, release = threading.Event(), threading.Event()
    seen: list[str] = []

    @dataclasses.dataclass
    class Slow:
        x: torch.Tensor

        def to(self, device: Any) -> Slow:
            seen.append(threading.current_thread().name)
            if threading.current_thread().name == "first":
                inside.set()
                release.wait(10)
            return dk.to_device(self, device)

    slow = Slow(torch.ones(1))
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(dk.to_device(slow, META)), name="first")
    first.start()
    assert inside.wait(10)
    results.append(dk.to_device(slow, META))  # this thread, while "first" is inside .to()
    release.set()
    first.join(10)
    assert seen == ["first", threading.current_thread().name]
    assert [result.x.is_meta for result in results] == [True, True]


def test_a_to_that_raises_is_unmarked_after() -> None:
    from devicekit import _movecalls

    class Fails:
        def to(self, device: Any) -> Fails:
            raise RuntimeError("no")

    fails = Fails()
    with pytest.raises(RuntimeError, match="no"):
        dk.to_device(fails, META)
    assert not _movecalls.calling_to(fails)


def test_a_weak_proxy_is_returned_as_it_is_without_a_warning() -> None:
    # Before, a proxy read as an iterator (its type forwards __next__), and the warning
    # said to pass list(proxy), which raises.
    import weakref

    class Context:
        def __init__(self) -> None:
            self.scale = torch.ones(1)

    context = Context()
    proxy = weakref.proxy(context)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moved = dk.to_device({"x": torch.ones(1), "context": proxy}, META)
    assert moved["context"] is proxy
    assert moved["x"].is_meta
    assert context.scale.device.type == "cpu"  # its referent is not the batch's to move


def test_torch_s_own_classes_get_advice_that_does_not_ask_for_a_to_method() -> None:
    # Before: "give Adam a .to(device)", which is not the user's to add.
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    normal = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
    from devicekit import _mover

    for cls in (type(optimizer), type(normal)):  # told once per class: this test's to see
        _mover.looks_left.pop(cls, None)
    with pytest.warns(RuntimeWarning) as caught:
        dk.to_device({"optimizer": optimizer, "normal": normal}, META)
    told = [str(warning.message) for warning in caught]
    assert not any("give Adam a .to" in said or "give Normal a .to" in said for said in told)
    assert any("make it after moving the model, or load_state_dict()" in said for said in told)
    assert any("torch's Normal has no .to() to call" in said for said in told)


def test_an_iterator_is_named_with_the_right_article() -> None:
    import itertools

    from devicekit import _mover

    _mover.looks_left.pop(itertools.count, None)
    with pytest.warns(RuntimeWarning, match=r"returned an itertools\.count as it is"):
        dk.to_device([itertools.count()], META)


def test_a_dead_weak_proxy_is_told_not_raised_bare() -> None:
    import gc
    import weakref

    class Gone:
        pass

    gone = Gone()
    proxy = weakref.proxy(gone)
    del gone
    gc.collect()
    for batch in ([proxy, torch.ones(1)], {"context": proxy}, proxy):
        with pytest.raises(ReferenceError) as caught:
            dk.to_device(batch, META)
        assert "a weak proxy (weakref.proxy) in obj whose object no longer" in str(
            caught.value.__notes__
        )


def test_an_optimizer_s_step_on_the_host_is_not_a_tensor_left_behind() -> None:
    # torch keeps Adam's state["step"] on the host on purpose: an optimizer made after
    # the model moved, as the advice says, was still warned of, at ['step'].
    from devicekit import _mover

    model = torch.nn.Linear(2, 2).to(META)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.state[model.weight].update(
        step=torch.tensor(1.0), exp_avg=torch.zeros(2, 2, device=META)
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    for cls in (type(optimizer), type(scheduler)):
        _mover.looks_left.pop(cls, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.to_device({"optimizer": optimizer, "scheduler": scheduler}, META)
    optimizer.state[model.weight]["exp_avg_sq"] = torch.zeros(2, 2)  # one left behind
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)))
    _mover.looks_left.pop(type(loader), None)
    with pytest.warns(RuntimeWarning) as caught:
        dk.to_device({"scheduler": scheduler, "loader": loader}, META)
    told = [str(warning.message) for warning in caught]
    assert any("StepLR.optimizer.state[" in said and "['exp_avg_sq']" in said for said in told)
    assert any("(a scheduler holds its optimizer)" in said for said in told)
    assert any("A DataLoader hands out batches" in said for said in told)
    dataset = torch.utils.data.TensorDataset(torch.ones(4, 2))
    _mover.looks_left.pop(type(dataset), None)
    with pytest.warns(RuntimeWarning, match=r"A dataset's items stay on the host, where"):
        dk.to_device([dataset], META)


def test_an_optimizer_s_host_counters_of_every_kind_are_not_left_behind() -> None:
    # NAdam keeps mu_product on the host too (Adam only step): warned of before.
    from devicekit import _mover

    model = torch.nn.Linear(2, 2).to(META)
    optimizer = torch.optim.NAdam(model.parameters())
    for param in model.parameters():  # as NAdam's step leaves it, not capturable
        optimizer.state[param].update(
            step=torch.tensor(1.0),
            mu_product=torch.tensor(0.9),
            exp_avg=torch.zeros_like(param),
            exp_avg_sq=torch.zeros_like(param),
        )
    _mover.looks_left.pop(type(optimizer), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.to_device([optimizer], META)


def test_a_reference_error_of_an_object_s_own_is_not_told_as_a_dead_proxy() -> None:
    class Cached:
        def to(self, device: Any) -> Cached:
            raise ReferenceError("my cache is gone")

    with pytest.raises(ReferenceError, match="my cache is gone") as caught:
        dk.to_device([Cached()], META)
    assert not any("weak proxy" in note for note in getattr(caught.value, "__notes__", []))


def test_a_future_is_named_as_its_module_shows_it_and_told_how_to_get_its_value() -> None:
    import asyncio
    import concurrent.futures

    from devicekit._movecalls import waits_for

    # Before, an asyncio task was named by its C module: "_asyncio.Task".
    assert waits_for(asyncio.Task) == ("asyncio.Task", "await future")
    assert waits_for(asyncio.Future) == ("asyncio.Future", "await future")
    assert waits_for(concurrent.futures.Future) == ("concurrent.futures.Future", "future.result()")
    assert waits_for(torch.futures.Future) == ("torch.futures.Future", "future.wait()")

    class Mine(concurrent.futures.Future):  # type: ignore[type-arg]
        pass

    assert waits_for(Mine) == (f"{__name__}.{Mine.__qualname__}", "future.result()")
    assert waits_for(list) is None
