"""dk.load: a checkpoint onto the device at hand, and clear errors for files that are not one."""

from __future__ import annotations

import dataclasses
import errno
import io
import pickle
import re
import sys
import types
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


def _legacy(tmp_path: Path) -> bytes:
    torch.save({"w": torch.ones(64)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    return (tmp_path / "old.pt").read_bytes()


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize(
    ("name", "content"),
    [
        # PytorchStreamReader's RuntimeError: failed finding central directory
        ("cut short", lambda tmp_path: _good(tmp_path)[: len(_good(tmp_path)) // 2]),
        ("legacy cut short", lambda tmp_path: _legacy(tmp_path)[:20]),  # EOFError
    ],
)
def test_a_checkpoint_cut_short_says_so(
    tmp_path: Path, name: str, content: object, weights_only: bool
) -> None:
    path = tmp_path / "bad.pt"
    path.write_bytes(content(tmp_path))  # type: ignore[operator]
    with pytest.raises(dk.CheckpointError) as caught:
        dk.load(path, "cpu", weights_only=weights_only)
    message = str(caught.value)
    assert message.startswith(f"load(path={str(path)!r}): not a checkpoint torch.load can read (")
    assert "): it is cut short" in message  # the zip's missing end says so; the legacy "or damaged"
    assert "save it again" in message.lower()
    assert caught.value.__cause__ is not None  # torch's own error, kept
    assert isinstance(caught.value, ValueError)
    with pytest.raises(dk.CheckpointError, match=r"^load\(path=the file\): not a checkpoint"):
        dk.load(io.BytesIO(path.read_bytes()), "cpu", weights_only=weights_only)


def test_a_missing_file_is_the_os_error_naming_the_path_and_a_close_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "model.pt")
    # Before: torch's bare "[Errno 2] No such file or directory: 'modle.pt'".
    with pytest.raises(
        FileNotFoundError,
        match=rf"^load\(path='{tmp_path}/modle.pt'\): there is no file {tmp_path}/modle.pt; "
        rf"did you mean '{tmp_path}/model.pt'\?$",
    ):
        dk.load(tmp_path / "modle.pt", "cpu")
    (tmp_path / "root" / "opt").mkdir(parents=True)  # a folder is never a checkpoint
    with pytest.raises(FileNotFoundError, match=r"there is no file .*/root/nope\.pt$"):
        dk.load(tmp_path / "root" / "nope.pt", "cpu")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=rf"^load\(path='gone/x.pt'\): there is no file {tmp_path}/gone/x.pt \(relative to "
        rf"the working directory, {tmp_path}\); the folder {tmp_path}/gone does not exist either$",
    ):
        dk.load("gone/x.pt", "cpu")


def test_a_folder_is_the_os_error_naming_the_checkpoints_inside(tmp_path: Path) -> None:
    with pytest.raises(
        IsADirectoryError,
        match=rf"^load\(path='{tmp_path}'\): .* is a folder, not a checkpoint "
        r"file; pass the checkpoint file inside it$",
    ):
        dk.load(tmp_path, "cpu")
    torch.save({"w": torch.ones(1)}, tmp_path / "b.pth")
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(IsADirectoryError, match=r"; it holds a.safetensors, b.pth: pass one$"):
        dk.load(str(tmp_path), "cpu")


@pytest.mark.gpu
def test_load_a_gpu_checkpoint_to_the_cpu(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(3.0, device="cuda")}, tmp_path / "gpu.pt")
    state = dk.load(tmp_path / "gpu.pt", "cpu")
    assert state["w"].device == torch.device("cpu")
    assert torch.equal(state["w"], torch.arange(3.0))


def test_checkpoint_error_shows_its_public_path() -> None:
    # Before, tracebacks read devicekit._errors.CheckpointError.
    assert dk.CheckpointError.__module__ == "devicekit"


def _safetensors() -> bytes:
    header = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    return len(header).to_bytes(8, "little") + header + bytes(8)


def _npy() -> bytes:
    return b"\x93NUMPY\x01\x00v\x00{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }"


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "the file is empty (0 bytes)"),
        (b'{"w": [1.0, 2.0]}', "it was not written by torch.save (its first bytes are neither"),
        (bytes(range(256)) * 2, "it was not written by torch.save"),
        (bytes(100), "it was not written by torch.save"),
        (_npy(), "it is a NumPy .npy file, not one torch.save wrote"),
        (pickle.dumps({"w": [1.0]}, protocol=2), "it is a pickle, but not one torch.save wrote"),
    ],
    ids=["empty", "json", "random", "zeros", "npy", "pickle"],
)
def test_a_file_in_another_format_says_what_it_is(
    tmp_path: Path, content: bytes, says: str, weights_only: bool
) -> None:
    # Before, with weights_only=True, torch's "Weights only load failed ... re-running
    # with weights_only=False will likely succeed" came through: wrong, and unsafe advice.
    path = tmp_path / "other.bin"
    path.write_bytes(content)
    with pytest.raises(dk.CheckpointError) as caught:
        dk.load(path, "cpu", weights_only=weights_only)
    assert str(caught.value).startswith(
        f"load(path={str(path)!r}): not a checkpoint torch.load can read: {says}"
    )
    assert "Weights only" not in str(caught.value)
    assert caught.value.__cause__ is not None


def _safetensors_file(tmp_path: Path) -> Path:
    path = tmp_path / "whole.safetensors"
    path.write_bytes(_safetensors())
    return path


def test_a_file_named_safetensors_that_is_none_is_read_by_its_bytes(tmp_path: Path) -> None:
    # torch 2.13 hands any path so named to the safetensors package: a torch.save
    # checkpoint misnamed so, or an empty file, raised its bare SafetensorError.
    misnamed = tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(2)}, misnamed)
    assert dk.load(misnamed, "cpu")["w"].tolist() == [1.0, 1.0]
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(dk.CheckpointError, match=r"the file is empty \(0 bytes\)"):
        dk.load(empty, "cpu")


