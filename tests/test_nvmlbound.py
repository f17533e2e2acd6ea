"""NVML calls after the start that never return: bounded, so nothing devicekit answers hangs.

The stand-in's calls block on an event here, as a driver's do on a GPU falling
off the bus; every event is set when the test ends, so no thread stays blocked.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _cli, _nvml

from .fake_pynvml import FakeGPU, FakeNVML
from .fake_pynvml import finishes as wait_for

Install = Callable[[Any], None]
H100 = "GPU-4e1be09d-5954-ebad-2f3a-c71188f45156"
OTHER = "GPU-0b0b0b0b-5954-ebad-2f3a-c71188f45156"
THIRD = "GPU-0c0c0c0c-5954-ebad-2f3a-c71188f45156"
BUS_0, BUS_1, BUS_2 = "00000000:18:00.0", "00000000:3A:00.0", "00000000:5D:00.0"
BLOCKED = (
    "the call is blocked in the NVIDIA driver (a hung GPU or a wedged driver: look for Xid "
    "errors in `dmesg`)"
)
_HANG_BOUND = 30  # seconds: only a hang takes this long; every answer here takes milliseconds
# The bound under test: short, so a test waits little for what never answers; long enough
# that a healthy unit (well under a millisecond) meets it on a busy machine.
WAIT = "0.5"


class Hang:
    """``fake.<name>`` blocks, for one GPU's handle or for every call, until ``release()``."""

    def __init__(self, fake: FakeNVML, name: str, gpu: FakeGPU | None = None) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = 0  # calls that blocked
        real = getattr(fake, name)

        def blocking(*args: Any) -> Any:
            if gpu is None or (args and args[0] is gpu):
                self.calls += 1
                self.entered.set()
                self.gate.wait()
            return real(*args)

        setattr(fake, name, blocking)

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def hang() -> Iterator[Callable[..., Hang]]:
    """Make a stand-in's call block; every one made is released when the test ends."""
    made: list[Hang] = []

    def make(fake: FakeNVML, name: str, gpu: FakeGPU | None = None) -> Hang:
        made.append(Hang(fake, name, gpu))
        return made[-1]

    yield make
    for each in made:
        each.release()


def finishes(fn: Callable[[], Any]) -> Any:
    """``fn()``, failing the test if it still runs after `_HANG_BOUND` seconds."""
    return wait_for(fn, within=_HANG_BOUND)


def two_gpus(nvml_session: Install, monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    """Two GPUs, NVML started and the GPUs listed; each unit waits `WAIT` seconds at most."""
    fake = FakeNVML([FakeGPU(H100, bus=BUS_0), FakeGPU(OTHER, bus=BUS_1)])
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, WAIT)
    assert len(dk.gpus()) == 2
    return fake


def reason(gpu: int, bus: str) -> str:
    return f"NVML did not answer in {WAIT} s reading the GPU at NVML index {gpu} ({bus}): {BLOCKED}"


READINGS = (
    "memory_total",
    "memory_used",
    "memory_free",
    "utilization",
    "memory_utilization",
    "temperature",
    "power_draw",
    "power_limit",
    "sm_clock",
    "memory_clock",
    "throttle_reasons",
    "fan_speed",
    "compute_mode",
    "mig_enabled",
    "processes",
    "energy",
)


@pytest.mark.timeout(120)
def test_a_gpu_that_never_answers_is_given_up_on_and_the_others_are_read(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    # Before: a snapshot's call blocked in the driver hung dk.gpus(), status(), the CLI,
    # doctor and pick_gpu for as long as the driver did: minutes, or for good.
    fake = two_gpus(nvml_session, monkeypatch)
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[0])
    hung, other = finishes(lambda: dk.gpus(all=True))
    assert hung.error == reason(0, BUS_0)
    assert {name: getattr(hung, name) for name in READINGS} == dict.fromkeys(READINGS)
    assert (hung.torch_index, hung.uuid, hung.name, hung.pci_bus_id, hung.sm_clock_max) == (
        0,
        H100,
        "NVIDIA H100 80GB HBM3",
        BUS_0,
        1980,
    )
    assert (other.error, other.utilization, other.memory_total) == (None, 10, 80 * 2**30)
    assert stuck.calls == 1


