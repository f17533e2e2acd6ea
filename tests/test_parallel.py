from __future__ import annotations

import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk

from .conftest import CTRL_C_WORKS, GPU_COUNT, FakeAccelerator


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
    from devicekit import _parallel

    fake_accelerator(None, 0)
    assert _parallel._slots(None, 1) == ["cpu"] * (os.cpu_count() or 1)
    assert _parallel._slots(None, 2) == ["cpu"] * 2 * (os.cpu_count() or 1)


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


def test_devices_accept_torch_devices_and_one_string(fake_accelerator: FakeAccelerator) -> None:
    from devicekit import _parallel

    fake_accelerator("cuda", 2)
    assert _parallel._slots([torch.device("cuda", 1), "cpu"], 1) == [1, "cpu"]
    assert _parallel._slots("cpu", 2) == ["cpu", "cpu"]  # one string is one device
    assert _parallel._slots(torch.device("cuda", 0), 1) == [0]


def test_few_items_spread_over_every_device(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before, slots were device by device ([0, 0, 1, 1]) and gpu_map kept the first
    # len(items): two items ran both on the first GPU while the second sat idle.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    fake_accelerator("cuda", 2)
    results = dk.gpu_map(where, range(2), devices=[0, 1], workers_per_device=2)
    assert sorted(visible or "" for _, visible, _ in results) == ["5", "7"]
    from devicekit import _parallel

    assert _parallel._slots([0, 1], 2) == [0, 1, 0, 1]


def test_workers_per_device_beyond_the_items_builds_no_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit import _parallel

    real_slots = _parallel._slots
    asked: list[int] = []

    def slots(devices: object, workers_per_device: int, *, caller: str = "") -> list[str | int]:
        asked.append(workers_per_device)
        # Before, gpu_map built all 10**12 slots (memory, for minutes) to use two.
        assert workers_per_device <= 2, "gpu_map built slots for workers it never starts"
        return real_slots(devices, workers_per_device, caller=caller)

    monkeypatch.setattr(_parallel, "_slots", slots)
    assert dk.gpu_map(abs, [-1, -2], devices=["cpu"], workers_per_device=10**12) == [1, 2]
    assert asked == [2]


def test_a_failed_start_leaves_no_worker_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit import _parallel

    real_env = _parallel.worker_env
    calls: list[str | int] = []

    def env_then_fail(device: str | int) -> str:
        calls.append(device)
        if len(calls) == 2:  # the second worker cannot start (EAGAIN, Ctrl-C...)
            raise OSError("cannot start a process")
        return real_env(device)

    monkeypatch.setattr(_parallel, "worker_env", env_then_fail)
    with dk.gpu_pool(devices=["cpu", "cpu"]) as pool:
        with pytest.raises(OSError, match="cannot start a process"):
            pool.map(abs, [1, 2])
        # Before, the first worker stayed in the pool, and every later map ran on
        # it alone, one worker short, without a word.
        assert pool._workers == []
        assert not multiprocessing.active_children()
        assert pool.map(where, range(2))
        assert len(pool._workers) == 2


def test_a_worker_that_exits_in_fn_says_why() -> None:
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(exit_on_two, [1, 2], devices=["cpu"])
    assert str(info.value) == (
        "gpu_map: worker 1 on the CPU exited with code 0 while running item 1 (2). fn must "
        "return or raise an Exception: sys.exit(), os._exit() or KeyboardInterrupt in fn "
        "ends its worker (any traceback is on stderr above)"
    )


REPO = os.path.dirname(os.path.dirname(__file__))


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
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("caught gpu_map: fn raised on item 3")


def test_an_unpicklable_item_is_named_before_any_worker_starts() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(TypeError) as info:
        dk.gpu_map(math.sqrt, [1, lambda: 2, 3], devices=["cpu"])
    message = str(info.value)
    assert "item 1 (<function " in message
    assert "<lambda>" in message
    assert "a function) is not: " in message
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
    with pytest.raises(dk.WorkerError, match=r"worker 1 on the CPU exited with code 3 while"):
        dk.gpu_map(die, [2], devices=["cpu"])


def test_workers_are_named_by_their_gpu(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    fake_accelerator("cuda", 2)
    with pytest.raises(dk.WorkerError, match=r"fn raised on item 0 \(3\) in worker 1 on cuda:1"):
        dk.gpu_map(fail_on_three, [3], devices=["cuda:1"])


def _kill_parent_and_watch(script: str, workers: int, tmp_path: Any) -> None:
    env = {**os.environ, "DK_TEST_PIDS": str(tmp_path)}
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env)
    try:
        assert _wait_for(lambda: len(os.listdir(tmp_path)) >= workers, 60), "workers never ran"
        pids = [int(name) for name in os.listdir(tmp_path)]
        assert all(_alive(pid) for pid in pids)
    finally:
        parent.kill()  # SIGKILL: the parent runs no cleanup at all
        parent.wait(timeout=30)
    try:
        assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 15), "orphans survived"
    finally:
        for pid in pids:
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


def test_a_missing_main_guard_is_named_in_a_few_lines(tmp_path: Any) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import math, devicekit as dk\n"
        "try:\n"
        "    dk.gpu_map(math.sqrt, range(4), devices=['cpu', 'cpu'])\n"
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
    with pytest.raises(TypeError, match="progress must be True or False, got 'yes'"):
        dk.gpu_map(math.sqrt, [1], devices=["cpu"], progress="yes")  # type: ignore[arg-type]
    assert set(multiprocessing.active_children()) == before  # refused before any worker started


def test_progress_without_tqdm_is_a_line_that_ends_at_the_total(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    assert dk.gpu_map(math.sqrt, [1, 4, 9], devices=["cpu"], progress=True) == [1.0, 2.0, 3.0]
    err = capsys.readouterr().err
    assert err.endswith("\rgpu_map: 3/3\n"), err
    assert "gpu_map: 1/3" in err


def test_progress_with_tqdm_is_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    assert dk.gpu_map(math.sqrt, [1, 4, 9], devices=["cpu"], progress=True) == [1.0, 2.0, 3.0]
    assert re.search(r"gpu_map: 100%.*3/3", capsys.readouterr().err)
