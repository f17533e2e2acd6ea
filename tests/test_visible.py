from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import devicekit as dk
from devicekit import _scopedenv, _visible

from .conftest import run_python
from .fake_pynvml import FakeGPU, FakeNVML

VAR = "CUDA_VISIBLE_DEVICES"


@pytest.fixture
def cuda_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scope tests are about the variable, not this process's CUDA state (tested separately)."""
    monkeypatch.setattr(_scopedenv, "cuda_started", lambda: None)
    monkeypatch.delenv(VAR, raising=False)


# --- parse_visible_devices -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", []),
        ("0", [0]),
        ("1,0", [1, 0]),
        (" 2 , 3 ", [2, 3]),
        ("3a", [3]),
        ("1gpu2,2ampere", [1, 2]),
        ("0,x,1", [0]),
        ("0,,1", [0]),
        (",0", []),
        ("0,", [0]),
        ("0,0", []),
        ("1,0,1", []),
        ("-1", []),
        ("0,-1,1", [0]),
        ("+1", [1]),
        ("GPU-ab12,GPU-cd34", ["GPU-ab12", "GPU-cd34"]),
        # torch's reading (its device count before CUDA starts), whitespace around UUIDs too:
        (" GPU-ab12 , GPU-cd34", []),  # a value that starts with a space lists no UUID
        ("GPU-ab12, GPU-cd34", ["GPU-ab12"]),  # ' GPU-cd34' is not a GPU- entry
        ("GPU-ab12 ,GPU-cd34", []),  # 'GPU-ab12 ' starts no UUID: no GPU from there on
        ("GPU-ab12,GPU-cd34\n", ["GPU-ab12"]),
        ("\u0663", [3]),  # an Arabic-Indic 3: torch's str.isdigit reads it
        ("0,\u0663", [0, 3]),
        ("\u00b2", []),  # a superscript 2: torch's int() fails on it, CUDA reads no index
        ("GPU-ab12,0,GPU-cd34", ["GPU-ab12"]),
        ("GPU-ab12,GPU-ab12", []),
        ("MIG-1f2e,MIG-3d4c", ["MIG-1f2e", "MIG-3d4c"]),
        ("MIG-1f2e,GPU-ab12", ["MIG-1f2e"]),
        ("0,GPU-ab12", [0]),
    ],
)
def test_parse_follows_cuda_rules(value: str, expected: list[int | str]) -> None:
    assert dk.parse_visible_devices(value) == expected


@pytest.mark.parametrize(
    ("value", "why", "fix"),
    [
        (
            "0,0",
            "0 is listed twice, and any duplicate makes CUDA hide every GPU",
            "list each GPU once, such as CUDA_VISIBLE_DEVICES=0",
        ),
        (
            "2, 1,2,3",
            "2 is listed twice, and any duplicate makes CUDA hide every GPU",
            "list each GPU once, such as CUDA_VISIBLE_DEVICES=2,1,3",
        ),
        (
            "GPU-ab12,GPU-ab12",
            "'GPU-ab12' is listed twice, and any duplicate makes CUDA hide every GPU",
            "list each GPU once, such as CUDA_VISIBLE_DEVICES=GPU-ab12",
        ),
        ("", "an empty value lists no GPU", "unset CUDA_VISIBLE_DEVICES, or list the GPUs"),
        ("-1", "the negative entry '-1' ends the list", "unset CUDA_VISIBLE_DEVICES, or list"),
        ("x", "'x' is not a device index, and CUDA stops reading at the first entry", "unset"),
        (
            "0,x,1",
            "'x' is not a device index, and CUDA stops reading at the first entry it cannot use "
            "and ignores the rest",
            "as written, CUDA uses CUDA_VISIBLE_DEVICES=0",
        ),
        ("0,,1", "an empty entry is not a device index", "CUDA uses CUDA_VISIBLE_DEVICES=0"),
        ("3a,1", "'3a' is read as 3", "as written, CUDA uses CUDA_VISIBLE_DEVICES=3,1"),
        ("00,+1", "'00' is read as 0; '+1' is read as 1", "CUDA uses CUDA_VISIBLE_DEVICES=0,1"),
        ("0,-1,1", "the negative entry '-1' ends the list", "CUDA uses CUDA_VISIBLE_DEVICES=0"),
        ("GPU-ab12,0", "'0' is not a GPU- UUID like the first entry", "=GPU-ab12"),
        (
            "GPU-ab12, GPU-cd34",
            "' GPU-cd34' has whitespace around the UUID, and torch compares UUIDs as written, "
            "so it counts no GPU from there on",
            "write the UUIDs without whitespace, such as CUDA_VISIBLE_DEVICES=GPU-ab12,GPU-cd34",
        ),
        (
            " GPU-ab12",
            "' GPU-ab12' has whitespace before the first UUID, and torch reads UUIDs only in a "
            "value that starts with GPU- or MIG-",
            "write the UUIDs without whitespace, such as CUDA_VISIBLE_DEVICES=GPU-ab12",
        ),
        (
            "0,\u0663",
            "'\u0663' is read as 3 by torch, but CUDA reads only the digits 0-9, so CUDA itself "
            "stops there",
            "write indices with the digits 0-9, such as CUDA_VISIBLE_DEVICES=0,3",
        ),
    ],
)
def test_misreading_names_the_rule_and_the_fix(value: str, why: str, fix: str) -> None:
    found = _visible.misreading(value)
    assert found is not None
    assert found.why.startswith(why)
    assert fix in found.fix


