from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk

from .conftest import FakeAccelerator, run_python
from .mapfns import REPO, alive, importable, run_python_args, wait_for

TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.06 GiB is free. Of the allocated memory 76.00 GiB is allocated by PyTorch, and "
    "1.20 GiB is reserved by PyTorch but unallocated."
)


class Step:
    """Fails with torch's out-of-memory error above ``limit``; remembers what it was asked."""

    def __init__(self, limit: int, error: type[Exception] = torch.OutOfMemoryError) -> None:
        self.limit, self.error, self.calls = limit, error, []

    def __call__(self, batch_size: int) -> None:
        self.calls.append(batch_size)
        if batch_size > self.limit:
            raise self.error(TORCH_OOM)


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 48, 64, 1000])
def test_the_threshold_is_found_exactly(limit: int) -> None:
    step = Step(limit)
    assert dk.find_batch_size(step) == limit
    assert step.calls[:2] == [1, 2]  # doubling, then bisecting
    assert len(set(step.calls)) <= 2 * (limit.bit_length() + 1)
    # A size that ran is tried once; one that failed once more, right after, before it counts.
    for size in set(step.calls):
        assert step.calls.count(size) == (1 if size <= limit else 2)
        if size > limit:
            assert step.calls[step.calls.index(size) + 1] == size


def test_an_old_runtime_error_counts_as_out_of_memory() -> None:
    assert dk.find_batch_size(Step(20, RuntimeError)) == 20


def test_margin_keeps_a_fraction_free() -> None:
    assert dk.find_batch_size(Step(48), margin=0.1) == 43
    assert dk.find_batch_size(Step(50), margin=0.02) == 49  # 48.999... in floats
    assert dk.find_batch_size(Step(48), margin=0.5) == 24
    assert dk.find_batch_size(Step(48), start=40, margin=0.5) == 40  # never below start


def test_max_size_bounds_the_search() -> None:
    step = Step(1000)
    assert dk.find_batch_size(step, max_size=100) == 100
    assert max(step.calls) == 100
    assert dk.find_batch_size(Step(1000), start=7, max_size=7) == 7
    assert dk.find_batch_size(Step(60), max_size=100) == 60


def _bisection(step: Step, precision: Fraction) -> tuple[int, int]:
    """(the largest size that ran, the smallest that failed) of ``step``'s search.

    Asserts, replaying the calls, that the bisection tried no size once the one
    that failed was within ``precision`` of the one that ran.
    """
    fits, failed = 0, None
    for size in dict.fromkeys(step.calls):  # each size once, in the order tried
        if failed is not None:  # bisecting: only while the interval is wider than asked
            assert failed - fits > max(1, fits * precision), (size, fits, failed)
        if size <= step.limit:
            fits = max(fits, size)
        else:
            failed = size if failed is None else min(failed, size)
    assert failed is not None
    return fits, failed


@pytest.mark.parametrize("margin", [0.1, 0.02, 0.5])
@pytest.mark.parametrize("limit", [1_000_003, 11_508_926, 777_777])
def test_with_a_margin_the_bisection_stops_within_a_tenth_of_it(limit: int, margin: float) -> None:
    # The README's step on the CPU bisected 23 times to 11,508,926 (a trial near the
    # bound writes gigabytes); a 10% margin hides any difference under 1%.
    share = Fraction(str(margin))  # 0.1 as the decimal it is written as
    step = Step(limit)
    answer = dk.find_batch_size(step, margin=margin)
    ran, failed = _bisection(step, share / 10)
    # The answer is a size that ran, less the margin, and the first size that failed
    # (twice) is at most a tenth of the margin above it.
    assert answer == math.floor(ran * (1 - share))
    assert ran < failed <= ran * (1 + share / 10)
    assert step.calls.count(failed) == 2
    # Doubling to the first failure, then one step per halving to a tenth of the margin.
    bisections = math.ceil(math.log2(10 / margin))
    assert len(set(step.calls)) <= limit.bit_length() + 1 + bisections
    exact = Step(limit)
    dk.find_batch_size(exact)
    assert len(set(step.calls)) < len(set(exact.calls)) - 5  # fewer trials than the exact search


def test_without_a_margin_the_search_is_exact_at_any_size() -> None:
    step = Step(11_508_926)
    assert dk.find_batch_size(step) == 11_508_926  # margin=0: nothing hides a difference
    assert dk.find_batch_size(Step(11_508_926), margin=0.0) == 11_508_926
    assert _bisection(step, Fraction(0)) == (11_508_926, 11_508_927)
    # Small sizes are exact with a margin too: a tenth of 10% of 48 is under one.
    assert dk.find_batch_size(Step(48), margin=0.1) == math.floor(48 * Fraction(9, 10))


def test_max_size_and_a_margin() -> None:
    # max_size ran: no bisection, and the margin comes off it.
    step = Step(10**6)
    assert dk.find_batch_size(step, max_size=600_000, margin=0.1) == 540_000
    assert max(step.calls) == 600_000
    assert all(step.calls.count(size) == 1 for size in step.calls)  # nothing failed
    # max_size failed: it is the first size that failed, and the bisection below it stops
    # within a tenth of the margin.
    step = Step(650_000)
    answer = dk.find_batch_size(step, max_size=700_000, margin=0.1)
    ran, failed = _bisection(step, Fraction(1, 100))
    assert max(step.calls) == 700_000
    assert ran < failed <= ran * Fraction(101, 100)
    assert answer == math.floor(ran * Fraction(9, 10))
    # Without a margin, exact below max_size as before.
    assert dk.find_batch_size(Step(650_000), max_size=700_000) == 650_000


def test_start_is_where_it_begins() -> None:
    step = Step(48)
    assert dk.find_batch_size(step, start=5) == 48
    assert step.calls[:3] == [5, 10, 20]
    assert min(step.calls) == 5


def test_a_start_that_fails_says_so_with_the_report() -> None:
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught:
        dk.find_batch_size(Step(3), start=4)
    error = caught.value
    assert isinstance(error, torch.OutOfMemoryError)
    message = str(error)
    assert message.startswith("find_batch_size: fn(4) ran out of memory, so even start=4 does")
    assert "cuda:0 is out of memory, asked for 2.00 GiB" in message
    assert "fixes, most promising first:" in message
    assert error.report is not None
    assert error.report.requested == 2 * 2**30
    assert "Pass a smaller start, or free memory first" in message
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught:
        dk.find_batch_size(Step(0))  # start=1 cannot be made smaller: no such advice
    assert "so even start=1 does not fit. Free memory first" in str(caught.value)
    assert "smaller start" not in str(caught.value)
    # T45: its fixes said "dk.find_batch_size(fn) finds the largest batch", from inside it.
    assert "find_batch_size(fn) finds" not in str(caught.value)
    assert "Use a smaller batch" in str(caught.value)


class MyOOM(torch.OutOfMemoryError):
    """A user's own out-of-memory class, with an attribute of its own."""

    def __init__(self, message: str, *, budget: int) -> None:
        super().__init__(message)
        self.budget = budget


def my_oom_step(batch_size: int) -> None:
    """Fails above 2 with the user's own class (importable: isolated children run it)."""
    if batch_size > 2:
        raise MyOOM(TORCH_OOM, budget=batch_size)


@pytest.mark.parametrize("isolate", [False, True])
def test_a_start_that_fails_keeps_the_user_s_error_class(isolate: bool) -> None:
    # `except MyOOM` around the search still catches "even start does not fit".
    with pytest.raises(MyOOM) as caught:
        dk.find_batch_size(my_oom_step, start=3, isolate=isolate)
    error = caught.value
    assert isinstance(error, dk.DeviceOutOfMemoryError)
    assert error.budget == 3
    assert str(error).startswith("find_batch_size: fn(3) ran out of memory, so even start=3")
    assert str(error).endswith(f"original message: {TORCH_OOM}")
    assert error.report is not None


def test_a_start_that_runs_out_of_host_memory_is_a_memory_error_too() -> None:
    with pytest.raises(MemoryError) as caught:
        dk.find_batch_size(host_memory_step, start=3)
    assert isinstance(caught.value, dk.DeviceOutOfMemoryError)
    assert str(caught.value).startswith("find_batch_size: fn(3) ran out of memory")


def test_other_errors_are_the_caller_s() -> None:
    def step(batch_size: int) -> None:
        if batch_size > 4:
            raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes do not match"):
        dk.find_batch_size(step)


def test_a_runtime_error_that_only_mentions_memory_is_the_caller_s() -> None:
    # Not torch's words: a size too big would end the search early on a bug of fn's.
    calls: list[int] = []

    def step(batch_size: int) -> None:
        calls.append(batch_size)
        if batch_size > 4:
            raise RuntimeError("expected scalar type Float but found Half (out of memory budget)")

    with pytest.raises(RuntimeError, match=r"found Half \(out of memory budget\)") as caught:
        dk.find_batch_size(step)
    assert not isinstance(caught.value, torch.OutOfMemoryError)
    assert calls == [1, 2, 4, 8]  # raised at once, not tried again as too big


def test_meta_is_refused_nothing_runs_out_of_memory_there() -> None:
    step = Step(48)
    with pytest.raises(ValueError, match=r"device='meta', where tensors have shapes but no memory"):
        dk.find_batch_size(step, device="meta")
    with pytest.raises(ValueError, match=r"pass the device fn's step runs on"):
        dk.find_batch_size(step, device=torch.device("meta"))
    assert step.calls == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_an_error_of_fn_s_own_says_which_size_raised_it() -> None:
    def step(batch_size: int) -> None:
        if batch_size > 4:
            raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes do not match") as caught:
        dk.find_batch_size(step)
    assert caught.value.__notes__ == ["devicekit.find_batch_size: fn(8) raised this"]


def test_a_function_that_always_fits_is_refused() -> None:
    with pytest.raises(RuntimeError, match="does not seem to use memory in proportion"):
        dk.find_batch_size(lambda batch_size: None, start=2**30)


def test_the_failed_trial_s_tensors_are_dropped() -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    def step(batch_size: int) -> None:
        activations = torch.ones(batch_size, 1000)
        made.append(weakref.ref(activations))
        if batch_size > 24:
            raise torch.OutOfMemoryError(TORCH_OOM)

    assert dk.find_batch_size(step) == 24
    assert len(made) > 5
    assert all(ref() is None for ref in made)  # not even the failed trials' locals survive


def test_arguments_are_checked() -> None:
    step = Step(4)
    with pytest.raises(TypeError, match="fn must be callable"):
        dk.find_batch_size(4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start must be an int >= 1, got 0"):
        dk.find_batch_size(step, start=0)
    with pytest.raises(
        ValueError, match="max_size must be an int >= 4, got 3; pass max_size >= st"
    ):
        dk.find_batch_size(step, start=4, max_size=3)
    for margin in (1, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"margin must be a finite number >= 0 and < 1, got"):
            dk.find_batch_size(step, margin=margin)
    for margin in (True, "0.1"):
        with pytest.raises(TypeError, match=r"margin must be a finite number >= 0 and < 1, got"):
            dk.find_batch_size(step, margin=margin)  # type: ignore[arg-type]
    with pytest.raises(dk.DeviceNotFoundError):
        dk.find_batch_size(step, device="cuda:9")
    with pytest.raises(TypeError, match="must be picklable"):
        dk.find_batch_size(lambda n: None, isolate=True)
    with pytest.raises(ValueError, match=r"trial_timeout=5 needs isolate=True: a trial in this"):
        dk.find_batch_size(step, trial_timeout=5)
    for timeout in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="trial_timeout must be a finite number of seconds"):
            dk.find_batch_size(step, isolate=True, trial_timeout=timeout)
    with pytest.raises(TypeError, match="trial_timeout must be a number of seconds, got '5'"):
        dk.find_batch_size(step, isolate=True, trial_timeout="5")  # type: ignore[arg-type]
    assert step.calls == []


class FlakyStep(Step):
    """Like `Step`, but ``fail_once`` sizes run out of memory on their first try only."""

    def __init__(self, limit: int, fail_once: set[int]) -> None:
        super().__init__(limit)
        self.fail_once = set(fail_once)

    def __call__(self, batch_size: int) -> None:
        if batch_size in self.fail_once:
            self.fail_once.discard(batch_size)
            self.calls.append(batch_size)
            raise torch.OutOfMemoryError(TORCH_OOM)
        super().__call__(batch_size)


def test_a_size_that_fails_once_is_tried_again_and_reported() -> None:
    # Without the second try the doubling ends at 64 and the answer is 63, not 100.
    step = FlakyStep(100, fail_once={64, 96})
    with pytest.warns(RuntimeWarning) as caught:
        assert dk.find_batch_size(step) == 100
    (warning,) = caught
    assert str(warning.message).startswith(
        "find_batch_size: fn(64), fn(96) ran out of memory and then ran on a second try, so "
        "memory near the limit is not steady here"
    )
    assert "(the largest that ran: 100)" in str(warning.message)
    assert "pass margin= (0.1 keeps 10% free)" in str(warning.message)
    assert warning.filename == __file__  # it points at the caller's line


def test_a_start_that_fails_once_is_tried_again() -> None:
    with pytest.warns(RuntimeWarning, match=r"fn\(4\) ran out of memory and then ran"):
        assert dk.find_batch_size(FlakyStep(20, fail_once={4}), start=4) == 20


def test_a_real_host_allocation_failure_counts_as_too_big() -> None:
    def step(batch_size: int) -> None:
        if batch_size > 12:
            bytearray(2**62)  # a real failed allocation of the host's memory: 4 EiB

    def torch_step(batch_size: int) -> None:  # torch's CPU allocator: a RuntimeError
        torch.empty(2**62 if batch_size > 5 else 8, dtype=torch.uint8)

    assert dk.find_batch_size(torch_step, device="cpu") == 5
    assert dk.find_batch_size(step) == 12  # Python's MemoryError
    with pytest.raises(dk.DeviceOutOfMemoryError) as caught:
        dk.find_batch_size(step, start=13)
    error = caught.value
    assert str(error).startswith("find_batch_size: fn(13) ran out of memory, so even start=13")
    assert isinstance(error.__cause__, MemoryError)
    assert error.report is not None
    assert error.report.device == "cpu"  # the host's memory ran out, not a GPU's


def test_a_step_that_explains_its_own_oom_is_searched_like_any_other() -> None:
    # @dk.explain_oom on the step turns each out-of-memory error into a
    # DeviceOutOfMemoryError: that is a size too big, not "even start does not fit".
    step = dk.explain_oom(Step(48))
    assert dk.find_batch_size(step) == 48
    with pytest.raises(dk.DeviceOutOfMemoryError, match=r"^find_batch_size: fn\(64\) ran out"):
        dk.find_batch_size(step, start=64)


# --- in child processes -----------------------------------------------------------------


def isolated_step(batch_size: int) -> None:
    """Runs only in a child: fails above 5, and refuses to run in the test's own process."""
    if os.environ.get("DK_TEST_PARENT") == str(os.getpid()):
        raise AssertionError("a trial ran in the parent")
    if batch_size > 5:
        raise torch.OutOfMemoryError(TORCH_OOM)
    if batch_size == 3:
        raise KeyError("three is not allowed")


def host_memory_step(batch_size: int) -> None:
    """Runs out of the host's memory (a real MemoryError) above 2."""
    if batch_size > 2:
        bytearray(2**62)


def hanging_step(batch_size: int) -> None:
    """Runs only in a child: from 4 up it writes its pid where the test reads it, and hangs."""
    if batch_size >= 4:
        with open(os.environ["DK_TEST_PID_FILE"], "w") as file:
            file.write(str(os.getpid()))
        time.sleep(3600)


def dying_step(batch_size: int) -> None:
    """Runs only in a child: from 4 up it ends its process as ``DK_TEST_DEATH`` says."""
    if batch_size < 4:
        return
    death = os.environ["DK_TEST_DEATH"]
    if death == "exit":
        os._exit(3)
    if death == "closed":  # closes the pipe to the parent, and lives on
        with open(os.environ["DK_TEST_PID_FILE"], "w") as file:
            file.write(str(os.getpid()))
        os.closerange(3, 4096)
        time.sleep(3600)
    os.kill(os.getpid(), getattr(signal, death))


def test_isolate_in_a_script_without_a_main_guard_says_to_add_one(tmp_path: Path) -> None:
    # Before: each spawned child ran the script's call again while importing it,
    # multiprocessing refused ("bootstrapping phase", a long traceback), and the
    # error said only "exited with code 1 ... its stderr may say why".
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import devicekit as dk\n"
        "from tests.test_batchsize import isolated_step\n"
        "try:\n"
        "    dk.find_batch_size(isolated_step, max_size=4, isolate=True)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    result = run_python_args([str(script)], cwd=tmp_path, timeout=240)  # it must exit 0
    assert result.stdout.startswith(
        "find_batch_size: the child process running fn(1) stopped while importing the main "
        "module, because the script calls find_batch_size(isolate=True) at import time. "
    ), result.stdout
    assert 'under `if __name__ == "__main__":`' in result.stdout
    own = [
        line
        for line in result.stderr.splitlines()
        if "NumPy" not in line and "_conversion_method_template" not in line  # torch's own
    ]
    assert own == [line for line in own if line.startswith("devicekit: find_batch_size(")]
    assert "bootstrapping phase" not in result.stderr


def isolate_in_a_daemon(queue: Any) -> None:
    """Runs in a daemonic child: what find_batch_size(isolate=True) raises there."""
    try:
        dk.find_batch_size(isolated_step, max_size=4, isolate=True)
    except Exception as error:  # noqa: BLE001 - sent back whole, whatever it is
        queue.put(f"{type(error).__name__}: {error}")


def test_isolate_in_a_daemonic_process_is_refused_plainly() -> None:
    # Before: multiprocessing's "AssertionError: daemonic processes are not allowed to
    # have children", naming neither find_batch_size nor a fix (a DataLoader worker).
    result = run_python(
        """
        import json, multiprocessing
        from tests.test_batchsize import isolate_in_a_daemon

        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        process = context.Process(target=isolate_in_a_daemon, args=(queue,), daemon=True)
        process.start()
        print(json.dumps(queue.get(timeout=120)))
        process.join(timeout=60)
        """,
        timeout=200,
    )
    assert result.startswith(
        "RuntimeError: find_batch_size(isolate=True) was called in 'SpawnProcess-1', a "
        "daemonic process"
    ), result


def test_an_isolated_child_that_dies_without_an_answer_says_how(tmp_path: Path) -> None:
    # Its end of the pipe closes as it dies: reading that end raised a bare EOFError.
    pid_file = tmp_path / "pid"
    result = run_python(
        f"""
        import json, os, devicekit as dk, devicekit._isolated as isolated
        from tests.test_batchsize import dying_step
        os.environ["DK_TEST_PID_FILE"] = {str(pid_file)!r}
        isolated._EXIT_WAIT = 1.0
        errors = {{}}
        for death, start in [("exit", 1), ("SIGKILL", 4), ("SIGSEGV", 4), ("closed", 4)]:
            os.environ["DK_TEST_DEATH"] = death
            try:
                dk.find_batch_size(dying_step, start=start, isolate=True)
            except Exception as error:
                errors[death] = f"{{type(error).__name__}}: {{error}}"
        print(json.dumps(errors))
        """,
        timeout=280,
    )
    died = "RuntimeError: find_batch_size: the child process running fn(4)"
    assert result["exit"] == (
        f"{died} exited with code 3 before it sent a result: fn, or something it called, "
        "ended the process (sys.exit(), os._exit()), or the child failed to start; its "
        "stderr may say why"
    )
    assert result["SIGKILL"].startswith(
        f"{died} was killed by SIGKILL (exit code -9) before it sent a result: a host out "
        "of memory ends a process with SIGKILL"
    )
    assert result["SIGSEGV"].startswith(
        f"{died} was killed by SIGSEGV (exit code -11) before it sent a result: a crash in "
        "native code"
    )
    assert result["closed"].startswith(
        f"{died} closed its end of the pipe without sending a result, and was still running "
        "1 s later, so it was killed"
    )
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no orphan left behind
        os.kill(child, 0)


def test_a_hung_isolated_trial_is_killed_at_its_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    result = run_python(
        f"""
        import json, os, devicekit as dk
        from tests.test_batchsize import hanging_step
        os.environ["DK_TEST_PID_FILE"] = {str(pid_file)!r}
        try:
            dk.find_batch_size(hanging_step, isolate=True, trial_timeout=2)
        except TimeoutError as error:
            print(json.dumps({{"error": str(error)}}))
        """,
        timeout=120,
    )
    assert result["error"].startswith(
        "find_batch_size: fn(4) ran longer than trial_timeout=2 s in its child process, which "
        "was killed"
    )
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no orphan left behind
        os.kill(child, 0)


def test_ctrl_c_during_an_isolated_trial_stops_its_child_at_once(tmp_path: Path) -> None:
    # A Ctrl-C that reaches this process alone: the parent never waits on a live child. It
    # is stopped as gpu_map's workers are (SIGTERM, then SIGKILL if it lingers).
    pid_file = tmp_path / "pid"
    result = run_python(
        f"""
        import _thread, json, os, threading, time
        from multiprocessing.process import BaseProcess
        import devicekit as dk
        from tests.test_batchsize import hanging_step
        os.environ["DK_TEST_PID_FILE"] = {str(pid_file)!r}
        calls = []
        real_start, real_join = BaseProcess.start, BaseProcess.join
        real_kill, real_terminate = BaseProcess.kill, BaseProcess.terminate
        def start(self):
            calls.append("start")
            return real_start(self)
        def join(self, timeout=None):
            calls.append("join")
            return real_join(self, timeout)
        def kill(self):
            calls.append("kill")
            return real_kill(self)
        def terminate(self):
            calls.append("terminate")
            return real_terminate(self)
        BaseProcess.start, BaseProcess.join, BaseProcess.kill = start, join, kill
        BaseProcess.terminate = terminate
        def interrupt():
            while not os.path.exists({str(pid_file)!r}):
                time.sleep(0.05)
            _thread.interrupt_main()
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            dk.find_batch_size(hanging_step, isolate=True)
        except KeyboardInterrupt:
            print(json.dumps({{"calls": calls}}))
        """,
        timeout=120,
    )
    calls = result["calls"]
    last_trial = calls[len(calls) - calls[::-1].index("start") - 1 :]
    assert last_trial[:2] == ["start", "terminate"]  # not a join (up to 10 s) on a live child
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no orphan left behind
        os.kill(child, 0)


def spawning_step(batch_size: int) -> None:
    """Runs only in a child: from 4 up it starts ``sleep``, writes both PIDs, and hangs."""
    if batch_size >= 4:
        sleeper = subprocess.Popen(["sleep", "300"])
        pid_file = os.environ["DK_TEST_PID_FILE"]
        with open(f"{pid_file}.part", "w") as file:
            file.write(f"{os.getpid()} {sleeper.pid}")
        os.replace(f"{pid_file}.part", pid_file)  # whole, never read half-written
        time.sleep(300)


def _trial_pids(pid_file: Path) -> list[int]:
    """The PIDs `spawning_step` wrote: its child's, then its ``sleep``'s; [] if none yet."""
    return [int(pid) for pid in pid_file.read_text().split()] if pid_file.exists() else []


def _end_leftovers(pids: list[int]) -> None:
    """Kill what a failed test left running (only the processes the test's own steps started)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")


@needs_proc
@pytest.mark.parametrize("end", ["trial_timeout", "ctrl-c"])
def test_what_fn_started_in_an_isolated_trial_is_stopped_with_it(tmp_path: Path, end: str) -> None:
    # Before, the child was killed and its `sleep` lived on with PPID 1, holding the
    # caller's stdout: `python script.py | tail` hung until it ended.
    pid_file = tmp_path / "pids"
    try:
        result = run_python(
            f"""
            import _thread, json, os, threading, time, devicekit as dk
            from tests.test_batchsize import spawning_step
            os.environ["DK_TEST_PID_FILE"] = {str(pid_file)!r}
            def interrupt():
                while not os.path.exists({str(pid_file)!r}):
                    time.sleep(0.05)
                _thread.interrupt_main()
            if {end!r} == "ctrl-c":
                threading.Thread(target=interrupt, daemon=True).start()
            try:
                dk.find_batch_size(spawning_step, isolate=True,
                                   trial_timeout=2 if {end!r} == "trial_timeout" else None)
            except (TimeoutError, KeyboardInterrupt) as error:
                print(json.dumps({{"error": type(error).__name__}}))
            """,
            timeout=60,  # the old code hung here: the orphan sleep held its stdout
        )
        assert result["error"] == (
            "TimeoutError" if end == "trial_timeout" else "KeyboardInterrupt"
        )
        pids = _trial_pids(pid_file)
        assert len(pids) == 2
        assert wait_for(lambda: not any(map(alive, pids)), 10), "fn's sleep outlived its trial"
    finally:
        _end_leftovers(_trial_pids(pid_file))


def detaching_step(batch_size: int) -> None:
    """Runs only in a child: starts ``sleep``, writes both PIDs, and returns at once."""
    sleeper = subprocess.Popen(["sleep", "300"])
    pid_file = os.environ["DK_TEST_PID_FILE"]
    with open(f"{pid_file}.part", "w") as file:
        file.write(f"{os.getpid()} {sleeper.pid}")
    os.replace(f"{pid_file}.part", pid_file)


@needs_proc
def test_what_fn_started_in_a_trial_that_ended_well_is_stopped_with_it(tmp_path: Path) -> None:
    # Before, only a trial cut short stopped them: one that returned left its `sleep`
    # with PPID 1, and `python script.py | tail` hung on it.
    pid_file = tmp_path / "pids"
    try:
        result = run_python(
            f"""
            import json, os, devicekit as dk
            from tests.test_batchsize import detaching_step
            os.environ["DK_TEST_PID_FILE"] = {str(pid_file)!r}
            size = dk.find_batch_size(detaching_step, isolate=True, device="cpu", max_size=1)
            print(json.dumps({{"size": size}}))
            """,
            timeout=60,  # the old code hung here: the orphan sleep held its stdout
        )
        assert result["size"] == 1
        pids = _trial_pids(pid_file)
        assert len(pids) == 2
        assert wait_for(lambda: not any(map(alive, pids)), 10), "fn's sleep outlived its trial"
    finally:
        _end_leftovers(_trial_pids(pid_file))


@needs_proc
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_caller_s_trial_child_ends_with_it(tmp_path: Path, signum: int) -> None:
    # Before, the child lived on with PPID 1 (for ever where fn hangs and no trial_timeout
    # is set), and so did what fn had started in it. gpu_map's workers end with their
    # caller; a trial's child now does the same, by the same code.
    pid_file = tmp_path / "pids"
    script = """
        import devicekit as dk
        from tests.test_batchsize import spawning_step
        dk.find_batch_size(spawning_step, isolate=True)
        """
    env = importable(DK_TEST_PID_FILE=str(pid_file))
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env)
    try:
        assert wait_for(lambda: len(_trial_pids(pid_file)) == 2, 100), "no trial started fn"
        child, sleeper = _trial_pids(pid_file)
        caller.send_signal(signum)
        assert caller.wait(timeout=60) == -signum  # it died of the signal, as without devicekit
        assert wait_for(lambda: not alive(child), 15), "the trial's child outlived its caller"
        if signum == signal.SIGTERM:  # a SIGKILL runs no code: fn's sleep is left, as gpu_map's
            assert wait_for(lambda: not alive(sleeper), 10), "fn's sleep outlived its caller"
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait(timeout=30)
        _end_leftovers(_trial_pids(pid_file))


def test_an_isolated_trial_s_memory_error_counts_as_too_big() -> None:
    result = run_python(
        """
        import json, devicekit as dk
        from tests.test_batchsize import host_memory_step
        found = dk.find_batch_size(host_memory_step, start=2, max_size=3, isolate=True)
        try:
            dk.find_batch_size(host_memory_step, start=3, isolate=True)
        except dk.DeviceOutOfMemoryError as error:
            started = [str(error).splitlines()[0], error.report.device]
        print(json.dumps({"found": found, "start": started}))
        """,
        timeout=280,
    )
    assert result["found"] == 2
    assert result["start"][0].startswith("find_batch_size: fn(3) ran out of memory, so even")
    assert result["start"][1] == "cpu"  # the child's report of its host memory crossed back


def _load_slowly() -> Callable[[int], None]:
    time.sleep(float(os.environ["DK_TEST_LOAD_SECONDS"]))
    return isolated_step


class SlowToLoad:
    """Loads in the child only after a sleep: a stand-in for fn's module being slow to import."""

    def __call__(self, batch_size: int) -> None:
        raise AssertionError("only the loaded function runs")

    def __reduce__(self) -> tuple[Callable[[], Callable[[int], None]], tuple[()]]:
        return (_load_slowly, ())


def test_the_trial_timeout_counts_from_fn_not_from_the_child_s_start() -> None:
    result = run_python(
        """
        import json, os, devicekit as dk, devicekit._isolated as isolated
        from tests.test_batchsize import SlowToLoad
        os.environ["DK_TEST_LOAD_SECONDS"] = "2.5"
        found = dk.find_batch_size(SlowToLoad(), max_size=2, isolate=True, trial_timeout=1)
        isolated._START_LIMIT = 1.0  # a child that never finishes starting is killed too
        try:
            dk.find_batch_size(SlowToLoad(), max_size=2, isolate=True, trial_timeout=1)
        except TimeoutError as error:
            print(json.dumps({"found": found, "error": str(error)}))
        """,
        timeout=120,
    )
    assert result["found"] == 2  # each child took 2.5 s to load fn, longer than the timeout
    assert result["error"].startswith(
        "find_batch_size: the child process for fn(1) did not start within 1 s"
    )


def test_isolated_trials_run_in_children() -> None:
    result = run_python(
        """
        import json, os, torch, devicekit as dk
        from tests.test_batchsize import isolated_step
        os.environ["DK_TEST_PARENT"] = str(os.getpid())
        found = dk.find_batch_size(isolated_step, start=5, max_size=6, isolate=True)
        try:
            dk.find_batch_size(isolated_step, start=6, isolate=True)
        except dk.DeviceOutOfMemoryError as error:
            started = [str(error).splitlines()[0], error.report.requested]
        try:
            dk.find_batch_size(isolated_step, start=3, max_size=3, isolate=True)
        except RuntimeError as error:
            other = str(error)
            notes = getattr(error.__cause__, "__notes__", None)
        print(json.dumps({"found": found, "start": started, "other": other, "notes": notes,
                          "cuda": torch.cuda.is_initialized()}))
        """,
        timeout=280,
    )
    assert result["found"] == 5
    assert result["start"][0].startswith("find_batch_size: fn(6) ran out of memory")
    assert result["start"][1] == 2 * 2**30  # the child's report crossed back
    assert "raised in its child process" in result["other"]
    assert "KeyError: 'three is not allowed'" in result["other"]
    if sys.version_info >= (3, 11):  # fn's own error crossed back with its note, in both
        assert (
            "'three is not allowed'\ndevicekit.find_batch_size: fn(3) raised this\n"
            in (result["other"])
        )
        assert result["notes"] == ["devicekit.find_batch_size: fn(3) raised this"]
    assert result["cuda"] is False


_RANKS = """
import datetime, json, os, sys, torch, torch.distributed as dist, devicekit as dk

def step(limit):
    def run(batch_size):
        if batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    return run

def rank_main(rank, port, out, limits):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    answers = []
    for limit in limits[rank]:  # one search per scenario, in the same process group
        try:
            answers.append(dk.find_batch_size(step(limit), start=4))
        except Exception as error:
            answers.append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(answers, file)
    dist.destroy_process_group()

if __name__ == "__main__":
    port, out = int(sys.argv[1]), sys.argv[2]
    limits = json.loads(sys.argv[3])
    torch.multiprocessing.spawn(rank_main, args=(port, out, limits), nprocs=2, join=True)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_rank_gets_the_same_answer_on_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    # Rank 0 fits up to 48, rank 1 up to 20; then rank 1 cannot even fit start=4.
    limits = [[48, 48], [20, 2]]
    completed = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(tmp_path), json.dumps(limits)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first[0] == second[0] == 20  # the minimum over ranks
    assert second[1].startswith("DeviceOutOfMemoryError: find_batch_size: fn(4) ran out of")
    assert first[1] == (
        "RuntimeError: find_batch_size: rank 1 failed (its own error says why), so no "
        "batch size is common to every rank"
    )


# --- on a GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_real_allocations_leave_the_allocator_where_it_was() -> None:
    step_bytes = 2**30
    keep = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    free, _ = torch.cuda.mem_get_info()

    def step(batch_size: int) -> None:
        half = torch.empty(batch_size * step_bytes // 2, dtype=torch.uint8, device="cuda")
        other = torch.empty(batch_size * step_bytes // 2, dtype=torch.uint8, device="cuda")
        (half[:1] + other[:1]).sum()  # the failed trial dies with `half` alive in its frame

    found = dk.find_batch_size(step)
    assert abs(torch.cuda.memory_reserved() - before) <= 2 * 2**20
    assert found <= free // step_bytes
    assert found >= free // step_bytes - 2  # what the driver keeps for itself, at most
    # And the next real step at that size runs: nothing was left behind.
    step(found)
    del keep


@pytest.mark.gpu
def test_isolated_trials_never_touch_this_process_s_allocator() -> None:
    result = run_python(
        """
        import json, torch, devicekit as dk
        from tests.test_batchsize import gpu_step
        found = dk.find_batch_size(gpu_step, isolate=True, max_size=1024)
        print(json.dumps({"found": found, "cuda": torch.cuda.is_initialized()}))
        """,
        timeout=500,
    )
    assert result["found"] >= 1
    assert result["cuda"] is False  # the parent never even started CUDA


def gpu_step(batch_size: int) -> None:
    torch.empty(batch_size * 2**30, dtype=torch.uint8, device="cuda")


def test_a_step_whose_body_never_runs_is_refused() -> None:
    # A generator's or coroutine's body runs only when consumed: called as a step, it
    # would "fit" at every size, and the answer would be max_size, never measured.
    ran: list[int] = []

    def generator_step(batch_size: int) -> Iterator[None]:
        ran.append(batch_size)
        yield

    async def async_step(batch_size: int) -> None:
        ran.append(batch_size)

    for step in (generator_step, async_step):
        with pytest.raises(TypeError, match=r"fn\(batch_size\) returns a (generator|coroutine) wi"):
            dk.find_batch_size(step, max_size=8)

    def looks_plain(batch_size: int) -> Iterator[None]:
        return generator_step(batch_size)

    # One that looks plain is caught at its first call, before a size is trusted.
    with pytest.raises(TypeError, match=r"fn\(1\) returns a generator without running its bo"):
        dk.find_batch_size(looks_plain, max_size=8)
    assert ran == []


def test_isolate_must_be_a_bool() -> None:
    # isolate="no" is truthy: it would run every trial in a child process.
    with pytest.raises(TypeError, match="isolate must be True or False, got 'no' of type str"):
        dk.find_batch_size(Step(4), isolate="no")  # type: ignore[arg-type]


def test_a_start_past_the_ceiling_is_still_doubled_before_it_is_called_unbounded() -> None:
    step = Step(limit=3 * 2**40)  # fits up to 3 Ti "items": a start of 2**40 finds 2 * 2**40
    assert dk.find_batch_size(step, start=2**40) == 3 * 2**40
    with pytest.raises(RuntimeError, match=rf"fn\({2**71}\) still fit"):
        dk.find_batch_size(lambda batch_size: None, start=2**40)


def test_a_step_that_keeps_memory_across_calls_is_warned_about() -> None:
    kept: list[torch.Tensor] = []  # what the step leaks: each call's "activations"

    def leaky(batch_size: int) -> None:
        if sum(t.numel() for t in kept) + batch_size > 1000:  # a device of 1000 elements
            raise torch.OutOfMemoryError(TORCH_OOM)
        kept.append(torch.ones(batch_size))

    with pytest.warns(RuntimeWarning, match="fn keeps memory from one call to the next"):
        found = dk.find_batch_size(leaky)
    assert found < 1000  # the answer the leak shrank, now with the warning that says so


def test_a_step_that_keeps_state_made_once_is_not_warned_about() -> None:
    state: list[torch.Tensor] = []  # like optimizer state: made by the first call, then reused

    def step(batch_size: int) -> None:
        if not state:
            state.append(torch.ones(1000))
        torch.ones(batch_size).sum()
        if batch_size > 40:
            raise torch.OutOfMemoryError(TORCH_OOM)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dk.find_batch_size(step) == 40


@pytest.mark.gpu
def test_a_kept_graph_on_the_gpu_is_warned_about() -> None:
    # Only CUDA's allocated bytes see it: the kept losses are 4-byte tensors, their
    # graphs (the saved activations) are held by no Python tensor.
    weight = torch.ones(1024, 1024, device="cuda", requires_grad=True)
    losses: list[torch.Tensor] = []

    def step(batch_size: int) -> None:
        inputs = torch.ones(batch_size * 64, 1024, device="cuda")
        losses.append(torch.tanh(inputs @ weight).sum())  # keeps each step's activations

    with pytest.warns(RuntimeWarning, match="fn keeps memory from one call to the next"):
        dk.find_batch_size(step, max_size=64)
    losses.clear()


# --- the CPU: bounded by the host's free memory ------------------------------------------

LINUX = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the host's bound is Linux's RLIMIT_AS"
)
MiB = 2**20


def _little_memory(monkeypatch: pytest.MonkeyPatch, available: int) -> int:
    """Make the machine report ``available`` bytes free; return the address space held now."""
    from devicekit import _hostmemory

    monkeypatch.setattr(_hostmemory, "meminfo", lambda: (64 * 2**30, available))
    _hostmemory._start_threads()  # their stacks and heaps count in what is held from here on
    held = _hostmemory._address_space()
    assert held is not None
    return held


class HostStep:
    """Writes ``batch_size`` MiB on the CPU, noting the soft RLIMIT_AS it ran under.

    Past ``cap`` MiB it raises instead: a safety net, so that a search that is not
    bounded fails the test without taking the machine's memory.
    """

    def __init__(self, cap: int = 512) -> None:
        self.cap = cap
        self.limits: list[int] = []

    def __call__(self, batch_size: int) -> None:
        import resource

        self.limits.append(resource.getrlimit(resource.RLIMIT_AS)[0])
        if batch_size > self.cap:
            raise AssertionError(f"fn({batch_size}) was called: the search was not bounded")
        torch.ones(batch_size, 2**18)  # batch_size MiB, written


@LINUX
@pytest.mark.filterwarnings("ignore:find_batch_size")  # a size that fails once may be near it
@pytest.mark.parametrize("device", ["cpu", None])
def test_on_the_cpu_the_search_stops_at_the_memory_available(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator, device: str | None
) -> None:
    import resource

    fake_accelerator(None, 0)  # device=None: torch here has no accelerator, so the CPU
    gc.collect()  # what earlier tests left: freed by the search, it would widen the room
    held = _little_memory(monkeypatch, 384 * MiB)  # 128 MiB above the 256 MiB reserve
    before = resource.getrlimit(resource.RLIMIT_AS)
    step = HostStep()
    found = dk.find_batch_size(step, device=device)
    # About 128 MiB: the bound is on the address space, which other mappings (the
    # threads' stacks and heaps, what the allocator gives back) move by some MiB.
    assert 16 <= found <= 256  # unbounded, fn(1024) would have raised
    assert all(0 < limit <= held + 384 * MiB for limit in step.limits)  # all under the bound
    assert resource.getrlimit(resource.RLIMIT_AS) == before  # and the old limit is back


@LINUX
@pytest.mark.parametrize("ending", ["error", "KeyboardInterrupt", "SIGINT"])
def test_the_old_limit_comes_back_however_fn_ends(
    monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    import resource

    held = _little_memory(monkeypatch, 512 * MiB)
    before = resource.getrlimit(resource.RLIMIT_AS)
    inside: list[int] = []

    def step(batch_size: int) -> None:
        inside.append(resource.getrlimit(resource.RLIMIT_AS)[0])
        if batch_size == 4:
            if ending == "error":
                raise ValueError("fn's own error")
            if ending == "SIGINT":  # a real Ctrl-C: the signal, then the handler's raise
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            raise KeyboardInterrupt

    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(ValueError if ending == "error" else KeyboardInterrupt):
            dk.find_batch_size(step, device="cpu")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert 0 < inside[-1] <= held + 512 * MiB  # lowered while fn ran (unlimited is -1)
    assert resource.getrlimit(resource.RLIMIT_AS) == before


@LINUX
def test_a_lower_ulimit_is_kept_and_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    held = _little_memory(monkeypatch, 8 * 2**30)  # the bound would be past the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mine = held + 2**30 if hard == resource.RLIM_INFINITY else min(held + 2**30, hard)
    inside: list[int] = []
    resource.setrlimit(resource.RLIMIT_AS, (mine, hard))
    try:
        found = dk.find_batch_size(
            lambda n: inside.append(resource.getrlimit(resource.RLIMIT_AS)[0]), max_size=4
        )
        after = resource.getrlimit(resource.RLIMIT_AS)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert found == 4
    assert set(inside) == {mine}  # never raised above what the user set
    assert after == (mine, hard)


def test_where_no_bound_can_be_set_the_cpu_needs_max_size(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")  # no RLIMIT_AS the kernel enforces
    fake_accelerator(None, 0)
    fix = r"needs max_size here, got max_size=None: .* pass max_size=, the largest batch to try"
    with pytest.raises(ValueError, match=fix):
        dk.find_batch_size(Step(48), device="cpu")
    with pytest.raises(ValueError, match=fix):
        dk.find_batch_size(Step(48))  # no accelerator: the trials run on the CPU
    assert dk.find_batch_size(Step(48), max_size=1000) == 48


_README_LINE = """
import json, resource, torch, devicekit as dk
from devicekit import _hostmemory
_hostmemory._start_threads()  # their stacks and heaps count in what is held from here on
held = _hostmemory._address_space()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
# A safety net under the bound being tested: past it even a search with no bound stops.
net = held + 2**30 if hard == resource.RLIM_INFINITY else min(held + 2**30, hard)
resource.setrlimit(resource.RLIMIT_AS, (net, hard))
_hostmemory.meminfo = lambda: (64 * 2**30, 400 * 2**20)  # 144 MiB above the reserve

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
limits = []
def train_step(batch):
    limits.append(resource.getrlimit(resource.RLIMIT_AS)[0])
    out = model(batch["x"] if isinstance(batch, dict) else batch)
    loss = out.pow(2).mean(); loss.backward(); return loss.detach()
