"""progress=: a tqdm bar, or a line, on stderr."""

from __future__ import annotations

import math
import multiprocessing
import re
import sys

import pytest

import devicekit as dk


def test_progress_must_be_a_bool() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(
        TypeError, match="progress must be None \\(no progress\\), True or False, got 'yes'"
    ):
        dk.gpu_map(math.sqrt, [1], devices=["cpu"], progress="yes")  # type: ignore[arg-type]
    assert set(multiprocessing.active_children()) == before  # refused before any worker started


def test_progress_without_tqdm_on_a_terminal_is_a_line_that_ends_at_the_total(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert dk.gpu_map(math.sqrt, [1, 4, 9], devices=["cpu"], progress=True) == [1.0, 2.0, 3.0]
    err = capsys.readouterr().err
    assert err.endswith("\rgpu_map: 3/3\n"), err
    assert "gpu_map: 1/3" in err


def test_progress_without_tqdm_in_a_log_is_a_line_per_tenth(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a pipe or a log file got "gpu_map: 1/20gpu_map: 2/20..." on one line.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert dk.gpu_map(math.sqrt, range(20), devices=["cpu"], progress=True)[4] == 2.0
    err = capsys.readouterr().err
    assert err.splitlines() == [f"gpu_map: {done}/20" for done in range(2, 21, 2)], err


def test_progress_with_tqdm_is_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    assert dk.gpu_map(math.sqrt, [1, 4, 9], devices=["cpu"], progress=True) == [1.0, 2.0, 3.0]
    assert re.search(r"gpu_map: 100%.*3/3", capsys.readouterr().err)


def test_progress_is_checked_for_an_empty_map_too() -> None:
    # Before, an empty map returned [] without looking at progress at all.
    with pytest.raises(
        TypeError, match="progress must be None \\(no progress\\), True or False, got 'yes'"
    ):
        dk.gpu_map(math.sqrt, [], devices=["cpu"], progress="yes")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="progress must be None \\(no progress\\), True or False, got 'yes'"
    ):
        dk.gpu_map(math.sqrt, [], executor="ray", progress="yes")  # type: ignore[arg-type]