@pytest.mark.parametrize("value", ["0", "1,0", " 2 , 3 ", "GPU-ab12,GPU-cd34"])
def test_a_value_read_as_written_has_no_misreading(value: str) -> None:
    assert _visible.misreading(value) is None


@given(st.text(alphabet="0123-x, ", max_size=8))
def test_misreading_exactly_when_not_read_as_written(value: str) -> None:
    found = _visible.misreading(value)
    assert (found is None) == _visible.reads_as_written(value)
    if found is not None:
        assert found.why
        assert found.fix


def test_parse_reads_the_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    assert dk.parse_visible_devices() is None
    monkeypatch.setenv(VAR, "2,1")
    assert dk.parse_visible_devices() == [2, 1]
    monkeypatch.setenv(VAR, "")
    assert dk.parse_visible_devices() == []


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match=r"expects a string or None, got 3 of type int"):
        dk.parse_visible_devices(3)  # type: ignore[arg-type]


def test_parse_names_a_huge_non_string_in_a_short_message() -> None:
    # Before: the repr of all 10**6 items, 7.9 MB.
    with pytest.raises(TypeError) as caught:
        dk.parse_visible_devices(list(range(10**6)))  # type: ignore[arg-type]
    message = str(caught.value)
    assert len(message) < 1000
    assert message.startswith("parse_visible_devices() expects a string or None, got [0, 1, 2, ")
    assert message.endswith("... of type list")


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([*range(10**5), 0], r"^duplicate entry 0 in visible_devices\(\[0, 1, 2, .*\.\.\.\)"),
        ({"a": 1}, r"^visible_devices\(\) expects .*; got \{'a': 1\} of type dict$"),
        (["0", "x" * 10**6], r"^malformed entry 'xxx.*xxx' in visible_devices\(\['0', 'xxx"),
    ],
)
def test_visible_devices_names_a_huge_bad_argument_in_a_short_message(
    devices: object, message: str
) -> None:
    # Before: the repr of the whole argument (and of each entry), megabytes.
    with pytest.raises((TypeError, ValueError)) as caught, dk.visible_devices(devices):  # type: ignore[arg-type]
        pass
    assert len(str(caught.value)) < 1000
    assert re.search(message, str(caught.value))


def _torch_reading(value: str) -> list[int] | list[str]:
    """Torch's own parser (private, so guarded): the reference devicekit must agree with."""
    with mock.patch.dict(os.environ, {VAR: value}):
        return torch.cuda._parse_visible_devices()


needs_torch_parser = pytest.mark.skipif(
    not hasattr(torch.cuda, "_parse_visible_devices"), reason="torch has no private parser"
)


@needs_torch_parser
@given(st.text(alphabet="0123456789,ax +-\u0663\u00b2\n", max_size=16))
def test_parse_agrees_with_torch_on_indices(value: str) -> None:
    assume(not value.lstrip().startswith(("GPU-", "MIG-")))
    try:
        expected = _torch_reading(value)
    except ValueError:  # torch's strtoul crashes on a lone sign or a "²"; CUDA reads no index
        assume(False)
    assert dk.parse_visible_devices(value) == expected


def _torch_count(entries: list[int] | list[str]) -> list[int] | list[str]:
    """torch's UUID entries up to the first it can match to no GPU: one with whitespace.

    torch keeps ``'GPU-ab '`` as written, then finds no UUID it starts
    (``_transform_uuid_to_ordinals``), so its count of devices ends there;
    devicekit ends the list there.
    """
    spaced = [i for i, entry in enumerate(entries) if str(entry) != str(entry).strip()]
    return entries[: spaced[0]] if spaced else entries  # type: ignore[return-value]


