"""``to_device`` against accelerate and Lightning: dict views, and TorchScript modules.

The two rows of docs/placement.md's peer table these check: a dict view
(``batch.values()``) that both peers return unchanged, tensors and all, with no
warning (devicekit refuses it), and a TorchScript module in a batch, which all
three move.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import devicekit as dk

from .test_placement_peers import META, accelerate_move, lightning_move

PEERS = {"accelerate": accelerate_move, "lightning": lightning_move}


@pytest.mark.parametrize("peer", sorted(PEERS))
@pytest.mark.parametrize("method", ["values", "items"])
def test_peers_return_a_dict_view_unchanged_where_devicekit_refuses_it(
    peer: str, method: str
) -> None:
    move = PEERS[peer]()
    batch = {"x": torch.ones(1)}
    view = getattr(batch, method)()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silently: no warning either
        assert move(view) is view
    assert batch["x"].is_cpu
    with pytest.raises(TypeError, match=r"cannot move obj, a dict view \(dict_"):
        dk.to_device(view, META)


def _traced() -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit, deprecated in 2.9
        return torch.jit.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_a_torchscript_module_in_a_batch_is_moved_by_all_three(peer: str) -> None:
    move = PEERS[peer]()
    for mover in (move, lambda obj: dk.to_device(obj, META)):
        model = _traced()
        moved = mover({"x": torch.ones(1, 2), "model": model})
        assert moved["model"] is model
        assert moved["x"].is_meta
        assert model.weight.is_meta
