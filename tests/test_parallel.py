from __future__ import annotations

import contextlib
import errno
import gc
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk

from .conftest import CTRL_C_WORKS, GPU_COUNT, FakeAccelerator

REPO = os.path.dirname(os.path.dirname(__file__))


def where(item: int) -> tuple[int, str | None, int]:
    time.sleep(0.3)  # long enough that every worker gets items
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), item


def fail_on_three(item: int) -> int:
    if item == 3:
        raise ValueError(f"bad item {item}")
    return item


def unpicklable_result(item: int) -> object:
    return threading.Lock() if item == 2 else item


def die(item: int) -> int:
    if item == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if item == 2:
        os._exit(3)
    return item


def exit_on_two(item: int) -> int:
    if item == 2:
        sys.exit(0)
    return item


def interrupt_on_two(item: int) -> int:
    if item == 2:
        raise KeyboardInterrupt
    return item


def hang_on_two(item: int) -> int:
    if item == 2:
        time.sleep(60)  # far beyond the test's timeout, well within its subprocess's
    return item * 10


def _fail_to_load() -> None:
    raise RuntimeError("cannot be rebuilt in a worker")


class LoadsBadly:
    """Pickles here; unpickling it (in the worker) raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _fail_to_load, ()


class CallableThatLoadsBadly(LoadsBadly):
    def __call__(self, item: int) -> int:
        return item


def _load_after(seconds: float) -> Callable[[int], int]:
    time.sleep(seconds)  # as a worker importing a heavy module for fn would (or one that hangs)
    return abs


class LoadsAfter:
    """A function whose unpickling (in the worker) takes ``seconds``: 3600 is never."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, item: int) -> int:
        return abs(item)

    def __reduce__(self) -> tuple[Any, ...]:
        return _load_after, (self.seconds,)


class _OnCuda(torch.UntypedStorage):
    """A CPU storage that says it is on cuda:0, so torch pickles it as it pickles a CUDA one.

    ``torch.save`` writes the device it reads here, and unpickling puts the
    storage back there: on a GPU machine that starts CUDA in the caller, on
    this CPU-only torch it raises.
    """

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def storage_on_cuda(item: int) -> torch.storage.TypedStorage:
    """Four bytes of ``item`` in a storage that pickles as a CUDA one."""
    wrapped = _OnCuda(4).fill_(item)
    return torch.storage.TypedStorage(wrap_storage=wrapped, dtype=torch.uint8, _internal=True)


def where_stored(storage: torch.storage.TypedStorage) -> tuple[str, list[int]]:
    untyped = storage._untyped_storage
    return untyped.device.type, untyped.tolist()


def newer_dtypes(item: int) -> list[torch.Tensor]:
    return [torch.full((2,), item, dtype=torch.uint16), torch.ones(2).to(torch.float8_e4m3fn)]


def nested_map(item: int) -> list[int]:
    return dk.gpu_map(abs, [item, -item], devices=["cpu"])


def die_on_two(item: int) -> int:
    if item == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return item


def pid_ignore_sigterm_and_wait(item: int) -> int:
    """Ignore SIGTERM (as some libraries' handlers do), write this worker's PID, stay busy."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return pid_and_wait(item)


def cuda_results(item: int) -> dict[str, Any]:
    import torch

    x = torch.arange(6.0, device="cuda").reshape(2, 3) * item
    return {"x": x, "row": x[1], "weight": torch.nn.Parameter(x.clone()), "device": str(x.device)}


def write_pid(item: int) -> int:
    """Write this worker's PID where the test can see it, and a moment later return."""
    with open(os.path.join(os.environ["DK_TEST_PIDS"], str(os.getpid())), "w") as file:
        file.write(str(item))
    time.sleep(0.5)  # so that the other worker takes the other item
    return item


def pid_and_wait(item: int) -> int:
    """Write this worker's PID where the test can see it, then stay busy."""
    folder = os.environ["DK_TEST_PIDS"]
    with open(os.path.join(folder, str(os.getpid())), "w") as file:
        file.write(str(item))
    time.sleep(120)
    return item


def on_gpu(item: int) -> tuple[int, str, int, str]:
    import torch

    x = torch.randn(512, 512, device=dk.try_gpu())
    (x @ x).sum().item()
    return (
        os.getpid(),
        str(dk.try_gpu()),
        torch.cuda.device_count(),
        str(torch.cuda.get_device_properties(0).uuid),
    )


def test_results_come_back_in_input_order() -> None:
    assert dk.gpu_map(math.sqrt, range(20), devices=["cpu", "cpu", "cpu"]) == [
        math.sqrt(i) for i in range(20)
    ]


def test_empty_input() -> None:
    assert dk.gpu_map(math.sqrt, [], devices=["cpu"]) == []


def test_each_worker_sees_only_its_device(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # the caller's 0 and 1 are GPUs 5 and 7
    fake_accelerator("cuda", 2)
    results = dk.gpu_map(where, range(8), devices=[0, "cuda:1"])
    assert [item for _, _, item in results] == list(range(8))
    by_worker: dict[int, set[str | None]] = {}
    for pid, visible, _ in results:
        by_worker.setdefault(pid, set()).add(visible)
    assert all(len(seen) == 1 for seen in by_worker.values())  # a worker keeps its device
    assert set().union(*by_worker.values()) <= {"5", "7"}
    assert len(by_worker) == 2


def test_cpu_workers_hide_every_gpu() -> None:
    results = dk.gpu_map(where, range(2), devices=["cpu"])
    assert {visible for _, visible, _ in results} == {""}


def test_no_gpu_means_cpu_workers(fake_accelerator: FakeAccelerator) -> None:
    from devicekit import _workerslots

    fake_accelerator(None, 0)
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    assert _workerslots.worker_slots(None, 1) == ["cpu"] * cpus
    assert _workerslots.worker_slots(None, 2) == ["cpu"] * 2 * cpus


def test_cpu_workers_are_as_many_as_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before, os.cpu_count(): a batch job given 2 of a machine's 64 cores got 64 workers.
    fake_accelerator(None, 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    with dk.gpu_pool() as pool:
        assert pool.devices == ["cpu", "cpu"]


def test_an_error_names_the_item_and_carries_the_traceback() -> None:
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(fail_on_three, range(6), devices=["cpu", "cpu"])
    message = str(info.value)
    assert re.match(
        r"gpu_map: fn raised on item 3 \(3\) in worker [12] on the CPU; the worker's traceback:\n",
        message,
    )
    assert "ValueError: bad item 3" in message
    assert "in fail_on_three" in message


def test_an_unpicklable_function_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(TypeError, match=r"gpu_map\(\) sends fn to worker processes, so it must be"):
        dk.gpu_map(lambda x: x, [1], devices=["cpu"])


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"workers_per_device": 0}, ValueError, "workers_per_device must be an int >= 1, got 0"),
        ({"devices": []}, ValueError, "needs at least one device"),
        ({"devices": [-1]}, ValueError, r"devices\[0\] must be a non-negative int"),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dk.gpu_map(math.sqrt, [1], **options)


def test_fn_and_items_are_checked_before_any_worker_starts() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(TypeError, match=r"^gpu_map\(\) needs fn, the function to run on each "):
        dk.gpu_map(None, [1], devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^gpu_map\(\) needs items, an iterable .* got 5 of type int; pass a list"
    ):
        dk.gpu_map(math.sqrt, 5, devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^gpu_pool\(\) needs at least one device, got devices"):
        dk.gpu_pool(devices=[])
    with dk.gpu_pool(devices=["cpu"]) as pool:
        with pytest.raises(TypeError, match=r"^GPUPool.map\(\) needs fn"):
            pool.map("sqrt", [1])  # type: ignore[arg-type]
        assert not pool._workers  # refused before its workers started
    assert set(multiprocessing.active_children()) == before


def test_a_device_beyond_the_visible_ones(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    fake_accelerator("cuda", 1)
    with pytest.raises(
        dk.DeviceNotFoundError,
        match=r"devices\[0\]=1 does not exist: 1 GPU is visible \(CUDA_VISIBLE_DEVICES='3'\)",
    ):
        dk.gpu_map(math.sqrt, [1], devices=[1])


def test_a_gpu_that_does_not_exist_is_refused_without_the_variable_too(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before, devices=[7] was only caught when CUDA_VISIBLE_DEVICES was set;
    # otherwise the worker silently ran on the CPU.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_accelerator("cuda", 2)
    with pytest.raises(dk.DeviceNotFoundError, match=r"devices\[0\]=7 does not exist"):
        dk.gpu_map(math.sqrt, [1], devices=[7])


def test_a_worker_count_no_machine_can_start_is_refused_before_anything_is_built() -> None:
    # Before: gpu_pool(workers_per_device=10**9) built a billion-entry list, then started.
    message = (
        r"^workers_per_device=1000000000 on 2 devices would start 2,000,000,000 worker "
        r"processes, each importing torch; gpu_pool\(\) starts at most 1024\. Use fewer"
    )
    with pytest.raises(ValueError, match=message):
        dk.gpu_pool(devices=["cpu", "cpu"], workers_per_device=10**9)
    with pytest.raises(ValueError, match=r"would start 1,026 worker processes.*gpu_map\(\)"):
        dk.gpu_map(math.sqrt, range(2000), devices=["cpu", "cpu"], workers_per_device=513)
    dk.gpu_pool(devices=["cpu", "cpu"], workers_per_device=512).close()  # 1024: allowed


def test_devices_accept_torch_devices_and_one_string(fake_accelerator: FakeAccelerator) -> None:
    from devicekit import _workerslots

    fake_accelerator("cuda", 2)
    assert _workerslots.worker_slots([torch.device("cuda", 1), "cpu"], 1) == [1, "cpu"]
    assert _workerslots.worker_slots("cpu", 2) == ["cpu", "cpu"]  # one string is one device
    assert _workerslots.worker_slots(torch.device("cuda", 0), 1) == [0]


def test_few_items_spread_over_every_device(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before, slots were device by device ([0, 0, 1, 1]) and gpu_map kept the first
    # len(items): two items ran both on the first GPU while the second sat idle.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    fake_accelerator("cuda", 2)
    results = dk.gpu_map(where, range(2), devices=[0, 1], workers_per_device=2)
    assert sorted(visible or "" for _, visible, _ in results) == ["5", "7"]
    from devicekit import _workerslots

    assert _workerslots.worker_slots([0, 1], 2) == [0, 1, 0, 1]


def test_workers_per_device_beyond_the_items_builds_no_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit import _gpumap, _workerslots

    real_slots = _workerslots.worker_slots
    asked: list[int] = []

    def slots(
        devices: object, workers_per_device: int, *, caller: str = "", most: int | None = None
    ) -> list[str | int]:
        asked.append(workers_per_device)
        # Before, gpu_map built all 10**12 slots (memory, for minutes) to use two.
        assert workers_per_device <= 2, "gpu_map built slots for workers it never starts"
        return real_slots(devices, workers_per_device, caller=caller, most=most)

    monkeypatch.setattr(_gpumap, "worker_slots", slots)  # where gpu_map looks it up
    assert dk.gpu_map(abs, [-1, -2], devices=["cpu"], workers_per_device=10**12) == [1, 2]
    assert asked == [2]


def test_a_failed_start_leaves_no_worker_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit import _dispatch

    real_env = _dispatch.worker_env
    calls: list[str | int] = []

    def env_then_fail(device: str | int) -> str:
        calls.append(device)
        if len(calls) == 2:  # the second worker cannot start (EAGAIN, Ctrl-C...)
            raise OSError("cannot start a process")
        return real_env(device)

    monkeypatch.setattr(_dispatch, "worker_env", env_then_fail)
    with dk.gpu_pool(devices=["cpu", "cpu"]) as pool:
        with pytest.raises(OSError, match="cannot start a process"):
            pool.map(abs, [1, 2])
        # Before, the first worker stayed in the pool, and every later map ran on
        # it alone, one worker short, without a word.
        assert pool._workers == []
        assert not multiprocessing.active_children()
        assert pool.map(where, range(2))
        assert len(pool._workers) == 2


def test_sys_exit_or_keyboard_interrupt_in_fn_is_named_with_its_traceback() -> None:
    # Before, the worker died and the message said only "exited with code 0" (or 1),
    # with the traceback, if any, somewhere on stderr.
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(exit_on_two, [1, 2], devices=["cpu"])
    message = str(info.value)
    assert message.startswith(
        "gpu_map: fn called sys.exit(0) on item 1 (2) in worker 1 on the CPU; fn must return a "
        "result, or raise an Exception to fail its item (SystemExit and KeyboardInterrupt are "
        "not Exceptions). The worker's traceback:\n"
    ), message
    assert "in exit_on_two" in message
    with pytest.raises(
        dk.WorkerError,
        match=r"^gpu_map: fn raised KeyboardInterrupt on item 1 \(2\) in worker 1 on the CPU; "
        r"fn must return a result, or raise an Exception",
    ):
        dk.gpu_map(interrupt_on_two, [1, 2], devices=["cpu"])


def test_an_fn_that_cannot_be_unpickled_in_a_worker_is_named() -> None:
    # Before: "worker 1 exited with code 1 while running item 0. fn must return or
    # raise an Exception", about an fn that never ran.
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(CallableThatLoadsBadly(), [1, 2], devices=["cpu"])
    message = str(info.value)
    assert message.startswith(
        "gpu_map: fn could not be unpickled in worker 1 on the CPU: RuntimeError: cannot be "
        "rebuilt in a worker. A worker finds fn by its module and name, and imports that module: "
        "define fn with def at the top level of a module"
    ), message
    assert "in _fail_to_load" in message  # the worker's traceback


def _importable(**env: str) -> dict[str, str]:
    """This environment, with the repository on ``PYTHONPATH`` and ``env`` on top."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **env}


def _run_python(
    args: list[str],
    *,
    cwd: Any = REPO,
    input: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` with the repository importable and ``env`` set; it must exit 0."""
    result = subprocess.run(
        [sys.executable, *args],
        input=input,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_importable(**(env or {})),
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def _run_in_repo(
    script: str, *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``python -c`` from the repository (its functions importable there)."""
    return _run_python(["-c", script], env=env, timeout=timeout)


def test_an_fn_defined_in_python_c_is_named_as_not_importable() -> None:
    # What a notebook or `python -c` gives: fn pickles by reference to __main__,
    # which a spawned worker cannot import.
    script = textwrap.dedent(
        """
        import devicekit as dk
        def double(x):
            return 2 * x
        try:
            dk.gpu_map(double, [1], devices=["cpu"])
        except dk.WorkerError as error:
            print(str(error).splitlines()[0])
        """
    )
    result = _run_in_repo(script)
    assert result.stdout.startswith(
        "gpu_map: fn could not be unpickled in worker 1 on the CPU: AttributeError: Can't get "
        "attribute 'double' on <module '__main__'"
    ), result.stdout
    assert "not in a notebook or `python -c`: put it in a .py file and import it" in result.stdout
    assert "Traceback" not in result.stderr  # the worker no longer dies, printing its own


def test_an_fn_defined_under_the_main_guard_is_told_to_move_above_it(tmp_path: Any) -> None:
    # Before, only "define fn with def at the top level of a module": it was, under the guard.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import devicekit as dk
            if __name__ == "__main__":
                def double(x):
                    return 2 * x
                try:
                    dk.gpu_map(double, [1], devices=["cpu"])
                except dk.WorkerError as error:
                    print(str(error).split(" The worker's traceback")[0])
            """
        )
    )
    result = _run_python([str(script)])
    assert "on <module '__mp_main__'" in result.stdout, result.stdout
    assert result.stdout.rstrip().endswith(
        'If fn is defined under `if __name__ == "__main__":`, move its def above that line: '
        "a worker imports the script without running what the guard holds."
    ), result.stdout


def test_an_item_that_cannot_be_unpickled_in_a_worker_is_named() -> None:
    # Before: "fn raised on item 1", though fn never saw it.
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(abs, [1, LoadsBadly(), 3], devices=["cpu"])
    message = str(info.value)
    assert re.match(
        r"gpu_map: item 1 \(<tests\.test_p.*\) could not be unpickled in "
        r"worker 1 on the CPU: RuntimeError: cannot be rebuilt in a worker\. Each item is rebuilt "
        r"in its worker from its pickle",
        message,
    ), message
    assert "in _fail_to_load" in message


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def _wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_ctrl_c_with_many_items_queued_stops_the_workers_and_exits() -> None:
    script = textwrap.dedent(
        """
        import time, devicekit as dk
        from tests.test_parallel import where
        print("started", flush=True)
        dk.gpu_map(where, range(20_000), devices=["cpu", "cpu"])
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_WORKS + script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert process.stdout is not None
        process.stdout.readline()
        time.sleep(3)  # workers are running
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:  # a failure leaves no orphan: its workers end with it (parent-death signal)
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode != 0
    assert "KeyboardInterrupt" in stderr


def test_a_failure_with_many_items_queued_lets_the_program_exit() -> None:
    # Before, the task queue's feeder thread kept the interpreter from exiting.
    script = textwrap.dedent(
        """
        import devicekit as dk
        from tests.test_parallel import fail_on_three
        if __name__ == "__main__":
            try:
                dk.gpu_map(fail_on_three, range(20_000), devices=["cpu", "cpu"])
            except dk.WorkerError as error:
                print("caught", str(error).splitlines()[0], flush=True)
        """
    )
    result = _run_in_repo(script)
    assert result.stdout.startswith("caught gpu_map: fn raised on item 3")


def test_an_unpicklable_item_is_named_before_any_worker_starts() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(TypeError) as info:
        dk.gpu_map(math.sqrt, [1, lambda: 2, 3], devices=["cpu"])
    message = str(info.value)
    assert "item 1 (<function " in message
    assert "<lambda>" in message
    assert "of type function) is not: " in message
    assert set(multiprocessing.active_children()) == before


def test_an_unpicklable_result_names_its_item() -> None:
    with pytest.raises(dk.WorkerError, match=r"the result of item 2 \(2\) cannot be sent back"):
        dk.gpu_map(unpicklable_result, range(5), devices=["cpu"])


def test_a_dead_worker_is_named_with_its_signal_and_item() -> None:
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(die, [1], devices=["cpu"])
    assert str(info.value) == (
        "gpu_map: worker 1 on the CPU was killed by SIGKILL (the out-of-memory killer sends it) "
        "while running item 0 (1)"
    )
    with pytest.raises(
        dk.WorkerError,
        match=r"worker 1 on the CPU exited with code 3 while running item 0 \(2\)\. fn must "
        r"return or raise an Exception: os\._exit\(\) in fn",
    ):
        dk.gpu_map(die, [2], devices=["cpu"])


def test_workers_are_named_by_their_gpu(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    fake_accelerator("cuda", 2)
    with pytest.raises(dk.WorkerError, match=r"fn raised on item 0 \(3\) in worker 1 on cuda:1"):
        dk.gpu_map(fail_on_three, [3], devices=["cuda:1"])


def _kill_parent_and_watch(
    script: str,
    workers: int,
    pids: Any,
    *,
    main: Any = None,
    env: dict[str, str] | None = None,
    seconds: float = 15,
) -> None:
    """Run ``script``, SIGKILL it once ``workers`` PIDs are in ``pids``, see them end in time.

    ``script`` runs with ``python -c``, or from the file ``main`` (a main module
    that spawned workers import again), with the repository importable.
    """
    env = _importable(DK_TEST_PIDS=str(pids), **(env or {}))
    command = [sys.executable, "-c", textwrap.dedent(script)]
    if main is not None:
        main.write_text(textwrap.dedent(script))
        command = [sys.executable, str(main)]
    parent = subprocess.Popen(command, cwd=REPO, env=env)
    try:
        assert _wait_for(lambda: len(os.listdir(pids)) >= workers, 60), "workers never ran"
        found = [int(name) for name in os.listdir(pids)]
        assert all(_alive(pid) for pid in found)
    finally:
        parent.kill()  # SIGKILL: the parent runs no cleanup at all
        parent.wait(timeout=30)
    try:
        assert _wait_for(lambda: not any(_alive(pid) for pid in found), seconds), "orphans survived"
    finally:
        for pid in found:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_busy_workers_end_when_their_parent_is_killed(tmp_path: Any) -> None:
    script = """
    import devicekit as dk
    from tests.test_parallel import pid_and_wait
    if __name__ == "__main__":
        dk.gpu_map(pid_and_wait, range(2), devices=["cpu", "cpu"])
    """
    _kill_parent_and_watch(script, 2, tmp_path)


def test_idle_pool_workers_end_when_their_parent_is_killed(tmp_path: Any) -> None:
    # A pool started from a thread gets no parent-death signal (it would fire when
    # that thread ends): idle workers see the parent's end of the pipe close.
    script = """
    import threading, time, devicekit as dk
    from tests.test_parallel import write_pid
    pools = []
    def start():
        pools.append(dk.gpu_pool(devices=["cpu", "cpu"]))
        pools[0].map(write_pid, range(2))  # one item each: both write their PID, then idle
    if __name__ == "__main__":
        thread = threading.Thread(target=start)
        thread.start()
        thread.join()
        time.sleep(120)
    """
    _kill_parent_and_watch(script, 2, tmp_path)


def _run_without_main_guard(
    tmp_path: Any, imports: str, call: str
) -> subprocess.CompletedProcess[str]:
    """Run ``call`` at the top of a script, with no main guard; print its WorkerError."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        f"{imports}\nimport devicekit as dk\n"
        "try:\n"
        f"    {call}\n"
        "except dk.WorkerError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_a_missing_main_guard_is_named_in_a_few_lines(tmp_path: Any) -> None:
    result = _run_without_main_guard(
        tmp_path, "import math", "dk.gpu_map(math.sqrt, range(4), devices=['cpu', 'cpu'])"
    )
    assert 'if __name__ == "__main__":' in result.stdout
    assert "stopped while importing the main module" in result.stdout
    assert "bootstrapping phase" not in result.stderr  # multiprocessing's long story
    assert "Traceback" not in result.stderr
    own = [
        line
        for line in result.stderr.splitlines()
        if "NumPy" not in line and "_conversion_method_template" not in line  # the parent's torch
    ]
    assert own, result.stderr
    assert all(line.startswith("devicekit: gpu_map() called at import time") for line in own), own
    assert len(own) <= 2  # one line per worker


def test_a_pool_reuses_its_workers_and_stops_them() -> None:
    with dk.gpu_pool(devices=["cpu", "cpu"]) as pool:
        assert "0 running (workers start at the first map)" in pool._repr_html_()
        first = {pid for pid, _, _ in pool.map(where, range(6))}
        second = {pid for pid, _, _ in pool.map(where, range(6))}
        assert first == second
        assert len(first) == 2
        assert "2 workers: cpu x2; 2 running" in repr(pool)
        html = pool._repr_html_()
        assert "<caption>GPUPool</caption>" in html
        assert "<td>cpu x2</td>" in html
        assert "<td>2 running</td>" in html
    assert "closed" in repr(pool)
    assert "<td>closed</td>" in pool._repr_html_()
    assert not any(_alive(pid) for pid in first)
    with pytest.raises(ValueError, match="this GPUPool is closed"):
        pool.map(where, [1])


def test_a_pool_starts_fresh_workers_after_a_failure() -> None:
    with dk.gpu_pool(devices=["cpu"]) as pool:
        with pytest.raises(dk.WorkerError):
            pool.map(fail_on_three, range(5))
        assert pool.map(fail_on_three, [1, 2]) == [1, 2]


@pytest.mark.gpu
def test_three_workers_share_one_gpu() -> None:
    results = dk.gpu_map(on_gpu, range(9), devices=[0], workers_per_device=3)
    pids = {pid for pid, _, _, _ in results}
    assert len(pids) == 3
    assert {device for _, device, _, _ in results} == {"cuda:0"}
    assert {count for _, _, count, _ in results} == {1}
    assert len({uuid for _, _, _, uuid in results}) == 1
    assert GPU_COUNT >= 1


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


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (0, ValueError, "timeout must be a finite number > 0, got 0 "),
        (-1.5, ValueError, "timeout must be a finite number > 0, got -1.5 "),
        (math.inf, ValueError, "timeout must be a finite number > 0, got inf "),
        (math.nan, ValueError, "timeout must be a finite number > 0, got nan "),
        (True, TypeError, "timeout must be a finite number > 0, got the bool True "),
        ("60", TypeError, "timeout must be a finite number > 0, got '60' of type str "),
    ],
)
def test_timeout_must_be_a_positive_number_of_seconds(
    timeout: object, error: type[Exception], message: str
) -> None:
    before = set(multiprocessing.active_children())
    fix = r"\(the seconds one item may run; None: no limit\)$"
    with pytest.raises(error, match="^" + re.escape(message) + fix):
        dk.gpu_map(abs, [1], devices=["cpu"], timeout=timeout)  # type: ignore[arg-type]
    with dk.gpu_pool(devices=["cpu"]) as pool, pytest.raises(error, match=re.escape(message)):
        pool.map(abs, [1], timeout=timeout)  # type: ignore[arg-type]
    assert set(multiprocessing.active_children()) == before  # refused before any worker started


def test_timeout_with_ray_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^timeout=5 works with executor='local' only: Ray does"):
        dk.gpu_map(abs, [1], executor="ray", timeout=5)


def test_an_item_over_its_timeout_stops_every_worker_and_keeps_the_results(tmp_path: Any) -> None:
    # A subprocess bounds the test: were the timeout ignored, fn would sleep 60 s.
    script = textwrap.dedent(
        """
        import json, multiprocessing, os, pickle, devicekit as dk
        from tests.test_parallel import hang_on_two, pid_and_wait
        out = {}
        with dk.gpu_pool(devices=["cpu"]) as pool:
            try:
                pool.map(hang_on_two, range(4), timeout=0.5)
            except TimeoutError as error:
                copy = pickle.loads(pickle.dumps(error))
                out["first"] = [type(error).__name__, isinstance(error, dk.WorkerError), str(error),
                                error.index, error.timeout, sorted(error.results.items()),
                                sorted(copy.results.items()), copy.index]
                out["left"] = len(multiprocessing.active_children())
            out["again"] = pool.map(abs, [-1, -2], timeout=30)  # fresh workers
        try:
            dk.gpu_map(pid_and_wait, range(2), devices=["cpu", "cpu"], timeout=0.5)
        except dk.WorkerTimeoutError as error:
            out["second"] = str(error).split(" ran longer")[0]
        out["children"] = len(multiprocessing.active_children())
        pids = [int(name) for name in os.listdir(os.environ["DK_TEST_PIDS"])]
        out["alive"] = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]  # before we exit
        print(json.dumps(out))
        """
    )
    result = _run_in_repo(script, env={"DK_TEST_PIDS": str(tmp_path)})
    out = json.loads(result.stdout.strip().splitlines()[-1])
    name, is_worker_error, message, index, limit, results, copied, copied_index = out["first"]
    assert (name, is_worker_error, index, limit) == ("WorkerTimeoutError", True, 2, 0.5)
    assert message == (
        "GPUPool.map(): item 2 (2) ran longer than timeout=0.5 s in worker 1 on the CPU, so every "
        "worker was stopped. 2 of 4 items had finished: their results are in this error's "
        ".results (a dict by item index); the others were lost. If the item needs longer, pass "
        "a larger timeout (or timeout=None for no limit)."
    )
    assert results == copied == [[0, 0], [1, 10]]  # item 3 never ran
    assert copied_index == 2
    assert out["left"] == 0
    assert out["again"] == [1, 2]
    assert re.fullmatch(r"gpu_map: item [01] \([01]\)", out["second"])
    assert out["children"] == 0
    assert out["alive"] == []  # stopped and reaped, not orphaned: while their parent still runs


def test_timeout_starts_once_the_worker_has_loaded_fn() -> None:
    # Loading fn (importing its module: torch, often) takes 4 s here; the item
    # itself, microseconds. Counted from the hand-over, the item would time out.
    assert dk.gpu_map(LoadsAfter(4), [-1, -2], devices=["cpu"], timeout=2) == [1, 2]


def test_a_missing_main_guard_with_large_items_is_named_too(tmp_path: Any) -> None:
    # Before, sending an item larger than the pipe's buffer to a worker that died
    # importing the main module raised a bare BrokenPipeError.
    result = _run_without_main_guard(
        tmp_path, "", "dk.gpu_map(len, [bytes(2_000_000)] * 2, devices=['cpu'])"
    )
    assert "stopped while importing the main module" in result.stdout, result.stderr
    assert "BrokenPipeError" not in result.stderr


def test_a_pool_replaces_a_worker_that_died_while_idle(caplog: pytest.LogCaptureFixture) -> None:
    # Before, the next map failed: "worker 1 on the CPU was killed by SIGKILL ... between
    # items", with index=None, though no item of it had run (and, earlier still, a bare
    # BrokenPipeError). The out-of-memory killer picks idle workers too.
    with dk.gpu_pool(devices=["cpu"], workers_per_device=2) as pool:
        assert pool.map(abs, [-1, -2]) == [1, 2]
        victim, other = pool._workers
        os.kill(victim.process.pid, signal.SIGKILL)
        assert _wait_for(lambda: not _alive(victim.process.pid), 30)
        with caplog.at_level(logging.WARNING, logger="devicekit"):
            assert pool.map(abs, [-3, -4, -5]) == [3, 4, 5]
        assert pool._workers[0] is not victim
        assert (pool._workers[0].number, pool._workers[0].slot) == (1, "cpu")
        assert pool._workers[1] is other  # the live one is kept
        assert [record.getMessage() for record in caplog.records] == [
            "GPUPool.map(): worker 1 on the CPU was killed by SIGKILL (the out-of-memory killer "
            "sends it) while idle, after the last map; starting a fresh one in its place (no "
            "item was lost)"
        ]


class _Stubborn:
    """A stand-in worker process that ignores SIGTERM: only SIGKILL ends it."""

    pid = None  # no process of the system's: stop_workers asks it, as multiprocessing's own

    def __init__(self, number: int, events: list[str]) -> None:
        self.number, self.events, self.alive = number, events, True

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.events.append(f"terminate {self.number}")

    def kill(self) -> None:
        self.events.append(f"kill {self.number}")
        self.alive = False

    def join(self, timeout: float | None = None) -> None:
        self.events.append(f"join {self.number}")


class _Conn:
    def send(self, message: object) -> None:
        pass

    def close(self) -> None:
        pass


def test_stopping_workers_that_ignore_sigterm_waits_for_them_together() -> None:
    # Before, each stubborn worker was terminated and waited for (5 s) in turn:
    # 32 workers whose fn hung with SIGTERM ignored took minutes to stop.
    from devicekit import _dispatch

    events: list[str] = []
    workers = [_dispatch.Worker(n, "cpu", _Stubborn(n, events), _Conn()) for n in (1, 2, 3)]
    _dispatch.stop_workers(workers, gently=False)
    assert events == [
        *("terminate 1", "terminate 2", "terminate 3", "join 1", "join 2", "join 3"),
        *("kill 1", "kill 2", "kill 3", "join 1", "join 2", "join 3"),
    ]


def test_maps_started_from_two_threads_at_once_give_each_worker_its_device(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # CUDA_VISIBLE_DEVICES is set around each worker's start, and the environment
    # is the process's. Before, two threads starting workers at once read or
    # lent each other's value: a worker on the wrong GPU, an IndexError, or the
    # caller's own variable left changed. The barrier holds both threads inside
    # that window together, where the code lets them in.
    from devicekit import _dispatch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    fake_accelerator("cuda", 1)
    real_scoped_env = _dispatch.scoped_env
    both_inside = threading.Barrier(2)

    @contextlib.contextmanager
    def scoped_env(name: str, value: str | None) -> Iterator[None]:
        with real_scoped_env(name, value):
            if name == "CUDA_VISIBLE_DEVICES":
                with contextlib.suppress(threading.BrokenBarrierError):
                    both_inside.wait(timeout=2)  # with a lock, the other never comes in
            yield

    monkeypatch.setattr(_dispatch, "scoped_env", scoped_env)
    seen: dict[str, object] = {}

    def run(name: str, devices: list[str | int]) -> None:
        try:
            seen[name] = {visible for _, visible, _ in dk.gpu_map(where, [1], devices=devices)}
        except Exception as error:  # noqa: BLE001 - shown by the assertion below
            seen[name] = error

    threads = [
        threading.Thread(target=run, args=("cpu", ["cpu"])),
        threading.Thread(target=run, args=("gpu", [0])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert seen == {"cpu": {""}, "gpu": {"5"}}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"


class Squares:
    """Map-style, like ``torch.utils.data.Dataset``: ``len()`` and ``[i]``, no ``__iter__``."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < 4:
            raise IndexError(index)
        return index * index


def test_a_map_style_dataset_is_its_items() -> None:
    # Before: "needs items, an iterable ...; pass a list, such as [<Squares>]", the
    # dataset as one item, for the commonest container of items in PyTorch.
    assert dk.gpu_map(abs, Squares(), devices=["cpu"]) == [0, 1, 4, 9]


def test_the_missing_main_guard_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, print() wrote the line and its newline apart: under PYTHONUNBUFFERED,
    # two workers' lines could interleave into one long line and an empty one.
    from devicekit import _mapguards

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    recorder = Recorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    monkeypatch.setattr(_mapguards, "in_worker_bootstrap", lambda: True)
    with pytest.raises(SystemExit) as info:
        dk.gpu_map(abs, [1], devices=["cpu"])
    assert info.value.code == 87
    assert len(recorder.writes) == 1
    assert recorder.writes[0].startswith("devicekit: gpu_map() called at import time. ")
    assert recorder.writes[0].endswith(" above that line).\n")


def test_a_worker_whose_fn_never_loads_is_stopped_at_the_startup_limit(tmp_path: Any) -> None:
    # Before, the item's clock started only once fn was loaded, so a module that
    # hung on import in the worker made gpu_map wait forever, timeout or not.
    # The subprocess bounds the test; the start-up limit is lowered to 3 s.
    script = textwrap.dedent(
        """
        import json, multiprocessing, devicekit as dk
        from devicekit import _dispatch
        from tests.test_parallel import LoadsAfter
        _dispatch._STARTUP_SECONDS = 3.0
        try:
            dk.gpu_map(LoadsAfter(3600), [1, 2], devices=["cpu"], timeout=0.5)
        except dk.WorkerTimeoutError as error:
            print(json.dumps([str(error), error.index, error.timeout, error.results,
                              len(multiprocessing.active_children())]))
        """
    )
    result = _run_in_repo(script, timeout=60)
    message, index, limit, results, children = json.loads(result.stdout.strip().splitlines()[-1])
    assert message.startswith(
        "gpu_map: worker 1 on the CPU was still loading fn (unpickling it, which imports its "
        "module) 3 s after it was given this map, so every worker was stopped. With "
        "timeout=0.5, a worker's start-up may take max(timeout, 3 s). 0 of 2 items had "
        "finished, so this error's .results is empty. "
    ), message
    assert "look at what the main module and fn's module do at import time" in message
    assert (index, limit, results, children) == (None, 3.0, {}, 0)


def test_a_main_module_that_hangs_in_a_worker_is_stopped_at_the_startup_limit(
    tmp_path: Any,
) -> None:
    # A hang in the worker's import of the main module, with an item larger than
    # the pipe's buffer: before, the item was written to the worker at once and
    # the write blocked forever on a worker that never read it.
    script = tmp_path / "hangs_in_workers.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, pathlib, time
            if __name__ == "__mp_main__":  # what a worker runs, importing this module
                pathlib.Path("pids", str(os.getpid())).touch()
                time.sleep(3600)
            import json, multiprocessing, devicekit as dk
            from devicekit import _dispatch
            _dispatch._STARTUP_SECONDS = 3.0
            if __name__ == "__main__":
                try:
                    dk.gpu_map(len, [bytes(3_000_000)], devices=["cpu"], timeout=0.5)
                except dk.WorkerTimeoutError as error:
                    print(json.dumps([str(error), len(multiprocessing.active_children())]))
            """
        )
    )
    (tmp_path / "pids").mkdir()
    try:
        result = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
            check=False,
        )
    finally:
        # A worker still importing has no parent-death signal yet: were the call to
        # hang and the script be killed, it would outlive the test.
        for name in os.listdir(tmp_path / "pids"):
            if _alive(int(name)):
                os.kill(int(name), signal.SIGKILL)
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path / "pids")  # the hang happened, in a worker
    message, children = json.loads(result.stdout.strip().splitlines()[-1])
    assert message.startswith(
        "gpu_map: worker 1 on the CPU was still starting (importing the main module, in a "
        "fresh Python) 3 s after it was given this map"
    ), message
    assert children == 0


@pytest.mark.parametrize(
    ("fn", "items", "message"),
    [
        (fail_on_three, range(6), r"^gpu_map: fn raised on item 3 \(3\)"),
        (die_on_two, [0, 1, 2, 3], r"^gpu_map: worker 1 on the CPU was killed by SIGKILL"),
        (unpicklable_result, range(4), r"^gpu_map: the result of item 2 \(2\) cannot be sent"),
    ],
)
def test_every_worker_error_keeps_the_finished_results(
    fn: Callable[[int], object], items: Any, message: str
) -> None:
    # Before, only WorkerTimeoutError kept them: a failing item lost the rest.
    with pytest.raises(dk.WorkerError, match=message) as info:
        dk.gpu_map(fn, items, devices=["cpu"])  # one worker: items finish in order
    error = info.value
    done = {index: index for index in range(error.index or 0)}
    assert error.index in (2, 3)
    assert error.results == done
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.index, copy.results) == (
        type(error),
        str(error),
        error.index,
        done,
    )
    if sys.version_info >= (3, 11):
        kept = f"{len(done)} of {len(list(items))} items had finished: their results are in "
        assert error.__notes__[0].startswith(kept)


def test_an_fn_that_cannot_be_loaded_keeps_no_results_and_names_no_item() -> None:
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(CallableThatLoadsBadly(), [1, 2], devices=["cpu"])
    assert (info.value.index, info.value.results) == (None, {})


def test_a_cuda_storage_in_a_result_comes_back_on_the_cpu() -> None:
    # Before, the result was rebuilt on the caller's cuda:0 (another GPU than the
    # worker's, CUDA started in the caller); here, CPU-only torch could not.
    [storage] = dk.gpu_map(storage_on_cuda, [7], devices=["cpu"])
    assert isinstance(storage, torch.storage.TypedStorage)
    assert where_stored(storage) == ("cpu", [7, 7, 7, 7])


def test_a_cuda_storage_in_an_item_reaches_fn_on_the_cpu() -> None:
    # Before: "item 0 could not be unpickled in worker 1", asked for CUDA there.
    assert dk.gpu_map(where_stored, [storage_on_cuda(3)], devices=["cpu"]) == [
        ("cpu", [3, 3, 3, 3])
    ]


def test_tensors_of_the_newer_dtypes_come_back() -> None:
    # Before: "cannot be rebuilt here: AttributeError: type object
    # 'torch.storage.UntypedStorage' has no attribute 'dtype'": torch pickles a
    # uint16 or float8 tensor with an UntypedStorage it cannot unpickle.
    [[uint16, float8]] = dk.gpu_map(newer_dtypes, [5], devices=["cpu"])
    assert uint16.dtype == torch.uint16
    assert uint16.to(torch.int32).tolist() == [5, 5]
    assert float8.dtype == torch.float8_e4m3fn
    assert float8.float().tolist() == [1.0, 1.0]


@pytest.mark.gpu
def test_cuda_tensors_in_results_come_back_on_the_cpu_without_cuda_here() -> None:
    script = textwrap.dedent(
        """
        import json, torch, devicekit as dk
        from tests.test_parallel import cuda_results
        if __name__ == "__main__":
            [out] = dk.gpu_map(cuda_results, [2], devices=[0])
            print(json.dumps({
                "devices": sorted({str(v.device) for k, v in out.items() if k != "device"}),
                "in_worker": out["device"],
                "x": out["x"].tolist(), "row": out["row"].tolist(),
                "parameter": type(out["weight"]).__name__,
                "cuda_started_here": torch.cuda.is_initialized(),
            }))
        """
    )
    result = json.loads(_run_in_repo(script).stdout.strip().splitlines()[-1])
    assert result == {
        "devices": ["cpu"],
        "in_worker": "cuda:0",
        "x": [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]],
        "row": [6.0, 8.0, 10.0],
        "parameter": "Parameter",
        "cuda_started_here": False,
    }


def test_gpu_map_inside_a_worker_says_why_it_cannot() -> None:
    # Before: "AssertionError: daemonic processes are not allowed to have children",
    # from deep inside multiprocessing.
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(nested_map, [1], devices=["cpu"])
    message = str(info.value)
    assert (
        "RuntimeError: gpu_map() was called inside fn, in a gpu_map worker, and a worker "
        "cannot start workers of its own: it is a daemonic process, which may have no "
        "children" in message
    ), message
    assert "call gpu_map once, from the main process, over every inner item" in message
    assert "AssertionError" not in message


def test_gpu_pool_in_another_daemonic_process_says_why_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class DataLoaderWorker:
        daemon, name = True, "DataLoaderWorker-1"

    monkeypatch.setattr(multiprocessing, "current_process", DataLoaderWorker)
    with pytest.raises(
        RuntimeError,
        match=r"^gpu_pool\(\) was called in 'DataLoaderWorker-1', a daemonic process \(a "
        r"multiprocessing or DataLoader worker, say\), which may start no processes",
    ):
        dk.gpu_pool(devices=["cpu"])


class _Interrupted(_Stubborn):
    """A stubborn stand-in whose first wait is cut short by a second Ctrl-C."""

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.events.count(f"join {self.number}") == 1 and self.number == 1:
            raise KeyboardInterrupt