_UUID_ENTRIES = ["GPU-ab", "GPU-cd", "GPU-ef12", "MIG-ab", "0", "x", "", " GPU-cd", "GPU-ab "]


@needs_torch_parser
@given(
    st.lists(st.sampled_from(_UUID_ENTRIES), min_size=1, max_size=5).filter(
        lambda entries: entries[0].lstrip().startswith(("GPU-", "MIG-"))
    )
)
def test_parse_agrees_with_torch_on_uuids(entries: list[str]) -> None:
    value = ",".join(entries)
    assert dk.parse_visible_devices(value) == _torch_count(_torch_reading(value))


@needs_torch_parser
@pytest.mark.parametrize(
    "value",
    [
        "GPU-ab12, GPU-cd34",  # devicekit read both, torch the first
        " GPU-ab12",  # devicekit read one, torch none
        "GPU-ab12 ,GPU-cd34",
        "GPU-ab12,GPU-cd34 ,GPU-ab12",
        "MIG-ab12, MIG-cd34",
        "\u0663",  # devicekit read none, torch 3
        "0,\u0663",
        "1\u0663",
    ],
)
def test_parse_agrees_with_torch_where_the_trial_found_it_did_not(value: str) -> None:
    assert dk.parse_visible_devices(value) == _torch_count(_torch_reading(value))


# --- visible_devices -------------------------------------------------------------------


@pytest.mark.usefixtures("cuda_not_started")
@pytest.mark.parametrize(
    ("devices", "value", "parsed"),
    [
        (1, "1", [1]),
        ("0,2", "0,2", [0, 2]),
        (" 1 , 2 ", "1,2", [1, 2]),
        ([2, 0], "2,0", [2, 0]),
        ((3,), "3", [3]),
        (range(2), "0,1", [0, 1]),
        (["1", 0], "1,0", [1, 0]),
        (["GPU-ab12", "GPU-cd34"], "GPU-ab12,GPU-cd34", ["GPU-ab12", "GPU-cd34"]),
        ("MIG-8c3b0f1e-aa01", "MIG-8c3b0f1e-aa01", ["MIG-8c3b0f1e-aa01"]),
        (["MIG-GPU-5bd6a7e1/1/0"], "MIG-GPU-5bd6a7e1/1/0", ["MIG-GPU-5bd6a7e1/1/0"]),
        ([], "", []),
        ("", "", []),
    ],
)
def test_visible_devices_sets_and_yields(devices: object, value: str, parsed: list[object]) -> None:
    with dk.visible_devices(devices) as seen:  # type: ignore[arg-type]
        assert os.environ[VAR] == value
        assert seen == parsed
        # What devicekit wrote is what CUDA will read back.
        assert dk.parse_visible_devices() == parsed
    assert VAR not in os.environ


@pytest.mark.usefixtures("cuda_not_started")
def test_visible_devices_restores_a_previous_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "3,2")
    with dk.visible_devices(2):
        assert os.environ[VAR] == "2"
    assert os.environ[VAR] == "3,2"


@pytest.mark.usefixtures("cuda_not_started")
def test_indices_outside_this_process_s_share_are_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The usual mistake: this process's cuda:N (pick_gpu().index) taken for the machine's N.
    monkeypatch.setenv(VAR, "3,2")
    with (
        pytest.warns(UserWarning, match=r"^visible_devices") as caught,
        dk.visible_devices(0) as parsed,
    ):
        assert os.environ[VAR] == "0"  # still done: leaving the share may be meant
    assert parsed == [0]
    assert str(caught[0].message) == (
        "visible_devices(): CUDA_VISIBLE_DEVICES='3,2' gave this process GPUs 3,2, and GPU 0 "
        "is not among them. Entries are the machine's GPU indices, not this process's cuda:N: "
        "if you meant this process's cuda:0, pass visible_devices('3'). Where leaving the "
        "share is meant, filter this warning."
    )
    assert caught[0].filename == __file__  # points at the with statement

    @dk.visible_devices(0)
    def step() -> str:
        return os.environ[VAR]

    with pytest.warns(UserWarning, match=r"^visible_devices") as caught:
        assert step() == "0"
    assert caught[0].filename == __file__  # the decorated call's line; before, contextlib's
    with (
        pytest.warns(UserWarning, match=r"^visible_devices") as caught,
        contextlib.ExitStack() as stack,
    ):
        stack.enter_context(dk.visible_devices(0))
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match=r"GPUs 0,7 are not among them\. .*: pass GPUs among 3,2"):
        _scopedenv._warn_if_outside_share([0, 7])  # the machine may have fewer GPUs to pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dk.visible_devices("2,3"), dk.visible_devices(3):  # within the share, then nested
            pass
        with dk.visible_devices(3), dk.visible_devices(2):  # the share is the one from outside
            pass
        monkeypatch.setenv(VAR, "GPU-ab12")  # UUIDs: nothing to compare indices with
        with dk.visible_devices(0):
            pass
        monkeypatch.delenv(VAR)  # every GPU
        with dk.visible_devices(5):
            pass


