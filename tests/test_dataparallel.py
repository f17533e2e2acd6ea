"""data_parallel: refusals that keep the user's module as it was."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import devicekit as dk

from .conftest import FakeAccelerator


@pytest.mark.parametrize("devices", ["meta", ["meta"], [torch.device("meta")] * 2])
def test_the_meta_device_is_refused_and_the_weights_stay(devices: object) -> None:
    # Before, the module was moved to meta in place: its weights were gone.
    module = torch.nn.Linear(3, 3)
    weight = module.weight.detach().clone()
    with pytest.raises(ValueError, match=r"devices=.*meta.*its weights lost\. Pass GPUs or 'cpu'"):
        dk.data_parallel(module, devices)  # type: ignore[arg-type]
    assert torch.equal(module.weight, weight)


def test_a_module_built_on_meta_is_told_to_use_to_empty() -> None:
    # Before, torch's bare NotImplementedError from deep inside Module.to().
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(dk.TensorCopyError, match=r"module\.1\.weight to 'cpu'.*to_empty"):
        dk.data_parallel(module, "cpu")
    assert module[0].weight.device.type == "cpu"  # nothing moved before the refusal
    module.to_empty(device="cpu")  # the fix it gives
    assert dk.data_parallel(module, "cpu") is module


@pytest.mark.parametrize("devices", [[0, 0], ["cuda", "cuda:0"]])
def test_a_gpu_named_twice_is_refused_before_the_module_moves(
    devices: object, fake_accelerator: FakeAccelerator
) -> None:
    # Before, [cuda:0, cuda:0] went to nn.DataParallel: two replicas on one GPU.
    fake_accelerator("cuda", 2)
    module = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"^devices=.* names cuda:0 twice: nn.DataParallel"):
        dk.data_parallel(module, devices)  # type: ignore[arg-type]
    assert module.weight.device.type == "cpu"


def test_a_wrapped_module_is_unwrapped_not_wrapped_again() -> None:
    # Before, a notebook cell run again gave DataParallel in DataParallel.
    model = torch.nn.Linear(2, 2)
    wrapped = torch.nn.DataParallel(model, device_ids=[])
    assert dk.data_parallel(wrapped, "cpu") is model


class _CopiesOnTo(torch.nn.Module):
    """A module whose own .to() returns a moved copy, as some wrappers' do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def to(self, *args: Any, **kwargs: Any) -> _CopiesOnTo:
        copied = copy.deepcopy(self)
        torch.nn.Module.to(copied, *args, **kwargs)
        copied.__dict__["moved"] = True
        return copied


class _ForgetsToReturn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def to(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().to(*args, **kwargs)


def test_what_the_module_s_own_to_returns_is_the_model() -> None:
    # Before, the return value was dropped: a .to() that returns a copy gave back the
    # module unmoved.
    module = _CopiesOnTo()
    result = dk.data_parallel(module, "cpu")
    assert result is not module
    assert getattr(result, "moved", False)
    forgets = _ForgetsToReturn()
    assert dk.data_parallel(forgets, "cpu") is forgets  # None: moved in place, kept


def test_a_to_that_returns_no_module_is_refused_with_the_fix() -> None:
    class ReturnsADict(torch.nn.Module):
        def to(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
            return {}

    with pytest.raises(TypeError, match=r"own \.to\('cpu'\), which returned a dict, not a module"):
        dk.data_parallel(ReturnsADict(), "cpu")


@pytest.mark.parametrize("devices", [{0, 1}, frozenset({"cpu"}), {"cpu": 0}.keys()])
def test_a_set_of_devices_is_refused_the_first_device_would_depend_on_hashing(
    devices: object,
) -> None:
    # Before, a set was taken: the device that gathers the outputs depended on hash order.
    module = torch.nn.Linear(2, 2)
    with pytest.raises(
        TypeError,
        match=r"^data_parallel\(\) needs devices as a list or tuple, got a \w+ \(.*\): a set has "
        r"no order, .* Pass a list in the order you mean, the gathering device first",
    ):
        dk.data_parallel(module, devices)  # type: ignore[arg-type]
    assert module.weight.device.type == "cpu"
