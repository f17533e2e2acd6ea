"""to_device with modules whose registries are not dicts, or whose class is made by torch.

A TorchScript module (torch.jit.script, torch.jit.trace) keeps its parameters and
buffers in C++, behind torch's OrderedDictWrapper (items() and [] only, no .get()). A
torch.fx GraphModule, a torch.compile'd OptimizedModule and a parametrized module are
the other modules torch builds for you: each must move inside a batch as any module
does, its tensors in the batch coming back as its own.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import devicekit as dk

META = torch.device("meta")


def _quietly(make: Callable[[], nn.Module]) -> nn.Module:
    with warnings.catch_warnings():
        # torch.jit is deprecated (torch 2.9+), and fx/compile may say they are beta.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return make()


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).T


def _parametrized() -> nn.Module:
    model = nn.Linear(2, 2)
    model.register_buffer("scale", torch.ones(2))
    parametrize.register_parametrization(model, "weight", _Symmetric())
    return model


MAKERS: dict[str, Callable[[], nn.Module]] = {
    "jit.script": lambda: torch.jit.script(nn.BatchNorm1d(2)),
    "jit.trace": lambda: torch.jit.trace(nn.BatchNorm1d(2).eval(), torch.ones(3, 2)),
    "fx.GraphModule": lambda: torch.fx.symbolic_trace(nn.Sequential(nn.BatchNorm1d(2))),
    "torch.compile": lambda: torch.compile(nn.BatchNorm1d(2)),
    "parametrize": _parametrized,
}


def _first_parameter(model: nn.Module) -> torch.Tensor:
    return next(iter(model.parameters()))


def _first_buffer(model: nn.Module) -> torch.Tensor:
    return next(b for b in model.buffers() if b.is_floating_point())


@pytest.fixture(params=sorted(MAKERS))
def model(request: pytest.FixtureRequest) -> nn.Module:
    return _quietly(MAKERS[request.param])


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("module_first", [True, False])
def test_a_module_torch_made_moves_in_a_batch_with_its_tensors_its_own(
    model: nn.Module, device: str, module_first: bool
) -> None:
    # Before, a TorchScript module in anything but itself raised AttributeError:
    # 'OrderedDictWrapper' object has no attribute 'get', after Module.to moved it.
    weight, mean = _first_parameter(model), _first_buffer(model)
    tensors: dict[str, Any] = {"x": torch.ones(1, 2), "w": weight, "stats": [mean]}
    batch = {"m": model, **tensors} if module_first else {**tensors, "m": model}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to warn of here
        moved = dk.to_device(batch, device)
    assert moved["m"] is model
    assert moved["x"].device == torch.device(device)
    assert moved["w"] is _first_parameter(model)
    assert moved["stats"][0] is _first_buffer(model)
    assert all(t.device == torch.device(device) for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("make", ["jit.script", "jit.trace"])
def test_a_torchscript_module_in_a_list_moves(make: str) -> None:
    model = _quietly(MAKERS[make])
    moved = dk.to_device([model], META)
    assert moved == [model]
    assert all(t.is_meta for t in model.parameters())


def test_a_loaded_torchscript_module_in_a_batch_moves_to_where_torch_moves_it() -> None:
    # torch.jit.load gives plain tensors, not Parameters: Module.to refuses meta (torch's
    # own AssertionError), so the host is the target here; before, .get() raised there too.
    def load() -> nn.Module:
        buffer = io.BytesIO()
        torch.jit.save(MAKERS["jit.script"](), buffer)
        buffer.seek(0)
        return torch.jit.load(buffer)

    model = _quietly(load)
    moved = dk.to_device({"m": model, "w": model.weight, "stats": [model.running_mean]}, "cpu")
    assert moved["m"] is model
    assert moved["w"] is model.weight
    assert moved["stats"][0] is model.running_mean


class _Registry:
    """A registry with what Module itself reads one with (items, in, [], []=): no .get()."""

    def __init__(self, entries: dict[str, Any]) -> None:
        self._entries = entries

    def items(self) -> list[tuple[str, Any]]:
        return list(self._entries.items())

    def keys(self) -> list[str]:
        return list(self._entries)

    def values(self) -> list[Any]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Any:
        return self._entries[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._entries[name] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)


class _Wrapped(nn.Module):
    """A module whose registries are not dicts, as a TorchScript module's are not."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(2))
        self.weight = nn.Parameter(torch.ones(2))
        state = vars(self)
        state["_parameters"] = _Registry(state["_parameters"])
        state["_buffers"] = _Registry(state["_buffers"])


@pytest.mark.parametrize("module_first", [True, False])
def test_a_module_whose_registries_have_no_get_keeps_its_tensors_shared(
    module_first: bool,
) -> None:
    # Without torch.jit (deprecated), the same contract: items() and [] only.
    model = _Wrapped()
    tensors = {"w": model.weight, "m_": model.mean}
    batch = {"m": model, **tensors} if module_first else {**tensors, "m": model}
    moved = dk.to_device(batch, META)
    assert moved["m"] is model
    assert moved["w"] is model.weight
    assert moved["m_"] is model.mean
    assert model.weight.is_meta
    assert model.mean.is_meta


@pytest.mark.parametrize("make", ["jit.script", "jit.trace"])
def test_check_module_and_assert_same_device_see_a_torchscript_modules_tensors_once(
    make: str,
) -> None:
    # A traced module keeps the compiled module behind it in `_actual_script_module`,
    # which holds the same parameters: check_module reported it as a plain attribute
    # module.to() would not move, and assert_same_device listed each tensor twice.
    model = _quietly(MAKERS[make])
    assert dk.check_module(model) == []
    with pytest.raises(dk.DeviceMismatchError) as caught:
        dk.assert_same_device(model, torch.ones(1, device="meta"))
    assert "cpu (5 tensors)" in str(caught.value)  # weight, bias, its 3 buffers: each once
    assert "_actual_script_module" not in str(caught.value)