@pytest.mark.usefixtures("cuda_not_started")
def test_visible_devices_restores_on_exceptions() -> None:
    with pytest.raises(KeyError, match="inside"), dk.visible_devices([1]):
        raise KeyError("inside")
    assert VAR not in os.environ


@pytest.mark.usefixtures("cuda_not_started")
def test_visible_devices_nests() -> None:
    with dk.visible_devices("0,1"):
        with dk.visible_devices([]):
            assert os.environ[VAR] == ""
            with dk.visible_devices([1]):
                assert os.environ[VAR] == "1"
            assert os.environ[VAR] == ""
        assert os.environ[VAR] == "0,1"
    assert VAR not in os.environ


@pytest.mark.usefixtures("cuda_not_started")
def test_visible_devices_none_unsets_the_variable_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VAR, "1")
    with dk.visible_devices(None) as parsed:
        assert parsed is None
        assert VAR not in os.environ  # every GPU visible, as parse_visible_devices() says
        assert dk.parse_visible_devices() is None
    assert os.environ[VAR] == "1"


@pytest.mark.usefixtures("cuda_not_started")
@pytest.mark.parametrize("value", [None, "", "1,0", "GPU-ab12"])
def test_visible_devices_round_trips_with_parse_visible_devices(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    with dk.visible_devices(dk.parse_visible_devices()):
        assert os.environ.get(VAR) == value
        assert dk.parse_visible_devices() == dk.parse_visible_devices(value)


@pytest.mark.usefixtures("cuda_not_started")
@pytest.mark.parametrize("hide", ["", [], ()])
def test_empty_values_hide_every_gpu(hide: object) -> None:
    with dk.visible_devices(hide) as parsed:  # type: ignore[arg-type]
        assert parsed == []
        assert os.environ[VAR] == ""


@pytest.mark.usefixtures("cuda_not_started")
@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        (-1, ValueError, r"negative entry -1 in visible_devices\(-1\): device indices start at 0"),
        ([0, -2], ValueError, r"negative entry -2 in visible_devices\(\[0, -2\]\)"),
        ("0,-1", ValueError, r"negative entry -1 in visible_devices\('0,-1'\)"),
        (
            "0,0",
            ValueError,
            r"duplicate entry 0 in visible_devices\('0,0'\): any duplicate makes CUDA hide every "
            r"GPU; list each once",
        ),
        (
            ["GPU-ab12", "gpu-AB12"],
            ValueError,
            r"malformed entry 'gpu-AB12'",
        ),
        (["GPU-ab12", "GPU-AB12"], ValueError, r"duplicate entry 'GPU-AB12'"),
        ("0,,1", ValueError, r"empty entry in visible_devices\('0,,1'\)"),
        ("1a", ValueError, r"malformed entry '1a' in visible_devices\('1a'\): expected a device"),
        ("GPU-", ValueError, r"malformed entry 'GPU-'"),
        (["MIG-"], ValueError, r"malformed entry 'MIG-'"),
        ([0, "GPU-ab12"], ValueError, r"mixed entry kinds .*\(GPU UUIDs, indices\)"),
        (["GPU-ab12", "MIG-cd34"], ValueError, r"mixed entry kinds .*\(GPU UUIDs, MIG UUIDs\)"),
        (True, TypeError, r"visible_devices\(\) expects an int, a comma-separated string"),
        ([True], TypeError, r"entry True in visible_devices\(\[True\]\) is a bool"),
        (1.5, TypeError, r"got 1\.5 of type float"),
        ([0.0], TypeError, r"entry 0\.0 .* has type float; expected an int or a UUID string"),
        (b"0", TypeError, r"got b'0'"),
        ({0: 1}, TypeError, r"got \{0: 1\}"),
    ],
)
def test_visible_devices_rejects_bad_input_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, devices: object, error: type[Exception], message: str
) -> None:
    monkeypatch.setenv(VAR, "7")
    with pytest.raises(error, match=message), dk.visible_devices(devices):  # type: ignore[arg-type]
        pytest.fail("the block must not run")
    assert os.environ[VAR] == "7"