def test_a_ctrl_c_while_stopping_workers_still_kills_them() -> None:
    # Before, a second Ctrl-C during the wait after SIGTERM skipped the SIGKILL:
    # workers that ignore SIGTERM outlived the call (and held the program's exit).
    from devicekit import _dispatch

    events: list[str] = []
    workers = [_dispatch.Worker(n, "cpu", _Interrupted(n, events), _Conn()) for n in (1, 2)]
    with pytest.raises(KeyboardInterrupt):
        _dispatch.stop_workers(workers, gently=False)
    assert events == [
        "terminate 1",
        "terminate 2",
        "join 1",
        "kill 1",
        "kill 2",
        "join 1",
        "join 2",
    ]
    assert not any(worker.process.is_alive() for worker in workers)


def test_two_ctrl_c_with_workers_ignoring_sigterm_leave_no_worker(tmp_path: Any) -> None:
    # The impatient Ctrl-C, for real: workers whose fn ignores SIGTERM, a first
    # Ctrl-C, and a second during the wait for them to stop.
    script = textwrap.dedent(
        """
        import json, multiprocessing, os, devicekit as dk
        from tests.test_parallel import pid_ignore_sigterm_and_wait
        if __name__ == "__main__":
            try:
                dk.gpu_map(pid_ignore_sigterm_and_wait, range(2), devices=["cpu", "cpu"])
            except KeyboardInterrupt:
                pids = [int(name) for name in os.listdir(os.environ["DK_TEST_PIDS"])]
                alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
                print(json.dumps([alive, len(multiprocessing.active_children())]), flush=True)
        """
    )
    env = {**os.environ, "DK_TEST_PIDS": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_WORKS + script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    pids: list[int] = []
    try:
        assert _wait_for(lambda: len(os.listdir(tmp_path)) >= 2, 60), "workers never ran"
        pids = [int(name) for name in os.listdir(tmp_path)]
        process.send_signal(signal.SIGINT)
        time.sleep(1)  # into the 5 s wait for workers that ignore SIGTERM
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        for pid in pids:  # a failure leaves no orphan behind (they ignore SIGTERM)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert process.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1]) == [[], 0]


def test_workers_that_ignore_sigterm_end_when_their_parent_is_killed(tmp_path: Any) -> None:
    # Before, the parent-death signal was SIGTERM: a worker whose fn (or a library)
    # ignored it outlived its killed parent, an orphan for as long as fn ran.
    script = """
    import devicekit as dk
    from tests.test_parallel import pid_ignore_sigterm_and_wait
    if __name__ == "__main__":
        dk.gpu_map(pid_ignore_sigterm_and_wait, range(2), devices=["cpu", "cpu"])
    """
    _kill_parent_and_watch(script, 2, tmp_path)


class _ExitsWhenPickled:
    def __reduce__(self) -> tuple[Any, ...]:
        sys.exit(3)


def exits_when_pickled(item: int) -> object:
    return _ExitsWhenPickled() if item == 1 else item


def test_a_result_whose_pickling_exits_is_named_and_keeps_the_worker() -> None:
    # Before, the SystemExit escaped the worker's loop and ended it: "exited with
    # code 3 while running item 1. fn must return or raise an Exception: os._exit()".
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(exits_when_pickled, [0, 1], devices=["cpu"])
    assert str(info.value) == (
        "gpu_map: the result of item 1 (1) cannot be sent back from worker 1 on the CPU: "
        "_ExitsWhenPickled result: SystemExit: 3. Return picklable data: numbers, strings, "
        "tensors, or containers of them."
    )
    assert info.value.results == {0: 0}


_SLOW_MAIN = """
import os, pathlib, sys, time
if __name__ == "__mp_main__":  # a worker, importing this module again
    pathlib.Path(os.environ["DK_TEST_PIDS"], str(os.getpid())).touch()
    time.sleep(120)  # a slow import: torch on a busy file system, or one that hangs
import threading, devicekit as dk
def run():
    dk.gpu_map(abs, [1, 2], devices=["cpu", "cpu"])
if __name__ == "__main__":
    if os.environ.get("DK_TEST_IN_THREAD"):  # no parent-death signal: the PPID is watched
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
"""

_SLOW_START = """
import os, pathlib, sys, time
if "--multiprocessing-fork" in sys.argv:  # a worker's Python, starting: none of its code yet
    pathlib.Path(os.environ["DK_TEST_PIDS"], str(os.getpid())).touch()
    time.sleep(2)
"""


@pytest.mark.parametrize("stage", ["importing main", "importing main, thread", "starting"])
def test_workers_end_when_their_parent_is_killed_before_they_ran_anything(
    tmp_path: Any, stage: str
) -> None:
    # Before, a worker armed the parent-death signal only once it had imported the
    # main module (spawn imports it again): killed while a worker imported it, the
    # parent left an orphan that finished the import (here 120 s; forever if it
    # hangs), running the rest of the main module. "starting": killed while the
    # worker's Python is still starting (its sitecustomize), before any of our code.
    pids, site = tmp_path / "pids", tmp_path / "site"
    pids.mkdir()
    site.mkdir()
    env = {"DK_TEST_IN_THREAD": "1" if "thread" in stage else ""}
    if stage == "starting":
        (site / "sitecustomize.py").write_text(textwrap.dedent(_SLOW_START))
        path = [str(site), REPO, os.environ.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    _kill_parent_and_watch(_SLOW_MAIN, 2, pids, main=tmp_path / "main.py", env=env, seconds=10)


def test_busy_workers_of_a_pool_started_in_a_thread_end_when_their_parent_is_killed(
    tmp_path: Any,
) -> None:
    # A worker started from a thread gets no parent-death signal (it follows the
    # thread). Before, it checked the PPID only between items: a busy fn outlived
    # its killed parent, here by 120 s. Now a thread watches the PPID.
    script = """
    import threading, time, devicekit as dk
    from tests.test_parallel import pid_and_wait
    if __name__ == "__main__":
        thread = threading.Thread(
            target=dk.gpu_map, args=(pid_and_wait, range(2)), kwargs={"devices": ["cpu"] * 2}
        )
        thread.start()
        thread.join()
    """
    _kill_parent_and_watch(script, 2, tmp_path, seconds=10)


def test_ctrl_c_while_workers_import_the_main_module_is_the_callers_alone(tmp_path: Any) -> None:
    # Ctrl-C in a terminal reaches every worker too. Before, a worker still
    # importing the main module died of it, printing a traceback of the import
    # (one per worker, interleaved), and the call raised "worker 1 exited with
    # code 1 before it started: it could not import the main module".
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, pathlib, signal, time
            if __name__ == "__mp_main__":
                pathlib.Path(os.environ["DK_TEST_PIDS"], str(os.getpid())).touch()
                time.sleep(120)
            import devicekit as dk
            if __name__ == "__main__":
                signal.signal(signal.SIGINT, signal.default_int_handler)  # see CTRL_C_WORKS
                try:
                    dk.gpu_map(abs, [1, 2], devices=["cpu", "cpu"])
                except KeyboardInterrupt:
                    print("KeyboardInterrupt", flush=True)
            """
        )
    )
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "DK_TEST_PIDS": str(pids)}
    process = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    found: list[int] = []
    try:
        assert _wait_for(lambda: len(os.listdir(pids)) >= 2, 60), "workers never started"
        found = [int(name) for name in os.listdir(pids)]
        for pid in found:  # what a terminal does: the same signal to every process
            os.kill(pid, signal.SIGINT)
        time.sleep(1)
        assert all(_alive(pid) for pid in found)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        for pid in found:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert (process.returncode, stdout) == (0, "KeyboardInterrupt\n"), stderr
    assert "Traceback" not in stderr
    assert "KeyboardInterrupt" not in stderr  # no worker's
    assert not any(_alive(pid) for pid in found)


MB = 1 << 20


def full_tensor(megabytes: int) -> torch.Tensor:
    return torch.full((megabytes * MB,), 7, dtype=torch.uint8)


def full_array(megabytes: int) -> Any:
    import numpy as np

    return np.full(megabytes * MB, 7, dtype=np.uint8)


def tensor_plus_one(item: torch.Tensor) -> torch.Tensor:
    return item + 1


def _peak_and_rss(pid: int | str) -> tuple[int, int]:
    """A process's peak resident memory since its last reset, and its resident memory now."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


_NO_NUMPY = pytest.mark.skipif(importlib.util.find_spec("numpy") is None, reason="needs numpy")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def _large_tensor() -> torch.Tensor:
    return torch.zeros(100 * MB, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("fn", "small", "make_item", "most"),
    [
        # The result and its pickle; before, 3: torch.save's copy too.
        (full_tensor, 1, lambda: 100, 2.4),
        # Before, 3: with protocol 4, numpy pickled a tobytes() copy.
        pytest.param(full_array, 1, lambda: 100, 2.4, marks=_NO_NUMPY),
        # Before, 5: the item's pickle and the item were kept while the result was pickled.
        # Made in the test: a parameter lives as long as the session, where other tests'
        # censuses of live tensors would count it.
        (tensor_plus_one, torch.zeros(1), _large_tensor, 3.4),
    ],
    ids=["tensor result", "numpy result", "tensor item and result"],
)
def test_a_worker_holds_few_copies_of_a_large_item_or_result(
    fn: Callable[[Any], Any], small: Any, make_item: Callable[[], Any], most: float
) -> None:
    size = 100 * MB
    item = make_item()
    with dk.gpu_pool(devices=["cpu"]) as pool:
        pool.map(fn, [small])  # started, with what fn imports imported
        pid = pool._workers[0].process.pid
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")  # its peak, from now
        _, before = _peak_and_rss(pid)
        (result,) = pool.map(fn, [item])
        peak, _ = _peak_and_rss(pid)
    assert len(result) == size
    assert (peak - before) / size < most, f"{(peak - before) / size:.2f} copies at the peak"


def echo(item: Any) -> Any:
    return item


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_the_caller_holds_items_and_results_once() -> None:
    # Before, every item's pickle was kept until the map ended: with 4 items of
    # 50 MB echoed back, the caller peaked at 13 x 50 MB above its start (the
    # items, their pickles, the results and one result in flight), now 9.
    script = """
        import json, devicekit as dk
        from tests.test_parallel import MB, echo, _peak_and_rss
        with dk.gpu_pool(devices=["cpu"]) as pool:
            pool.map(echo, [0])  # started
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
            _, before = _peak_and_rss("self")
            items = [bytes([i]) * (50 * MB) for i in range(4)]
            assert pool.map(echo, items) == items
            peak, _ = _peak_and_rss("self")
        print(json.dumps((peak - before) / (50 * MB)))
    """
    copies = json.loads(_run_in_repo(textwrap.dedent(script)).stdout.strip().splitlines()[-1])
    assert copies < 10.5, f"{copies:.2f} x 50 MB at the peak"


class _Answers:
    """A worker's end of the pipe with one answer waiting; ``before`` runs as it is read."""

    def __init__(self, answer: tuple[Any, ...], before: Callable[[], None]) -> None:
        self.answers, self.before = [answer], before

    def recv(self) -> tuple[Any, ...]:
        self.before()
        return self.answers.pop()

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.answers)


class _Sentinel:
    """A process whose sentinel is never ready."""

    def __init__(self) -> None:
        self.sentinel = object()


def test_an_answer_is_dropped_before_the_next_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, a result's pickle was kept while the next worker's answer was read:
    # with answers from several workers at once, the caller held two large
    # pickles (and the results) instead of one.
    import array
    import multiprocessing.connection
    import weakref

    from devicekit import _dispatch

    first = array.array("B", pickle.dumps(b"first"))
    gone = weakref.ref(first)
    alive: list[bool] = []
    conns = [
        _Answers(("ok", 0, first), lambda: None),
        _Answers(("ok", 1, pickle.dumps(b"second")), lambda: alive.append(gone() is not None)),
    ]
    del first
    workers = [_dispatch.Worker(n, "cpu", _Sentinel(), conn) for n, conn in enumerate(conns, 1)]
    monkeypatch.setattr(multiprocessing.connection, "wait", lambda handles, timeout: conns)
    one_map = _dispatch._Map(
        workers, [0, 1], fn_id=0, fn_bytes=b"", payloads=[b"", b""], step=lambda: None, timeout=None
    )
    one_map._collect()
    assert one_map.results == {0: b"first", 1: b"second"}
    assert alive == [False]


def test_a_closed_pool_says_so_before_it_reads_the_items() -> None:
    # Before, a closed pool read and pickled every item first: a generator was
    # consumed, and an item that cannot be pickled raised a TypeError instead.
    pool = dk.gpu_pool(devices=["cpu"])
    pool.close()
    read: list[int] = []

    def items() -> Iterator[Any]:
        read.append(1)
        yield lambda: 1

    with pytest.raises(ValueError, match="this GPUPool is closed"):
        pool.map(abs, items())
    assert read == []


def test_a_missing_main_guard_is_named_before_the_workers_read_the_items(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, each worker importing the script read every item (a generator, a
    # dataset loading each one) before it was refused.
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("DK_TEST_PIDS", str(pids))
    imports = (
        "import os, pathlib\n"
        "def items():\n"
        "    if __name__ == '__mp_main__':  # read in a worker\n"
        "        pathlib.Path(os.environ['DK_TEST_PIDS'], str(os.getpid())).touch()\n"
        "    yield from range(4)\n"
    )
    result = _run_without_main_guard(
        tmp_path, imports, "dk.gpu_map(abs, items(), devices=['cpu', 'cpu'])"
    )
    assert "stopped while importing the main module" in result.stdout
    assert os.listdir(pids) == []


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(10.0)[2:7:2],  # a view: its offset and stride
        torch.randn(3, 4).t(),
        torch.randn(5).bfloat16(),
        torch.randn(3, dtype=torch.complex64),
        torch.tensor([True, False]),
        torch.empty(0),
        torch.tensor(3.5),
        torch.nn.Parameter(torch.randn(2)),
        torch.randn(2, requires_grad=True),
        torch.randn(3, 3).to_sparse(),
        torch.randn(1, 3, 4, 4).to(memory_format=torch.channels_last),
    ],
    ids=lambda tensor: f"{tensor.dtype}-{tensor.layout}-{tuple(tensor.shape)}",
)
def test_tensors_cross_as_torch_pickles_them(tensor: torch.Tensor) -> None:
    # Storages now cross as their raw bytes, not as torch.save writes them: what
    # comes back must be what torch's own pickling gives.
    from devicekit._worker import dumps

    ours, torchs = pickle.loads(dumps(tensor)), pickle.loads(pickle.dumps(tensor))
    assert type(ours) is type(torchs)
    assert (ours.dtype, ours.shape, ours.layout, ours.requires_grad) == (
        torchs.dtype,
        torchs.shape,
        torchs.layout,
        torchs.requires_grad,
    )
    if tensor.layout != torch.strided:
        assert torch.equal(ours.to_dense(), torchs.to_dense())
        return
    assert (ours.stride(), ours.storage_offset()) == (torchs.stride(), torchs.storage_offset())
    assert bytes(ours.untyped_storage()) == bytes(torchs.untyped_storage())
    assert ours.untyped_storage().resizable()  # memory of its own, not a view of the pickle


_FORKS = """
import json, math, os, sys
import devicekit as dk
if __name__ == "__main__":
    pool = dk.gpu_pool(devices=["cpu"])
    first = pool.map(math.sqrt, [4.0])
    pid = os.fork()
    if pid == 0:  # a plain fork() (not multiprocessing's) that ends normally
        try:
            pool.map(math.sqrt, [1.0])
        except RuntimeError as error:
            print(str(error), file=sys.stderr, flush=True)
        sys.exit(0)  # the interpreter's exit handlers run here, in the child
    os.waitpid(pid, 0)
    after = pool.map(math.sqrt, [9.0])
    pool.close()
    print(json.dumps([first, after]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_neither_uses_nor_stops_its_parent_s_workers() -> None:
    # Before: the child's exit handler (multiprocessing's, and the pool's finalizer) sent
    # SIGTERM to the parent's workers, printing AssertionError tracebacks, and the
    # parent's next map failed with "worker 1 on the CPU was killed by SIGTERM".
    result = subprocess.run(
        [sys.executable, "-c", _FORKS],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [[2.0], [3.0]]
    assert "Traceback" not in result.stderr, result.stderr
    assert re.search(
        r"^GPUPool.map\(\): this pool's workers belong to process \d+, and this process "
        r"\(\d+\) is a fork of it, which cannot share their pipes\. Make a pool in this "
        r"process \(dk.gpu_pool\(\)\), or call gpu_map here\.$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr


def wait_for_gate(gate: str) -> str:
    """Say it started (``gate + ".started"``), then wait until ``gate`` exists (60 s at most)."""
    with open(gate + ".started", "w"):
        pass
    _wait_for(lambda: os.path.exists(gate), 60)
    return gate


@pytest.mark.timeout(300)
def test_a_second_map_on_a_busy_pool_is_refused_at_once(tmp_path: Any) -> None:
    # Before, two threads' maps on one pool read the same pipes: one hung for ever in
    # recv(), or both failed with WorkerErrors blaming the workers.
    gate = str(tmp_path / "gate")
    outcome: dict[str, object] = {}

    def run(name: str, fn: Callable[[Any], Any], items: list[Any]) -> None:
        try:
            outcome[name] = pool.map(fn, items)
        except BaseException as error:  # noqa: BLE001 - shown by the assertions below
            outcome[name] = error

    with dk.gpu_pool(devices=["cpu"]) as pool:
        first = threading.Thread(
            target=run, args=("first", wait_for_gate, [gate]), name="first-map", daemon=True
        )
        first.start()
        try:
            assert _wait_for(lambda: os.path.exists(gate + ".started"), 120), "fn never ran"
            second = threading.Thread(target=run, args=("second", abs, [-1]), daemon=True)
            second.start()
            second.join(60)  # refused at once: were it to wait or hang, this ends it
            assert not second.is_alive(), "the second map waited"
            assert str(outcome["second"]) == (
                "GPUPool.map() is already running on this pool, in thread 'first-map'. A pool "
                "runs one map at a time, from one thread: its workers answer one map at a "
                "time. Use one pool per thread (dk.gpu_pool() in each), or dk.gpu_map(), which "
                "starts workers of its own for each call."
            )
            assert type(outcome["second"]) is RuntimeError
            assert "first" not in outcome  # the first map runs on, unaffected
        finally:
            open(gate, "w").close()
            first.join(60)
        assert outcome["first"] == [gate]
        assert pool.map(abs, [-2]) == [2]  # free again


def test_a_script_read_from_stdin_is_refused_before_any_worker_starts(tmp_path: Any) -> None:
    # Before, every worker printed multiprocessing's FileNotFoundError for '<stdin>',
    # and the error said to add the main guard, which the script had.
    script = textwrap.dedent(
        """
        import devicekit as dk
        if __name__ == "__main__":
            try:
                dk.gpu_map(abs, [1], devices=["cpu"])
            except RuntimeError as error:
                print(error)
        """
    )
    result = _run_python(["-"], input=script, cwd=tmp_path)
    assert result.stdout == (
        "gpu_map() cannot start its workers: the main module was read from standard input "
        "(`python -`), which is read once. Workers are started with spawn, and each one imports "
        "the main module again, from its file. Save the code to a .py file and run that file "
        "(or, from `python -c`, import fn from a module).\n"
    )
    assert "Traceback" not in result.stderr


def test_a_main_module_whose_file_is_gone_is_refused_before_any_worker_starts(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None, raising=False)  # a script, not `python -m`
    monkeypatch.setattr(main, "__file__", str(tmp_path / "gone.py"), raising=False)
    before = set(multiprocessing.active_children())
    gone = re.escape(repr(str(tmp_path / "gone.py")))
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: dk.gpu_pool(devices=["cpu"]), r"gpu_pool\(\)"),
        (lambda: dk.gpu_map(abs, [1], devices=["cpu"]), r"gpu_map\(\)"),
    ]
    for call, caller in calls:
        with pytest.raises(
            RuntimeError,
            match=rf"^{caller} cannot start its workers: the main module's file, {gone}, does "
            r"not exist\. Workers are started with spawn",
        ):
            call()
    assert set(multiprocessing.active_children()) == before


def test_a_main_module_that_fails_in_a_worker_is_not_said_to_lack_the_guard(
    tmp_path: Any,
) -> None:
    # Before: "... could not import the main module ... a script must call gpu_map()
    # under `if __name__ == "__main__":`", to a script that does.
    script = tmp_path / "fails_in_workers.py"
    script.write_text(
        textwrap.dedent(
            """
            import devicekit as dk
            if __name__ == "__mp_main__":  # what a worker runs, importing this module
                raise RuntimeError("this module fails in a worker")
            if __name__ == "__main__":
                try:
                    dk.gpu_map(abs, [1], devices=["cpu"])
                except dk.WorkerError as error:
                    print(error)
            """
        )
    )
    result = _run_python([str(script)], cwd=tmp_path)
    assert result.stdout == (
        "gpu_map: worker 1 on the CPU exited with code 1 before it started, while it imported "
        "the main module (a spawned worker imports it again): that import failed in the "
        "worker, and its own error is printed above, on stderr. Fix what it says (the main "
        "module must import without error in a fresh Python, from its file).\n"
    )
    assert "RuntimeError: this module fails in a worker" in result.stderr


def start_a_child(item: int) -> int:
    """Start ``sh``, which starts ``sleep 60``; write both PIDs where the test sees them.

    Then wait past the map's timeout (item 0), raise (item 1), or return, and
    leave them running.
    """
    folder = os.environ["DK_TEST_PIDS"]
    # The shell writes its child's PID itself: a grandchild of the worker.
    child = subprocess.Popen(["sh", "-c", 'sleep 60 & echo $! > "$0"; wait', f"{folder}/sleep"])
    with open(os.path.join(folder, "sh"), "w") as file:
        file.write(str(child.pid))
    assert _wait_for(lambda: _written(f"{folder}/sleep"), 60)
    if item == 0:
        time.sleep(60)  # past the map's timeout
    if item == 1:
        raise ValueError("fn fails, and its worker is stopped")
    return item  # they run on, until the pool closes


def _written(path: Any) -> bool:
    """Whether ``path`` exists and has something in it (a PID, once the shell wrote it)."""
    return os.path.exists(path) and os.path.getsize(path) > 0


def _started_pids(folder: Any) -> list[int]:
    pids = []
    for name in ("sh", "sleep"):
        with open(os.path.join(folder, name)) as file:
            pids.append(int(file.read()))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.parametrize("how", ["timeout", "fn raises", "pool closes"])
def test_processes_fn_started_end_with_their_worker(
    how: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, only the worker was stopped: `sleep 60` lived on, with PPID 1. Both
    # the child and the grandchild are stopped, whether the worker was busy or idle.
    monkeypatch.setenv("DK_TEST_PIDS", str(tmp_path))
    with dk.gpu_pool(devices=["cpu"]) as pool:
        if how == "timeout":
            with pytest.raises(dk.WorkerTimeoutError):
                pool.map(start_a_child, [0], timeout=1)
        elif how == "fn raises":
            with pytest.raises(dk.WorkerError, match="fn fails, and its worker is stopped"):
                pool.map(start_a_child, [1])
        else:
            assert pool.map(start_a_child, [2]) == [2]
    started = _started_pids(tmp_path)
    try:
        for pid in started:
            assert _wait_for(lambda: not _alive(pid), 10), "what fn started outlived the map"  # noqa: B023
    finally:
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_workers_stay_in_the_caller_s_process_group_and_session() -> None:
    # Before, each worker made a session of its own (os.setsid): what a terminal or
    # `timeout` sends the caller's group no longer reached the processes fn started.
    with dk.gpu_pool(devices=["cpu"], workers_per_device=2) as pool:
        assert pool.map(abs, [-1, -2]) == [1, 2]
        for worker in pool._workers:
            pid = worker.process.pid
            assert os.getpgid(pid) == os.getpgrp()
            assert os.getsid(pid) == os.getsid(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_a_signal_to_a_killed_caller_s_group_reaches_what_fn_started(tmp_path: Any) -> None:
    # The caller is killed with its group, as a terminal's hang-up or `timeout -s KILL`
    # kills a job: it runs no code, its workers end by their parent-death signal, and
    # what fn started must be in the group to be killed too. Before, `sleep 60` lived
    # on, with PPID 1, in the session its worker had made.
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(
            """
            import devicekit as dk
            from tests.test_parallel import start_a_child
            if __name__ == "__main__":
                dk.gpu_map(start_a_child, [0], devices=["cpu"])
            """
        )
    )
    caller = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_importable(DK_TEST_PIDS=str(tmp_path)),
        start_new_session=True,  # a group of its own, as a shell's job is
    )
    started: list[int] = []
    try:
        assert _wait_for(lambda: _written(tmp_path / "sleep"), 120), "fn started nothing"
        started = _started_pids(tmp_path)
        os.killpg(caller.pid, signal.SIGKILL)
        caller.wait(30)
        for pid in started:
            assert _wait_for(lambda: not _alive(pid), 30), "what fn started outlived the caller"  # noqa: B023
    finally:
        with contextlib.suppress(OSError):
            os.killpg(caller.pid, signal.SIGKILL)
        caller.wait(30)
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def trap_then_start_more(folder: str) -> None:
    """Start a shell that, on SIGTERM, starts ``sleep 61`` and runs on; hang."""
    shell = (
        'trap \'sleep 61 & echo $! > "$0.late"\' TERM; echo $$ > "$0"; while :; do sleep 1; done'
    )
    subprocess.Popen(["sh", "-c", shell, f"{folder}/shell"])
    time.sleep(60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_what_fn_started_while_being_stopped_is_killed_too(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process that answers SIGTERM by starting another: the last step looks the
    # workers' descendants up again, so the late one gets SIGKILL too.
    from devicekit import _dispatch

    real_signal_each = _dispatch.signal_each
    gc.collect()  # a pool an earlier test dropped is stopped now, not through the patch below

    def signal_each(procs: dict[int, int], signum: int) -> list[int]:
        sent = real_signal_each(procs, signum)
        trapped = (tmp_path / "shell").exists()  # this test's stop, not another pool's
        if signum == signal.SIGTERM and trapped:  # let the trap start its process first
            assert _wait_for(lambda: _written(tmp_path / "shell.late"), 60)
        return sent

    monkeypatch.setattr(_dispatch, "signal_each", signal_each)
    monkeypatch.setattr(_dispatch, "_STOP_SECONDS", 0.5)  # the shell ignores SIGTERM: not long
    with dk.gpu_pool(devices=["cpu"]) as pool, pytest.raises(dk.WorkerTimeoutError):
        pool.map(trap_then_start_more, [str(tmp_path)], timeout=2)
    pids = []
    for name in ("shell", "shell.late"):
        with open(tmp_path / name) as file:
            pids.append(int(file.read()))
    try:
        for pid in pids:
            assert _wait_for(lambda: not _alive(pid), 10), "a process outlived the stop"  # noqa: B023
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _fake_proc(root: Any, table: dict[int, tuple[int, int]], *, children: bool) -> str:
    """A /proc of ``{pid: (parent, start time)}``, with ``task/<pid>/children`` files or none."""
    for pid, (parent, started) in table.items():
        task = root / str(pid) / "task" / str(pid)
        task.mkdir(parents=True, exist_ok=True)
        fields = ["S", str(parent), *["0"] * 17, str(started), "0"]
        (root / str(pid) / "stat").write_text(f"{pid} (a (b) c) {' '.join(fields)}\n")
        if children:
            kids = [str(kid) for kid, (up, _) in table.items() if up == pid]
            (task / "children").write_text(" ".join(kids) + (" " if kids else ""))
    return str(root)


# PIDs above the kernel's largest (2**22): no process of this machine can have one.
W, C, G, U = 2**22 + 1, 2**22 + 2, 2**22 + 3, 2**22 + 4


@pytest.mark.parametrize("children", [True, False], ids=["children files", "stat scan"])
def test_descendants_are_found_by_parent_and_tied_to_their_start_time(
    tmp_path: Any, children: bool
) -> None:
    from devicekit._workerstate import descendants

    table = {W: (1, 100), C: (W, 150), G: (C, 160), U: (1, 170)}
    proc = _fake_proc(tmp_path, table, children=children)
    assert descendants({W: 100}, proc=proc) == {C: 150, G: 160}
    assert descendants({C: 150}, proc=proc) == {G: 160}
    # The worker's PID has another start time: it is another process's now (the
    # worker was reaped), whose children are not the worker's.
    assert descendants({W: 99}, proc=proc) == {}


def test_a_child_listed_before_its_pid_was_reused_is_not_taken(tmp_path: Any) -> None:
    from devicekit._workerstate import descendants

    # W's children file names C, but C's stat names another parent: C ended after the
    # list was read, and its PID went to a process that is not W's.
    proc = _fake_proc(tmp_path, {W: (1, 100), C: (W, 150)}, children=True)
    (tmp_path / str(C) / "stat").write_text(f"{C} (x) S 1 {' '.join(['0'] * 17)} 180 0\n")
    assert descendants({W: 100}, proc=proc) == {}


def test_without_linux_s_proc_no_descendants_are_looked_up(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # macOS: only the workers are stopped, as before workers had sessions of their own
    # (which, there, hid fn's processes from the terminal's Ctrl-C too).
    from devicekit import _workerstate

    assert _workerstate.descendants({W: 100}, proc=str(tmp_path / "none")) == {}
    monkeypatch.setattr(_workerstate.sys, "platform", "darwin")
    assert _workerstate.descendants({os.getpid(): 1}) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_a_pid_whose_start_time_changed_is_not_signalled() -> None:
    # The process recorded at this PID has ended and the PID went to another one (the
    # `sleep` here): another start time, so it is left alone.
    from devicekit._workerstate import signal_each, start_time

    other = subprocess.Popen(["sleep", "60"])
    try:
        started = start_time(other.pid)
        assert started is not None
        assert signal_each({other.pid: started - 1}, signal.SIGKILL) == []
        assert other.poll() is None
        assert signal_each({other.pid: started}, signal.SIGKILL) == [other.pid]
        assert other.wait(30) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait(30)


def test_a_worker_s_start_time_is_read_only_where_proc_shows_it_as_our_child(
    tmp_path: Any,
) -> None:
    from devicekit._workerstate import child_start_time

    proc = _fake_proc(tmp_path, {W: (os.getpid(), 100), C: (1, 150)}, children=True)
    assert child_start_time(W, proc=proc) is None  # no `self`: not a /proc of ours
    (tmp_path / "self").symlink_to("1")  # another PID namespace's /proc
    assert child_start_time(W, proc=proc) is None
    (tmp_path / "self").unlink()
    (tmp_path / "self").symlink_to(str(os.getpid()))
    assert child_start_time(W, proc=proc) == 100
    assert child_start_time(C, proc=proc) is None  # not our child: another process's PID


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.parametrize("foreign", ["proc/self", "parent"])
def test_workers_seen_in_another_pid_namespace_s_proc_have_no_descendants(
    foreign: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a /proc of another PID namespace (`unshare -pf` without --mount-proc)
    # gave the worker's PID another process's start time, and that process's
    # descendants were signalled when the workers stopped. Now the worker's start
    # time is recorded only where /proc is ours and names us as its parent.
    from devicekit import _dispatch, _workerstate

    if foreign == "proc/self":
        real_readlink = os.readlink

        def readlink(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path) == "/proc/self":
                return "1"  # in that namespace's numbering, we are someone else
            return real_readlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "readlink", readlink)
    else:
        real_stat = _workerstate._stat

        def stat(pid: int, proc: str) -> tuple[str, int, int] | None:
            found = real_stat(pid, proc)
            return None if found is None else (found[0], 1, found[2])  # another's child

        monkeypatch.setattr(_workerstate, "_stat", stat)
    with dk.gpu_pool(devices=["cpu"]) as pool:
        assert pool.map(abs, [-1]) == [1]
        assert [worker.started for worker in pool._workers] == [None]
        assert _dispatch._started_by(pool._workers, {}) == {}


@pytest.mark.skipif(
    not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"),
    reason="needs pidfds",
)
@pytest.mark.parametrize(
    "refusal",
    [PermissionError(errno.EPERM, "Operation not permitted"), OSError(errno.ENOSYS, "nosys")],
    ids=["EPERM", "ENOSYS"],
)
def test_a_refused_pidfd_signal_falls_back_to_kill(
    refusal: OSError, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a seccomp filter or gVisor refusing pidfd_send_signal read as "it has
    # ended": the process was never signalled and outlived the stop.
    from devicekit import _workerstate

    def refused(pidfd: int, signum: int, *args: Any) -> None:
        raise refusal

    other = subprocess.Popen(["sleep", "60"])
    try:
        started = _workerstate.start_time(other.pid)
        assert started is not None
        monkeypatch.setattr(_workerstate.signal, "pidfd_send_signal", refused)
        assert _workerstate.signal_each({other.pid: started}, signal.SIGKILL) == [other.pid]
        assert other.wait(30) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait(30)


def test_a_ctrl_c_while_looking_up_descendants_still_kills_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a second Ctrl-C during the last lookup of the workers' descendants (a
    # scan of all /proc where there are no children files) skipped every SIGKILL.
    from devicekit import _dispatch

    calls: list[int] = []

    def started_by(workers: list[Any], known: dict[int, int]) -> dict[int, int]:
        calls.append(1)
        if len(calls) == 2:  # the one before the SIGKILLs
            raise KeyboardInterrupt
        return {}

    monkeypatch.setattr(_dispatch, "_started_by", started_by)
    events: list[str] = []
    workers = [_dispatch.Worker(n, "cpu", _Stubborn(n, events), _Conn()) for n in (1, 2)]
    with pytest.raises(KeyboardInterrupt):
        _dispatch.stop_workers(workers, gently=False)
    assert events[-4:] == ["kill 1", "kill 2", "join 1", "join 2"]
    assert not any(worker.process.is_alive() for worker in workers)


def test_a_pool_names_itself_in_its_errors() -> None:
    # Before, each of these said gpu_map, which the caller had not called.
    with dk.gpu_pool(devices=["cpu"]) as pool:
        with pytest.raises(TypeError, match=r"^GPUPool\.map\(\) sends fn to worker processes"):
            pool.map(lambda x: x, [1])
        with pytest.raises(
            TypeError,
            match=r"^GPUPool\.map\(\) sends each item to a worker process, so it must be "
            r"picklable, and item 1 \(<function .*, of type function\) is not: ",
        ):
            pool.map(str, [1, lambda: 2])
        with pytest.raises(
            dk.WorkerError, match=r"^GPUPool\.map\(\): fn raised on item 3 \(3\) in worker 1"
        ):
            pool.map(fail_on_three, range(5))


class IndexedOnly:
    """Iterable by the old protocol only: ``[i]`` until ``IndexError``, no ``__iter__`` or len()."""

    def __getitem__(self, index: int) -> int:
        if index >= 3:
            raise IndexError(index)
        return -index


def test_items_none_and_items_iterable_by_index_only() -> None:
    # Before: "pass a list, such as [None]". And an object with [i] alone was read from
    # [0] to the first IndexError: where [i] never raises one, for ever, its memory
    # growing; it is refused, saying what to give it.
    with pytest.raises(TypeError) as info:
        dk.gpu_map(abs, None, devices=["cpu"])  # type: ignore[arg-type]
    assert str(info.value) == (
        "gpu_map() needs items, an iterable (a list, a generator) or a map-style dataset "
        "(len() and [i]) of the items to run fn on, got None"
    )
    before = set(multiprocessing.active_children())
    with pytest.raises(TypeError) as info:
        dk.gpu_map(abs, IndexedOnly(), devices=["cpu"])  # type: ignore[arg-type]
    assert re.fullmatch(
        r"gpu_map\(\) needs items, an iterable \(a list, a generator\) or a map-style dataset "
        r"\(len\(\) and \[i\]\) of the items to run fn on, got <tests\.test_parallel\."
        r"IndexedOnly object at 0x[0-9a-f]+> of type IndexedOnly, which has \[i\] but neither "
        r"len\(\) nor __iter__, so where its items end is not known \(read \[0\], \[1\]\.\.\. "
        r"until an IndexError, it is read for ever if \[i\] never raises one\)\. Give its "
        r"class __len__ \(a map-style dataset\) or __iter__, or pass a list of its items",
        str(info.value),
    ), str(info.value)
    assert set(multiprocessing.active_children()) == before
    with (
        dk.gpu_pool(devices=["cpu"]) as pool,
        pytest.raises(TypeError, match=r"^GPUPool\.map\(\) needs items, .* neither len"),
    ):
        pool.map(abs, IndexedOnly())  # type: ignore[arg-type]


class _Huge:
    """A callable, and not picklable, whose repr is a megabyte long."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, item: object) -> object:
        return item

    def __repr__(self) -> str:
        return "H" * 10**6


def test_errors_show_a_large_fn_or_items_cut_short() -> None:
    # Before, each error quoted the whole repr: a megabyte of message.
    huge = list(range(10**6))
    refused: list[tuple[Callable[[], object], str]] = [
        (lambda: dk.gpu_map(huge, [1], devices=["cpu"]), r"got \[0, 1, 2, .*\.\.\. of type list"),
        (lambda: dk.gpu_map(abs, _Huge(), devices=["cpu"]), r"got H+\.\.\.H+ of type _Huge"),
        (lambda: dk.gpu_map(_Huge(), [1], devices=["cpu"]), r"picklable, and H+\.\.\.H+ is not"),
    ]
    for call, shown in refused:
        with pytest.raises(TypeError) as info:
            call()
        assert re.search(shown, str(info.value)), str(info.value)
        assert len(str(info.value)) < 1000, str(info.value)[:300]


def test_the_worker_limit_counts_the_workers_a_map_starts() -> None:
    # Before, 1,025 devices for 2 items were refused: "would start 1,025 worker
    # processes ... Use fewer workers per device", for a map that starts 2.
    assert dk.gpu_map(abs, [-1, -2], devices=["cpu"] * 1025) == [1, 2]
    with pytest.raises(
        ValueError,
        match=r"^workers_per_device=1 on 1025 devices would start 1,025 worker processes, "
        r"each importing torch; gpu_pool\(\) starts at most 1024\. Name at most 1024 devices",
    ):
        dk.gpu_pool(devices=["cpu"] * 1025)


def test_what_an_error_kept_is_said_in_good_english() -> None:
    from devicekit._mapfaults import kept

    # Before: "0 of 1 item had finished: their results are in this error's .results".
    assert kept(0, 1) == "0 of 1 item had finished, so this error's .results is empty."
    assert kept(1, 4).startswith("1 of 4 items had finished: its result is in this error's ")
    assert kept(2, 4).startswith("2 of 4 items had finished: their results are in ")


def start_a_child_then_die(how: str) -> int:
    """Start what ``start_a_child`` starts, then end the worker without a word: ``how``."""
    start_a_child(2)
    if how == "SIGKILL":  # as the out-of-memory killer does
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def _kill_what_was_started(folder: Any) -> None:
    """Kill what ``start_a_child`` started, where it wrote its PIDs and it still runs."""
    for name in ("sh", "sleep"):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(folder, name)) as file:
                pid = int(file.read())
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _said_stopped(message: str) -> set[tuple[int, str]]:
    """The processes a message says were stopped, as ``{(pid, name)}``."""
    said = re.search(
        r"2 processes that its fn had started outlived it and were stopped: "
        r"PID (\d+) \((\w+)\), PID (\d+) \((\w+)\)\.$",
        message,
    )
    assert said, message
    return {(int(said[1]), said[2]), (int(said[3]), said[4])}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["os._exit", "SIGKILL"])