def three_gpus(nvml_session: Install, monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    """Three GPUs, as `two_gpus` makes two."""
    fake = FakeNVML(
        [FakeGPU(H100, bus=BUS_0), FakeGPU(OTHER, bus=BUS_1), FakeGPU(THIRD, bus=BUS_2)]
    )
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, WAIT)
    assert len(dk.gpus()) == 3
    return fake


def given_up_when_read(
    fake: FakeNVML, monkeypatch: pytest.MonkeyPatch, call: str = "nvmlDeviceGetUtilizationRates"
) -> dict[str, int]:
    """UUID -> how many units the queries had given up on when ``call`` was asked of it."""
    seen: dict[str, int] = {}
    real = getattr(fake, call)  # blocking, where a test made it so

    def noting(handle: FakeGPU) -> Any:
        seen[handle.uuid] = len(_nvml.session().wedged)
        return real(handle)

    monkeypatch.setattr(fake, call, noting)
    return seen


@pytest.mark.timeout(120)
def test_gpus_that_all_hang_cost_one_wait_not_one_each(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    # Before: each GPU was waited for in turn: a driver in recovery, blocking every GPU at
    # once, made the first query wait the bound once per GPU (4 minutes for 8 GPUs at 30 s).
    fake = three_gpus(nvml_session, monkeypatch)
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates")
    seen = given_up_when_read(fake, monkeypatch)
    began = time.monotonic()
    infos = finishes(dk.gpus)
    assert time.monotonic() - began < 10 * float(WAIT)  # a hang guard; the count decides
    assert [info.error for info in infos] == [reason(0, BUS_0), reason(1, BUS_1), reason(2, BUS_2)]
    # Every GPU's read began before the query gave up on any: one wait for the three.
    assert seen == {H100: 0, OTHER: 0, THIRD: 0}
    assert stuck.calls == 3


@pytest.mark.timeout(120)
def test_doctor_s_persistence_check_of_gpus_that_hang_costs_one_wait(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    # Before: doctor asked each GPU's persistence mode in turn, after the status: GPUs
    # that hung meanwhile cost the bound once each.
    fake = three_gpus(nvml_session, monkeypatch)
    assert _nvml.persistence_modes([2, 0, 7]) == {2: True, 0: True, 7: None}  # 7: no such GPU
    stuck = hang(fake, "nvmlDeviceGetPersistenceMode")
    began = given_up_when_read(fake, monkeypatch, "nvmlDeviceGetPersistenceMode")
    assert finishes(lambda: _nvml.persistence_modes([0, 1, 2])) == {0: None, 1: None, 2: None}
    assert began == {H100: 0, OTHER: 0, THIRD: 0}  # all began before the one deadline
    assert stuck.calls == 3


@pytest.mark.timeout(120)
def test_healthy_gpus_are_read_while_a_hung_one_is_waited_for(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    fake = three_gpus(nvml_session, monkeypatch)
    hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[0])
    seen = given_up_when_read(fake, monkeypatch)
    infos = finishes(lambda: dk.gpus(all=True))
    assert [info.error for info in infos] == [reason(0, BUS_0), None, None]
    assert [info.utilization for info in infos] == [None, 10, 10]
    assert [info.memory_total for info in infos] == [None, 80 * 2**30, 80 * 2**30]
    # Read beside the hung GPU, not after it was given up on.
    assert seen == {H100: 0, OTHER: 0, THIRD: 0}


@pytest.mark.timeout(120)
def test_gpus_given_up_on_together_answer_at_once_then_are_read_again_together(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    fake = three_gpus(nvml_session, monkeypatch)
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates")
    seen = given_up_when_read(fake, monkeypatch)
    finishes(dk.status)
    assert seen == {H100: 0, OTHER: 0, THIRD: 0}
    reasons = [reason(0, BUS_0), reason(1, BUS_1), reason(2, BUS_2)]
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "3600")  # waiting again would fail the test
    monkeypatch.setattr("devicekit._nvmlbound.RETRY_AFTER", 0.0)  # blocked: no retry is due
    for _ in range(3):
        assert [info.error for info in finishes(dk.gpus)] == reasons
        assert finishes(lambda: dk.gpu(1)).error == reasons[1]
    assert stuck.calls == 3  # no second read began beside a blocked one
    stuck.release()
    for job in list(_nvml.session().wedged.values()):
        assert job.wait(_HANG_BOUND)
    infos = finishes(dk.gpus)
    assert [(info.error, info.utilization) for info in infos] == [(None, 10)] * 3
    assert not _nvml.session().wedged


@pytest.mark.timeout(120)
def test_a_gpu_and_its_mig_instances_block_one_thread_and_keep_what_answered(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    # A GPU and its instances are one key: read in turn by one worker, so a hung GPU
    # blocks one thread, as when they were read one after the other.
    slices = [FakeGPU("MIG-11111111-aaaa"), FakeGPU("MIG-22222222-bbbb")]
    fake = FakeNVML([FakeGPU(H100, bus=BUS_0, mig=slices), FakeGPU(OTHER, bus=BUS_1)])
    nvml_session(fake)
    monkeypatch.setattr("devicekit._gpus._order_from_cuda", lambda: None)  # no CUDA child
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, WAIT)
    assert len(dk.gpus(all=True)) == 4
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates", slices[1])
    infos = finishes(lambda: dk.gpus(all=True))
    assert [info.uuid for info in infos] == [H100, *(each.uuid for each in slices), OTHER]
    assert [info.error for info in infos] == [None, None, reason(0, BUS_0), None]
    assert [info.utilization for info in infos] == [10, 10, None, 10]
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "3600")
    again = finishes(lambda: dk.gpus(all=True))
    assert [info.error for info in again] == [reason(0, BUS_0)] * 3 + [None]
    assert stuck.calls == 1


@pytest.mark.timeout(120)
def test_a_gpu_given_up_on_answers_at_once_and_is_not_read_again_while_blocked(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    fake = two_gpus(nvml_session, monkeypatch)
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[0])
    finishes(dk.gpus)
    # From now on a query that waited for the GPU again would wait an hour: the hang guard
    # would fail the test. Each answers at once, with the same reason, and reads no GPU 0.
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "3600")
    monkeypatch.setattr("devicekit._nvmlbound.RETRY_AFTER", 0.0)  # blocked: no retry is due
    for _ in range(3):
        hung, other = finishes(dk.gpus)
        assert hung.error == reason(0, BUS_0)
        assert (other.error, other.utilization) == (None, 10)
    assert finishes(dk.pick_gpu) == torch.device("cuda", 1)
    assert finishes(lambda: _nvml.persistence_mode(0)) is None  # the same GPU: not asked
    assert finishes(lambda: _nvml.read_energy(fake.gpus[0])) is None
    assert finishes(lambda: _nvml.read_energy(fake.gpus[1])) == 5000.0
    calls = fake.calls.copy()
    snapshot = finishes(dk.status)
    assert f"cannot be read: {reason(0, BUS_0)}" in str(snapshot)
    (finding,) = [f for f in snapshot.findings if f.severity == "error"]
    assert (finding.title, finding.detail) == ("cuda:0 cannot be read", reason(0, BUS_0))
    assert stuck.calls == 1  # the one blocked read: no second one began beside it
    assert fake.calls["nvmlDeviceGetPersistenceMode"] == 0
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] - calls["nvmlDeviceGetMemoryInfo_v2"] == 1


