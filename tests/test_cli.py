from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import devicekit as dk
from devicekit import _cli

from .conftest import GPU_COUNT


def test_report_names_versions_build_devices_and_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _cli.main([]) == 0
    out = capsys.readouterr().out
    assert f"devicekit             {dk.__version__}" in out
    assert f"torch                 {torch.__version__} ({_cli.torch_build()} build)" in out
    assert "CUDA_VISIBLE_DEVICES  (unset: every GPU is visible)" in out
    devices = ", ".join(str(d) for d in dk.try_all_gpus()) if GPU_COUNT else "none ("
    assert f"devices               {devices}" in out


@pytest.mark.skipif(GPU_COUNT > 0, reason="checks the no-GPU message")
def test_report_says_plainly_when_there_is_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    _cli.main([])
    assert "No GPU" in capsys.readouterr().out


def test_torch_build_matches_torch_version() -> None:
    build = _cli.torch_build()
    if torch.version.cuda:
        assert build == f"CUDA {torch.version.cuda}"
    elif torch.version.hip:
        assert build == f"ROCm {torch.version.hip}"
    else:
        assert build in {"CPU", "MPS", "XPU"}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("1,0", "CUDA_VISIBLE_DEVICES  '1,0'"),
        ("", "CUDA_VISIBLE_DEVICES  '' -> hides every GPU"),
        ("0,0", "CUDA_VISIBLE_DEVICES  '0,0' -> hides every GPU"),
        ("2,x,3", "CUDA_VISIBLE_DEVICES  '2,x,3' -> CUDA reads it as '2'"),
        ("1, 2", "CUDA_VISIBLE_DEVICES  '1, 2'\n"),
    ],
)
def test_report_explains_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str, shown: str
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    _cli.main([])
    assert shown in capsys.readouterr().out


def test_hidden_gpus_are_named_as_the_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cli, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(_cli, "accelerator_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    _cli.main([])
    assert "No GPU: CUDA_VISIBLE_DEVICES hides every GPU" in capsys.readouterr().out


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"devicekit {dk.__version__}"


def test_python_dash_m_runs_the_same_report() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"devicekit             {dk.__version__}\n")


def test_unknown_arguments_fail_with_usage() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit", "--bogus"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr
