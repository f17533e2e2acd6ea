"""gpu_map and GPUPool: devices, workers, results, errors, timeouts and pools."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import pickle
import re
import signal
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import devicekit as dk

from .conftest import GPU_COUNT, FakeAccelerator
from .mapfns import (
    MB,
    LoadsAfter,
    alive,
    fail_on_three,
    peak_and_rss,
    run_in_repo,
    unpicklable_result,
    wait_for,
    where,
)


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
    from devicekit import _workerstart

    real_env = _workerstart.worker_env
    calls: list[str | int] = []

    def env_then_fail(device: str | int) -> str:
        calls.append(device)
        if len(calls) == 2:  # the second worker cannot start (EAGAIN, Ctrl-C...)
            raise OSError("cannot start a process")
        return real_env(device)

    monkeypatch.setattr(_workerstart, "worker_env", env_then_fail)
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


def test_a_failure_with_many_items_queued_lets_the_program_exit() -> None:
    # Before, the task queue's feeder thread kept the interpreter from exiting.
    script = textwrap.dedent(
        """
        import devicekit as dk
        from tests.mapfns import fail_on_three
        if __name__ == "__main__":
            try:
                dk.gpu_map(fail_on_three, range(20_000), devices=["cpu", "cpu"])
            except dk.WorkerError as error:
                print("caught", str(error).splitlines()[0], flush=True)
        """
    )
    result = run_in_repo(script)
    assert result.stdout.startswith("caught gpu_map: fn raised on item 3")


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
    assert not any(alive(pid) for pid in first)
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


@pytest.mark.timeout(120)
def test_a_timeout_past_what_the_system_can_wait_is_taken() -> None:
    # Before, a month (past 2**31 ms) raised "OverflowError: timeout is too large" from
    # the wait once the workers had started, and 1e10 s "timestamp too large to convert".
    for timeout in (30 * 24 * 3600, 1e10, 1e300):
        assert dk.gpu_map(abs, [-1, -2], devices=["cpu"], timeout=timeout) == [1, 2]
    with dk.gpu_pool(devices=["cpu"]) as pool:
        assert pool.map(abs, [-3], timeout=1e10) == [3]


def test_timeout_with_ray_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^timeout=5 works with executor='local' only: Ray does"):
        dk.gpu_map(abs, [1], executor="ray", timeout=5)


def test_an_item_over_its_timeout_stops_every_worker_and_keeps_the_results(tmp_path: Any) -> None:
    # A subprocess bounds the test: were the timeout ignored, fn would sleep 60 s.
    script = textwrap.dedent(
        """
        import json, multiprocessing, os, pickle, devicekit as dk
        from tests.mapfns import hang_on_two, pid_and_wait
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
    result = run_in_repo(script, env={"DK_TEST_PIDS": str(tmp_path)})
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


def test_a_pool_replaces_a_worker_that_died_while_idle(caplog: pytest.LogCaptureFixture) -> None:
    # Before, the next map failed: "worker 1 on the CPU was killed by SIGKILL ... between
    # items", with index=None, though no item of it had run (and, earlier still, a bare
    # BrokenPipeError). The out-of-memory killer picks idle workers too.
    with dk.gpu_pool(devices=["cpu"], workers_per_device=2) as pool:
        assert pool.map(abs, [-1, -2]) == [1, 2]
        victim, other = pool._workers
        os.kill(victim.process.pid, signal.SIGKILL)
        assert wait_for(lambda: not alive(victim.process.pid), 30)
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


def test_maps_started_from_two_threads_at_once_give_each_worker_its_device(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # CUDA_VISIBLE_DEVICES is set around each worker's start, and the environment
    # is the process's. Before, two threads starting workers at once read or
    # lent each other's value: a worker on the wrong GPU, an IndexError, or the
    # caller's own variable left changed. The barrier holds both threads inside
    # that window together, where the code lets them in.
    from devicekit import _workerstart

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    fake_accelerator("cuda", 1)
    real_scoped_env = _workerstart.scoped_env
    both_inside = threading.Barrier(2)

    @contextlib.contextmanager
    def scoped_env(name: str, value: str | None) -> Iterator[None]:
        with real_scoped_env(name, value):
            if name == "CUDA_VISIBLE_DEVICES":
                with contextlib.suppress(threading.BrokenBarrierError):
                    both_inside.wait(timeout=2)  # with a lock, the other never comes in
            yield

    monkeypatch.setattr(_workerstart, "scoped_env", scoped_env)
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


def test_a_worker_whose_fn_never_loads_is_stopped_at_the_startup_limit(tmp_path: Any) -> None:
    # Before, the item's clock started only once fn was loaded, so a module that
    # hung on import in the worker made gpu_map wait forever, timeout or not.
    # The subprocess bounds the test; the start-up limit is lowered to 3 s.
    script = textwrap.dedent(
        """
        import json, multiprocessing, devicekit as dk
        from devicekit import _dispatch
        from tests.mapfns import LoadsAfter
        _dispatch._STARTUP_SECONDS = 3.0
        try:
            dk.gpu_map(LoadsAfter(3600), [1, 2], devices=["cpu"], timeout=0.5)
        except dk.WorkerTimeoutError as error:
            print(json.dumps([str(error), error.index, error.timeout, error.results,
                              len(multiprocessing.active_children())]))
        """
    )
    result = run_in_repo(script, timeout=60)
    message, index, limit, results, children = json.loads(result.stdout.strip().splitlines()[-1])
    assert message.startswith(
        "gpu_map: worker 1 on the CPU was still loading fn (unpickling it, which imports its "
        "module) 3 s after it was given this map, so every worker was stopped. With "
        "timeout=0.5, a worker's start-up may take max(timeout, 3 s). 0 of 2 items had "
        "finished, so this error's .results is empty. "
    ), message
    assert "look at what the main module and fn's module do at import time" in message
    assert (index, limit, results, children) == (None, 3.0, {}, 0)


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
        from tests.mapfns import cuda_results
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
    result = json.loads(run_in_repo(script).stdout.strip().splitlines()[-1])
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
        "RuntimeError: gpu_map() was called inside fn, in a gpu_map worker, and a worker does "
        "not start workers of its own: it has its device already (dk.try_gpu() in fn)"
    ) in message, message
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