@pytest.mark.usefixtures("cuda_not_started")
def test_visible_devices_takes_a_numpy_array_of_indices_as_a_list() -> None:
    # Before: numpy's own "only integer scalar arrays can be converted to a scalar index".
    np = pytest.importorskip("numpy")
    with dk.visible_devices(np.arange(2)) as parsed:
        assert parsed == [0, 1]
        assert os.environ[VAR] == "0,1"
    with dk.visible_devices(np.int64(1)) as parsed, dk.visible_devices(np.array(2)) as inner:
        assert (parsed, inner) == ([1], [2])
    with pytest.raises(
        TypeError, match=r"(?s)^entry array\(\[0, 1\]\) in visible_devices\(.* has type "
    ):
        dk.visible_devices(np.arange(4).reshape(2, 2)).__enter__()
    with pytest.raises(
        TypeError, match=r"^entry np\.True_ in visible_devices\(\[np\.True_\]\) is a bool"
    ):
        dk.visible_devices([np.True_]).__enter__()


@pytest.mark.usefixtures("cuda_not_started")
@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (
            torch.tensor([0, 1]),  # before: torch's "only integer tensors of a single element..."
            r"^visible_devices\(\) expects .*; got a tensor \(shape \[2\], on cpu\), and a "
            r"tensor's value is never read as an index: pass tensor\.tolist\(\) if it holds",
        ),
        (torch.tensor(1), r"got a tensor \(shape \[\], on cpu\)"),  # before: read as [1]
        ([0, torch.tensor(1)], r"^entry a tensor \(shape \[\], on cpu\) in visible_devices\("),
    ],
    ids=repr,
)
def test_visible_devices_never_reads_a_tensor_as_indices(devices: object, message: str) -> None:
    with pytest.raises(TypeError, match=message), dk.visible_devices(devices):  # type: ignore[arg-type]
        pytest.fail("the block must not run")
    assert VAR not in os.environ


@pytest.mark.usefixtures("cuda_not_started")
@pytest.mark.parametrize(
    ("devices", "message"),
    [
        # nvidia-smi --query-gpu=index prints one a line: the words status and doctor use.
        (
            "0\n1",
            r"^malformed entry '0\\n1' in visible_devices\('0\\n1'\): CUDA separates entries "
            r"with commas only, so '0\\n1' is one entry: CUDA reads its number, 0, stops at the "
            r"newline and drops the rest, '1'; separate the GPUs with commas, such as "
            r"visible_devices\('0,1'\)$",
        ),
        ("0;1", r"stops at the semicolon .*such as visible_devices\('0,1'\)$"),
        (
            ["MIG-xyz"],
            r"^malformed entry 'MIG-xyz' in visible_devices\(\['MIG-xyz'\]\): a MIG UUID is "
            r"'MIG-' followed by hexadecimal digits \(0-9, a-f\) and dashes",
        ),
        ("GPU-12g4", r"a GPU UUID is 'GPU-' followed by hexadecimal digits \(0-9, a-f\)"),
        ("gpu-ab12", r"a GPU UUID starts with 'GPU-' in capitals, as nvidia-smi -L prints it"),
        ("\u0663", r"CUDA reads indices written with the digits 0-9 only; write '3'$"),
    ],
    ids=repr,
)
def test_visible_devices_says_what_a_malformed_entry_should_be(
    devices: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message), dk.visible_devices(devices):  # type: ignore[arg-type]
        pytest.fail("the block must not run")


@pytest.mark.usefixtures("cuda_not_started")
def test_a_visible_devices_block_entered_twice_says_to_call_it_again() -> None:
    # Before: contextlib's "AttributeError: '_GeneratorContextManager' object has no attribute".
    block = dk.visible_devices([1, 0])
    with block as parsed:
        assert parsed == [1, 0]
    with (
        pytest.raises(
            RuntimeError,
            match=r"^this dk\.visible_devices\(\[1, 0\]\) block was entered already, and each "
            r"block is entered once: call dk\.visible_devices\(\.\.\.\) again for each with",
        ),
        block,
    ):
        pytest.fail("the block must not run")
    assert VAR not in os.environ


def test_visible_devices_refuses_once_cuda_has_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_scopedenv, "cuda_started", lambda: "torch has initialized CUDA")
    monkeypatch.delenv(VAR, raising=False)
    with (
        pytest.raises(
            dk.CUDAInitializedError,
            match=r"cannot set CUDA_VISIBLE_DEVICES='1' for this process: torch has initialized "
            r"CUDA.*pass subprocesses_only=True",
        ),
        dk.visible_devices(1),
    ):
        pytest.fail("the block must not run")
    assert VAR not in os.environ
    with pytest.raises(RuntimeError), dk.visible_devices(1):  # catchable as the builtin
        pass