def test_a_safetensors_file_without_the_package_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import raises ImportError
    with pytest.raises(dk.CheckpointError, match=r"package is not installed; pip install safet"):
        dk.load(_safetensors_file(tmp_path), "cpu")


def test_a_legacy_checkpoint_cut_short_is_a_checkpoint_error(tmp_path: Path) -> None:
    # torch's legacy (pre-1.6) format cut inside its tensor data: torch raised a bare
    # RuntimeError("unexpected EOF, expected 10 more bytes. The file might be corrupted.").
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(64)}, buffer, _use_new_zipfile_serialization=False)
    path = tmp_path / "legacy.pt"
    path.write_bytes(buffer.getvalue()[:-10])
    for weights_only in (True, False):
        with pytest.raises(dk.CheckpointError, match=r"unexpected EOF.*\): it is cut short"):
            dk.load(path, "cpu", weights_only=weights_only)


def test_a_zip_that_is_not_a_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    # Before: torch's raw "[enforce fail at inline_container.cc:...]" RuntimeError.
    import zipfile

    with zipfile.ZipFile(tmp_path / "notes.zip", "w") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(dk.CheckpointError, match=r"or not written by torch\.save"):
        dk.load(tmp_path / "notes.zip", "cpu")


class Unloadable:
    def __init__(self) -> None:
        self.value = 1

    def __setstate__(self, state: object) -> None:
        raise KeyError("a key the class itself misses")


def test_an_error_from_the_files_own_objects_is_not_blamed_on_the_file(tmp_path: Path) -> None:
    # Before, the user's own KeyError read as "empty, cut short, or not written by torch.save".
    torch.save({"obj": Unloadable()}, tmp_path / "obj.pt")
    with pytest.raises(KeyError, match="a key the class itself misses") as caught:
        dk.load(tmp_path / "obj.pt", "cpu", weights_only=False)
    assert not isinstance(caught.value, dk.CheckpointError)


def test_a_file_opened_in_text_mode_is_a_type_error(tmp_path: Path) -> None:
    # Before: UnicodeDecodeError from deep inside torch.
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    with (
        open(tmp_path / "w.pt", encoding="latin-1") as file,
        pytest.raises(TypeError, match=r"^path is a file opened in text mode.*open\(path, 'rb'\)"),
    ):
        dk.load(file, "cpu")  # type: ignore[arg-type]


def test_a_file_object_is_named_by_its_name(tmp_path: Path) -> None:
    (tmp_path / "bad.pt").write_bytes(b"")
    with (
        open(tmp_path / "bad.pt", "rb") as file,
        pytest.raises(dk.CheckpointError, match=r"^load\(path='.*bad\.pt'\): .* empty"),
    ):
        dk.load(file, "cpu")


def test_a_file_object_is_read_from_where_it_stands(tmp_path: Path) -> None:
    buffer = io.BytesIO(b"HEADER")
    buffer.seek(0, io.SEEK_END)
    torch.save({"w": torch.ones(2)}, buffer)
    buffer.seek(6)
    assert torch.equal(dk.load(buffer, "cpu")["w"], torch.ones(2))
    damaged = io.BytesIO(b"HEADER" + buffer.getvalue()[6:-20])
    damaged.seek(6)  # the header is not torch's; what follows it is, cut short
    with pytest.raises(dk.CheckpointError, match=r"it is cut short: its 1,\d{3} bytes end"):
        dk.load(damaged, "cpu")


@pytest.mark.parametrize(
    ("map_location", "error", "match"),
    [
        ("gpu", ValueError, r"^map_location='gpu' is not a device torch knows"),
        ("cuda:99", dk.DeviceNotFoundError, r"^map_location='cuda:99'"),
        (torch.device("cuda", 99), dk.DeviceNotFoundError, r"^map_location=device\("),
        (0, TypeError, r"^map_location must be a device .* got 0 of type int"),
        (True, TypeError, r"^map_location must be a device .* got the bool True"),
    ],
)
def test_map_location_is_checked_as_device_is(
    tmp_path: Path, map_location: object, error: type[Exception], match: str
) -> None:
    # Before: "don't know how to restore data location ... (tagged with gpu)",
    # "'int' object is not callable", torch's CUDA RuntimeError.
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    with pytest.raises(error, match=match):
        dk.load(tmp_path / "w.pt", map_location=map_location)