@pytest.mark.timeout(120)
def test_a_gpu_is_read_again_once_its_blocked_call_returned_and_a_while_passed(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    fake = two_gpus(nvml_session, monkeypatch)
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[0])
    assert finishes(dk.gpus)[0].error == reason(0, BUS_0)
    stuck.release()  # the driver answers at last
    job = _nvml.session().wedged[0]
    assert job.wait(_HANG_BOUND)
    assert dk.gpus()[0].error == reason(0, BUS_0)  # not yet: it may hang again at once
    assert stuck.calls == 1
    job.ended -= _nvml.RETRY_AFTER  # type: ignore[operator]
    again = dk.gpus()[0]
    assert (again.error, again.utilization, again.memory_total) == (None, 10, 80 * 2**30)
    assert 0 not in _nvml.session().wedged


@pytest.mark.timeout(120)
def test_a_blocked_snapshot_holds_no_lock_other_queries_need(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    fake = two_gpus(nvml_session, monkeypatch)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "3600")
    slow = hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[0])
    answers: list[Any] = []
    reader = threading.Thread(target=lambda: answers.append(dk.gpus()), daemon=True)
    reader.start()
    assert slow.entered.wait(_HANG_BOUND)
    assert not _nvml.session().lock.locked()
    assert finishes(dk.nvml_error) is None
    assert finishes(dk.driver_version) == "580.159.04"
    assert finishes(lambda: dk.gpu(1)).utilization == 10
    slow.release()  # slow, not hung: it answers within the bound, and counts
    reader.join(_HANG_BOUND)
    assert [info.error for info in answers[0]] == [None, None]


