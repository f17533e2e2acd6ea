"""gpu_map's executor argument, and executor="ray" where Ray is not installed.

What needs Ray itself is in tests/compat/test_ray.py.
"""

from __future__ import annotations

import math
import sys

import pytest

import devicekit as dk

from .conftest import FakeAccelerator


def test_an_unknown_executor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"executor='dask': expected 'local' .* or 'ray'"):
        dk.gpu_map(math.sqrt, [1], executor="dask")  # type: ignore[arg-type]


def test_without_ray_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an absent package looks like to import
    with pytest.raises(ImportError, match=r"needs Ray, .*; pip install 'devicekit\[ray\]'"):
        dk.gpu_map(math.sqrt, [1, 4], executor="ray")


def test_bad_arguments_are_refused_before_ray_is_needed(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    fake_accelerator("cuda", 2)
    with pytest.raises(ValueError, match=r"workers_per_device must be an int >= 1, got 0"):
        dk.gpu_map(math.sqrt, [1], executor="ray", workers_per_device=0)
    with pytest.raises(ValueError, match=r"at least one device, got an empty list"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices=[])
    with pytest.raises(ValueError, match=r"executor='ray' runs every item the same way"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices=["meta"])
    with pytest.raises(ValueError, match=r"as a GPU task or as a CPU task"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices=["cpu", 1])
    with pytest.raises(TypeError, match=r"devices must be a device or a list of devices"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices={"cpu": 1})