def make_batch(n): return {"x": torch.randn(n, 16)}

batch_size = dk.find_batch_size(lambda n: train_step(make_batch(n)), margin=0.1)
print(json.dumps({"found": batch_size, "held": held, "net": net, "highest": max(limits[1:]),
                  "after": resource.getrlimit(resource.RLIMIT_AS)[0]}))
"""


@LINUX
def test_the_readme_line_on_the_cpu_answers_within_the_memory_available() -> None:
    result = run_python(_README_LINE, timeout=280)
    assert result["found"] >= 1
    # Every trial after the first (which tells the CPU on a machine with CUDA) was bounded.
    assert 0 < result["highest"] <= result["held"] + 400 * MiB
    assert result["after"] == result["net"]


def _load_with_little_memory() -> Callable[[int], None]:
    from devicekit import _hostmemory

    _hostmemory.meminfo = lambda: (64 * 2**30, 384 * MiB)  # in the child, before its bound
    return HostStep()


class LittleMemoryStep:
    """A `HostStep` that, loaded in a child, makes the child's machine report 384 MiB free."""

    def __call__(self, batch_size: int) -> None:
        raise AssertionError("only the loaded step runs")

    def __reduce__(self) -> tuple[Callable[[], Callable[[int], None]], tuple[()]]:
        return (_load_with_little_memory, ())


