"""``devicekit claims``: who holds which GPU claim, from the kernel's lock table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devicekit import _claimlist, _claims
from devicekit._cli import main

from .conftest import CTRL_C_WORKS
from .fake_pynvml import FakeGPU, FakeNVML

Install = Callable[[Any], None]
TIMEOUT = 120  # seconds: generous, for a loaded 2-core machine; never a pass/fail timing
UUIDS = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-0000-0000-0000-000000000000"]
needs_lock_table = pytest.mark.skipif(
    not os.path.exists("/proc/locks"), reason="needs Linux's kernel lock table"
)


@pytest.fixture(autouse=True)
def claims_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    directory = tmp_path / "claims"
    monkeypatch.setenv(_claims.DIR_VAR, str(directory))
    return directory


@pytest.fixture
def holder() -> Iterator[Callable[[str], int]]:
    """Start a process that claims a GPU and keeps the claim; returns its pid."""
    jobs: list[subprocess.Popen[str]] = []

    def start(uuid: str) -> int:
        code = f"""
            import os, sys
            from devicekit import _claims
            assert _claims.claim({uuid!r}, 0)
            print(os.getpid(), flush=True)
            sys.stdin.read()
            """
        job = subprocess.Popen(
            [sys.executable, "-c", CTRL_C_WORKS + textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        jobs.append(job)
        assert job.stdout is not None
        line = job.stdout.readline()
        assert line, job.communicate(timeout=TIMEOUT)[1]
        return int(line)

    yield start
    for job in jobs:
        try:
            job.communicate(timeout=TIMEOUT)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()


def test_nothing_claimed_yet_creates_nothing(claims_dir: Path) -> None:
    report = _claimlist.claims_report()
    assert (report.held, report.lock_files, report.unknown) == ((), 0, None)
    assert str(report) == f"GPU claims in {claims_dir}: none held (0 lock files; a claim ends " + (
        "with the process that holds it)"
    )
    assert not claims_dir.exists()  # a listing is no reason to make the directory
    # NVML was not asked (no claim to label): unknown, not "true" as before on a machine
    # without NVML.
    assert report.to_dict()["nvml"] is None
    assert report.to_dict()["schema"] == 1  # as every --json document has one


@needs_lock_table
def test_only_live_claims_are_listed_with_their_holder_and_gpu(
    nvml_session: Install, holder: Callable[[str], int]
) -> None:
    nvml_session(FakeNVML([FakeGPU(uuid) for uuid in UUIDS]))
    # GPU 0 was claimed by a job that has ended: its file stays, with that job's pid in it.
    assert _claims.claim(UUIDS[0], 0)
    assert _claims.release(UUIDS[0])
    pid = holder(UUIDS[1])
    report = _claimlist.claims_report()
    assert report.lock_files == 2
    (claim,) = report.held
    assert (claim.gpu, claim.pid) == (UUIDS[1], pid)
    assert claim.device == "cuda:1"  # as this process numbers it
    assert claim.process is not None  # "python3", or what the system calls it
    assert str(report).splitlines()[1] == f"  cuda:1  {UUIDS[1]}  held by pid {pid} " + (
        f"({claim.process})"
    )
    assert report.to_dict()["held"] == [
        {"gpu": UUIDS[1], "device": "cuda:1", "pid": pid, "process": claim.process}
    ]


@needs_lock_table
def test_the_command_prints_the_claims_as_text_or_json(
    holder: Callable[[str], int], capsys: pytest.CaptureFixture[str]
) -> None:
    pids = [holder(uuid) for uuid in UUIDS]
    assert main(["claims"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(": 2 held")  # before: "2 helds"
    # This machine has no NVML: which GPU each claim is cannot be asked (before, each read
    # "not a GPU NVML lists here", as if NVML had been asked).
    assert lines[1].startswith(f"  ? (no NVML here)  {UUIDS[0]}  held by pid {pids[0]} (")
    assert main(["claims", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [claim["pid"] for claim in document["held"]] == pids
    assert (document["lock_files"], document["nvml"]) == (2, False)


def test_the_command_takes_no_gpu_indices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["claims", "-i", "0"])
    assert exited.value.code == 2
    assert "devicekit claims does not take GPU indices" in capsys.readouterr().err


def test_without_a_lock_table_it_says_it_cannot_tell(
    monkeypatch: pytest.MonkeyPatch, claims_dir: Path
) -> None:
    claims_dir.mkdir()
    (claims_dir / f"{UUIDS[0]}.lock").write_text("4242")  # a pid that may be stale
    monkeypatch.setattr(_claimlist, "LOCK_TABLE", str(claims_dir / "no-such-table"))
    report = _claimlist.claims_report()
    assert report.held == ()
    assert report.unknown == (
        "cannot tell which are held: this system has no kernel lock table (/proc/locks)"
    )
    assert str(report) == f"GPU claims in {claims_dir}: {report.unknown}"


def test_a_relative_claims_dir_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(_claims.DIR_VAR, "claims")
    with pytest.raises(ValueError, match=r"DEVICEKIT_CLAIMS_DIR='claims' is a relative path"):
        _claimlist.claims_report()
    with pytest.raises(SystemExit) as exited:  # before: a traceback, and exit 1
        main(["claims"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "devicekit claims: error: DEVICEKIT_CLAIMS_DIR='claims' is a relative path" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["link", "world-writable", "group-writable"])
def test_a_directory_that_claims_refuse_is_said_to_be_one_not_listed_as_empty(
    tmp_path: Path, claims_dir: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    # Before: "none held" (exit 0), following the link, where claim=True refuses the directory.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / f"{UUIDS[0]}.lock").write_text("")
    if kind == "link":
        claims_dir.symlink_to(elsewhere)
        why = (
            rf"{claims_dir} should be a directory of GPU claims owned by this user "
            rf"\(uid {os.getuid()}\), but it is a symbolic link owned by uid \d+, which claims do "
            r"not follow \(its target could change\); remove it, or set DEVICEKIT_CLAIMS_DIR to a "
            r"directory of your own"
        )
    else:
        claims_dir.mkdir()
        claims_dir.chmod(0o1777 if kind == "world-writable" else 0o770)  # /tmp, a group's
        why = r"DEVICEKIT_CLAIMS_DIR='.*' is writable by other users \(mode \d+\), who could plant"
    report = _claimlist.claims_report()
    assert (report.held, report.lock_files) == ((), None)  # unknown, not 0
    assert report.unknown is not None
    assert re.match(rf"claims cannot be kept here: {why}", report.unknown), report.unknown
    assert str(report) == f"GPU claims in {claims_dir}: {report.unknown}"
    assert main(["claims", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["lock_files"], document["unknown"]) == (None, report.unknown)


def test_a_directory_that_cannot_be_read_has_an_unknown_count_not_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(_claims.DIR_VAR, str(tmp_path / "a-file" / "claims"))
    report = _claimlist.claims_report()
    assert (report.held, report.lock_files) == ((), None)  # before: 0 lock files
    assert report.unknown == "cannot be read (Not a directory)"
    assert report.to_dict()["lock_files"] is None