def test_map_location_forms_torch_takes_still_work(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert dk.load(tmp_path / "w.pt", map_location=torch.device("meta"))["w"].device == META
    assert dk.load(tmp_path / "w.pt", map_location={"cpu": "meta"})["w"].device == META
    assert dk.load(tmp_path / "w.pt", map_location=lambda storage, _: storage)["w"].is_cpu


def test_map_location_none_is_not_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Before, map_location=None reached torch, which put tensors back on cuda:1.
    path = _saved_as_if_on("cuda:1", monkeypatch, tmp_path / "ckpt.pt")
    assert dk.load(path, map_location=None)["w"].device == dk.try_gpu()
    assert dk.load(path, META, map_location=None)["w"].device == META


@pytest.mark.skipif(GPU_COUNT >= 2, reason="needs a machine without a cuda:1")
def test_a_device_error_from_the_users_mapping_stays_torchs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _saved_as_if_on("cuda:1", monkeypatch, tmp_path / "ckpt.pt")
    with pytest.raises(RuntimeError, match="deserialize object on") as caught:
        dk.load(path, map_location={"cuda:0": "cpu"})  # cuda:1 left unmapped
    assert not isinstance(caught.value, dk.CheckpointError)


@pytest.mark.parametrize("weights_only", ["False", 0, 1])
def test_weights_only_must_be_a_bool(tmp_path: Path, weights_only: object) -> None:
    # Before, weights_only="False" was truthy: a weights-only load, silently.
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    with pytest.raises(TypeError, match=r"^weights_only must be True, False or None"):
        dk.load(tmp_path / "w.pt", "cpu", weights_only=weights_only)


def test_a_misspelt_keyword_names_load_and_the_keyword_meant(tmp_path: Path) -> None:
    # Before, torch passed it to the unpickler: "Unpickler.__init__() got an unexpected
    # keyword argument 'maplocation'", naming neither load nor map_location.
    with pytest.raises(
        TypeError,
        match=r"^load\(\) got an unexpected keyword argument 'maplocation'; did you mean "
        r"map_location\?",
    ):
        dk.load(tmp_path / "absent.pt", maplocation="cpu")  # refused before the file is read


def test_the_keywords_torch_and_the_unpickler_take_still_pass(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    loaded = dk.load(tmp_path / "w.pt", "cpu", weights_only=False, encoding="latin1", mmap=True)
    assert loaded["w"].tolist() == [1.0, 1.0]
    loaded = dk.load(
        tmp_path / "w.pt", "cpu", weights_only=False, pickle_module=pickle, fix_imports=True
    )
    assert loaded["w"].sum() == 2


def test_a_checkpoints_bytes_get_a_short_message_that_says_to_wrap_them(tmp_path: Path) -> None:
    # Before: the whole repr of the bytes, 13 MB for a 4 MB checkpoint, and no fix.
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(10**6)}, buffer)
    with pytest.raises(TypeError) as caught:
        dk.load(buffer.getvalue(), "cpu")  # type: ignore[arg-type]
    message = str(caught.value)
    assert len(message) < 1000
    assert message.startswith(
        "path must be a file path (str or os.PathLike) or a binary file object with read() and "
        "seek(), got b'PK\\x03\\x04"
    )
    assert message.endswith(
        "... of type bytes; pass io.BytesIO(data) for a checkpoint's bytes, or "
        "os.fsdecode(path) for a path"
    )


def test_a_path_too_long_for_the_system_gets_a_short_message(tmp_path: Path) -> None:
    # Before: Python's "[Errno 36] File name too long: 'xxxx...'", the whole string.
    with pytest.raises(OSError, match=r"^\[Errno 36\] load\(path='xxx") as caught:
        dk.load("x" * 10**6, "cpu")
    assert len(str(caught.value)) < 1000
    assert "a path of 1000000 characters" in str(caught.value)


@pytest.mark.parametrize("mmap", ["yes", "False", 1, 0])
def test_mmap_must_be_a_bool(tmp_path: Path, mmap: object) -> None:
    # Before, mmap="yes" (and "False") was truthy: the file was memory-mapped, silently.
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    with pytest.raises(
        TypeError, match=r"^mmap must be True, False or None \(torch's default\), got .* of type "
    ):
        dk.load(tmp_path / "w.pt", "cpu", mmap=mmap)
    for flag in (True, False, None):  # None: torch's default
        assert torch.equal(dk.load(tmp_path / "w.pt", "cpu", mmap=flag)["w"], torch.ones(2))


def test_mmap_of_a_legacy_file_or_a_file_object_names_load_and_the_fix(tmp_path: Path) -> None:
    # Before: torch's "mmap can only be used with files saved with `torch.save(<path>,
    # _use_new_zipfile_serialization=True)" (a call with the path as what to save), and
    # "f must be a file path in order to use the mmap argument" for a file object.
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    legacy = r"^load\(path='.*old.pt', mmap=True\): this checkpoint is in torch's legacy "
    with pytest.raises(RuntimeError, match=legacy) as info:
        dk.load(path, "cpu", mmap=True)
    assert "load it with mmap=False" in str(info.value)
    assert info.value.__suppress_context__  # torch's garbled message adds nothing
    assert torch.equal(dk.load(path, "cpu", mmap=False)["w"], torch.ones(2))
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    buffer.seek(0)
    file_object = r"^load\(path=the file, mmap=True\): .* got a file object \(BytesIO\); pass "
    with pytest.raises(ValueError, match=file_object):
        dk.load(buffer, "cpu", mmap=True)
    assert torch.equal(dk.load(buffer, "cpu")["w"], torch.ones(2))  # nothing was read


@pytest.mark.parametrize("legacy", [False, True])
def test_a_file_object_past_the_checkpoints_start_says_to_seek_back(
    tmp_path: Path, legacy: bool
) -> None:
    # Before: "it was not written by torch.save ... Check the path", of a good checkpoint.
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt", _use_new_zipfile_serialization=not legacy)
    with open(tmp_path / "w.pt", "rb") as file:
        file.read(10)
        with pytest.raises(dk.CheckpointError) as caught:
            dk.load(file, "cpu")
        assert str(caught.value) == (
            f"load(path={str(tmp_path / 'w.pt')!r}): not a checkpoint torch.load can read: the "
            "file object stands at byte 10, and torch reads from where it stands, but the "
            "checkpoint starts at byte 0. Call file.seek(0) before load(file), or open the file "
            "again"
        )
        assert file.tell() == 10  # left where it stood
        file.seek(0)
        assert torch.equal(dk.load(file, "cpu")["w"], torch.ones(2))


def test_a_file_object_past_a_start_that_is_no_checkpoint_says_where_it_read(
    tmp_path: Path,
) -> None:
    buffer = io.BytesIO(b'{"w": [1.0, 1.0]} and more text')
    buffer.seek(4)
    with pytest.raises(
        dk.CheckpointError,
        match=r"not written by torch\.save .*Check the path \(read from byte 4, where the file "
        r"stood\)$",
    ):
        dk.load(buffer, "cpu")