def test_subprocesses_only_sets_the_variable_after_cuda_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_scopedenv, "cuda_started", lambda: "torch has initialized CUDA")
    monkeypatch.delenv(VAR, raising=False)
    with dk.visible_devices("1", subprocesses_only=True) as parsed:
        child = subprocess.run(
            [sys.executable, "-c", f"import os; print(os.environ['{VAR}'])"],
            capture_output=True,
            text=True,
            check=True,
        )
    assert parsed == [1]
    assert child.stdout.strip() == "1"
    assert VAR not in os.environ


_SPECS = st.one_of(
    st.none(),
    st.integers(min_value=0, max_value=15),
    st.lists(st.integers(min_value=0, max_value=15), unique=True, max_size=4),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=4),  # may be invalid
    st.text(alphabet="0123,-x ", max_size=8),  # may be invalid
)
_PREVIOUS = st.one_of(st.none(), st.text(alphabet="0123456789,GPU-", max_size=8))


@given(previous=_PREVIOUS, specs=st.lists(_SPECS, min_size=1, max_size=4), fail=st.booleans())
def test_any_nesting_restores_what_it_changed(
    previous: str | None, specs: list[object], fail: bool
) -> None:
    environ = {} if previous is None else {VAR: previous}
    with (
        mock.patch.dict(os.environ, environ, clear=False),
        mock.patch.object(_scopedenv, "cuda_started", return_value=None),
        warnings.catch_warnings(),
    ):
        # Nested blocks step outside each other's share on purpose: that warning is tested alone.
        warnings.filterwarnings("ignore", r"visible_devices\(\): ", UserWarning)
        if previous is None:
            os.environ.pop(VAR, None)

        def enter(level: int) -> None:
            if level == len(specs):
                if fail:
                    raise LookupError("user code failed")
                return
            before = os.environ.get(VAR)
            try:
                with dk.visible_devices(specs[level]) as parsed:  # type: ignore[arg-type]
                    assert dk.parse_visible_devices() == parsed
                    enter(level + 1)
            except (TypeError, ValueError):
                pass  # an invalid spec must leave the variable alone
            assert os.environ.get(VAR) == before

        try:
            enter(0)
        except LookupError:
            assert fail
        assert os.environ.get(VAR) == previous


@given(
    previous=st.one_of(st.none(), st.sampled_from(["", "3", "GPU-ab12"])),
    values=st.lists(st.one_of(st.none(), st.sampled_from(["0", "1", "0,1", ""])), max_size=5),
    data=st.data(),
)
def test_blocks_that_end_in_any_order_restore_the_variable(
    previous: str | None, values: list[str | None], data: st.DataObject
) -> None:
    # Two generators, an ExitStack unwound by hand, or two threads: blocks need not
    # end innermost first. Each time, the block that began last and is still open
    # decides; once all have ended, the variable is as before the first.
    # Drawn before any block begins: a draw that stops the example midway would leave
    # blocks open, and their generators would restore the variable when collected later.
    order = data.draw(st.permutations(range(len(values))))
    with mock.patch.dict(os.environ, {} if previous is None else {VAR: previous}):
        if previous is None:
            os.environ.pop(VAR, None)
        blocks = [_scopedenv.scoped_env(VAR, value) for value in values]
        for block in blocks:
            block.__enter__()
        still_open = list(range(len(values)))
        for ending in order:
            blocks[ending].__exit__(None, None, None)
            still_open.remove(ending)
            expected = values[still_open[-1]] if still_open else previous
            assert os.environ.get(VAR) == expected
        assert os.environ.get(VAR) == previous
        assert VAR not in _scopedenv._scopes.open


@pytest.mark.usefixtures("cuda_not_started")
def test_visible_devices_blocks_in_two_threads_restore_the_variable() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str | None] = {}

    def first() -> None:
        with dk.visible_devices("0"):
            first_in.set()
            second_in.wait(60)
        first_out.set()
        seen["first left"] = os.environ.get(VAR)

    def second() -> None:
        first_in.wait(60)
        with dk.visible_devices("1"):
            second_in.set()
            first_out.wait(60)
        seen["second left"] = os.environ.get(VAR)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert seen == {"first left": "1", "second left": None}  # the second still held "1"
    assert VAR not in os.environ  # as before either began


def test_subprocesses_only_must_be_a_bool(monkeypatch: pytest.MonkeyPatch) -> None:
    # A truthy "no" used to skip the CUDA check: refused before anything changes.
    monkeypatch.setattr(_scopedenv, "cuda_started", lambda: "torch has initialized CUDA")
    monkeypatch.delenv(VAR, raising=False)
    with (
        pytest.raises(TypeError, match=r"subprocesses_only must be True or False, got 'no'"),
        dk.visible_devices(1, subprocesses_only="no"),  # type: ignore[arg-type]
    ):
        pytest.fail("the block must not run")
    assert VAR not in os.environ


