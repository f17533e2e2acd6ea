"""Walks of a module's tree that never hash a module: torch's order, and a @dataclass module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit._submodules import held_tensors, named_held, named_submodules


def _tree() -> nn.Module:
    """Shared submodules and parameters, a None child, a buffer, nesting: torch's corner cases."""
    shared = nn.Linear(2, 2)
    model = nn.Sequential(
        nn.Sequential(shared, nn.BatchNorm1d(2)),
        nn.ModuleDict({"b": nn.Linear(2, 3), "a": shared, "none": None}),  # type: ignore[dict-item]
        nn.Sequential(nn.Sequential(nn.ReLU(), nn.Linear(3, 1))),
    )
    model.extra = nn.Linear(1, 1)
    model.extra.weight = shared.weight  # tied
    return model


def test_the_walks_follow_torchs_order_and_names_each_module_and_tensor_once() -> None:
    model = _tree()
    ours = [(path, id(module)) for path, module in named_submodules(model)]
    assert ours == [(path, id(module)) for path, module in model.named_modules()]
    params = [(name, id(tensor)) for name, tensor in named_held(model, "_parameters")]
    assert params == [(name, id(tensor)) for name, tensor in model.named_parameters()]
    buffers = [(name, id(tensor)) for name, tensor in named_held(model, "_buffers")]
    assert buffers == [(name, id(tensor)) for name, tensor in model.named_buffers()]
    expected = [*model.parameters(), *model.buffers()]
    assert [id(t) for t in held_tensors(model)] == [id(t) for t in expected]


@dataclasses.dataclass(eq=True)  # eq=True sets __hash__ to None
class _Head(nn.Module):
    width: int = 2

    def __post_init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(self.width, 1)


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = _Head()


def test_a_dataclass_module_moves_inside_a_batch_as_its_own_to_moves_it() -> None:
    # torch's named_modules() hashes the module it starts from: to_device of a batch
    # that held one, assert_same_device and check_module raised "unhashable type: '_Head'".
    moved = dk.to_device({"model": _Head(), "x": torch.ones(2)}, "meta")
    assert moved["model"].fc.weight.is_meta
    assert moved["x"].is_meta
    dk.assert_same_device(model=_Head(), x=torch.ones(2))


def test_a_model_holding_one_gets_the_fix_where_torch_cannot_move_it() -> None:
    with pytest.raises(TypeError, match="unhashable") as caught:
        dk.to_device([_Outer()], "meta")  # torch's own Module.to raises here
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert notes.startswith("head: _Head defines __eq__ and no __hash__")
    assert "@dataclass(eq=False)" in notes


@dataclasses.dataclass(eq=True)
class _Nested(nn.Module):
    def __post_init__(self) -> None:
        super().__init__()
        self.head = _Head()


def test_the_note_names_the_submodule_torch_hashed_not_the_root() -> None:
    # Module.to never hashes the module it is called on: a first version named the
    # root (_Nested), whose fix would not have helped.
    with pytest.raises(TypeError, match="unhashable type: '_Head'") as caught:
        dk.to_device([_Nested()], "meta")
    assert getattr(caught.value, "__notes__", [""])[0].startswith("head: _Head defines __eq__")


def test_check_module_reports_each_class_torch_cannot_walk_once() -> None:
    model = nn.ModuleList([_Head(), _Head(), _Head()])
    assert [finding.split(":")[0] for finding in dk.check_module(model)] == ["0"]


@pytest.mark.parametrize(("model", "where"), [(_Head(), "the model"), (_Outer(), "head")])
def test_check_module_reports_a_module_torch_cannot_walk(model: nn.Module, where: str) -> None:
    findings = dk.check_module(model)
    assert len(findings) == 1
    assert findings[0].startswith(f"{where}: _Head defines __eq__ and no __hash__")
    assert "__hash__ = torch.nn.Module.__hash__" in findings[0]