def test_an_empty_path_says_it_is_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: "there is no file /the/working/directory (relative to the working directory ...)".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=r"^load\(path=''\): the path is empty; pass the checkpoint file's path$",
    ):
        dk.load("", "cpu")


def test_a_legacy_checkpoint_cut_short_names_torchs_error_in_words(tmp_path: Path) -> None:
    # Before: "(EOFError: EOFError)" where torch's EOFError had no message.
    path = tmp_path / "cut.pt"
    said = set()
    for size in range(1, 64):
        path.write_bytes(_legacy(tmp_path)[:size])
        try:
            dk.load(path, "cpu")
        except dk.CheckpointError as error:
            found = re.search(r"can read \((.*?)\): it is cut short", str(error))
            said |= {found.group(1)} if found else set()
    assert "EOFError: the data ends early" in said
    assert not any(text.endswith("EOFError") for text in said)
    assert not any(text.startswith("error:") for text in said)  # struct.error, said as such


def _conv_bn(tmp_path: Path) -> bytes:
    """A Conv+BatchNorm state dict, whose zip torch's reader seeks before byte 0 of when cut."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(144, 2),
    )
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    return (tmp_path / "sd.pt").read_bytes()


def test_a_zip_checkpoint_cut_at_any_length_is_a_checkpoint_error(tmp_path: Path) -> None:
    # Before, from byte 4097 on (1021 of 5118 lengths): torch's raw "OSError: [Errno 22]
    # Invalid argument" from a path, "ValueError: negative seek value -3689" from a BytesIO.
    data = _conv_bn(tmp_path)
    path = tmp_path / "cut.pt"
    said, said_of_objects = {}, []
    for size in range(4, len(data)):  # fewer than 4 bytes: empty, or not torch's at all
        path.write_bytes(data[:size])
        with pytest.raises(dk.CheckpointError) as caught:
            dk.load(path, "cpu")
        said[size] = str(caught.value)
        if size % 16 == 0 or size > len(data) - 64:  # a file object too (every size: slow)
            with pytest.raises(dk.CheckpointError) as caught:
                dk.load(io.BytesIO(data[:size]), "cpu")
            said_of_objects.append(str(caught.value))
    assert all("): it is cut short: its " in message for message in said_of_objects)
    for size, message in said.items():
        assert message.startswith(f"load(path={str(path)!r}): not a checkpoint torch.load can read")
        assert f"): it is cut short: its {size:,} bytes end without the directory every zip " in (
            message
        )
        assert message.endswith(
            "so its save stopped part way (a writer killed, a disk full, a copy interrupted). "
            "Save it again, or copy it again from a whole one"
        )


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # a flipped PROTO byte
@pytest.mark.parametrize("weights_only", [True, False])
def test_a_flipped_byte_in_the_pickle_or_the_directory_is_told_as_damage(
    weights_only: bool,
) -> None:
    # Before: torch's "Weights only load failed ... Re-running torch.load with weights_only
    # set to False will likely succeed ... Unsupported operand 151", or a raw "Trying to resize
    # storage that is not resizable", MemoryError, "invalid literal for int()".
    import zipfile

    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2), "step": 3}, buffer)
    data = buffer.getvalue()
    with zipfile.ZipFile(buffer) as archive:
        pickled = archive.getinfo("archive/data.pkl")
        regions = [
            # From byte 4: a file whose first bytes are no zip's is "not written by torch.save".
            range(pickled.header_offset + 4, pickled.header_offset + 100 + pickled.file_size),
            range(archive.start_dir, len(data)),  # the directory, and the records that end it
        ]
    said: dict[int, str] = {}
    raw: dict[int, str] = {}
    for at in (at for region in regions for at in region):
        flipped = bytearray(data)
        flipped[at] ^= 0xFF
        try:
            dk.load(io.BytesIO(flipped), "cpu", weights_only=weights_only)
        except dk.CheckpointError as error:
            said[at] = str(error)
        except Exception as error:  # noqa: BLE001 - any other is what this test looks for
            raw[at] = f"{type(error).__name__}: {error}"
    assert not raw, f"{len(raw)} flips got torch's own errors, such as {next(iter(raw.items()))}"
    details = set()
    for at, message in said.items():
        found = re.search(r"\): it is (damaged|cut short): (.*?), so ", message)
        assert found, f"byte {at}: {message}"
        assert "weights_only" not in message
        details.add(found.group(2))
    assert (
        "its record 'archive/data.pkl' does not match the CRC-32 checksum its directory keeps "
        "for it" in details
    )


def test_a_flipped_byte_says_what_torch_met_and_what_is_damaged(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "flip.pt")
    data = (tmp_path / "flip.pt").read_bytes()
    at = data.index(b"\x80\x02}")  # data.pkl's first opcode after PROTO 2: EMPTY_DICT
    flipped = bytearray(data)
    flipped[at + 2] ^= 0xFF  # now EXT1, which the weights_only unpickler refuses
    (tmp_path / "flip.pt").write_bytes(flipped)
    with pytest.raises(dk.CheckpointError) as caught:
        dk.load(tmp_path / "flip.pt", "cpu")
    assert str(caught.value) == (
        f"load(path={str(tmp_path / 'flip.pt')!r}): not a checkpoint torch.load can read "
        "(UnpicklingError: Unsupported operand 130): it is damaged: its record 'flip/data.pkl' "
        "does not match the CRC-32 checksum its directory keeps for it, so bytes in it changed "
        "after it was saved (a disk, memory or copy error). Copy it again from a good copy, or "
        "save it again"
    )
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)  # torch's own, kept


def test_a_legacy_checkpoint_with_an_opcode_no_pickle_has_is_damage(tmp_path: Path) -> None:
    # Before: torch's "Weights only load failed ... Unsupported operand 255" and its advice.
    flipped = bytearray(_legacy(tmp_path))
    flipped[2] = 0xFF  # no pickle opcode at all
    (tmp_path / "old.pt").write_bytes(flipped)
    with pytest.raises(
        dk.CheckpointError,
        match=r"\(UnpicklingError: Unsupported operand 255\): it is cut short or damaged",
    ):
        dk.load(tmp_path / "old.pt", "cpu")


def test_a_refusal_of_a_checkpoint_saved_without_crcs_stays_torchs(tmp_path: Path) -> None:
    # torch.save can leave the CRC-32s out (as zeros): no record is then called damaged.
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"batch": Batch(torch.ones(1))}, tmp_path / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    with pytest.raises(pickle.UnpicklingError, match=r"^Weights only load failed"):
        dk.load(tmp_path / "nocrc.pt", "cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/self/mem")
def test_an_os_error_reading_the_file_stays_the_os_error(tmp_path: Path) -> None:
    # /proc/self/mem opens, and reading its byte 0 fails as a failing disk does (EIO): the
    # file is not damaged, and the check of it must not say so.
    with pytest.raises(OSError, match=r"^\[Errno (5|13|1)\] ") as caught:
        dk.load("/proc/self/mem", "cpu")
    assert not isinstance(caught.value, dk.CheckpointError)

    class FailingDisk(io.BytesIO):  # a whole checkpoint, on a disk that fails
        def read(self, size: int | None = -1, /) -> bytes:
            raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError, match=r"^\[Errno 5\] Input/output error$") as caught:
        dk.load(FailingDisk(_good(tmp_path)), "cpu")
    assert not isinstance(caught.value, dk.CheckpointError)


@pytest.mark.parametrize("size", [0, 1, 3])
def test_mmap_of_a_file_cut_to_a_few_bytes_is_no_legacy_checkpoint(
    tmp_path: Path, size: int
) -> None:
    # Before: "this checkpoint is in torch's legacy format ... cannot be memory-mapped".
    (tmp_path / "cut.pt").write_bytes(_good(tmp_path)[:size])
    with pytest.raises(dk.CheckpointError, match=r"(empty \(0 bytes\)|it is cut short: it ends)"):
        dk.load(tmp_path / "cut.pt", "cpu", mmap=True)


@dataclasses.dataclass
class Config:  # saved as the saving script's own: __main__.Config
    lr: float = 0.1


def test_a_class_of_the_saving_scripts_main_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, weights_only=False: "AttributeError: Can't get attribute 'Config' on <module
    # '__main__' ...>"; weights_only=True: re-running with False "will likely succeed".
    # A __main__ of its own: under `python -m pytest` the real one is pytest.__main__,
    # whose classes pickle saves under that name.
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    with monkeypatch.context() as patch:  # as the training script that saved it had it
        patch.setattr(Config, "__module__", "__main__")
        patch.setattr(main, "Config", Config, raising=False)
        torch.save({"config": Config(), "w": torch.ones(2)}, tmp_path / "ckpt.pt")
    path = str(tmp_path / "ckpt.pt")
    lacks = (
        rf"^load\(path='{path}'\): the checkpoint holds a __main__\.Config, a class of the script "
        r"that saved it \(pickle saves an object by its class's name, not its code\), but this "
        r"program's __main__( \(.*\))? has no Config"
    )
    with pytest.raises(AttributeError, match=lacks) as caught:
        dk.load(path, "cpu", weights_only=False)
    assert str(caught.value).endswith(
        ". Define or import Config in the script you run, before load(), or save a state_dict() "
        "and plain types (dict, list, str, numbers), which load anywhere"
    )
    with pytest.raises(pickle.UnpicklingError, match=lacks) as refused:
        dk.load(path, "cpu")
    assert "weights_only=False would fail too" in str(refused.value)
    assert "both need the class. Define or import Config in the script you run" in str(
        refused.value
    )
    assert "add_safe_globals([Config])" in str(refused.value)
    assert "Re-running" not in str(refused.value)
    monkeypatch.setattr(main, "Config", Config, raising=False)  # now this script has it
    monkeypatch.setattr(Config, "__module__", "__main__")
    with pytest.raises(pickle.UnpicklingError, match=r"^Weights only load failed"):
        dk.load(path, "cpu")  # torch's own refusal: its advice holds now
    assert dk.load(path, "cpu", weights_only=False)["config"] == Config()


def test_a_class_from_a_module_this_program_lacks_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a bare "ModuleNotFoundError: No module named 'devicekit_gone_models'".
    module = types.ModuleType("devicekit_gone_models")
    exec("class Net:\n    pass\n", module.__dict__)
    module.Net.__module__ = module.__name__
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, module.__name__, module)
        torch.save({"net": module.Net()}, tmp_path / "net.pt")
    with pytest.raises(ModuleNotFoundError) as caught:
        dk.load(tmp_path / "net.pt", "cpu", weights_only=False)
    assert str(caught.value) == (
        f"load(path={str(tmp_path / 'net.pt')!r}): the checkpoint holds an object of a class "
        "from the module devicekit_gone_models, which this program cannot import (pickle saves "
        "an object by its class's name, not its code). Install devicekit_gone_models, or run "
        "from the folder of the code that saved it (or add that folder to sys.path), or save a "
        "state_dict() and plain types (dict, list, str, numbers), which load anywhere"
    )
    assert caught.value.name == "devicekit_gone_models"


def _saved_on_meta(tmp_path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).to(META)
    torch.save(model.state_dict(), tmp_path / "meta.pt")
    return tmp_path / "meta.pt"


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_checkpoint_saved_from_meta_is_refused_off_meta(
    tmp_path: Path, device: str | None, legacy: bool
) -> None:
    # Before: every tensor came back on meta, and load_state_dict failed later with
    # "Cannot copy out of meta tensor; no data!".
    path = _saved_on_meta(tmp_path)
    target = dk.try_gpu() if device is None else device
    if legacy:
        state = torch.load(path, weights_only=True)
        torch.save(state, path, _use_new_zipfile_serialization=False)
    with pytest.raises(dk.CheckpointError) as caught:
        dk.load(path, device)
    assert str(caught.value) == (
        f"load(path={str(path)!r}): the checkpoint was saved from tensors on the meta device "
        "(0.weight, 0.bias, 1.weight, 1.bias, 1.running_mean and 2 more), which have a shape "
        f"and no values, so the file has none to put on {target}. "
        "Save it again from real weights: after model.to_empty(device=...) and initialising "
        "them, or after loading them; or, if a skeleton of shapes is what you want, load it "
        "with device='meta'"
    )
    state = dk.load(path, META)  # a skeleton of shapes, asked for
    assert state["0.weight"].shape == (2, 3)
    assert state["0.weight"].is_meta


def test_meta_tensors_are_found_inside_objects_too(tmp_path: Path) -> None:
    torch.save({"batch": Batch(torch.ones(2, device=META))}, tmp_path / "obj.pt")
    with pytest.raises(dk.CheckpointError, match=r"saved from tensors on the meta device, which"):
        dk.load(tmp_path / "obj.pt", "cpu", weights_only=False)
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "real.pt")
    assert dk.load(tmp_path / "real.pt", "cpu")["step"] == 3  # no meta: loads as before


def _flip_in_tensor(data: bytes, record: str) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo(record)
    header = data[info.header_offset : info.header_offset + 30]
    at = info.header_offset + 30 + int.from_bytes(header[26:28], "little")
    at += int.from_bytes(header[28:30], "little")
    flipped = bytearray(data)
    flipped[at + 5] ^= 0xFF
    return bytes(flipped)


def test_verify_names_the_damaged_record_and_its_tensors(tmp_path: Path) -> None:
    # Before: verify was no keyword (torch's unpickler refused it); a flipped byte in a
    # tensor's data loaded with a wrong value, and still does without verify=True.
    weight = torch.arange(8.0)
    torch.save({"a": torch.ones(8), "b": weight, "b_view": weight[2:], "n": 3}, tmp_path / "x.pt")
    path = tmp_path / "x.pt"
    path.write_bytes(_flip_in_tensor(path.read_bytes(), "x/data/1"))
    assert not torch.equal(dk.load(path, "cpu")["b"], weight)  # the documented limit
    with pytest.raises(dk.CheckpointError) as caught:
        dk.load(path, "cpu", verify=True)
    assert str(caught.value) == (
        f"load(path={str(path)!r}, verify=True): the checkpoint is damaged: its record "
        "'x/data/1' does not match the CRC-32 checksum its directory keeps for it (it holds b, "
        "b_view), so bytes in it changed after it was saved (a disk, memory or copy error), and "
        "the values loaded from it are wrong. Copy it again from a good copy, or save it again"
    )
    with open(path, "rb") as file, pytest.raises(dk.CheckpointError, match="'x/data/1'"):
        dk.load(file, "cpu", verify=True)  # a file object is read again from where it began
    with pytest.raises(dk.CheckpointError, match="'x/data/1'"):
        dk.load(path, "cpu", verify=True, mmap=True)  # asked for: the whole file is read


def test_verify_passes_whole_files_and_those_without_crcs(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(8)}, tmp_path / "good.pt")
    assert torch.equal(dk.load(tmp_path / "good.pt", "cpu", verify=True)["w"], torch.ones(8))
    buffer = io.BytesIO(b"junk" + (tmp_path / "good.pt").read_bytes())
    buffer.seek(4)  # a checkpoint from where the file object stands
    assert torch.equal(dk.load(buffer, "cpu", verify=True)["w"], torch.ones(8))
    torch.save({"w": torch.ones(8)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.warns(RuntimeWarning, match="legacy format"):  # loaded, and said unchecked
        assert torch.equal(dk.load(tmp_path / "old.pt", "cpu", verify=True)["w"], torch.ones(8))
    torch.serialization.set_crc32_options(False)  # every CRC-32 written as 0: none to check
    try:
        torch.save({"w": torch.ones(8)}, tmp_path / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    path = tmp_path / "nocrc.pt"
    path.write_bytes(_flip_in_tensor(path.read_bytes(), "nocrc/data/0"))
    with pytest.warns(RuntimeWarning, match="keep no CRC-32"):
        assert dk.load(path, "cpu", verify=True)["w"].shape == (8,)  # not refused: unchecked


@pytest.mark.parametrize("verify", ["yes", 1, None])
def test_verify_must_be_a_bool(tmp_path: Path, verify: object) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "w.pt")
    with pytest.raises(TypeError, match=r"^verify must be True or False, got "):
        dk.load(tmp_path / "w.pt", "cpu", verify=verify)  # type: ignore[arg-type]


def test_a_memory_error_from_a_compressed_archive_says_what_it_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the allocator's bare "DefaultCPUAllocator: can't allocate memory", nothing more.
    import zipfile

    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(2**20)}, buffer)
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(tmp_path / "z.pt", "w") as packed:
        for info in source.infolist():
            packed.writestr(info.filename, source.read(info), compress_type=zipfile.ZIP_DEFLATED)
    assert dk.load(tmp_path / "z.pt", "cpu")["w"].shape == (2**20,)  # with room, it loads

    def no_room(*args: object, **kwargs: object) -> object:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 4194304 bytes."
        )

    monkeypatch.setattr(torch, "load", no_room)
    with pytest.raises(RuntimeError, match="can't allocate memory") as caught:
        dk.load(tmp_path / "z.pt", "cpu")
    (note,) = caught.value.__notes__
    assert re.fullmatch(
        r"devicekit.load: this archive's records are compressed, which torch.save never does "
        r"\(another zip tool wrote it\): [\d,]+ bytes in the file inflate to 4,194,[\d,]+ "
        r"\([\d,]+ times as many\), all of which torch.load allocates\. .*zip bomb.*",
        note,
    )
    torch.save({"w": torch.zeros(4)}, tmp_path / "plain.pt")  # torch's own: no note
    with pytest.raises(RuntimeError, match="can't allocate memory") as caught:
        dk.load(tmp_path / "plain.pt", "cpu")
    assert not getattr(caught.value, "__notes__", None)


def test_torchs_words_in_devicekits_message_lose_terminal_escapes() -> None:
    # Before: "\x1b[1m...\x1b[0m" (torch's bold) in the message devicekit wrote.
    from devicekit._checkpointdamage import torch_said

    said = torch_said(pickle.UnpicklingError("\x1b[1mdo those steps only if you trust\x1b[0m."))
    assert said == "UnpicklingError: do those steps only if you trust."


def _repacked(path: Path, to: Path, *, compress: int, meta_first: bool = False) -> Path:
    """``path``'s records in a new zip as the ``zip -r`` tool writes one: folder entries first."""
    import zipfile

    with zipfile.ZipFile(path) as source:
        records = [(info.filename, source.read(info)) for info in source.infolist()]
    names = [name for name, _ in records]
    folders = sorted({name.rsplit("/", 1)[0] + "/" for name in names if "/" in name})
    if meta_first:  # another record before data.pkl, as an unsorted re-pack may put it
        records.sort(key=lambda record: record[0].endswith("data.pkl"))
    with zipfile.ZipFile(to, "w", compression=compress) as target:
        for folder in folders:
            target.writestr(folder, b"")  # size 0, a name ending in /, the folder flag
        for name, data in records:
            target.writestr(name, data)
    return to


