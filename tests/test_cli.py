"""The ``devicekit`` command: the status report, JSON, watch, options, exit codes.

Rendering is checked in-process with the NVML stand-in; the conventions (``--json``
anywhere, argument checks, exit codes, no torch for ``--help``) through the real
entry point in a subprocess.
"""

from __future__ import annotations

import ctypes
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import devicekit as dk
from devicekit import _cli, _status

from .conftest import CTRL_C_WORKS, GPU_COUNT, FakeAccelerator
from .fake_pynvml import FakeGPU, FakeNVML

Install = Callable[[Any], None]
A = "GPU-aaaa1111-0000-0000-0000-000000000000"
B = "GPU-bbbb2222-0000-0000-0000-000000000000"
NUMPY_WARNING = "Failed to initialize NumPy"
NO_IDS = "devicekit {} does not take GPU indices (it covers every GPU); drop -i"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devicekit", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def two_gpus(**a_fields: Any) -> FakeNVML:
    return FakeNVML(
        [
            FakeGPU(A, bus="00000000:3A:00.0", throttle=0x4, **a_fields),
            FakeGPU(B, bus="00000000:18:00.0", unsupported={"nvmlDeviceGetFanSpeed"}),
        ]
    )


# --- the report -----------------------------------------------------------------------------


def test_report_names_versions_build_devices_and_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _cli.main([]) == 0
    out = capsys.readouterr().out
    assert f"devicekit             {dk.__version__}" in out
    assert f"torch                 {torch.__version__} ({_status.torch_build()} build)" in out
    assert "CUDA_VISIBLE_DEVICES  (unset: every GPU is visible)" in out
    devices = ", ".join(str(d) for d in dk.try_all_gpus()) if GPU_COUNT else "none ("
    assert f"devices               {devices}" in out


@pytest.mark.skipif(GPU_COUNT > 0, reason="checks the no-GPU message")
def test_report_says_plainly_when_there_is_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    _cli.main([])
    assert "No GPU" in capsys.readouterr().out


def test_torch_build_matches_torch_version() -> None:
    build = _status.torch_build()
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


def test_the_empty_variable_is_judged_the_same_by_status_and_doctor(
    monkeypatch: pytest.MonkeyPatch, nvml_session: Install
) -> None:
    # Before, doctor said "'' is read as []: CUDA stops at the first bad entry".
    nvml_session(two_gpus())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # Titles that start with it: where the torch build has an accelerator (a CUDA build on
    # any machine), both also say "No GPU: CUDA_VISIBLE_DEVICES hides every GPU".
    (status_finding,) = [f for f in dk.status().findings if f.title.startswith("CUDA_VISIBLE")]
    doctor_findings = [f for f in dk.doctor().findings if f.title.startswith("CUDA_VISIBLE")]
    assert doctor_findings == [status_finding]
    assert status_finding.title == "CUDA_VISIBLE_DEVICES hides every GPU"
    assert status_finding.severity == "error"  # there are two GPUs it hides