@pytest.mark.timeout(120)
def test_counting_the_gpus_that_never_returns_reads_as_no_nvml_and_its_answer_is_taken(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    fake = FakeNVML([FakeGPU(H100)])
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, WAIT)
    stuck = hang(fake, "nvmlDeviceGetCount")
    why = finishes(dk.nvml_error)
    assert why == f"NVML did not answer in {WAIT} s counting and opening the GPUs: {BLOCKED}"
    assert finishes(dk.gpus) == []
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "3600")  # waiting again would fail the test
    assert finishes(dk.nvml_error) == why
    assert f"GPU status unavailable: {why}" in str(finishes(dk.status))
    assert finishes(dk.pick_gpu) == torch.device("cpu")
    assert not _nvml.session().lock.locked()
    assert stuck.calls == 1
    stuck.release()
    assert _nvml.session().wedged["enumeration"].wait(_HANG_BOUND)
    assert dk.nvml_error() is None  # the late count is taken, not asked again
    assert len(dk.gpus()) == 1
    assert fake.calls["nvmlDeviceGetCount"] == 1


@pytest.mark.timeout(120)
def test_a_driver_version_that_never_comes_is_unknown_and_then_asked_once(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    fake = FakeNVML([FakeGPU(H100)])
    nvml_session(fake)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, WAIT)
    stuck = hang(fake, "nvmlSystemGetDriverVersion")
    assert finishes(dk.driver_version) is None
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "3600")
    assert finishes(dk.cuda_driver_version) is None  # the same unit: not asked beside it
    assert finishes(dk.status).driver_version is None
    assert stuck.calls == 1
    stuck.release()
    job = _nvml.session().wedged["system"]
    assert job.wait(_HANG_BOUND)
    job.ended -= _nvml.RETRY_AFTER  # type: ignore[operator]
    for _ in range(3):
        assert (dk.driver_version(), dk.cuda_driver_version()) == ("580.159.04", "13.0")
    # Fixed while NVML holds the driver open: asked once (twice with the blocked call).
    assert fake.calls["nvmlSystemGetDriverVersion"] == 2


@pytest.mark.timeout(120)
def test_the_command_and_doctor_say_which_gpu_did_not_answer(
    nvml_session: Install,
    monkeypatch: pytest.MonkeyPatch,
    hang: Callable[..., Hang],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = two_gpus(nvml_session, monkeypatch)
    hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[1])
    assert finishes(lambda: _cli.main([])) == 0  # a report, not a failure of the command
    out = capsys.readouterr().out
    assert f"cannot be read: {reason(1, BUS_1)}" in out
    assert finishes(lambda: _cli.main(["doctor"])) == 1
    out = capsys.readouterr().out
    assert "cuda:1 cannot be read" in out
    assert reason(1, BUS_1) in out
    assert finishes(lambda: _cli.main(["--json"])) == 0
    document = json.loads(capsys.readouterr().out)
    assert [gpu["error"] for gpu in document["gpus"]] == [None, reason(1, BUS_1)]