@pytest.mark.parametrize("compress", [0, 8], ids=["stored", "deflated"])
def test_a_checkpoint_re_packed_by_zip_is_not_called_damaged(tmp_path: Path, compress: int) -> None:
    # Before: `zip -r` writes an entry per folder, which verify=True took for damage ("says
    # the record is ... a folder"), telling the user the values they loaded were wrong.
    import warnings
    import zipfile

    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    repacked = _repacked(path, tmp_path / "repacked.pt", compress=compress)
    assert any(info.is_dir() for info in zipfile.ZipFile(repacked).infolist())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compressed records are said unchecked (tested below)
        loaded = dk.load(repacked, "cpu", verify=True)
    assert loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_meta_checkpoint_re_packed_with_another_record_first_is_refused(tmp_path: Path) -> None:
    # torch finds data.pkl by name; the first record is not always it after a re-pack.
    path = tmp_path / "meta.pt"
    torch.save({"w": torch.empty(4, device="meta")}, path)
    repacked = _repacked(path, tmp_path / "repacked.pt", compress=0, meta_first=True)
    with pytest.raises(dk.CheckpointError, match="saved from tensors on the meta device"):
        dk.load(repacked, "cpu")


def test_verify_says_when_it_could_not_check(tmp_path: Path) -> None:
    # Before, verify=True passed silently on files it cannot check (the docs listed them):
    # whoever asked for the check was not told it did not happen.
    import warnings

    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.ones(2)}, whole)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dk.load(whole, "cpu", verify=True)  # every record checked: nothing to say
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.warns(RuntimeWarning, match=r"verify=True\): it is in torch's legacy format") as w:
        dk.load(legacy, "cpu", verify=True)
    assert w[0].filename == __file__  # at the caller's line
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(2)}, tmp_path / "no_crc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    with pytest.warns(RuntimeWarning, match=r"records? of it keep no CRC-32"):
        dk.load(tmp_path / "no_crc.pt", "cpu", verify=True)
    repacked = _repacked(whole, tmp_path / "deflated.pt", compress=8)
    with pytest.warns(RuntimeWarning, match=r"or are compressed"):
        dk.load(repacked, "cpu", verify=True)