def test_hidden_gpus_are_named_as_the_reason(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
) -> None:
    fake_accelerator("cuda", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    _cli.main([])
    assert "No GPU: CUDA_VISIBLE_DEVICES hides every GPU" in capsys.readouterr().out


def test_status_table_shows_each_gpu_by_torch_index(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(two_gpus(compute=[(os.getpid(), 3 * 2**30)]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # only the GPU on bus 3A, NVML's 0
    assert _cli.main([]) == 0
    out = capsys.readouterr().out
    assert "driver                580.159.04 (supports CUDA 13.0)" in out
    assert f"cuda:0  nvml 0  NVIDIA H100 80GB HBM3  00000000:3A:00.0  {A}" in out
    assert f"hidden  nvml 1  NVIDIA H100 80GB HBM3  00000000:18:00.0  {B}" in out
    assert "memory [..........] 2.0 GiB / 80.0 GiB (2%)  util 10%  memory util 5%" in out
    assert "clocks held by: power_cap" in out
    assert "fan ?  power 120 W / 700 W" in out  # unsupported fan: "?", never 0
    assert f"processes: {os.getpid()} " in out
    assert out.index("cuda:0") < out.index("hidden")


def test_json_document(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(two_gpus(compute=[(os.getpid(), 3 * 2**30)]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert _cli.main(["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == _status.SCHEMA_VERSION == 3
    assert document["cuda_visible_devices"] == "1,0"
    assert document["cuda_visible_devices_parsed"] == [1, 0]
    assert document["nvml_available"] is True
    assert document["nvml_error"] is None
    assert document["driver_version"] == "580.159.04"
    assert [(g["nvml_index"], g["torch_index"]) for g in document["gpus"]] == [(0, 0), (1, 1)]
    assert document["gpus"][1]["fan_speed"] is None
    assert document["gpus"][0]["processes"][0]["used_memory"] == 3 * 2**30
    assert document["time"].startswith(time.strftime("%Y-"))


def test_without_nvml_the_status_says_why_and_exits_zero(
    nvml_session: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(None)
    assert _cli.main([]) == 0
    assert "GPU status unavailable: the nvidia-ml-py package is not installed" in (
        capsys.readouterr().out
    )
    assert _cli.main(["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["gpus"] == []
    assert document["nvml_available"] is False
    assert document["nvml_error"].startswith("the nvidia-ml-py package is not installed")


def test_a_status_renders_for_notebooks_with_human_units(nvml_session: Install) -> None:
    nvml_session(two_gpus())
    snapshot = dk.status()
    page = snapshot._repr_html_()
    assert "<th>memory</th>" in page
    assert "2.0 GiB / 80.0 GiB" in page
    assert "120 W / 700 W" in page
    assert "85899345920" not in page
    assert repr(snapshot).startswith("Status(torch ")
    assert "2 GPUs on the machine" in repr(snapshot)


# --- untrusted text -------------------------------------------------------------------------


@pytest.fixture
def hostile_process() -> Iterator[int]:
    """A real process whose name carries terminal escape sequences, as any user can set."""
    if not sys.platform.startswith("linux"):
        pytest.skip("sets its name with prctl")
    name = b"x\x1b]0;owned\x07\x1b[2J"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import ctypes, sys, time; ctypes.CDLL(None).prctl(15, {name!r}, 0, 0, 0); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        with open(f"/proc/{child.pid}/comm", "rb") as comm:
            assert b"\x1b" in comm.read()  # the kernel kept the escape bytes
        yield child.pid
    finally:
        child.kill()
        child.wait(timeout=30)


def test_process_names_cannot_reach_the_terminal(
    nvml_session: Install, hostile_process: int, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(two_gpus(compute=[(hostile_process, 2**30)]))
    assert _cli.main([]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "\x07" not in out
    assert f"{hostile_process} x\\x1b]0;owned\\x07\\x1b[2J 1 GiB" in out
    assert "\x1b" not in dk.doctor().__str__()
    assert "\x1b" not in dk.status()._repr_html_()


def test_escape_covers_every_control_character() -> None:
    from devicekit._format import safe_text

    assert all(safe_text(chr(code)).startswith("\\x") for code in [*range(32), *range(127, 160)])
    assert safe_text("GPU 0 ✓") == "GPU 0 ✓"
    assert ctypes.sizeof(ctypes.c_int) > 0  # ctypes is what the fixture's child uses


# --- options and exit codes, through the real entry point --------------------------------


def test_version_and_help_answer_without_torch_or_its_warning() -> None:
    for flags in (["--version"], ["-V"], ["--help"], ["watch", "--help"]):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "devicekit", *flags],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
        assert "torch" not in imported, flags
        assert NUMPY_WARNING not in result.stderr
    assert run_cli("-V").stdout.strip() == f"devicekit {dk.__version__}"


def test_every_subcommand_has_a_description() -> None:
    for command in ("status", "watch", "doctor", "bench"):
        result = run_cli(command, "--help")
        assert result.returncode == 0
        usage, _, rest = result.stdout.partition("\n\n")
        assert usage.startswith(f"usage: devicekit {command}")
        assert len(rest.split("\n\n")[0]) > 40, result.stdout  # a sentence, not nothing
    main_help = " ".join(run_cli("--help").stdout.split())  # as one line, however wrapped
    assert (
        "Exit codes: 0 ok, 1 doctor found an error, 2 usage error, 74 stdout cannot be "
        "written, 130 interrupted (Ctrl-C; watch, which runs until Ctrl-C, stops with 0), "
        "141 the pipe was closed (| head)."
    ) in main_help


def test_the_help_says_watch_exits_0_on_ctrl_c(capsys: pytest.CaptureFixture[str]) -> None:
    # Before, the help said only "130 interrupted (Ctrl-C)", and watch stopped by Ctrl-C
    # exits 0 (by design: Ctrl-C is how it ends), which looked like a bug.
    help_text: dict[str, str] = {}
    for args in (["--help"], ["watch", "--help"]):
        with pytest.raises(SystemExit) as exited:
            _cli.main(args)
        assert exited.value.code == 0
        help_text[args[0]] = " ".join(capsys.readouterr().out.split())  # as one line
    main_help = help_text["--help"]
    assert "130 interrupted (Ctrl-C; watch, which runs until Ctrl-C, stops with 0)" in main_help
    assert "watch refresh the status until Ctrl-C (which exits 0)" in help_text["--help"]
    assert "Ctrl-C is how it ends, so it exits 0, not 130." in help_text["watch"]


@pytest.mark.parametrize(
    "args",
    [
        ["--json", "doctor"],
        ["doctor", "--json"],
        ["--json", "watch", "--count", "1"],
        ["watch", "--count", "1", "--json"],
        ["--json"],
    ],
    ids=" ".join,
)
def test_json_is_honoured_before_or_after_the_subcommand(args: list[str]) -> None:
    result = run_cli(*args)
    assert result.returncode in (0, 1), result.stderr  # doctor exits 1 on an error finding
    document = json.loads(result.stdout)
    assert "findings" in document
    assert NUMPY_WARNING not in result.stderr


def test_watch_json_writes_one_document_per_line() -> None:
    result = run_cli("watch", "--json", "-n", "0.1", "--count", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert [json.loads(line)["schema"] for line in lines] == [3, 3, 3]


def test_watch_piped_separates_refreshes_and_stamps_each(
    nvml_session: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(two_gpus())
    assert _cli.main(["watch", "-n", "0.1", "--count", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("devicekit             ") == 3
    assert out.count("devicekit watch, ") == 3
    assert "\x1b[2J" not in out  # not a terminal: never cleared
    assert "every 0.1 s\n=" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["watch", "-n", "inf"], "expected a finite number of seconds, got 'inf'; use -n 1"),
        (["watch", "-n", "nan"], "expected a finite number of seconds, got 'nan'; use -n 1"),
        # A hint for each: a word said only what it expected.
        (
            ["watch", "-n", "abc"],
            "expected a finite number of seconds, got 'abc'; use -n 1 (the default is 2), "
            "from 0.1 to 86400",
        ),
        (["bench", "--max-time", "abc"], "got 'abc'; the default is 0.4"),
        (
            ["watch", "-n", "1e-9", "--count", "3"],
            "argument -n/--interval: expected at least 0.1 seconds between refreshes, "
            "got '1e-9'; use -n 0.1 or more",
        ),
        (["watch", "-n", "0.09"], "expected at least 0.1 seconds between refreshes, got '0.09'"),
        (["watch", "-n", "0"], "expected at least 0.1 seconds between refreshes, got '0'"),
        (["watch", "-n", "-1"], "expected at least 0.1 seconds between refreshes, got '-1'"),
        (["watch", "--count", "0"], "expected at least 1 refresh, got '0'"),
        (["watch", "--count", "-5"], "expected at least 1 refresh, got '-5'"),
        (["watch", "--count", "x"], "expected a whole number, got 'x'"),
        (["-i", "a"], "expected GPU indices separated by commas, such as 0,2; got 'a'"),
        # Digits to isdigit(), not to int(): argparse said "invalid _indices value".
        (["-i", "\u00b2"], "expected GPU indices separated by commas, such as 0,2; got '\u00b2'"),
        (["-i", "\u0663"], "expected GPU indices separated by commas, such as 0,2; got '\u0663'"),
        (["-i", "99"], "argument -i/--id: there is no cuda:99; this process sees "),
        (["-i", "0", "doctor"], f"argument -i/--id: {NO_IDS.format('doctor')}"),
        (["doctor", "-i", "0"], f"argument -i/--id: {NO_IDS.format('doctor')}"),
        (["bench", "-i", "0"], f"argument -i/--id: {NO_IDS.format('bench')}"),
        (["bench", "--id=0,1"], f"argument -i/--id: {NO_IDS.format('bench')}"),
        (
            ["doctor", "extra"],
            "error: unrecognized arguments: extra; see devicekit doctor --help\n",
        ),
        (["foo"], "; see devicekit --help\n"),
        (
            ["watch", "-n", "1e10"],
            "expected at most 86400 seconds (a day) between refreshes, got '1e10'; use -n 86400 "
            "or less, or devicekit for one look",
        ),
        (["--bogus"], "error: unrecognized arguments: --bogus; see devicekit --help\n"),
        # A command's option before the command: argparse took its value for the command.
        (
            ["-n", "2"],
            "argument -n: it is an option of 'devicekit watch', so it goes after the "
            "command: devicekit watch -n 2\n",
        ),
        (["--max-time", "1"], "goes after the command: devicekit bench --max-time 1\n"),
        (["-i", "0", "--count=3", "watch"], "command: devicekit -i 0 watch --count=3\n"),
        # -i with its value attached is the top-level option (before: "an option of
        # 'devicekit status' ... devicekit status -i0", which also dropped a command).
        (["-i0"], "argument -i/--id: there is no cuda:0; this process sees "),
        (["-i1", "watch", "--count", "1"], "argument -i/--id: there is no cuda:1; this "),
        (["-i0", "doctor"], f"argument -i/--id: {NO_IDS.format('doctor')}"),
        (
            ["--json", "-n2", "watch"],
            "argument -n: it is an option of 'devicekit watch', so it "
            "goes after the command: devicekit --json watch -n2\n",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_readable_message(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "usage", "message"),
    [
        (
            ["watch", "--jsn"],
            "usage: devicekit watch [-h]",
            "devicekit watch: error: unrecognized arguments: --jsn (did you mean --json?)",
        ),
        (
            ["--jsn"],
            "usage: devicekit [-h]",
            "devicekit: error: unrecognized arguments: --jsn (did you mean --json?)",
        ),
        (
            ["--JSON"],  # before: no suggestion, since difflib compares letters as written
            "usage: devicekit [-h]",
            "devicekit: error: unrecognized arguments: --JSON (did you mean --json?)",
        ),
        (["DOCTOR"], "usage: devicekit [-h]", "; did you mean doctor?"),
        (
            ["--jsn", "doctor"],  # before the subcommand: it would take it there too
            "usage: devicekit doctor [-h]",
            "unrecognized arguments: --jsn (did you mean --json?)",
        ),
        (
            ["watch", "--intervl=3", "--cout", "2"],
            "usage: devicekit watch [-h]",
            "unrecognized arguments: --intervl=3 --cout 2 "
            "(did you mean --interval instead of --intervl, --count instead of --cout?)",
        ),
        (
            ["doctr"],
            "usage: devicekit [-h]",
            "devicekit: error: argument COMMAND: invalid choice: 'doctr' (choose from ",
        ),
        (["doctr"], "usage: devicekit [-h]", "; did you mean doctor?"),
        (["bnech", "--json"], "usage: devicekit [-h]", "; did you mean bench?"),
        # An error about a subcommand's arguments shows that subcommand's usage.
        (["watch", "-i", "99"], "usage: devicekit watch [-h]", "there is no cuda:99"),
        (["-i", "0", "doctor"], "usage: devicekit doctor [-h]", "does not take GPU indices"),
        (["doctor", "-i0"], "usage: devicekit doctor [-h]", "does not take GPU indices"),
    ],
)
def test_a_typo_exits_2_with_the_usage_and_a_suggestion(
    capsys: pytest.CaptureFixture[str], args: list[str], usage: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        _cli.main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage)
    assert message in err


@pytest.mark.parametrize(
    "args",
    [["watch", "--zzz"], ["qqq"], ["doctor", "-i", "0"], ["doctor", "extra"], ["-V2"]],
    ids=" ".join,
)
def test_nothing_close_gets_no_suggestion(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _cli.main(args)
    assert exited.value.code == 2
    assert "did you mean" not in capsys.readouterr().err


def test_select_gpus_by_torch_index(
    nvml_session: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(two_gpus())
    assert _cli.main(["-i", "1", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [g["torch_index"] for g in document["gpus"]] == [1]
    assert _cli.main(["watch", "--count", "1", "-i", "0,cuda:1"]) == 0
    out = capsys.readouterr().out
    assert "cuda:0  nvml" in out
    assert "cuda:1  nvml" in out


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--json", "-i", "1"],
        ["--json", "status", "-i", "1"],
        ["-i", "1", "status", "--json"],
    ],
    ids=" ".join,
)
def test_status_is_what_plain_devicekit_prints(
    nvml_session: Install, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    # Before, `devicekit status` was "invalid choice: 'status'", though the docs call the
    # report dk.status().
    nvml_session(two_gpus())
    assert _cli.main(["--json", "-i", "1"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert _cli.main(args) == 0
    aliased = json.loads(capsys.readouterr().out)
    assert {**aliased, "time": None} == {**plain, "time": None}
    assert [g["torch_index"] for g in aliased["gpus"]] == [1]


def test_status_is_listed_in_the_help_and_has_its_own_usage(
    nvml_session: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml_session(two_gpus())
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    assert re.search(
        r"\n +status +print the status \(what plain `devicekit` prints\)\n", capsys.readouterr().out
    )
    with pytest.raises(SystemExit) as exited:
        _cli.main(["status", "-i", "7"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: devicekit status [-h]")
    assert "there is no cuda:7" in err


def test_python_dash_m_runs_the_same_report() -> None:
    result = run_cli()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"devicekit             {dk.__version__}\n")
    assert NUMPY_WARNING not in result.stderr


def test_the_command_hides_torchs_numpy_warning() -> None:
    if importlib.util.find_spec("numpy") is not None:
        pytest.skip("torch warns only where numpy is not installed")
    bare = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert NUMPY_WARNING in bare.stderr  # what the command hides is really there
    for args in (["doctor"], ["watch", "--count", "1"]):
        result = run_cli(*args)
        assert result.returncode in (0, 1), result.stderr
        assert NUMPY_WARNING not in result.stderr
        assert "UserWarning" not in result.stderr


@pytest.mark.parametrize("args", [[], ["--json"], ["doctor"], ["watch", "--count", "1"]])
def test_a_malformed_nvml_timeout_is_told_once_as_a_finding(args: list[str]) -> None:
    result = run_cli(*args, env={"DEVICEKIT_NVML_TIMEOUT": "abc"})
    assert result.returncode in (0, 1), result.stderr
    assert "RuntimeWarning" not in result.stderr  # not also as a raw warning above it
    assert "DEVICEKIT_NVML_TIMEOUT='abc'" in result.stdout


def test_the_command_leaves_its_callers_warning_filters_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = list(warnings.filters)
    assert _cli.main(["--json"]) == 0
    assert warnings.filters == before
    capsys.readouterr()


def _interrupted(
    code: str,
    args: list[str],
    *,
    ready: Literal["stdout", "stderr"],
    pause: float = 0.0,
    timeout: float,
) -> tuple[int, str, str]:
    """Run ``python -c code args``; Ctrl-C it once it prints a line on ``ready``.

    ``pause`` seconds after that line, SIGINT; returns (exit status, stdout, stderr).
    The process never outlives the call, even when the test fails.
    """
    process = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_WORKS + code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stream = process.stdout if ready == "stdout" else process.stderr
        assert stream is not None
        line = stream.readline()  # it is running
        time.sleep(pause)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    output = {"stdout": stdout, "stderr": stderr}
    output[ready] = line + output[ready]  # the line read before the rest
    return process.returncode, output["stdout"], output["stderr"]


def test_watch_stops_cleanly_on_ctrl_c() -> None:
    status, _, stderr = _interrupted(
        "import runpy; runpy.run_module('devicekit', run_name='__main__')",
        ["watch", "-n", "0.1"],
        ready="stdout",
        timeout=30,
    )
    assert status == 0
    assert "Traceback" not in stderr


# --- what a command line meets: closed pipes, full disks, Ctrl-C, ASCII terminals -------------


def no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert "Exception ignored" not in stderr, stderr  # Python's own, at exit


@pytest.mark.parametrize(
    "args",
    [[], ["--json"], ["doctor"], ["watch", "-n", "0.1", "--count", "3"], ["--help"]],
    ids=lambda args: " ".join(args) or "status",
)
def test_a_closed_pipe_ends_the_command_quietly_with_141(args: list[str]) -> None:
    # The read end is closed before the command writes anything, so its first write
    # always fails (with `| head -1` that depends on timing).
    process = subprocess.Popen(
        [sys.executable, "-m", "devicekit", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        process.stdout.close()
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 141, stderr
    no_traceback(stderr)
    assert "devicekit:" not in stderr  # the reader has what it wanted: not worth a word


def test_watch_piped_into_head_stops_quietly() -> None:
    result = subprocess.run(
        ["sh", "-c", f"'{sys.executable}' -m devicekit watch -n 0.1 --count 3 | head -1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.stdout.startswith("devicekit watch, ")
    assert result.stdout.count("\n") == 1
    no_traceback(result.stderr)
    assert result.stderr == "", result.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(
    "args",
    [[], ["--json"], ["watch", "--count", "1"], ["--help"], ["--version"]],
    ids=lambda args: " ".join(args) or "status",
)
def test_a_full_disk_is_one_line_on_stderr(args: list[str]) -> None:
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "devicekit", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=120,
        )
    assert result.returncode == 74, result.stderr
    no_traceback(result.stderr)
    assert result.stderr.endswith(
        "devicekit: cannot write to stdout: [Errno 28] No space left on device\n"
    )


def run_with_stdout_closed(*args: str) -> subprocess.CompletedProcess[str]:
    """The command started as ``devicekit ARGS >&-``: Python sets ``sys.stdout`` to None."""
    return subprocess.run(
        [sys.executable, "-m", "devicekit", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),  # after the redirection: descriptor 1 is closed
        text=True,
        check=False,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args",
    [[], ["doctor", "--json"], ["watch", "--count", "1"], ["--help"], ["--version"]],
    ids=lambda args: " ".join(args) or "status",
)
def test_a_closed_stdout_is_one_line_on_stderr_and_74(args: list[str]) -> None:
    # It was a traceback (AttributeError: 'NoneType' object has no attribute 'flush').
    result = run_with_stdout_closed(*args)
    assert result.returncode == 74, result.stderr
    no_traceback(result.stderr)
    assert result.stderr.endswith("devicekit: cannot write to stdout: [Errno 9] stdout is closed\n")


def test_a_usage_error_with_stdout_closed_still_exits_2() -> None:
    result = run_with_stdout_closed("-i", "x")
    assert result.returncode == 2, result.stderr
    assert result.stderr.endswith("got 'x'\n")


@pytest.mark.parametrize(
    "args",
    [["bench"], []],  # [] is interrupted while it imports torch
    ids=lambda args: " ".join(args) or "status",
)
def test_ctrl_c_exits_130_without_a_traceback(args: list[str]) -> None:
    status, stdout, stderr = _interrupted(
        "import runpy, sys; import devicekit._cli\n"
        "print('ready', file=sys.stderr, flush=True)\n"
        "runpy.run_module('devicekit', run_name='__main__')",
        args,
        ready="stderr",
        # Past runpy and into main() (microseconds), not yet done importing torch (a
        # second or more) or benchmarking.
        pause=0.3,
        timeout=60,
    )
    assert stderr.startswith("ready\n"), stderr
    assert status == 130, (stdout, stderr)
    no_traceback(stderr)
    assert stderr.endswith("devicekit: interrupted\n"), stderr


def test_ctrl_c_while_torch_loads_is_raised_once_it_has_loaded() -> None:
    seen_inside: list[bool] = []

    def load() -> None:
        # Stands in for torch's import, which swallows a KeyboardInterrupt raised in it
        # (see _load_torch): it must not see the Ctrl-C.
        with _cli._ctrl_c_held():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)  # Python runs the handler at the next bytecode
            except KeyboardInterrupt:
                seen_inside.append(True)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load()
        assert seen_inside == []
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "env",
    [
        {"PYTHONIOENCODING": "ascii"},
        {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"},  # surrogateescape
    ],
    ids=["PYTHONIOENCODING=ascii", "LC_ALL=C"],
)
def test_an_ascii_stdout_gets_escapes_not_a_crash(env: dict[str, str]) -> None:
    result = run_cli("bench", "--help", env=env)  # launch latencies in ms and µs
    assert result.returncode == 0, result.stderr
    no_traceback(result.stderr)
    assert "latencies (ms, \\xb5s)" in " ".join(result.stdout.split())


def test_an_ascii_stdout_shows_the_report_escaped() -> None:
    # The variable is shown as it is set: the one report text anyone can make non-ASCII.
    result = run_cli(env={"PYTHONIOENCODING": "ascii", "CUDA_VISIBLE_DEVICES": "µ"})
    assert result.returncode == 0, result.stderr
    no_traceback(result.stderr)
    assert "CUDA_VISIBLE_DEVICES  '\\xb5'" in result.stdout


def test_the_callers_stdout_keeps_its_error_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    written = io.BytesIO()
    stdout = io.TextIOWrapper(written, encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", stdout)
    with pytest.raises(SystemExit) as exited:
        _cli.main(["bench", "--help"])
    assert exited.value.code == 0
    assert b"latencies (ms, \\xb5s)" in b" ".join(written.getvalue().split())
    assert stdout.errors == "strict"


@pytest.mark.parametrize(
    ("error", "code", "err"),
    [
        (BrokenPipeError(32, "Broken pipe"), 141, ""),
        (OSError(28, "No space left on device"), 74, "devicekit: cannot write to stdout: "),
    ],
)
def test_a_stdout_without_a_file_descriptor_fails_the_same(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: OSError,
    code: int,
    err: str,
) -> None:
    # A caller's own stream in place of stdout: nothing to point at the null device.
    class Failing(io.StringIO):
        def write(self, text: str) -> int:
            raise error

    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", Failing())
    assert _cli.main(["--version"]) == code
    assert capsys.readouterr().err == (f"{err}{error}\n" if err else "")


def test_the_readme_shows_what_the_command_prints_today() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("```console\n$ devicekit\n", 1)[1].split("```", 1)[0]
    ours = subprocess.run(
        [sys.executable, "-m", "devicekit"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    ).stdout
    if torch.version.cuda or "GPU status unavailable: libnvidia-ml" not in ours:
        pytest.skip("the README shows a machine without a driver and a CPU build of torch")
    # Versions differ between machines; every other line must be as the README says.
    varying = ("torch ", "python ", "devicekit ")
    assert [line for line in block.splitlines() if not line.startswith(varying)] == [
        line for line in ours.splitlines() if not line.startswith(varying)
    ]


def test_without_nvml_the_number_of_gpus_is_unknown_not_zero(nvml_session: Install) -> None:
    nvml_session(None)
    text = repr(dk.status())
    assert "; GPU count unknown: no NVML (the nvidia-ml-py package is not installed" in text
    assert "?" not in text
    assert "0 GPUs" not in text


def test_watch_help_describes_its_ids_option() -> None:
    help_text = run_cli("watch", "--help", env={"COLUMNS": "100"}).stdout
    assert "[-i IDS]" in help_text  # in the usage line, and described under the options:
    assert re.search(r"^  -i IDS, --id IDS +only these GPUs, by torch index", help_text, re.M)


def test_bench_max_time_reaches_bench(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from devicekit import _bench  # the module _run imports bench() from

    asked: list[dict[str, object]] = []

    def fake_bench(**options: object) -> dk.BenchReport:
        asked.append(options)
        return dk.BenchReport(())

    monkeypatch.setattr(_bench, "bench", fake_bench)
    assert _cli.main(["bench", "--max-time", "1.5"]) == 0
    assert _cli.main(["bench"]) == 0
    assert asked == [{"max_time": 1.5}, {}]  # bench()'s own default otherwise
    assert "--max-time SECONDS" in run_cli("bench", "--help").stdout
    capsys.readouterr()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_bench_max_time_is_checked(value: str) -> None:
    result = run_cli("bench", "--max-time", value)
    assert result.returncode == 2
    assert "devicekit bench: error: argument --max-time: expected a " in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "code"), [(["--version"], 0), (["bench", "-n", "0"], 2)])
def test_a_ctrl_c_while_python_shuts_down_keeps_the_commands_exit_code(
    args: list[str], code: int
) -> None:
    # Before, a Ctrl-C after the output was written, while Python shut down (torch's and
    # NVML's exit hooks), raised there: a traceback, or a death by SIGINT (130, no word).
    script = (
        "import atexit, os, signal, sys, time\n"
        "def late():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "atexit.register(late)  # runs last: after every hook devicekit and torch added\n"
        f"sys.argv = ['devicekit', *{args!r}]\n"
        "import runpy\n"
        "runpy.run_module('devicekit', run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == code
    assert "KeyboardInterrupt" not in result.stderr