def test_subprocesses_only_warns_when_cuda_starts_in_this_process_inside_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VAR, raising=False)
    state: list[str | None] = [None]
    monkeypatch.setattr(_scopedenv, "cuda_started", lambda: state[0])
    with (
        pytest.warns(
            RuntimeWarning,
            match=r"subprocesses_only=True\) was meant for the processes started in it, but "
            r"torch has initialized CUDA inside the block, so this process read "
            r"CUDA_VISIBLE_DEVICES=1 too and keeps that view of the GPUs until it exits",
        ) as caught,
        dk.visible_devices([1], subprocesses_only=True),
    ):
        state[0] = "torch has initialized CUDA"  # torch.zeros(1, device="cuda"), say
    assert VAR not in os.environ
    assert caught[0].filename == __file__  # points at the with block, not at devicekit


def test_subprocesses_only_is_quiet_when_cuda_started_before_or_not_at_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VAR, raising=False)
    state: list[str | None] = [None]
    monkeypatch.setattr(_scopedenv, "cuda_started", lambda: state[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dk.visible_devices([1], subprocesses_only=True):  # CUDA never starts
            pass
        state[0] = "torch has initialized CUDA"
        with dk.visible_devices([1], subprocesses_only=True):  # started before: its view is set
            pass


@pytest.mark.gpu
def test_subprocesses_only_warns_when_this_process_starts_cuda_in_the_block() -> None:
    found = run_python(
        """
        import json, warnings, torch
        import devicekit as dk
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with dk.visible_devices([0], subprocesses_only=True):
                torch.zeros(1, device="cuda")
        print(json.dumps([str(w.message) for w in caught if w.category is RuntimeWarning]))
        """
    )
    assert any("keeps that view of the GPUs until it exits" in message for message in found)


def test_cuda_started_is_none_in_a_fresh_process() -> None:
    result = run_python(
        """
        import json, torch
        from devicekit._visible import cuda_started
        print(json.dumps(cuda_started()))
        """
    )
    assert result is None


@pytest.mark.gpu
def test_a_child_started_inside_an_empty_scope_sees_no_gpu() -> None:
    probe = (
        "import json, torch; "
        "print(json.dumps([torch.cuda.device_count(), torch.cuda.is_available()]))"
    )
    # subprocesses_only: whatever this test process did with CUDA, the child starts clean.
    with dk.visible_devices("", subprocesses_only=True):
        hidden = run_python(probe)
    with dk.visible_devices([0], subprocesses_only=True):
        one = run_python(probe)
    assert hidden == [0, False]
    assert one == [1, True]


@pytest.mark.parametrize(
    ("value", "as_written"),
    [
        ("0,1", True),
        (" 1 , 0 ", True),
        ("GPU-ab12", True),
        ("0,x", False),
        ("0,0", False),
        ("", False),
        ("3a", False),
    ],
)
def test_reads_as_written(value: str, as_written: bool) -> None:
    assert _visible.reads_as_written(value) is as_written


def test_an_index_past_the_machine_s_gpus_is_refused_where_nvml_counts_them(
    nvml_session: Callable[[Any], None],
) -> None:
    nvml_session(FakeNVML([FakeGPU(f"GPU-{i}0000000-0000-0000-0000-000000000000") for i in (1, 2)]))
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with (
        pytest.raises(
            ValueError,
            match=r"^entry 7 in visible_devices\(\[1, 7\]\): this machine has 2 GPUs \(0 to 1\), "
            r"and CUDA stops reading at the first entry it cannot use and ignores the rest; list "
            r"indices below 2",
        ),
        dk.visible_devices([1, 7]),
    ):
        pass
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # nothing changed
    with (
        pytest.raises(ValueError, match=r"^entry 1000000000000000000000000000000 in"),
        dk.visible_devices(10**30),
    ):
        pass
    with dk.visible_devices("1,0") as parsed:  # indices the machine has: as before
        assert parsed == [1, 0]
    nvml_session(None)  # no NVML: the count is unknown, so any index is taken as written
    with dk.visible_devices([7]) as parsed:
        assert parsed == [7]


_A = "GPU-5bd6a7e1-0000-0000-0000-000000000000"
_B = "GPU-5bd6f00d-0000-0000-0000-000000000000"


@pytest.mark.usefixtures("cuda_not_started")
@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (
            ["GPU-deadbeef"],
            r"^entry 'GPU-deadbeef' in visible_devices\(\['GPU-deadbeef'\]\) is the UUID of no "
            r"GPU on this machine \(it has GPU-5bd6a7e1-.*, GPU-5bd6f00d-.*\), and CUDA stops "
            r"reading at the first entry it cannot use and ignores the rest; copy the UUID from "
            r"nvidia-smi -L$",
        ),
        (
            "GPU-5bd6",
            r"^entry 'GPU-5bd6' in visible_devices\('GPU-5bd6'\) starts the UUIDs of 2 GPUs "
            r"\(GPU-5bd6a7e1-.*, GPU-5bd6f00d-.*\), so CUDA cannot tell which it means.*"
            r"give enough of the UUID to name one$",
        ),
        (
            [_A, "GPU-5bd6a7"],
            r"^entries 'GPU-5bd6a7e1-0000-0000-0000-000000000000' and 'GPU-5bd6a7' in "
            r"visible_devices\(.*\) both name GPU-5bd6a7e1-0000-0000-0000-000000000000, and any "
            r"duplicate makes CUDA hide every GPU; list each GPU once$",
        ),
    ],
)
def test_a_gpu_uuid_that_names_no_gpu_or_several_is_refused_where_nvml_lists_them(
    nvml_session: Callable[[Any], None], devices: object, message: str
) -> None:
    nvml_session(
        FakeNVML([FakeGPU(_A, bus="00000000:18:00.0"), FakeGPU(_B, bus="00000000:19:00.0")])
    )
    with pytest.raises(ValueError, match=message), dk.visible_devices(devices):  # type: ignore[arg-type]
        pytest.fail("the block must not run")
    assert VAR not in os.environ