def test_a_pickle_module_of_ones_own_needs_weights_only_false(tmp_path: Path) -> None:
    # Before: torch's bare "RuntimeError: Can not safely load weights when explicit
    # pickle_module is specified", of load()'s default weights_only=True.
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    for given in ({}, {"weights_only": True}):
        with pytest.raises(
            ValueError,
            match=rf"^load\(path='{tmp_path}/w.pt', pickle_module=pickle\): a pickle_module of "
            r"your own unpickles the file, so torch cannot check .* pass weights_only=False as "
            r"well for a file you trust, or leave pickle_module out$",
        ):
            dk.load(tmp_path / "w.pt", "cpu", pickle_module=pickle, **given)
    for weights_only in (False, None):  # None: torch's default, off with a pickle_module
        state = dk.load(tmp_path / "w.pt", "cpu", pickle_module=pickle, weights_only=weights_only)
        assert torch.equal(state["w"], torch.ones(2))


class _Unseekable(io.BytesIO):
    """A stream that reads but cannot seek, as an HTTP response."""

    def seek(self, offset: int, whence: int = 0) -> int:
        raise io.UnsupportedOperation("seek")

    def tell(self) -> int:
        raise io.UnsupportedOperation("tell")


def test_a_file_object_that_cannot_seek_is_a_type_error_with_the_fix(tmp_path: Path) -> None:
    # Before: torch's bare "OSError: [Errno 29] Illegal seek" from a pipe (and torch's
    # io.UnsupportedOperation, naming no load(), from a stream that cannot seek).
    import os

    data = _good(tmp_path)
    read, write = os.pipe()
    os.write(write, data)  # under a pipe's 64 KiB: written whole, nothing waits
    os.close(write)
    says = (
        r"^load\(path=the file\): path is a file object that cannot seek \({}: a pipe, "
        r"standard input or a download\), but torch.load seeks in the file; read it into "
        r"memory first: dk.load\(io.BytesIO\(f.read\(\)\)\)$"
    )
    with os.fdopen(read, "rb") as pipe:
        with pytest.raises(TypeError, match=says.format("BufferedReader")):
            dk.load(pipe, "cpu")
        assert torch.equal(dk.load(io.BytesIO(pipe.read()), "cpu")["w"], torch.ones(64))
    with pytest.raises(TypeError, match=says.format("_Unseekable")):
        dk.load(_Unseekable(data), "cpu")


