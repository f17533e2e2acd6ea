"""dk.load: a checkpoint onto the device at hand, and clear errors for files that are not one."""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path

import pytest
import torch

import devicekit as dk

from .conftest import GPU_COUNT

META = torch.device("meta")


@dataclasses.dataclass
class Batch:  # an arbitrary class: unpickling it could run code
    x: torch.Tensor


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
    assert dk.load(tmp_path / "w.pt", META)["w"].device == META
    assert dk.load(tmp_path / "w.pt", map_location="meta")["w"].device == META
    with open(tmp_path / "w.pt", "rb") as file:  # a binary file object works too
        assert dk.load(file, "cpu")["w"].device == torch.device("cpu")


def test_load_defaults_to_weights_only(tmp_path: Path) -> None:
    torch.save({"batch": Batch(torch.ones(1))}, tmp_path / "code.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"^Weights only load failed"):
        dk.load(tmp_path / "code.pt", "cpu")  # torch's own message: it says how to allow it
    assert type(dk.load(tmp_path / "code.pt", "cpu", weights_only=False)["batch"]) is Batch


def test_load_rejects_device_and_map_location_together() -> None:
    with pytest.raises(TypeError, match="takes device or map_location, not both"):
        dk.load(io.BytesIO(), "cpu", map_location="cpu")


@pytest.mark.parametrize("path", [None, 3, b"w.pt", ["w.pt"]])
def test_a_path_that_is_not_a_file_is_a_type_error(path: object) -> None:
    with pytest.raises(
        TypeError, match=r"^path must be a file path \(str or os.PathLike\) or a binary file"
    ):
        dk.load(path, "cpu")  # type: ignore[arg-type]


def _good(tmp_path: Path) -> bytes:
    torch.save({"w": torch.ones(64)}, tmp_path / "good.pt")
    return (tmp_path / "good.pt").read_bytes()


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("text", lambda good: b"hello"),  # torch raises KeyError: 101 (or "Memo value not found")
        ("empty", lambda good: b""),  # EOFError
        ("cut short", lambda good: good[: len(good) // 2]),  # PytorchStreamReader's RuntimeError
    ],
)
def test_a_file_that_is_not_a_checkpoint_says_so(
    tmp_path: Path, name: str, content: object, weights_only: bool
) -> None:
    path = tmp_path / "bad.pt"
    path.write_bytes(content(_good(tmp_path)))  # type: ignore[operator]
    with pytest.raises(dk.CheckpointError) as caught:
        dk.load(path, "cpu", weights_only=weights_only)
    message = str(caught.value)
    assert message.startswith(f"load(path={str(path)!r}): not a checkpoint torch.load can read (")
    assert "not written by torch.save" in message
    assert caught.value.__cause__ is not None  # torch's own error, kept
    assert isinstance(caught.value, ValueError)
    with pytest.raises(dk.CheckpointError, match=r"^load\(path=the file\): not a checkpoint"):
        dk.load(io.BytesIO(path.read_bytes()), "cpu", weights_only=weights_only)


def test_a_missing_file_is_the_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        dk.load(tmp_path / "missing.pt", "cpu")


@pytest.mark.gpu
def test_load_a_gpu_checkpoint_to_the_cpu(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(3.0, device="cuda")}, tmp_path / "gpu.pt")
    state = dk.load(tmp_path / "gpu.pt", "cpu")
    assert state["w"].device == torch.device("cpu")
    assert torch.equal(state["w"], torch.arange(3.0))