@pytest.mark.usefixtures("cuda_not_started")
def test_a_gpu_uuid_in_the_wrong_case_is_refused_with_the_case_nvidia_smi_prints(
    nvml_session: Callable[[Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(
        FakeNVML([FakeGPU(_A, bus="00000000:18:00.0"), FakeGPU(_B, bus="00000000:19:00.0")])
    )
    message = (
        r"^entry 'GPU-5BD6A7' in visible_devices\(\['GPU-5BD6A7'\]\) names "
        r"GPU-5bd6a7e1-0000-0000-0000-000000000000 only if case is ignored, and torch compares "
        r"UUIDs case and all, so it would find no GPU there; write 'GPU-5bd6a7', as "
        r"nvidia-smi -L prints it$"
    )
    with pytest.raises(ValueError, match=message), dk.visible_devices(["GPU-5BD6A7"]):
        pytest.fail("the block must not run")
    # What the check refuses is what the mapping cannot place: one rule for both.
    monkeypatch.setenv(VAR, "GPU-5BD6A7")
    assert dk.gpus() == []
    monkeypatch.setenv(VAR, "GPU-5bd6a7")
    assert [info.uuid for info in dk.gpus()] == [_A]


@pytest.mark.usefixtures("cuda_not_started")
def test_gpu_uuids_the_machine_has_are_accepted(nvml_session: Callable[[Any], None]) -> None:
    nvml_session(
        FakeNVML([FakeGPU(_A, bus="00000000:18:00.0"), FakeGPU(_B, bus="00000000:19:00.0")])
    )
    for devices in (["GPU-5bd6f", "GPU-5bd6a"], [_A], ["MIG-abcd1234"]):
        with dk.visible_devices(devices) as parsed:  # MIG UUIDs are not checked
            assert parsed == devices
    nvml_session(FakeNVML([FakeGPU(_A), FakeGPU(None)]))  # type: ignore[arg-type]
    with dk.visible_devices(["GPU-deadbeef"]):  # a GPU of unknown UUID could be the one
        pass
    nvml_session(None)  # no NVML: nothing to check against
    with dk.visible_devices(["GPU-deadbeef"]) as parsed:
        assert parsed == ["GPU-deadbeef"]


@pytest.mark.parametrize("devices", [{0, 1}, frozenset({"GPU-aaaa1111", "GPU-bbbb2222"}), {0}])
def test_a_set_is_refused_since_it_keeps_no_order(devices: object) -> None:
    # Before, a set was taken in its iteration order, which the hash seed changes:
    # cuda:0 was another GPU from run to run.
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    refused = r"a set keeps no order of yours.*sorted\(\.\.\.\)"
    with pytest.raises(TypeError, match=refused), dk.visible_devices(devices):  # type: ignore[arg-type]
        pass
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
    with dk.visible_devices({0: "first"}.keys()):  # a dict's keys keep their order: taken
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