def full_tensor(megabytes: int) -> torch.Tensor:
    return torch.full((megabytes * MB,), 7, dtype=torch.uint8)


def full_array(megabytes: int) -> Any:
    import numpy as np

    return np.full(megabytes * MB, 7, dtype=np.uint8)


def tensor_plus_one(item: torch.Tensor) -> torch.Tensor:
    return item + 1


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
        _, before = peak_and_rss(pid)
        (result,) = pool.map(fn, [item])
        peak, _ = peak_and_rss(pid)
    assert len(result) == size
    assert (peak - before) / size < most, f"{(peak - before) / size:.2f} copies at the peak"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_the_caller_holds_items_and_results_once() -> None:
    # Before, every item's pickle was kept until the map ended: with 4 items of
    # 50 MB echoed back, the caller peaked at 13 x 50 MB above its start (the
    # items, their pickles, the results and one result in flight), now 9.
    script = """
        import json, devicekit as dk
        from tests.mapfns import MB, echo, peak_and_rss
        with dk.gpu_pool(devices=["cpu"]) as pool:
            pool.map(echo, [0])  # started
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
            _, before = peak_and_rss("self")
            items = [bytes([i]) * (50 * MB) for i in range(4)]
            assert pool.map(echo, items) == items
            peak, _ = peak_and_rss("self")
        print(json.dumps((peak - before) / (50 * MB)))
    """
    copies = json.loads(run_in_repo(textwrap.dedent(script)).stdout.strip().splitlines()[-1])
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


def wait_for_gate(gate: str) -> str:
    """Say it started (``gate + ".started"``), then wait until ``gate`` exists (60 s at most)."""
    with open(gate + ".started", "w"):
        pass
    wait_for(lambda: os.path.exists(gate), 60)
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
            assert wait_for(lambda: os.path.exists(gate + ".started"), 120), "fn never ran"
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
            assert wait_for(lambda: os.path.exists(gate + ".started"), 120), "fn never ran"
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
        wait_for(lambda: os.path.exists(gate + ".started"), 120)
        os.kill(os.getpid(), signal.SIGUSR1)
        if handler == "catches the error":
            wait_for(lambda: bool(caught), 60)
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

    map_code = inspect.unwrap(GPUPool.map).__code__  # map's own, under its decorator
    lines, first = inspect.getsourcelines(map_code)
    (at,) = [first + i for i, line in enumerate(lines) if "self._mapper = threading." in line]
    pool = dk.gpu_pool(devices=["cpu"])

    def in_map(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == at:
            pool.close()  # as a signal handler would, between two lines of map()
        return in_map

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return in_map if frame.f_code is map_code else None

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


def test_a_pool_asked_for_ray_names_gpu_map_where_ray_runs() -> None:
    # Before: "gpu_pool() got an unexpected keyword argument 'executor'", and the same for
    # GPUPool(), which said neither that a pool is local only nor where Ray runs.
    said = (
        r" got executor='ray', but a pool runs on this machine only: its workers are local "
        r"processes, kept between its maps\. Ray runs through gpu_map\(fn, items, "
        r"executor='ray'\), one call per map .*; for a local pool, leave executor out$"
    )
    with pytest.raises(TypeError, match=r"^gpu_pool\(\)" + said):
        dk.gpu_pool(devices=["cpu"], executor="ray")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^GPUPool\(\)" + said):
        dk.GPUPool(executor="ray")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^gpu_pool\(\) got executor='dask', but a pool runs"):
        dk.gpu_pool(devices=["cpu"], executor="dask")  # type: ignore[call-arg]
    with dk.gpu_pool(devices=["cpu"], executor="local") as pool:  # type: ignore[call-arg]
        assert pool.map(abs, [-2]) == [2]  # what a pool is: taken, and nothing changes


def test_a_pool_made_by_hand_or_given_map_options_says_where_they_go() -> None:
    # Before, Python's own: "missing 1 required positional argument: 'slots'", and
    # "gpu_pool() got an unexpected keyword argument 'timeout'".
    with pytest.raises(
        TypeError, match=r"^dk\.GPUPool is made by dk\.gpu_pool\(\).*with dk\.gpu_pool\(\) as pool"
    ):
        dk.GPUPool()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"with dk\.gpu_pool\(devices='cpu'\) as pool"):
        dk.GPUPool(devices="cpu")  # type: ignore[call-arg]
    with pytest.raises(
        TypeError,
        match=r"^gpu_pool\(\) got timeout=5, an option of each map.*items, timeout=5\)$",
    ):
        dk.gpu_pool(timeout=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"got progress=True, an option of each map"):
        dk.gpu_pool(devices="cpu", progress=True)  # type: ignore[call-arg]
