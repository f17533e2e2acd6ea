"""GPU claims and waiting: pick_gpu(claim=True, wait=...), claim_gpu, release_gpu.

Processes that race for GPUs are real processes started behind a barrier;
each installs a fake NVML before devicekit first asks for one, so no real
GPU is touched. The lock directory is a temporary DEVICEKIT_CLAIMS_DIR per test.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _claimfiles, _claims

from .conftest import CTRL_C_WORKS, run_python
from .fake_pynvml import FakeGPU, FakeNVML

Install = Callable[[Any], None]
TIMEOUT = 120  # seconds: generous, for a loaded 2-core machine; never a pass/fail timing
GiB = 2**30


def uuid(i: int) -> str:
    return f"GPU-{i:04d}0000-0000-0000-0000-000000000000"


def machine(count: int, *, used: int = 2 * GiB) -> FakeNVML:
    return FakeNVML(
        [FakeGPU(uuid(i), bus=f"00000000:{0x18 + i:02X}:00.0", used=used) for i in range(count)]
    )


@pytest.fixture(autouse=True)
def private_claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Each test's claims live in its own directory; children inherit it. Yields that directory."""
    directory = tmp_path / "claims"
    monkeypatch.setenv(_claims.DIR_VAR, str(directory))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    yield directory
    for held in list(_claims._held.claims):  # a failed test must not leave claims to the next one
        _claims.release(held)


# --- in one process --------------------------------------------------------------------------


def test_a_claimed_gpu_is_skipped_by_the_next_claim(nvml_session: Install) -> None:
    nvml_session(machine(2))
    first, second = dk.pick_gpu(claim=True), dk.pick_gpu(claim=True)
    assert {first, second} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert dk.pick_gpu(claim=True) == torch.device("cpu")
    assert dk.pick_gpu() == first  # without claim=True, claims are not looked at
    with pytest.raises(
        dk.GPUUnavailableError,
        match=r"pick_gpus\(1\) found 0 GPUs that qualify; rejected: "
        r"cuda:0: claimed by this process; cuda:1: claimed by this process",
    ):
        dk.pick_gpus(1, claim=True)
    assert dk.release_gpu(first) is True
    assert dk.release_gpu(first) is False  # nothing left to release
    assert dk.pick_gpu(claim=True) == first


def test_release_gpu_takes_what_pick_gpu_returned(nvml_session: Install) -> None:
    nvml_session(machine(1))
    device = dk.pick_gpu(claim=True)
    assert dk.release_gpu("cuda:0") is True
    assert dk.release_gpu("cpu") is False  # pick_gpu's fallback: nothing to release
    assert dk.release_gpu(dk.pick_gpu(claim=True)) is True
    assert device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"device='meta' is not a CUDA device"):
        dk.release_gpu("meta")
    # Before: "names an MPS device, but this torch build has no MPS support ... install".
    with pytest.raises(ValueError, match=r"^device='mps' is not a CUDA device; pass a CUDA"):
        dk.release_gpu("mps")
    with pytest.raises(TypeError, match=r"device must be .* got the bool True"):
        dk.release_gpu(True)  # type: ignore[arg-type]


def test_pick_gpus_claims_all_or_none(nvml_session: Install) -> None:
    nvml_session(machine(3))
    held = dk.pick_gpu(claim=True, exclude=[0, 2])
    assert held == torch.device("cuda", 1)
    with pytest.raises(dk.GPUUnavailableError, match=r"cuda:1: claimed by this process"):
        dk.pick_gpus(3, claim=True)
    assert sorted(_claims._held.claims) == [uuid(1)]  # the two it could claim were let go
    assert dk.pick_gpus(2, claim=True) == [torch.device("cuda", 0), torch.device("cuda", 2)]