def test_what_fn_started_is_stopped_when_its_worker_dies_by_itself(
    how: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, `sh` and `sleep 60` lived on, with PPID 1: a worker that dies by itself
    # leaves its children to init, and no parent PID led from it to them any more.
    # They are found by the mark the worker left in their environment.
    monkeypatch.setenv("DK_TEST_PIDS", str(tmp_path))
    try:
        with pytest.raises(dk.WorkerError) as info:
            dk.gpu_map(start_a_child_then_die, [how], devices=["cpu"])
        sh, sleep = _started_pids(tmp_path)
        for pid in (sh, sleep):
            assert _wait_for(lambda: not _alive(pid), 10), "what fn started outlived it"  # noqa: B023
        message = str(info.value)
        if how == "SIGKILL":
            assert message.startswith(
                "gpu_map: worker 1 on the CPU was killed by SIGKILL (the out-of-memory killer "
                "sends it) while running item 0 ('SIGKILL'). 2 processes that its fn had "
                "started outlived it and were stopped: PID "
            ), message
        else:
            assert "(any message is on stderr above). 2 processes that" in message, message
        assert _said_stopped(message) == {(sh, "sh"), (sleep, "sleep")}
    finally:
        _kill_what_was_started(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.timeout(300)
def test_what_fn_started_is_stopped_when_an_idle_pool_worker_dies(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, the warning said nothing of them and they ran on, given to init.
    monkeypatch.setenv("DK_TEST_PIDS", str(tmp_path))
    try:
        with dk.gpu_pool(devices=["cpu"]) as pool:
            assert pool.map(start_a_child, [2]) == [2]  # they run on, below the idle worker
            sh, sleep = _started_pids(tmp_path)
            (victim,) = pool._workers
            os.kill(victim.process.pid, signal.SIGKILL)
            # Its own wait, not /proc: a zombie whose threads still end cannot be waited
            # for yet, and would read as alive to the next map, which would see it die.
            assert _wait_for(lambda: not victim.alive(), 30)
            with caplog.at_level(logging.WARNING, logger="devicekit"):
                assert pool.map(abs, [-3]) == [3]
            for pid in (sh, sleep):
                assert _wait_for(lambda: not _alive(pid), 10), "what fn started outlived it"  # noqa: B023
        (warning,) = [record.getMessage() for record in caplog.records]
        assert warning.startswith(
            "GPUPool.map(): worker 1 on the CPU was killed by SIGKILL (the out-of-memory killer "
            "sends it) while idle, after the last map; starting a fresh one in its place (no "
            "item was lost). 2 processes that its fn had started"
        ), warning
        assert _said_stopped(warning) == {(sh, "sh"), (sleep, "sleep")}
    finally:
        _kill_what_was_started(tmp_path)


def marks_of_a_child(item: int) -> tuple[str, str]:
    """The mark a process this worker starts carries, and this worker's own ``PID-start time``."""
    from devicekit._workerstate import start_time

    shell = subprocess.run(
        ["sh", "-c", "echo $DEVICEKIT_WORKER"], capture_output=True, text=True, check=True
    )
    return shell.stdout.strip(), f"{os.getpid()}-{start_time(os.getpid())}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_a_worker_marks_what_it_starts_below_any_worker_above_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This process was started by another worker's fn: its mark stays, ours is added.
    monkeypatch.setenv("DEVICEKIT_WORKER", "12-345")
    ((mark, worker),) = dk.gpu_map(marks_of_a_child, [0], devices=["cpu"])
    assert mark == f"12-345 {worker}"
    assert os.environ["DEVICEKIT_WORKER"] == "12-345"  # the caller's own is left alone


# Two more PIDs no process of this machine can have.
E, X = 2**22 + 5, 2**22 + 6


def test_processes_marked_by_a_worker_are_found_once_it_has_ended(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devicekit._workerstate import descendants, marked, orphans

    # W has ended and is gone from /proc. C, given to init, carries W's mark among
    # others; G is C's child, which dropped the mark; E carries it but started before
    # W (it copied the mark: no process W started is older than W); X carries the
    # mark of another process that had W's PID; U carries none.
    table = {C: (1, 150), G: (C, 160), E: (1, 90), X: (1, 170), U: (1, 180)}
    proc = _fake_proc(tmp_path, table, children=True)
    environs = {
        C: f"PATH=/bin\0DEVICEKIT_WORKER=7-1 {W}-100\0",
        G: "PATH=/bin\0",
        E: f"DEVICEKIT_WORKER={W}-100\0",
        X: f"DEVICEKIT_WORKER={W}-99\0",
        U: "HOME=/\0",
    }
    for pid, environ in environs.items():
        (tmp_path / str(pid) / "environ").write_text(environ)
    assert marked({W: 100}, proc=proc) == {C: 150}
    (found,) = orphans([_dead_worker(W, 100)], proc=proc)
    assert found.procs == {C: 150, G: 160}
    assert found.names == {C: "a (b) c", G: "a (b) c"}
    assert descendants({W: 100}, proc=proc) == {}  # by parent PID only: W has none now
    assert marked({C: 150}, proc=proc) == {}  # a mark names a worker, not its descendants
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # none of them is this user's
    assert marked({W: 100}, proc=proc) == {}


class _Ended:
    """A worker's process that has ended: what `_dead_worker` stands on."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        return False


def _dead_worker(pid: int, started: int) -> Any:
    from devicekit._workerstate import Worker

    return Worker(number=1, slot="cpu", process=_Ended(pid), conn=None, started=started)


def close_in_thread(pool: dk.GPUPool) -> BaseException | None:
    """``pool.close()`` from a thread of its own: what it raised (None: nothing); 60 s at most."""
    outcome: list[BaseException | None] = []

    def close() -> None:
        try:
            pool.close()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - returned to the test
            outcome.append(error)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(60)  # refused at once: were it to wait or hang, this ends it
    assert not closer.is_alive(), "close() waited"
    return outcome[0]


@pytest.mark.timeout(300)
def test_closing_a_pool_while_another_thread_maps_on_it_is_refused_at_once(
    tmp_path: Any,
) -> None:
    # Before, close() stopped the workers under the running map: the map failed
    # with "worker 1 on the CPU was killed by SIGTERM while running item 0", as if the
    # worker had crashed, and its thread raced close() to stop the same processes.
    gate = str(tmp_path / "gate")
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["map"] = pool.map(wait_for_gate, [gate])
        except BaseException as error:  # noqa: BLE001 - shown by the assertions below
            outcome["map"] = error

    with dk.gpu_pool(devices=["cpu"]) as pool:
        mapper = threading.Thread(target=run, name="first-map", daemon=True)
        mapper.start()
        try:
            assert _wait_for(lambda: os.path.exists(gate + ".started"), 120), "fn never ran"
            refused = close_in_thread(pool)
            assert type(refused) is RuntimeError
            assert str(refused) == (
                "GPUPool.close() was called while GPUPool.map() runs on this pool, in thread "
                "'first-map'; the pool is left open, and the map runs on. Closing it would "
                "stop the workers under that map. Close the pool from the thread that maps, "
                "once map() has returned (leave the `with dk.gpu_pool()` block there); to end "
                "a map that takes too long, pass map(..., timeout=seconds)."
            )
            assert "map" not in outcome  # the map runs on, unaffected
        finally:
            open(gate, "w").close()
            mapper.join(60)
        assert outcome["map"] == [gate]
        assert pool.map(abs, [-2]) == [2]  # still open, and its workers with it
        assert close_in_thread(pool) is None  # no map runs now: closed from any thread
        assert pool._workers == []
        with pytest.raises(ValueError, match="this GPUPool is closed"):
            pool.map(abs, [-3])


def environment_of_a_child(item: int) -> dict[str, str]:
    """The environment a process this worker starts is given: its mark included."""
    shell = subprocess.run(["env", "-0"], capture_output=True, check=True)
    pairs = [entry.split("=", 1) for entry in shell.stdout.decode().split("\0") if "=" in entry]
    return dict(pairs)


def start_a_daemon(item: int) -> int:
    """Start ``sleep 60`` as ``nohup server &`` does (its shell exits: init has it); its PID."""
    shell = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(shell.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.timeout(300)
def test_a_process_that_carries_a_live_worker_s_mark_outlives_an_orderly_stop() -> None:
    # Before, every stop looked for the mark, the end of every map included: closing
    # the pool killed this process, which fn never started, as it killed a tmux
    # server that fn had started and the user had gone on using.
    stranger: subprocess.Popen[bytes] | None = None
    try:
        with dk.gpu_pool(devices=["cpu"]) as pool:
            (environ,) = pool.map(environment_of_a_child, [0])
            assert environ["DEVICEKIT_WORKER"]  # copied, as tmux or `at` copy it
            stranger = subprocess.Popen(["sleep", "60"], env=environ)
        assert _alive(stranger.pid), "an orderly close stopped a process fn never started"
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.timeout(300)
def test_a_daemon_that_fn_started_outlives_the_end_of_gpu_map() -> None:
    # Before, `nohup server &` in fn was stopped at the end of every gpu_map: found by
    # the mark, though its worker ended in order. Only a worker's descendants are.
    (daemon,) = dk.gpu_map(start_a_daemon, [0], devices=["cpu"])
    try:
        assert _alive(daemon), "the end of gpu_map stopped a daemon fn had started"
    finally:
        with contextlib.suppress(OSError):
            os.kill(daemon, signal.SIGKILL)


def _ticks_now() -> float:
    """Clock ticks since boot, as ``/proc/<pid>/stat`` counts a start time."""
    with open("/proc/uptime") as uptime:
        return float(uptime.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def _environs_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The PIDs whose ``/proc/<pid>/environ`` ``_workerstate`` opens from now on, in order."""
    from devicekit import _workerstate

    read: list[int] = []

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("/environ"):
            read.append(int(str(path).split("/")[-2]))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(_workerstate, "open", spy, raising=False)
    return read


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.timeout(300)
def test_an_orderly_stop_reads_no_process_s_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, every stop read /proc/<pid>/environ of every process of this user, twice
    # (17 to 54 ms with a thousand processes; each read takes the process's memory
    # map lock, which a hung process may hold): this one's, say.
    older = subprocess.Popen(["sleep", "60"])
    try:
        read = _environs_read(monkeypatch)
        with dk.gpu_pool(devices=["cpu"]) as pool:
            assert pool.map(abs, [-1]) == [1]
        assert dk.gpu_map(abs, [-2], devices=["cpu"]) == [2]
        assert read == []
    finally:
        older.kill()
        older.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.timeout(300)
def test_a_dead_worker_s_mark_is_looked_for_once_and_in_younger_processes_only(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a stop after a worker died read each process's environment three times
    # (once for the error's names, twice in the stop), that of processes older than
    # every worker included, which cannot carry a worker's mark.
    from devicekit._workerstate import start_time

    monkeypatch.setenv("DK_TEST_PIDS", str(tmp_path))
    older = subprocess.Popen(["sleep", "60"])
    try:
        started = start_time(older.pid)
        assert started is not None
        # Start times are in clock ticks: the worker's must come at a later tick.
        assert _wait_for(lambda: _ticks_now() > started + 1, 60)
        read = _environs_read(monkeypatch)
        with pytest.raises(dk.WorkerError, match="were stopped: PID"):
            dk.gpu_map(start_a_child_then_die, ["SIGKILL"], devices=["cpu"])
        sh, sleep = _started_pids(tmp_path)
        assert read.count(sh) == 1, read
        assert read.count(sleep) == 1, read
        assert older.pid not in read
    finally:
        older.kill()
        older.wait()
        _kill_what_was_started(tmp_path)


def test_a_message_names_ten_leftover_processes_and_counts_the_rest() -> None:
    # Before, all were named: up to 4,096 of them, from a fork bomb in fn.
    from devicekit._mapfaults import outlived

    stopped = dict.fromkeys(range(100, 112), "sleep")
    said = outlived(stopped, dict.fromkeys(range(200, 213), "cat"))
    named = ", ".join(f"PID {pid} (sleep)" for pid in range(100, 110))
    assert f"were stopped: {named}, and 2 more." in said, said
    assert "PID 110" not in said
    assert said.endswith(
        "PID 209 (cat), and 3 more; stop them yourself (kill -9 200 201 202 203 204 205 206 "
        "207 208 209, and the 3 more)."
    ), said


def close_from_a_handler(pool: dk.GPUPool, caught: list[BaseException], *, reraise: bool) -> Any:
    """Make SIGUSR1 close ``pool``; what that raises goes to ``caught``, and on if ``reraise``."""

    def handler(signum: int, frame: Any) -> None:
        try:
            pool.close()
        except RuntimeError as error:
            caught.append(error)
            if reraise:
                raise

    return signal.signal(signal.SIGUSR1, handler)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("handler", ["lets the error out", "catches the error"])
def test_closing_a_pool_from_a_signal_handler_in_the_mapping_thread_closes_it(
    tmp_path: Any, handler: str
) -> None:
    # Before, the map was stopped but the pool was left open ("the pool is left
    # open"): a shutdown handler's close() did not close it. A handler that caught
    # the error left the map, and then the pool, running.
    gate = str(tmp_path / "gate")
    caught: list[BaseException] = []

    def signal_then_open_the_gate() -> None:
        _wait_for(lambda: os.path.exists(gate + ".started"), 120)
        os.kill(os.getpid(), signal.SIGUSR1)
        if handler == "catches the error":
            _wait_for(lambda: bool(caught), 60)
            open(gate, "w").close()

    with dk.gpu_pool(devices=["cpu"]) as pool:
        reraise = handler == "lets the error out"
        previous = close_from_a_handler(pool, caught, reraise=reraise)
        sender = threading.Thread(target=signal_then_open_the_gate, daemon=True)
        try:
            sender.start()
            if handler == "catches the error":
                assert pool.map(wait_for_gate, [gate]) == [gate]
            else:
                with pytest.raises(RuntimeError):
                    pool.map(wait_for_gate, [gate])
        finally:
            signal.signal(signal.SIGUSR1, previous)
            open(gate, "w").close()
            sender.join(60)
        assert pool._workers == []
        assert repr(pool).endswith("; closed)")
        with pytest.raises(ValueError, match="this GPUPool is closed"):
            pool.map(abs, [-1])
        (error,) = caught
        assert str(error) == (
            "GPUPool.close() was called while GPUPool.map() runs on this pool, in this same "
            "thread: this call came from inside it (a signal handler or a callback, say); "
            "this error stops that map (its workers are stopped) and the pool is closed. To "
            "end a map that takes too long, pass map(..., timeout=seconds); to keep the "
            "map, close the pool once map() has returned."
        )


@pytest.mark.timeout(300)
def test_a_close_between_map_s_check_and_its_start_leaves_the_pool_closed() -> None:
    # A signal handler's close() can run between map()'s check of the pool and its
    # mark that a map runs (the lock is reentrant): before, the map then started
    # fresh workers on the closed pool, which nothing stopped until it was collected.
    import inspect

    from devicekit._parallel import GPUPool

    lines, first = inspect.getsourcelines(GPUPool.map)
    (at,) = [first + i for i, line in enumerate(lines) if "self._mapper = threading." in line]
    pool = dk.gpu_pool(devices=["cpu"])

    def in_map(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == at:
            pool.close()  # as a signal handler would, between two lines of map()
        return in_map

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return in_map if frame.f_code is GPUPool.map.__code__ else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with pytest.raises(ValueError, match="this GPUPool is closed"):
            pool.map(abs, [-1])
    finally:
        sys.settrace(previous)
        workers = list(pool._workers)
        pool._closed = False
        pool.close()
    assert workers == []


def _interrupted(*args: Any, **kwargs: Any) -> Any:
    raise KeyboardInterrupt


@pytest.mark.timeout(300)
def test_a_second_ctrl_c_while_dead_workers_are_looked_up_still_stops_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a Ctrl-C during the scan for what dead workers had started skipped the
    # stop: the pool kept its workers, running, after the map had failed.
    from devicekit import _parallel

    pool = dk.gpu_pool(devices=["cpu", "cpu"])
    try:
        assert pool.map(abs, [-1, -2]) == [1, 2]
        processes = [worker.process for worker in pool._workers]
        monkeypatch.setattr(_parallel, "orphans", _interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.map(math.sqrt, [-1])  # fn raises: a WorkerError, then the scan
        assert pool._workers == []
        assert not any(process.is_alive() for process in processes)
    finally:
        monkeypatch.undo()
        pool.close()


def start_a_daemon_then_hang(pid_file: str) -> None:
    """Start a daemon (as ``nohup server &``), note its PID, and never return."""
    Path(pid_file).write_text(str(start_a_daemon(0)))
    time.sleep(600)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.timeout(300)
def test_a_daemon_that_fn_started_is_stopped_with_a_map_cut_short(tmp_path: Path) -> None:
    # Before, a map stopped by its timeout (a failure, Ctrl-C) left what fn had detached
    # from its worker running: no parent PID leads to it, and the mark was looked for
    # only after a worker died on its own.
    pid_file = tmp_path / "daemon.pid"
    daemon = None
    try:
        with pytest.raises(dk.WorkerTimeoutError):
            dk.gpu_map(start_a_daemon_then_hang, [str(pid_file)], devices=["cpu"], timeout=5)
        daemon = int(pid_file.read_text())
        assert _wait_for(lambda: not _alive(daemon), 10), "the daemon outlived the map"
    finally:
        if daemon is not None:
            with contextlib.suppress(OSError):
                os.kill(daemon, signal.SIGKILL)
