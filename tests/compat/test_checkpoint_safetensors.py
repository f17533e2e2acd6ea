"""``dk.load`` of safetensors files, with the real ``safetensors`` package.

torch 2.13 hands a path named ``*.safetensors`` to that package where it is
installed; devicekit loads every safetensors file with it, on every torch
(devicekit/_checkpointsafe.py). The tests without the package, and of files
so named that are not safetensors, are in tests/test_checkpoint.py.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import devicekit as dk

from ..test_checkpoint import _safetensors, _safetensors_file

pytest.importorskip("safetensors")


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt", "file object"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_safetensors_file_loads_onto_the_device_whatever_its_name(
    tmp_path: Path, name: str, device: str
) -> None:
    # torch 2.13 loaded one named *.safetensors (through the safetensors package),
    # refused it on meta with safetensors' "device meta is invalid", and read any other
    # name as a broken pickle: three answers for one file.
    path = tmp_path / name
    path.write_bytes(_safetensors())
    source: Path | io.BytesIO = io.BytesIO(b"x" + _safetensors()) if name == "file object" else path
    if isinstance(source, io.BytesIO):
        source.seek(1)  # read from where it stands
    loaded = dk.load(source, device)
    assert list(loaded) == ["w"]
    assert loaded["w"].device == torch.device(device)
    assert loaded["w"].shape == (2,)
    if device == "cpu":
        assert loaded["w"].tolist() == [0.0, 0.0]


def test_a_safetensors_file_cut_short_is_a_checkpoint_error_and_verify_says_what_it_checked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors())
    with pytest.warns(RuntimeWarning, match=r"verify=True\): a safetensors file keeps no check"):
        dk.load(path, "cpu", verify=True)  # before: "it is in torch's legacy format"
    path.write_bytes(_safetensors()[:-4])
    with pytest.raises(
        dk.CheckpointError, match=r"\): a safetensors file cut short or dam"
    ) as caught:
        dk.load(path, "cpu")  # before: safetensors' bare SafetensorError, no path
    assert str(path) in str(caught.value)
    assert caught.value.__cause__ is not None
    with pytest.raises(TypeError, match=r"map_location is a dict, but this is a safetensors"):
        dk.load(_safetensors_file(tmp_path), map_location={"cuda:0": "cpu"})