@pytest.mark.timeout(120)
def test_the_exit_does_not_wait_for_a_shutdown_behind_a_blocked_call(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    # nvmlShutdown would wait out its bound behind the blocked call: the exit took that
    # much longer. The driver frees what the process held when it ends.
    registered: list[Any] = []
    fake = FakeNVML([FakeGPU(H100), FakeGPU(OTHER, bus=BUS_1)])
    nvml_session(fake)
    monkeypatch.setattr("atexit.register", lambda fn, *args: registered.append((fn, args)))
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, WAIT)
    dk.gpus()
    ((fn, args),) = registered
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[0])
    finishes(dk.gpus)
    finishes(lambda: fn(*args))
    assert fake.shutdown_calls == 0
    stuck.release()
    assert _nvml.session().wedged[0].wait(_HANG_BOUND)
    finishes(lambda: fn(*args))  # nothing blocked any more: shut down as usual
    assert fake.shutdown_calls == 1


def test_an_error_in_a_snapshot_that_is_not_nvmls_is_raised_not_taken_for_a_hang(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = two_gpus(nvml_session, monkeypatch)

    def broken(handle: FakeGPU) -> None:
        raise RuntimeError("binding bug")

    monkeypatch.setattr(fake, "nvmlDeviceGetUtilizationRates", broken)
    with pytest.raises(RuntimeError, match=r"^binding bug$"):
        dk.gpus()
    assert not _nvml.session().wedged


def test_the_same_workers_serve_query_after_query(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A thread per snapshot costs about 3x a hand-off to a waiting one. A status reads its
    # two GPUs at once, in two workers; both wait for the next status.
    fake = two_gpus(nvml_session, monkeypatch)
    readers: set[threading.Thread] = set()
    real = fake.nvmlDeviceGetUtilizationRates

    def noting(handle: FakeGPU) -> Any:
        readers.add(threading.current_thread())
        return real(handle)

    monkeypatch.setattr(fake, "nvmlDeviceGetUtilizationRates", noting)
    for _ in range(10):
        dk.status()
    assert len(readers) == 2
    assert threading.current_thread() not in readers
    for _ in range(10):
        dk.gpu(0)
    assert len(readers) == 2


@pytest.mark.timeout(120)
def test_no_worker_thread_outlives_a_burst_of_queries(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A thread of devicekit's running for good would make every later os.fork (a
    # DataLoader's workers) warn of a multi-threaded fork on Python 3.12+.
    monkeypatch.setattr("devicekit._nvmlbound.IDLE_SECONDS", 0.05)
    two_gpus(nvml_session, monkeypatch)
    dk.status()
    deadline = time.monotonic() + _HANG_BOUND
    while any(t.name == "devicekit-nvml" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a worker is still waiting for work"
        time.sleep(0.01)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(120)
def test_a_forked_child_reads_with_threads_of_its_own(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent's waiting workers do not exist in the child: handing them work there
    # would give up on every GPU.
    two_gpus(nvml_session, monkeypatch)
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "5")
    dk.gpus()  # a worker now waits for work, in the parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            errors = [info.error for info in dk.gpus()]
            os.write(write, json.dumps(errors).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + _HANG_BOUND
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not finish")
            time.sleep(0.05)
        assert json.loads(os.read(read, 4096)) == [None, None]
    finally:
        os.close(read)


@pytest.mark.timeout(120)
def test_a_bound_too_short_for_a_read_is_named_not_taken_for_a_hung_driver(
    nvml_session: Install, monkeypatch: pytest.MonkeyPatch, hang: Callable[..., Hang]
) -> None:
    # Before: DEVICEKIT_NVML_TIMEOUT=0.000001 gave "the call is blocked in the NVIDIA
    # driver" and doctor's fix "reset the GPU ... or reboot", for a healthy GPU.
    fake = three_gpus(nvml_session, monkeypatch)
    stuck = hang(fake, "nvmlDeviceGetUtilizationRates", fake.gpus[0])  # it never answers
    monkeypatch.setenv(_nvml.TIMEOUT_VAR, "0.000001")
    infos = finishes(lambda: dk.gpus(all=True))
    error = infos[0].error
    assert error is not None
    assert "DEVICEKIT_NVML_TIMEOUT=1e-06 is shorter than an NVML read can take" in error
    (lost,) = [f for f in dk.status().findings if f.title == "cuda:0 cannot be read"]
    assert lost.fix.startswith("raise DEVICEKIT_NVML_TIMEOUT (30 s is the default)")
    assert "reboot" not in lost.fix
    stuck.release()