def test_pick_gpus_holds_none_when_a_claim_raises(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(machine(3))
    claim = _claims.claim
    calls: list[int] = []

    def third_fails(gpu_uuid: str, index: int) -> bool:
        calls.append(index)
        if len(calls) == 3:  # the disk filled up, or Ctrl-C, at the third GPU
            raise OSError(errno.ENOSPC, "No space left on device")
        return claim(gpu_uuid, index)

    monkeypatch.setattr(_claims, "claim", third_fails)
    with pytest.raises(OSError, match="No space left"):
        dk.pick_gpus(3, claim=True)
    assert len(calls) == 3
    assert not _claims._held.claims  # the two claimed before it were let go


def test_claim_gpu_releases_at_the_end_of_the_block(nvml_session: Install) -> None:
    nvml_session(machine(1))
    with dk.claim_gpu() as device:
        assert device == torch.device("cuda", 0)
        assert dk.pick_gpu(claim=True) == torch.device("cpu")
    assert dk.pick_gpu(claim=True) == device
    dk.release_gpu(device)
    with pytest.raises(RuntimeError, match="inside"), dk.claim_gpu():
        raise RuntimeError("inside")
    assert not _claims._held.claims
    with dk.claim_gpu(min_free_memory=100 * GiB) as device:
        assert device == torch.device("cpu")


def test_a_claim_gpu_block_entered_twice_says_what_to_do(nvml_session: Install) -> None:
    # Before, the second entry failed inside contextlib: AttributeError: ... 'args'.
    nvml_session(machine(2))
    block = dk.claim_gpu()
    with block as device:
        assert device == torch.device("cuda", 0)
    with (
        pytest.raises(
            RuntimeError,
            match=r"this claim_gpu\(\) was already entered once; a claim is one with block, "
            r"so call dk.claim_gpu\(...\) again for each",
        ),
        block,
    ):
        pass
    assert not _claims._held.claims  # the refused entry claimed nothing
    with dk.claim_gpu() as first, dk.claim_gpu() as second:  # nested: two GPUs, both released
        assert {first, second} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert not _claims._held.claims


def test_claim_gpu_is_no_decorator_as_the_function_would_not_learn_its_gpu(
    nvml_session: Install,
) -> None:
    # Before, each call claimed a GPU the function had no way to learn of, and held it.
    nvml_session(machine(2))

    def job() -> None:
        pass

    with pytest.raises(TypeError, match=r"^dk.claim_gpu\(\) cannot decorate .*job: the function"):
        dk.claim_gpu()(job)
    assert not _claims._held.claims


def test_a_claim_can_follow_its_gpu_under_other_visible_devices(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(machine(2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert dk.pick_gpu(claim=True) == torch.device("cuda", 0)  # physical GPU 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert dk.pick_gpu(claim=True) == torch.device("cuda", 0)  # physical GPU 0
    assert sorted(_claims._held.claims) == [uuid(0), uuid(1)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert dk.release_gpu(0) is True  # cuda:0 as this visibility numbers it
    assert sorted(_claims._held.claims) == [uuid(0)]


def test_claim_gpu_releases_its_own_claim_whatever_the_block_makes_visible(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml_session(machine(2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert dk.pick_gpu(claim=True) == torch.device("cuda", 0)  # physical GPU 1, kept
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with dk.claim_gpu() as device:
        assert device == torch.device("cuda", 0)  # physical GPU 0
        # The block leaves cuda:0 naming physical GPU 1, which the other claim holds.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert sorted(_claims._held.claims) == [uuid(1)]  # the block's own claim went, no other


def test_a_claim_gpu_block_releases_the_claim_it_took_after_waiting_for_another_thread(
    nvml_session: Install,
) -> None:
    # Before, a block told its claim by the UUIDs held before and after its pick: a GPU
    # that another thread held when this block began, and released while it waited, was
    # not "its" claim, and stayed claimed after the block (8 threads on 3 GPUs: all 3).
    fake = machine(1)
    nvml_session(fake)
    got: list[torch.device] = []
    with dk.claim_gpu() as device:
        looked = fake.calls["nvmlDeviceGetMemoryInfo_v2"]
        waiter = later(0, lambda: got.append(enter_claim_gpu_block(wait=TIMEOUT)))
        deadline = time.monotonic() + TIMEOUT
        while fake.calls["nvmlDeviceGetMemoryInfo_v2"] == looked:  # until it has looked once
            assert time.monotonic() < deadline
            time.sleep(0.01)
    waiter.join(TIMEOUT)
    assert got == [device]
    assert not _claims._held.claims  # the waiter's block released what it took


def enter_claim_gpu_block(*, wait: float) -> torch.device:
    with dk.claim_gpu(wait=wait) as device:
        assert _claims.is_held(uuid(0))
    return device


def test_a_claim_gpu_block_releases_only_its_own_claim_not_one_made_again_inside(
    nvml_session: Install,
) -> None:
    # Before, a claim released in the block and made again (by UUID the same GPU) was
    # released at the block's end, under the pick_gpu(claim=True) that made it.
    nvml_session(machine(1))
    with dk.claim_gpu() as device:
        assert dk.release_gpu(device) is True
        assert dk.pick_gpu(claim=True) == device
    assert _claims.is_held(uuid(0))  # the block's own claim was gone; this one stays
    assert dk.release_gpu(device) is True


def test_one_claim_gpu_block_entered_by_two_threads_at_once_lets_one_in(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the block was marked entered only once the claim was taken: a second thread
    # entering meanwhile got in too, made a block of its own over the first one's, and the
    # first thread's claim was released under it; its exit left the second thread's block.
    nvml_session(machine(2))
    from devicekit import _pick

    inside, go_on = threading.Event(), threading.Event()
    real_ranked = _pick._ranked

    def slow_ranked(*args: Any) -> Any:  # the first pick waits here, holding its entry open
        if not inside.is_set():
            inside.set()
            assert go_on.wait(TIMEOUT)
        return real_ranked(*args)

    monkeypatch.setattr(_pick, "_ranked", slow_ranked)
    block = dk.claim_gpu()
    outcome: list[object] = []

    def first() -> None:
        with block as device:
            outcome.append(device)
            outcome.append(sorted(_claims._held.claims))

    thread = later(0, first)
    try:
        assert inside.wait(TIMEOUT)
        with (
            pytest.raises(RuntimeError, match=r"this claim_gpu\(\) was already entered once"),
            block,
        ):
            pass
    finally:
        go_on.set()
        thread.join(TIMEOUT)
    assert outcome == [torch.device("cuda", 0), [uuid(0)]]
    assert not _claims._held.claims


def test_lock_files_are_named_by_uuid_even_for_old_mig_names(private_claims: Path) -> None:
    mig = "MIG-GPU-aaaa1111-0000-0000-0000-000000000000/1/0"  # drivers before R470
    assert _claims.claim(mig, 0) is True
    lock = private_claims / "MIG-GPU-aaaa1111-0000-0000-0000-000000000000_1_0.lock"
    assert lock.read_text().strip() == str(os.getpid())
    assert _claims.holder(mig) == os.getpid()
    assert _claims.claim(mig, 0) is False
    assert _claims.release(mig) is True
    assert lock.exists()  # never deleted: see the module's docstring


def test_a_fork_child_does_not_keep_the_parents_claim() -> None:
    assert _claims.claim(uuid(0), 0)
    ready, report = os.pipe()
    child = os.fork()
    if child == 0:  # the child: say it runs, then hold on to everything it inherited
        os.write(report, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        assert select.select([ready], [], [], TIMEOUT)[0]  # the child is past its fork hooks
        assert _claims.release(uuid(0))
        assert _claims.claim(uuid(0), 0)  # free at once, although the child still runs
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready)
        os.close(report)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_fork_from_another_thread_waits_for_a_claim_being_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a fork between a claim's lock and its record left the child a lock it did
    # not know of: the GPU stayed claimed, after its release, until the child ended.
    in_window = threading.Event()
    real_claim = _claims._Claim

    def slow_record(*args: Any) -> Any:  # after the lock is taken, before it is recorded
        in_window.set()
        time.sleep(1)
        return real_claim(*args)

    monkeypatch.setattr(_claims, "_Claim", slow_record)
    ready, report = os.pipe()
    children: list[int] = []

    def fork() -> None:
        assert in_window.wait(TIMEOUT)
        child = os.fork()
        if child == 0:  # the child: say it runs, then hold on to everything it inherited
            os.write(report, b"x")
            time.sleep(30)
            os._exit(0)
        children.append(child)

    forker = later(0, fork)
    try:
        assert _claims.claim(uuid(0), 0)
        forker.join(TIMEOUT)
        assert select.select([ready], [], [], TIMEOUT)[0]  # the child is past its fork hooks
        assert _claims.release(uuid(0))
        assert _claims.claim(uuid(0), 0)  # free at once, although the child still runs
    finally:
        forker.join(TIMEOUT)
        for child in children:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        os.close(ready)
        os.close(report)


def test_an_interrupt_inside_a_claim_leaves_no_lock_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ctrl-C can land between taking the lock and recording it; an unrecorded lock
    # could never be released, and this process would see its own GPU as another's.
    def interrupted(fd: int, data: bytes, offset: int) -> int:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _claims.claim(uuid(0), 0)
    assert not _claims._held.claims
    assert _claims.claim(uuid(0), 0) is True


def test_a_full_disk_does_not_fail_a_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)  # the holder's pid cannot be written
    assert _claims.claim(uuid(0), 0) is True
    assert _claims.is_held(uuid(0))


# --- the lock directory ----------------------------------------------------------------------


@pytest.fixture
def default_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No DEVICEKIT_CLAIMS_DIR, and a stand-in for /tmp: yields where the claims must go."""
    monkeypatch.delenv(_claims.DIR_VAR)
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(_claimfiles, "_SHARED_TMP", str(shared))
    return shared / f"devicekit-{os.getuid()}"


def test_the_lock_directory_is_private(nvml_session: Install, default_directory: Path) -> None:
    nvml_session(machine(1))
    directory = default_directory
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)  # made by an older umask, say: readable by everyone
    assert dk.pick_gpu(claim=True) == torch.device("cuda", 0)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert [path.name for path in directory.iterdir()] == [f"{uuid(0)}.lock"]
    assert stat.S_IMODE((directory / f"{uuid(0)}.lock").stat().st_mode) & 0o077 == 0


def test_a_chosen_directory_is_never_changed_and_refused_when_others_can_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before: DEVICEKIT_CLAIMS_DIR=$HOME or a group's project folder was made mode 0700
    # without a word (a setgid 2775 folder lost its group access).
    readable = tmp_path / "home"
    readable.mkdir()
    readable.chmod(0o755)
    monkeypatch.setenv(_claims.DIR_VAR, str(readable))
    assert _claims.claims_directory() == readable
    assert stat.S_IMODE(readable.stat().st_mode) == 0o755  # left as the user made it
    shared = tmp_path / "project"
    shared.mkdir()
    shared.chmod(0o2775)
    monkeypatch.setenv(_claims.DIR_VAR, str(shared))
    with pytest.raises(PermissionError) as caught:
        _claims.claims_directory()
    assert str(caught.value) == (
        f"[Errno 13] DEVICEKIT_CLAIMS_DIR={str(shared)!r} is writable by other users (mode "
        "2775), who could plant files or links where the lock files go; devicekit does not "
        "change a directory you chose. Set DEVICEKIT_CLAIMS_DIR to a directory only you can "
        f"write, such as {str(shared / 'devicekit-claims')!r} (devicekit creates it, private)"
    )
    assert stat.S_IMODE(shared.stat().st_mode) == 0o2775
    monkeypatch.setenv(_claims.DIR_VAR, str(shared / "devicekit-claims"))  # the advice works
    made = _claims.claims_directory().stat().st_mode
    assert stat.S_IMODE(made) & 0o777 == 0o700  # (setgid, from its parent, stays)


def test_a_chosen_directory_may_start_with_a_tilde_and_lack_its_parents(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before: "~/claims" was refused as a relative path, and a missing parent was an error.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(_claims.DIR_VAR, "~/jobs/claims")
    assert _claims.claims_directory() == tmp_path / "jobs" / "claims"
    assert stat.S_IMODE((tmp_path / "jobs" / "claims").stat().st_mode) == 0o700


def test_every_job_of_a_user_finds_the_same_directory_whatever_its_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_directory: Path
) -> None:
    # A login shell has XDG_RUNTIME_DIR; cron, Slurm, sudo -u and services do not, and
    # Slurm gives each job its own TMPDIR. Jobs that looked in different directories
    # never saw each other's claims, and took the same GPU.
    environments: list[dict[str, str | None]] = [
        {"XDG_RUNTIME_DIR": None, "TMPDIR": None},
        {"XDG_RUNTIME_DIR": str(tmp_path), "TMPDIR": None},
        {"XDG_RUNTIME_DIR": None, "TMPDIR": str(tmp_path)},
    ]
    for environment in environments:
        for name, value in environment.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
        assert _claims.claims_directory() == default_directory
    assert stat.S_IMODE(default_directory.stat().st_mode) == 0o700


def test_devicekit_claims_dir_names_the_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(_claims.DIR_VAR, str(tmp_path / "mine"))
    assert _claims.claims_directory() == tmp_path / "mine"
    assert stat.S_IMODE((tmp_path / "mine").stat().st_mode) == 0o700
    monkeypatch.setenv(_claims.DIR_VAR, "claims")  # relative: one per working directory
    with pytest.raises(
        ValueError, match=r"DEVICEKIT_CLAIMS_DIR='claims' is a relative path, .*absolute path"
    ):
        _claims.claims_directory()


def test_a_claims_dir_that_is_a_file_or_a_link_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before, both read "it is not a directory owned by uid <yours>": a file's owner read
    # "not owned by you", and a link to a real directory was called not a directory.
    (tmp_path / "file").touch()
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for name, kind in [
        ("file", f"a regular file owned by uid {os.getuid()}"),
        (
            "link",
            f"a symbolic link owned by uid {os.getuid()}, which claims do not follow "
            r"\(its target could change\)",
        ),
    ]:
        monkeypatch.setenv(_claims.DIR_VAR, str(tmp_path / name))
        with pytest.raises(
            PermissionError,
            match=rf"{name} should be a directory of GPU claims owned by this user \(uid "
            rf"{os.getuid()}\), but it is {kind}; remove it, or "
            "set DEVICEKIT_CLAIMS_DIR to a directory of your own",
        ):
            _claims.claims_directory()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_claims_dir_that_is_a_device_or_a_pipe_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before, DEVICEKIT_CLAIMS_DIR=/dev/null read "it is not a directory owned by uid 0" to
    # uid 0, which owns it, and the fix began "remove it".
    os.mkfifo(tmp_path / "pipe")
    null_owner = os.stat(os.devnull).st_uid
    for path, kind in [
        (os.devnull, f"a character device owned by uid {null_owner}"),
        (str(tmp_path / "pipe"), rf"a named pipe \(FIFO\) owned by uid {os.getuid()}"),
    ]:
        monkeypatch.setenv(_claims.DIR_VAR, path)
        with pytest.raises(
            PermissionError,
            match=rf"{re.escape(path)} should be a directory of GPU claims owned by this user "
            rf"\(uid {os.getuid()}\), but it is {kind}; set DEVICEKIT_CLAIMS_DIR to a directory "
            "of your own$",
        ):
            _claims.claims_directory()


def test_a_directory_someone_else_made_is_refused(tmp_path: Path, default_directory: Path) -> None:
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    default_directory.symlink_to(elsewhere)
    with pytest.raises(
        PermissionError,
        match=r"should be a directory of GPU claims owned by .* set DEVICEKIT_CLAIMS_DIR",
    ):
        _claims.claims_directory()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_directory_owned_by_another_user_is_refused(private_claims: Path) -> None:
    private_claims.mkdir(mode=0o700)
    os.chown(private_claims, 65534, 65534)
    with pytest.raises(PermissionError, match=r"directory owned by uid 65534"):
        _claims.claims_directory()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to squat another user's directory")
def test_a_directory_squatted_in_a_sticky_tmp_is_not_said_to_be_removable() -> None:
    # Before: "remove it", which the user cannot in a sticky /tmp: it is another user's.
    base = Path(tempfile.mkdtemp(prefix="devicekit-test-"))  # a stand-in for /tmp
    try:
        base.chmod(0o1777)
        squatted = base / "devicekit-65534"
        squatted.mkdir(mode=0o755)  # root's: made before nobody's first claim
        code = CTRL_C_WORKS + textwrap.dedent(
            f"""
            import json, os
            from devicekit import _claimfiles, _claimlist
            os.setgid(65534); os.setuid(65534)
            _claimfiles._SHARED_TMP = {str(base)!r}
            try:
                _claimfiles.claims_directory()
            except PermissionError as error:
                print(json.dumps([str(error), _claimlist.claims_report().unknown]))
            """
        )
        error, unknown = run_python(code, env={_claims.DIR_VAR: ""}, timeout=TIMEOUT)
    finally:
        shutil.rmtree(base)
    why = (
        f"{squatted} should be a directory of GPU claims owned by this user (uid 65534), but "
        "it is a directory owned by uid 0; set DEVICEKIT_CLAIMS_DIR to a directory of your "
        "own (or ask its owner or root to remove it)"
    )
    assert error == f"[Errno 13] {why}"
    assert unknown == f"claims cannot be kept here: {why}"


def test_a_directory_that_cannot_be_made_is_a_clear_error(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    nvml_session(machine(1))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(_claims.DIR_VAR, str(tmp_path / "a-file" / "claims"))
    with pytest.raises(
        NotADirectoryError,
        match=r"claim=True cannot create the directory of GPU claims .*a-file/claims: "
        r"Not a directory; set DEVICEKIT_CLAIMS_DIR to a directory of your own .* "
        r"or pass claim=False",
    ):
        dk.pick_gpu(claim=True)
    assert not _claims._held.claims
    assert dk.pick_gpu() == torch.device("cuda", 0)  # without claims, nothing is written


def test_a_lock_file_that_cannot_be_made_is_a_clear_error(
    nvml_session: Install, private_claims: Path
) -> None:
    nvml_session(machine(1))
    private_claims.mkdir(mode=0o700)
    (private_claims / f"{uuid(0)}.lock").mkdir()  # in the way of the lock file
    with pytest.raises(
        PermissionError,
        match=rf"claim=True cannot use .*{uuid(0)}\.lock as a GPU's lock file: it should be a "
        rf"regular file owned by this user \(uid {os.getuid()}\), but it is a directory owned "
        r"by uid \d+; remove it \(claim=True makes it again\)$",
    ):
        dk.pick_gpu(claim=True)
    assert not _claims._held.claims


@pytest.mark.parametrize("kind", ["link", "fifo", "theirs"])
def test_a_lock_file_is_never_opened_through_a_link_nor_in_place_of_another_file(
    private_claims: Path, tmp_path: Path, kind: str
) -> None:
    # Before, the lock file was opened following links: a link planted in its place had
    # the pid written over the first bytes of its target.
    private_claims.mkdir(mode=0o700)
    lock = private_claims / f"{uuid(0)}.lock"
    target = tmp_path / "precious"
    target.write_text("precious data\n")
    described = {
        "link": r"a symbolic link owned by uid \d+, which claims do not follow .*",
        "fifo": r"a named pipe \(FIFO\) owned by uid \d+",
        "theirs": r"a regular file owned by uid \d+",
    }[kind]
    if kind == "link":
        lock.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.write_text("")
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file to another user")
        os.chown(lock, 65534, 65534)
    with pytest.raises(
        PermissionError,
        match=rf"^\[Errno 13\] claim=True cannot use {re.escape(str(lock))} as a GPU's lock "
        rf"file: .* but it is {described}; remove it",
    ):
        _claims.claim(uuid(0), 0)
    assert target.read_text() == "precious data\n"
    assert not _claims._held.claims
    lock.unlink()
    assert _claims.claim(uuid(0), 0) is True  # removed, as the message says: claims work


def test_a_read_only_directory_of_ones_own_is_named_as_not_writable(tmp_path: Path) -> None:
    # Before: "Permission denied; set DEVICEKIT_CLAIMS_DIR to a directory of your own",
    # about a directory that was the user's own.
    code = CTRL_C_WORKS
    if os.geteuid() == 0:  # root may write anywhere: the job runs as nobody, in nobody's own
        base = Path(tempfile.mkdtemp(prefix="devicekit-test-"))
        base.chmod(0o755)
        directory = base / "claims"
        directory.mkdir(mode=0o500)
        os.chown(directory, 65534, 65534)
        code += "import os\nfrom devicekit import _claims\nos.setgid(65534); os.setuid(65534)\n"
    else:
        base = tmp_path
        directory = base / "claims"
        directory.mkdir(mode=0o500)
    code += textwrap.dedent(
        """
        import json
        from devicekit import _claims
        try:
            _claims.claim("GPU-0000", 0)
        except PermissionError as error:
            print(json.dumps(str(error)))
        """
    )
    try:
        message = run_python(code, env={_claims.DIR_VAR: str(directory)}, timeout=TIMEOUT)
    finally:
        directory.chmod(0o700)
        if base != tmp_path:
            shutil.rmtree(base)
    assert message.startswith(
        f"[Errno 13] claim=True cannot open the lock file {directory}/GPU-0000.lock: "
        f"Permission denied: {directory}, this user's own, is not writable (mode 500); make it "
        f"writable (chmod u+w {directory}), or set DEVICEKIT_CLAIMS_DIR to a directory of your own"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a job as another user")
def test_another_users_job_is_told_what_to_do(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # root's: nobody cannot make its claims directory in here
    code = CTRL_C_WORKS + textwrap.dedent(
        """
        import json, os
        from devicekit import _claims  # imported as root: nobody may not read this checkout
        os.setgid(65534); os.setuid(65534)
        try:
            _claims.claim("GPU-0000", 0)
        except PermissionError as error:
            print(json.dumps(str(error)))
        """
    )
    message = run_python(code, env={_claims.DIR_VAR: str(private / "claims")}, timeout=TIMEOUT)
    assert "claim=True cannot create the directory of GPU claims" in message
    assert "Permission denied; set DEVICEKIT_CLAIMS_DIR" in message


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A file system with room for four files, mounted for the test (root only)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small file system")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=4", "tmpfs", str(mount)],
        capture_output=True,
        timeout=TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=TIMEOUT, check=False)


def test_a_full_disk_is_a_clear_error_and_keeps_what_works(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, tiny_disk: Path
) -> None:
    nvml_session(machine(3))
    monkeypatch.setenv(_claims.DIR_VAR, str(tiny_disk / "claims"))
    # The root, the directory and two lock files take the four inodes there are.
    assert dk.pick_gpus(2, claim=True) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    for device in (0, 1):
        dk.release_gpu(device)
    with pytest.raises(
        OSError, match=r"claim=True cannot open the lock file .*: No space left on device; set "
    ) as caught:
        dk.pick_gpu(claim=True, exclude=[0, 1])
    assert caught.value.errno == errno.ENOSPC
    assert dk.pick_gpu(claim=True) == torch.device("cuda", 0)  # GPUs claimed before still can be


def test_a_claim_share_locks_its_directory_against_tmp_cleaners(private_claims: Path) -> None:
    # systemd-tmpfiles ages /tmp, but skips a directory someone holds a flock on: a
    # claim held for weeks keeps its file where the next job looks for it.
    import fcntl

    def cleaner_may_age_it() -> bool:
        probe = os.open(private_claims, os.O_RDONLY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(probe)
        return True

    assert _claims.claim(uuid(0), 0)
    assert _claims.claim(uuid(1), 1)
    assert not cleaner_may_age_it()
    _claims.release(uuid(0))
    assert not cleaner_may_age_it()  # one claim left
    _claims.release(uuid(1))
    assert cleaner_may_age_it()


# --- arguments and platforms -----------------------------------------------------------------


@pytest.mark.parametrize("wait", [-1, float("nan"), float("inf")])
def test_wait_must_be_finite_and_not_negative(nvml_session: Install, wait: float) -> None:
    nvml_session(machine(1))
    with pytest.raises(
        ValueError, match=r"wait must be a finite number of seconds >= 0, got .*; None looks once"
    ):
        dk.pick_gpu(wait=wait)
    with pytest.raises(ValueError, match=r"wait must be a finite number"):
        dk.pick_gpus(1, wait=wait)


@pytest.mark.parametrize("wait", ["3", True, [1]])
def test_wait_must_be_a_number(nvml_session: Install, wait: Any) -> None:
    nvml_session(machine(1))
    with pytest.raises(TypeError, match=r"wait must be a number of seconds, got"):
        dk.pick_gpu(wait=wait)


def test_claim_must_be_a_bool(nvml_session: Install) -> None:
    nvml_session(machine(1))
    with pytest.raises(TypeError, match=r"claim must be True or False, got 1 of type int"):
        dk.pick_gpu(claim=1)  # type: ignore[arg-type]
    assert not _claims._held.claims


def test_claims_need_file_locks(nvml_session: Install, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml_session(machine(1))
    monkeypatch.setattr(_claims, "fcntl", None)
    with pytest.raises(NotImplementedError, match=r"claim=True needs OS file locks"):
        dk.pick_gpu(claim=True)
    with pytest.raises(NotImplementedError, match=r"claim=True needs OS file locks"):
        dk.pick_gpus(1, claim=True)
    with pytest.raises(NotImplementedError), dk.claim_gpu():
        pass
    assert dk.pick_gpu() == torch.device("cuda", 0)  # picking alone needs no locks


# --- waiting ---------------------------------------------------------------------------------


def later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_wait_returns_once_a_gpu_frees_up(nvml_session: Install) -> None:
    fake = machine(2, used=79 * GiB)  # 1 GiB free on each
    nvml_session(fake)
    freer = later(0.5, lambda: setattr(fake.gpus[1], "used", 10 * GiB))
    started = time.monotonic()
    device = dk.pick_gpu(min_free_memory=20 * GiB, wait=TIMEOUT)
    elapsed = time.monotonic() - started
    freer.join(TIMEOUT)
    assert device == torch.device("cuda", 1)
    assert 0.5 <= elapsed < TIMEOUT  # it waited, and stopped waiting once one qualified
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] >= 2 * 2  # looked more than once


def test_wait_gives_up_after_its_time(nvml_session: Install) -> None:
    nvml_session(machine(2, used=79 * GiB))
    started = time.monotonic()
    assert dk.pick_gpu(min_free_memory=20 * GiB, wait=0.6) == torch.device("cpu")
    assert time.monotonic() - started >= 0.6
    started = time.monotonic()
    with pytest.raises(
        dk.GPUUnavailableError,
        match=r"pick_gpus\(1\) found 0 GPUs that qualify after waiting 600 ms; rejected: "
        r"cuda:0: 1\.0 GiB free < 20\.0 GiB required; cuda:1: ",
    ):
        dk.pick_gpus(1, min_free_memory=20 * GiB, wait=0.6)
    assert time.monotonic() - started >= 0.6


def test_waiting_cannot_add_gpus_so_it_does_not(nvml_session: Install) -> None:
    nvml_session(None)  # no NVML: no GPU will ever show up
    started = time.monotonic()
    assert dk.pick_gpu(wait=TIMEOUT) == torch.device("cpu")
    with pytest.raises(dk.GPUUnavailableError, match=r"pick_gpus\(1\) found no GPU"):
        dk.pick_gpus(1, wait=TIMEOUT)
    nvml_session(machine(2))
    with pytest.raises(
        dk.GPUUnavailableError,
        match=r"pick_gpus\(3\) found 2 GPUs that qualify after waiting .*; "
        r"this process sees only 2 GPUs$",
    ):
        dk.pick_gpus(3, wait=TIMEOUT)
    assert time.monotonic() - started < TIMEOUT


def test_wait_with_claim_takes_the_gpu_once_it_is_released(nvml_session: Install) -> None:
    nvml_session(machine(1))
    held = dk.pick_gpu(claim=True)
    releaser = later(0.5, lambda: dk.release_gpu(held))
    assert dk.pick_gpu(claim=True, wait=TIMEOUT) == held
    releaser.join(TIMEOUT)
    assert list(_claims._held.claims) == [uuid(0)]


# --- several processes -----------------------------------------------------------------------


def _on_fake_machine(gpus: int) -> None:
    """In a spawned job: a machine of ``gpus`` fake GPUs, with a CUDA build as nvml_session has."""
    sys.modules["pynvml"] = machine(gpus)  # before devicekit first asks NVML anything
    torch.version.cuda = torch.version.cuda or "13.0"  # without CUDA no GPU is cuda:N


def _racer(gpus: int, barrier: Any, results: Any, done: Any) -> None:
    """A job in its own process: a machine of fake GPUs, then pick_gpu(claim=True) at the gun."""
    _on_fake_machine(gpus)
    barrier.wait(TIMEOUT)
    device = dk.pick_gpu(claim=True)
    results.put((os.getpid(), str(device)))
    done.wait(TIMEOUT)  # hold the claim until every racer has reported


def race(processes: int, gpus: int) -> list[str]:
    context = multiprocessing.get_context("spawn")
    barrier, results, done = context.Barrier(processes), context.Queue(), context.Event()
    racers = [
        context.Process(target=_racer, args=(gpus, barrier, results, done))
        for _ in range(processes)
    ]
    for racer in racers:
        racer.start()
    try:
        picked = [results.get(timeout=TIMEOUT) for _ in racers]
        done.set()
        for racer in racers:
            racer.join(TIMEOUT)
            assert racer.exitcode == 0
    finally:
        for racer in racers:
            if racer.is_alive():
                racer.kill()
                racer.join()
    assert len({pid for pid, _ in picked}) == processes
    return sorted(device for _, device in picked)


@pytest.mark.parametrize("processes", [2, 4])
def test_jobs_started_together_get_different_gpus(processes: int) -> None:
    assert race(processes, processes) == [f"cuda:{i}" for i in range(processes)]


def test_with_one_gpu_the_second_job_gets_the_cpu() -> None:
    assert race(2, 1) == ["cpu", "cuda:0"]


def _job(code: str, env: dict[str, str | None]) -> subprocess.Popen[str]:
    """A Python job on a fake 1-GPU machine, under ``env`` (None: unset): runs ``code``."""
    full = {**os.environ}
    for name, value in env.items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    prelude = f"""
        import os, sys, time, torch
        sys.path.insert(0, {os.getcwd()!r})
        from tests.fake_pynvml import FakeGPU, FakeNVML
        U = {uuid(0)!r}  # the UUID of the one GPU
        sys.modules["pynvml"] = FakeNVML([FakeGPU(U)])
        torch.version.cuda = torch.version.cuda or "13.0"
        import devicekit as dk
        from devicekit import _claimfiles, _claims, _gpus
        """
    program = CTRL_C_WORKS + textwrap.dedent(prelude) + textwrap.dedent(code)
    return subprocess.Popen(
        [sys.executable, "-c", program],
        env=full,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(job: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Close the job's stdin, wait for it to end (killed after TIMEOUT), and return its output."""
    try:
        out, err = job.communicate(timeout=TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return job.returncode, out, err


def test_a_job_from_a_login_shell_and_one_from_cron_get_different_gpus(
    tmp_path: Path, default_directory: Path
) -> None:
    # The same user; one job has a login session's XDG_RUNTIME_DIR, the other none and
    # a TMPDIR of its own (cron, Slurm). Both take /tmp, patched here to a stand-in.
    claim = f"""
        _claimfiles._SHARED_TMP = {str(default_directory.parent)!r}
        print(dk.pick_gpu(claim=True), flush=True)
        sys.stdin.read()  # hold the claim until the test closes stdin
        """
    login = _job(claim, {_claims.DIR_VAR: None, "XDG_RUNTIME_DIR": str(tmp_path)})
    cron = None
    try:
        assert login.stdout is not None
        assert login.stdout.readline().strip() == "cuda:0"
        cron = _job(claim, {_claims.DIR_VAR: None, "XDG_RUNTIME_DIR": None, "TMPDIR": "/var/tmp"})
        assert cron.stdout is not None
        assert cron.stdout.readline().strip() == "cpu"  # it saw the login job's claim
    finally:
        for job in (login, cron):
            if job is not None:
                _finish(job)  # closes stdin: the job lets go and exits


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's lock table")
def test_the_holder_named_is_the_process_that_holds_the_lock(nvml_session: Install) -> None:
    nvml_session(machine(1))
    # An earlier job held GPU 0 and exited: its pid stays in the file, free for reuse.
    earlier = _job("print(os.getpid()); _claims.claim(U, 0)", {})
    code, out, err = _finish(earlier)
    assert code == 0, err
    dead = int(out.split()[0])
    # The next holder's disk is full: it holds the lock but cannot write its pid.
    full = _job(
        """
        import errno
        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.pwrite = full
        assert _claims.claim(U, 0)
        print(os.getpid(), flush=True)
        sys.stdin.read()
        """,
        {},
    )
    try:
        assert full.stdout is not None
        holding = int(full.stdout.readline())
        assert _claims.claim(uuid(0), 0) is False
        assert _claims.holder(uuid(0)) == holding != dead  # not the pid in the file
        with pytest.raises(
            dk.GPUUnavailableError, match=rf"claimed by another process \(pid {holding}\)"
        ):
            dk.pick_gpus(1, claim=True)
    finally:
        _finish(full)


def test_without_the_kernels_lock_table_a_holder_that_exited_is_not_named(
    private_claims: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Without /proc/locks (macOS; btrfs, whose device numbers there differ from stat's)
    # the pid in the file is all there is. Before, it was named even once that process
    # had exited (its pid free for reuse), and "0" named this process group.
    files = sys.modules[_claims.holder.__module__]  # where holder() reads the lock table
    monkeypatch.setattr(files, "PROC_LOCKS", str(tmp_path / "no-lock-table"))
    earlier = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    lock = _claims.claims_directory() / f"{uuid(0)}.lock"
    for gone in (int(earlier.stdout), 0):
        lock.write_text(f"{gone:>10}\n")
        assert _claims.holder(uuid(0)) is None
    # Nor this process (it holds no claim here: is_held() said so first), nor a number
    # past any pid (os.kill raised OverflowError on it), nor a zombie (it exited).
    for never in (os.getpid(), 9_999_999_999):
        lock.write_text(f"{never:>10}\n")
        assert _claims.holder(uuid(0)) is None
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{alive.pid:>10}\n")
        assert _claims.holder(uuid(0)) == alive.pid
        alive.kill()
        if Path("/proc/self/stat").exists():  # where a zombie can be told apart
            deadline = time.monotonic() + TIMEOUT
            stat = Path(f"/proc/{alive.pid}/stat")
            while b"Z" not in stat.read_bytes().rpartition(b")")[2][:3]:
                assert time.monotonic() < deadline, "the child never became a zombie"
                time.sleep(0.01)
            assert _claims.holder(uuid(0)) is None  # exited, not reaped yet: holds nothing
    finally:
        alive.kill()
        alive.wait(timeout=TIMEOUT)


def test_ctrl_c_while_waiting_stops_the_wait_and_holds_nothing() -> None:
    assert _claims.claim(uuid(0), 0)  # the one GPU is taken: the job waits
    job = _job(
        """
        tried = _claims.claim
        def claim(*args):
            taken = tried(*args)
            print("looked", flush=True)  # the wait has begun
            return taken
        _claims.claim = claim
        try:
            dk.pick_gpu(claim=True, wait=3600)
        except KeyboardInterrupt:
            print("interrupted", sorted(_claims._held.claims), flush=True)
        """,
        {},
    )
    try:
        assert job.stdout is not None
        assert job.stdout.readline().strip() == "looked"
        job.send_signal(signal.SIGINT)
    finally:
        code, out, err = _finish(job)
    assert code == 0, err
    assert out.splitlines()[-1] == "interrupted []"


def _holder(barrier: Any, release: Any) -> None:
    _on_fake_machine(1)
    dk.pick_gpu(claim=True)
    barrier.wait(TIMEOUT)
    if release.wait(TIMEOUT):
        dk.release_gpu(0)
    time.sleep(TIMEOUT)  # alive, but no longer holding the GPU


@pytest.fixture
def holder() -> Any:
    """Start a process that claims the one fake GPU; yields (process, release event)."""
    context = multiprocessing.get_context("spawn")
    barrier, release = context.Barrier(2), context.Event()
    process = context.Process(target=_holder, args=(barrier, release), daemon=True)
    process.start()
    try:
        barrier.wait(TIMEOUT)
        yield process, release
    finally:
        process.kill()
        process.join(TIMEOUT)


def test_a_killed_process_leaves_no_claim(nvml_session: Install, holder: Any) -> None:
    process, _ = holder
    nvml_session(machine(1))
    assert dk.pick_gpu(claim=True) == torch.device("cpu")
    with pytest.raises(
        dk.GPUUnavailableError, match=rf"cuda:0: claimed by another process \(pid {process.pid}\)"
    ):
        dk.pick_gpus(1, claim=True)
    os.kill(process.pid, signal.SIGKILL)
    process.join(TIMEOUT)
    assert process.exitcode == -signal.SIGKILL
    assert dk.pick_gpu(claim=True) == torch.device("cuda", 0)  # at once: no wait


def test_a_waiting_process_gets_the_gpu_another_releases(
    nvml_session: Install, holder: Any
) -> None:
    process, release = holder
    nvml_session(machine(1))
    releaser = later(0.5, release.set)
    assert dk.pick_gpu(claim=True, wait=TIMEOUT) == torch.device("cuda", 0)
    releaser.join(TIMEOUT)
    assert process.is_alive()  # released by release_gpu, not by exiting


# --- the setting, checked on every claim=True call -------------------------------------------


def _bad_claims_dirs(tmp_path: Path) -> list[tuple[str, type[Exception], str]]:
    """Settings that claims_directory() refuses: (value, error, what the message says)."""
    (tmp_path / "file").touch()
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    shared = tmp_path / "project"
    shared.mkdir()
    shared.chmod(0o2775)  # a group's project folder
    return [
        ("relative/claims", ValueError, "is a relative path"),
        (os.devnull, PermissionError, "but it is a character device"),
        (str(tmp_path / "file"), PermissionError, "but it is a regular file"),
        (str(tmp_path / "link"), PermissionError, "but it is a symbolic link"),
        (str(shared), PermissionError, r"is writable by other users \(mode 2775\)"),
        # Under a file: no directory can ever be made there (it passed without a GPU).
        (str(tmp_path / "file" / "claims"), NotADirectoryError, r"claims: Not a directory"),
    ]


def test_a_bad_claims_dir_is_refused_even_without_a_gpu_to_claim(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before, every one of these returned the CPU without a word where there was no GPU (a
    # laptop, CI), and was refused only on the GPU node, once a claim was really taken.
    nvml_session(machine(0))
    calls: list[Callable[[], object]] = [
        lambda: dk.pick_gpu(claim=True),
        lambda: dk.pick_gpus(1, claim=True),
        lambda: dk.claim_gpu().__enter__(),
    ]
    for value, error, said in _bad_claims_dirs(tmp_path):
        monkeypatch.setenv(_claims.DIR_VAR, value)
        with pytest.raises(error) as on_the_gpu_node:
            _claims.claims_directory()
        for call in calls:
            with pytest.raises(error, match=said) as caught:
                call()
            assert str(caught.value) == str(on_the_gpu_node.value)  # as the GPU path says it
        assert dk.pick_gpu() == torch.device("cpu")  # without claim=True, not looked at


def test_a_claims_dir_not_made_yet_is_left_to_be_made_and_empty_means_the_default(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The check creates nothing, and a path that exists only on the GPU nodes is no error.
    nvml_session(machine(0))
    monkeypatch.setenv(_claims.DIR_VAR, str(tmp_path / "scratch" / "claims"))
    assert dk.pick_gpu(claim=True) == torch.device("cpu")
    with dk.claim_gpu() as device:
        assert device == torch.device("cpu")
    assert not (tmp_path / "scratch").exists()
    monkeypatch.setenv(_claims.DIR_VAR, "")  # empty: unset, the default directory
    assert dk.pick_gpu(claim=True) == torch.device("cpu")