@LINUX
def test_isolated_trials_on_the_cpu_are_bounded_in_their_child() -> None:
    result = run_python(
        """
        import json, devicekit as dk
        from tests.test_batchsize import LittleMemoryStep
        print(json.dumps(dk.find_batch_size(LittleMemoryStep(), start=16, device="cpu",
                                            isolate=True)))
        """,
        timeout=500,
    )
    assert 16 <= result <= 256  # about 128: see the test above


def test_start_max_size_and_margin_of_other_number_types_are_taken() -> None:
    # start=torch.tensor(3) failed in Fraction arithmetic; margin=np.float32 in Fraction().
    numpy = pytest.importorskip("numpy")
    assert dk.find_batch_size(Step(40), start=torch.tensor(3)) == 40
    assert dk.find_batch_size(Step(40), max_size=numpy.int64(20)) == 20
    assert dk.find_batch_size(Step(50), margin=numpy.float32(0.25)) == 37


def test_a_step_that_keeps_memory_is_warned_about_under_explain_oom_too() -> None:
    # Each call builds an out-of-memory report (explain_oom around a failed allocation),
    # whose census used to freeze what the step had kept, so no trial saw it grow.
    kept: list[torch.Tensor] = []

    def leaky(batch_size: int) -> None:
        kept.append(torch.ones(1000))
        with contextlib.suppress(torch.OutOfMemoryError), dk.explain_oom():
            torch.empty(2**62, dtype=torch.uint8)
        if batch_size > 8:
            raise torch.OutOfMemoryError(TORCH_OOM)

    frozen = gc.get_freeze_count()
    with pytest.warns(RuntimeWarning, match="fn keeps memory from one call to the next"):
        assert dk.find_batch_size(leaky) == 8
    assert gc.get_freeze_count() == frozen


# --- restore: what the trials change, put back ------------------------------------------------


def _training_step() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A model, its optimizer, and a step that trains it; sizes above 300 run out of memory."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(size: int) -> None:
        x = torch.randn(size, 8)
        if size > 300:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        model(x).pow(2).mean().backward()
        optimizer.step()

    return model, optimizer, step


def test_restore_puts_back_the_model_the_optimizer_the_gradients_and_the_generator() -> None:
    # T45: the search trained the model (12 Adam steps on random batches), filled the
    # optimizer's state, left gradients and moved the generator on, without a word.
    model, optimizer, step = _training_step()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert dk.find_batch_size(step, restore=[model, optimizer]) == 300
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    # Without it, the trials' steps stay: as documented.
    assert dk.find_batch_size(step) == 300
    assert not all(torch.equal(before[name], t) for name, t in model.state_dict().items())


def test_restore_puts_back_even_when_the_search_fails() -> None:
    model, optimizer, step = _training_step()
    before = [p.clone() for p in model.parameters()]

    def fails_at_64(size: int) -> None:
        step(size)
        if size >= 64:
            raise ValueError("a bug at 64")

    with pytest.raises(ValueError, match="a bug at 64"):
        dk.find_batch_size(fails_at_64, restore=[model, optimizer])
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("restore", "error", "text"),
    [
        (torch.nn.Linear(2, 2).weight, TypeError, r"restore must be a list of objects"),
        ([object()], TypeError, r"restore\[0\] must have state_dict\(\) and load_state_dict\(\)"),
        ("model", TypeError, r"restore must be a list of objects"),
    ],
)
def test_restore_refuses_what_has_no_state(restore: Any, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        dk.find_batch_size(lambda size: None, max_size=4, restore=restore)


def test_restore_is_refused_with_isolate() -> None:
    with pytest.raises(ValueError, match=r"restore= with isolate=True: the trials run in child"):
        dk.find_batch_size(abs, isolate=True, restore=[torch.nn.Linear(2, 2)])


def test_a_margin_given_as_a_numpy_float32_is_read_as_written() -> None:
    # T45: np.float32(0.1) is 0.10000000149 as a float: floor(50 * 0.8999999985) = 44, not 45.
    np = pytest.importorskip("numpy")

    def step(size: int) -> None:
        if size > 50:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    assert dk.find_batch_size(step, margin=np.float32(0.1)) == 45
    assert dk.find_batch_size(step, margin=0.1) == 45


def test_restore_leaves_a_grad_scaler_ready_for_the_next_real_step() -> None:
    # R20: a trial stopped inside scaler.step() left the optimizer marked "unscaled" (outside
    # the scaler's state_dict): the user's next step skipped unscaling, an update 1024x large.
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    size = [0]

    def out_of_memory_past_100(opt: Any, args: Any, kwargs: Any) -> None:
        if size[0] > 100:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    optimizer.register_step_pre_hook(out_of_memory_past_100)

    def step(n: int) -> None:
        size[0] = n
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(n, 8)).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()

    dk.find_batch_size(step, device="cpu", restore=[model, optimizer, scaler], max_size=1024)
    before = model.weight.detach().clone()
    expected = torch.nn.Linear(8, 1)
    expected.load_state_dict(model.state_dict())
    reference = torch.optim.SGD(expected.parameters(), lr=0.1)
    expected(torch.ones(1, 8)).pow(2).mean().backward()
    reference.step()  # the same step, unscaled by hand: what the user's step must do
    step(1)
    assert torch.allclose(model.weight - before, expected.weight - before)


def test_restore_refuses_what_it_could_not_put_back() -> None:
    # R20: a lazy module's state failed to load after a successful search (its answer lost);
    # a state that does not pickle failed with a bare AttributeError.
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"restore\[0\] \(Sequential\) has lazy parameters"):
        dk.find_batch_size(lambda size: None, max_size=4, restore=[lazy])

    class Holder:
        def state_dict(self) -> dict[str, Any]:
            return {"fn": lambda: None}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(TypeError, match=r"restore\[0\] \(Holder\) cannot be saved to be put"):
        dk.find_batch_size(lambda size: None, max_size=4, restore=[Holder()])