def _legacy_start(protocol: int) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"w": torch.ones(2)}, buffer, _use_new_zipfile_serialization=False, pickle_protocol=protocol
    )
    return buffer.getvalue()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # protocol 4, of torch's
@pytest.mark.parametrize(
    ("data", "sizes", "what"),
    [
        (_good, range(1, 4), "a zip archive's signature"),
        (_legacy, range(1, 14), "its magic number"),
        (lambda _: _legacy_start(0), range(1, 25), "its magic number"),  # as text
        (lambda _: _legacy_start(4), range(1, 22), "its magic number"),  # framed
    ],
    ids=["zip", "legacy", "legacy-protocol-0", "legacy-protocol-4"],
)
@pytest.mark.parametrize("weights_only", [True, False])
def test_a_file_cut_inside_torchs_first_bytes_says_it_is_cut_short(
    tmp_path: Path, data: object, sizes: range, what: str, weights_only: bool
) -> None:
    # Before: "it is a pickle, but not one torch.save wrote (no torch header); if you
    # trust it, load it with pickle.load" (legacy), "not written by torch.save" (zip).
    whole = data(tmp_path)  # type: ignore[operator]
    path = tmp_path / "cut.pt"
    for size in sizes:
        path.write_bytes(whole[:size])
        with pytest.raises(dk.CheckpointError) as caught:
            dk.load(path, "cpu", weights_only=weights_only)
        message = str(caught.value)
        assert message.startswith(f"load(path={str(path)!r}): not a checkpoint torch.load can")
        assert (
            f"): it is cut short: it ends after {size} byte{'s' if size > 1 else ''}, inside the "
            f"first bytes torch.save writes ({what}), so its save stopped part way"
        ) in message, message
        assert message.endswith("Save it again, or copy it again from a whole one")


def test_a_gzip_compressed_checkpoint_says_to_open_it_with_gzip(tmp_path: Path) -> None:
    # Before: "it was not written by torch.save (its first bytes are neither a zip archive
    # nor torch's legacy format). Check the path".
    import gzip

    path = tmp_path / "sd.pt.gz"
    with gzip.open(path, "wb") as file:
        file.write(_good(tmp_path))
    with pytest.raises(
        dk.CheckpointError,
        match=r"can read: it is gzip-compressed \(a \.gz file\); if a checkpoint is inside, "
        r"load it with dk\.load\(gzip\.open\(path, 'rb'\)\)$",
    ):
        dk.load(path, "cpu")
    with gzip.open(path, "rb") as file:  # the fix, as said
        assert torch.equal(dk.load(file, "cpu")["w"], torch.ones(64))  # type: ignore[arg-type]


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("key", ["w", "model.layers.0.self_attention.query_projection.weight"])
def test_a_numpy_npz_archive_says_what_it_is(tmp_path: Path, compressed: bool, key: str) -> None:
    # Before: "it is cut short or damaged (a writer killed or a disk full mid-save), or
    # not written by torch.save", of a whole .npz.
    numpy = pytest.importorskip("numpy")
    path = tmp_path / "arrays.npz"
    (numpy.savez_compressed if compressed else numpy.savez)(path, **{key: numpy.ones(3)})
    with pytest.raises(
        dk.CheckpointError,
        match=r"can read: it is a NumPy \.npz archive \(a zip of \.npy arrays\), not one "
        r"torch\.save wrote; load it with numpy\.load\(path\), and each array with "
        r"torch\.from_numpy$",
    ):
        dk.load(path, "cpu")


def test_a_file_as_a_folder_is_the_os_error_naming_the_file(tmp_path: Path) -> None:
    # Before: a bare "NotADirectoryError: [Errno 20] Not a directory: '.../sd.pt/'".
    torch.save({"w": torch.ones(1)}, tmp_path / "sd.pt")
    with pytest.raises(
        NotADirectoryError,
        match=rf"^load\(path='{tmp_path}/sd.pt/'\): {tmp_path}/sd.pt is a file, but the path "
        rf"ends in '/', which names a folder; pass the path without it: '{tmp_path}/sd.pt'$",
    ) as caught:
        dk.load(f"{tmp_path}/sd.pt/", "cpu")
    assert caught.value.errno is None or caught.value.errno == errno.ENOTDIR
    with pytest.raises(
        NotADirectoryError,
        match=rf"^load\(path='{tmp_path}/sd.pt/w.pt'\): {tmp_path}/sd.pt is a file, not a "
        r"folder, so there is nothing inside it; check the path$",
    ):
        dk.load(tmp_path / "sd.pt" / "w.pt", "cpu")
