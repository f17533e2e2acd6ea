"""gpu_map(..., executor="ray") against a real Ray, on the CPU.

``ray.init(num_gpus=2)`` declares two logical GPUs: Ray schedules tasks on
them and sets ``CUDA_VISIBLE_DEVICES`` as it would for real ones, which is all
devicekit relies on. The functions below run in Ray workers, which import
this module by name (Ray puts the driver's working directory on their path).
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _mover

from ..conftest import CTRL_C_WORKS, FakeAccelerator, run_python

ray = pytest.importorskip("ray")

_CAN_TELL = hasattr(ray.runtime_context.RuntimeContext, "is_canceled")  # Ray 2.54 and later
TIMEOUT = 120  # seconds: generous, for a loaded 2-core machine; never a pass/fail timing


def where(item: int) -> tuple[int, str | None, list[str]]:
    return item, os.environ.get("CUDA_VISIBLE_DEVICES"), [str(i) for i in ray.get_gpu_ids()]


def fail_on_three(item: int) -> int:
    if item == 3:
        raise ValueError(f"bad item {item}")
    return item


def die_on_one(item: int) -> int:
    if item == 1:
        os._exit(3)  # the worker process dies, as under the out-of-memory killer
    return item


def exit_on_one(job: tuple[str, int]) -> int:
    """Note each run of an item in ``directory``; item 1 calls sys.exit(3)."""
    directory, item = job
    Path(directory, f"{item}-{uuid.uuid4()}").touch()
    if item == 1:
        sys.exit(3)
    return item


def interrupt(item: int) -> int:
    raise KeyboardInterrupt


def lock(item: int) -> threading.Lock:
    return threading.Lock()  # Ray cannot serialize it


def unbalance(item: int) -> int:
    """Return, having emptied the record of scoped_env's open blocks: its exit then fails."""
    from devicekit import _scopedenv

    _scopedenv._scopes.open.clear()
    return item


def started_then_sleep(path: str) -> None:
    """Note the start, then wait (bounded) in short sleeps: Ray's cancel lands between two.

    Ray cancels a running task by ``_thread.interrupt_main()``, which sends no signal: the
    ``KeyboardInterrupt`` is raised once the sleep under way returns. One sleep of TIMEOUT
    held the test that long (2 of the compat run's minutes), and its end raced the test's
    ``ray.get(timeout=TIMEOUT)``.
    """
    Path(path).touch()
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        time.sleep(0.05)


@ray.remote
def locked() -> threading.Lock:
    return threading.Lock()  # Ray cannot serialize it: this task fails, not the next


@ray.remote
def _run() -> threading.Lock:
    """A user's task that fails as ``locked`` does, named as devicekit's function is."""
    return threading.Lock()


_DRIVER = os.getpid()  # in a Ray worker, the worker's: items carry the driver's


def _rebuild_in(pid: int) -> OnlyHere:
    if os.getpid() != pid:
        raise ValueError("this item cannot be rebuilt in a Ray worker")
    return OnlyHere()


class OnlyHere:
    """An item that Ray serializes here but cannot rebuild in its worker."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_in, (_DRIVER,)


class BuiltOnlyHere:
    """A fn that Ray serializes here but cannot rebuild in its worker."""

    def __call__(self, item: int) -> int:
        return item

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_fn_in, (_DRIVER,)


def _rebuild_fn_in(pid: int) -> BuiltOnlyHere:
    if os.getpid() != pid:
        raise ModuleNotFoundError("No module named 'only_on_the_driver'")
    return BuiltOnlyHere()


def _exit_here() -> None:
    sys.exit(4)


def _interrupt_here() -> None:
    raise KeyboardInterrupt


class ExitsWhenPickled:
    def __reduce__(self) -> tuple[Any, ...]:
        sys.exit(5)


class ExitsWhenRebuilt:
    def __reduce__(self) -> tuple[Any, ...]:
        return _exit_here, ()


class InterruptsWhenRebuilt:
    def __reduce__(self) -> tuple[Any, ...]:
        return _interrupt_here, ()


def _fail_here() -> None:
    raise ModuleNotFoundError("No module named 'only_on_the_cluster'")


class FailsWhenRebuilt:
    def __reduce__(self) -> tuple[Any, ...]:
        return _fail_here, ()


class ExitsWhenUnpickled:
    """An item whose unpickling notes each attempt in ``directory``, then calls sys.exit(3)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __setstate__(self, state: dict[str, str]) -> None:
        Path(state["directory"], f"unpickled-{uuid.uuid4()}").touch()
        sys.exit(3)


def noted(job: tuple[str, int, str]) -> object:
    """Note each run in ``directory``, then return ``kind``'s result."""
    directory, item, kind = job
    Path(directory, f"{item}-{uuid.uuid4()}").touch()
    made = {"exits": ExitsWhenPickled, "exits here": ExitsWhenRebuilt}
    made.update({"interrupts here": InterruptsWhenRebuilt, "fails here": FailsWhenRebuilt})
    if item != 1:
        return item
    if kind == "lambda, then exits":  # Ray pickles a lambda by value; pickle refuses it
        return [lambda: 1, ExitsWhenPickled()]
    if kind == "local class, then exits":

        class Local:  # the same, for a class defined in a function
            pass

        return [Local(), ExitsWhenPickled()]
    return made[kind]()


def meet(job: tuple[str, int, int]) -> tuple[str, int]:
    """Report in, then wait (bounded) until all ``total`` tasks have: they all ran at once."""
    directory, item, total = job
    Path(directory, str(item)).write_text("here")
    deadline = time.monotonic() + TIMEOUT
    while len(os.listdir(directory)) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.environ["CUDA_VISIBLE_DEVICES"], len(os.listdir(directory))


def on_gpu(item: int) -> tuple[str, int, str]:
    import torch

    device = dk.try_gpu()
    x = torch.randn(256, 256, device=device)
    (x @ x).sum().item()
    return str(device), torch.cuda.device_count(), str(dk.local_device())


@pytest.fixture(scope="module")
def _shut_down_at_the_end() -> Iterator[None]:
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def cluster(_shut_down_at_the_end: None) -> Any:
    """A local Ray with 2 CPUs and 2 logical GPUs, shared by the tests that ask for it."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False)
    return ray


@pytest.fixture
def no_cluster(_shut_down_at_the_end: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# --- without a running cluster: gpu_map starts one (first, to start as few as possible) -------


def test_without_a_cluster_gpu_map_starts_one_and_shuts_it_down(no_cluster: None) -> None:
    results = dk.gpu_map(where, range(3), devices="cpu", executor="ray")
    assert [item for item, _, _ in results] == [0, 1, 2]
    assert {visible for _, visible, _ in results} == {""}  # CPU tasks hide every GPU
    assert not ray.is_initialized()


def test_gpus_named_here_pin_the_cluster_it_starts(
    no_cluster: None, monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7")  # this process's 0 and 2 are GPUs 5 and 7
    fake_accelerator("cuda", 3)
    results = dk.gpu_map(where, range(2), devices=[0, "cuda:2"], executor="ray")
    assert {visible for _, visible, _ in results} <= {"5", "7"}
    assert all(visible == ",".join(ids) for _, visible, ids in results)
    assert not ray.is_initialized()


_TWO_THREADS = """
import json, os, sys, threading, time
import devicekit as dk

SIGNAL = SIGNAL_PATH  # a file the driver writes once the first thread has ended

def quick(item):
    return item

def after_the_first_thread(job):
    signal, item = job
    deadline = time.monotonic() + 60
    while not os.path.exists(signal) and time.monotonic() < deadline:
        time.sleep(0.05)
    return item

found = {}

def first():
    found["first"] = dk.gpu_map(quick, range(2), devices="cpu", executor="ray")

def second(wait):
    if wait:  # until the first thread's map has started Ray
        while not getattr(sys.modules.get("ray"), "is_initialized", lambda: False)():
            time.sleep(0.05)
    jobs = [(SIGNAL, item) for item in range(6)]
    found["second"] = dk.gpu_map(after_the_first_thread, jobs, devices="cpu", executor="ray")

def both(wait):
    def caught(target, *args):
        def run():
            try:
                target(*args)
            except BaseException as error:
                found[target.__name__] = f"{type(error).__name__}: {error}"
        return threading.Thread(target=run)
    one, two = caught(first), caught(second, wait)
    one.start()
    two.start()
    one.join()  # its thread has ended: Ray's processes started from it must live on
    open(SIGNAL, "w").close()
    two.join()

both(wait=True)
os.remove(SIGNAL)
after = dict(found)
both(wait=False)  # started together: both import Ray, and both would start it
import ray
print(json.dumps({"after": after, "together": found, "initialized": ray.is_initialized()}))
"""


def test_maps_in_two_threads_share_the_cluster_gpu_map_started(
    no_cluster: None, tmp_path: Path
) -> None:
    # Before, the first map to end shut Ray down under the other ("No owner found for
    # object.", its results lost), or both started Ray (Ray's "Perhaps you called ray.init
    # twice by accident?", or "partially initialized module 'ray' has no attribute
    # 'is_initialized'"); Ray's agents were left running, orphaned. A cluster started from
    # a thread that then ended was killed with that thread (Ray's PR_SET_PDEATHSIG).
    code = _TWO_THREADS.replace("SIGNAL_PATH", repr(str(tmp_path / "first-ended")))
    found = run_python(code, timeout=TIMEOUT)
    for run in ("after", "together"):
        assert found[run] == {"first": [0, 1], "second": list(range(6))}, run
    assert found["initialized"] is False  # the last map shut it down


# --- on a running cluster --------------------------------------------------------------------


def test_same_results_as_the_local_executor(cluster: Any) -> None:
    local = dk.gpu_map(math.sqrt, range(20), devices=["cpu"])
    assert dk.gpu_map(math.sqrt, range(20), devices="cpu", executor="ray") == local
    assert dk.gpu_map(math.sqrt, [], executor="ray") == []
    assert ray.is_initialized()  # a cluster gpu_map did not start is left running


def test_each_task_sees_the_gpu_ray_gave_it(cluster: Any) -> None:
    results = dk.gpu_map(where, range(4), executor="ray")
    assert [item for item, _, _ in results] == [0, 1, 2, 3]
    for _, visible, ids in results:
        assert len(ids) == 1
        assert visible == ids[0]
    assert {visible for _, visible, _ in results} <= {"0", "1"}


def test_cpu_tasks_hide_every_gpu(cluster: Any) -> None:
    results = dk.gpu_map(where, range(3), devices=["cpu"], executor="ray")
    assert {(visible, tuple(ids)) for _, visible, ids in results} == {("", ())}


def test_a_failing_item_raises_worker_error_with_its_index(cluster: Any) -> None:
    with pytest.raises(
        dk.WorkerError, match=r"fn raised on item 3 \(3\) in a Ray task on .+ \(the CPU\)"
    ) as caught:
        dk.gpu_map(fail_on_three, range(6), devices="cpu", executor="ray")
    assert "ValueError: bad item 3" in str(caught.value)
    assert "in fail_on_three" in str(caught.value)  # the remote traceback
    # As with the local executor, the results already in are kept, by index.
    assert caught.value.index == 3
    assert 3 not in caught.value.results
    assert all(caught.value.results[index] == index for index in caught.value.results)


def test_an_item_ray_cannot_serialize_raises_type_error_with_its_index(cluster: Any) -> None:
    import threading

    # Before, "cannot be: Could not serialize the argument <unlocked ...> for a task or actor
    # devicekit._raytask.run.", which said nothing of why, and Ray's error was dropped.
    with pytest.raises(
        TypeError,
        match=r"and item 2 \(<unlocked .*>, a lock\) cannot be: TypeError: cannot pickle "
        r"'_thread.lock' object. Pass data",
    ) as caught:
        dk.gpu_map(math.sqrt, [1, 4, threading.Lock()], devices="cpu", executor="ray")
    assert "Could not serialize the argument" in str(caught.value.__cause__)  # Ray's, kept
    assert dk.gpu_map(math.sqrt, [1, 4], devices="cpu", executor="ray") == [1.0, 2.0]


class _RefusesToPickle:
    """Its pickling raises ValueError, not the TypeError Ray wraps."""

    def __reduce__(self) -> Any:
        raise ValueError("not picklable: connect in fn instead")


def test_what_ray_cannot_serialize_is_named_with_the_reason(cluster: Any) -> None:
    # Before, a ValueError in an item's __reduce__ came out raw, naming no item; a fn
    # that used a lock read "cannot be: Could not serialize the put value <function ...>".
    with pytest.raises(
        TypeError,
        match=r"and item 1 \(<tests.compat.*>, a _RefusesToPickle\) "
        r"cannot be: ValueError: not picklable: connect in fn instead. Pass data",
    ) as caught:
        dk.gpu_map(math.sqrt, [1, _RefusesToPickle()], devices="cpu", executor="ray")
    assert isinstance(caught.value.__cause__, ValueError)
    lock = threading.Lock()

    def holds_a_lock(item: int) -> int:  # a closure: Ray pickles it by value, lock and all
        with lock:
            return item

    with pytest.raises(
        TypeError,
        match=r"sends fn to Ray tasks, .* and <function .*holds_a_lock .*> cannot be: TypeError: "
        r"cannot pickle '_thread.lock' object \(Ray found it in the variable 'lock'\)\. Pass",
    ):
        dk.gpu_map(holds_a_lock, [1], devices="cpu", executor="ray")


def test_a_task_whose_worker_dies_raises_worker_error_with_its_index(cluster: Any) -> None:
    # Ray retries a task whose worker died (max_retries, 3 by default), then gives up.
    with pytest.raises(
        dk.WorkerError, match=r"gpu_map: the Ray task for item 1 \(1\) failed: .*worker died"
    ) as caught:
        dk.gpu_map(die_on_one, range(3), devices="cpu", executor="ray")
    assert caught.value.index == 1
    assert all(caught.value.results[index] == index for index in caught.value.results)


def test_sys_exit_in_fn_is_reported_as_such_and_not_retried(cluster: Any, tmp_path: Path) -> None:
    # Before, SystemExit ended the Ray worker: Ray retried the task 3 times (fn ran 4 times)
    # and the error was "The worker died unexpectedly".
    jobs = [(str(tmp_path), item) for item in range(3)]
    with pytest.raises(
        dk.WorkerError,
        match=r"gpu_map: fn called sys.exit\(3\) on item 1 \(\(.*, 1\)\) in a Ray task on .+ "
        r"\(the CPU\); fn must return a result, or raise an Exception to fail its item "
        r"\(SystemExit and KeyboardInterrupt are not Exceptions\). The worker's traceback:\n",
    ) as caught:
        dk.gpu_map(exit_on_one, jobs, devices="cpu", executor="ray")
    assert "SystemExit: 3" in str(caught.value)
    assert caught.value.index == 1
    assert len(list(tmp_path.glob("1-*"))) == 1  # fn ran once for item 1


def test_keyboard_interrupt_in_fn_is_reported_as_fn_s_not_as_a_cancellation(
    cluster: Any,
) -> None:
    # Before, Ray took it for a cancellation: ray.exceptions.TaskCancelledError.
    with pytest.raises(
        dk.WorkerError,
        match=r"gpu_map: fn raised KeyboardInterrupt on item 0 \(5\) in a Ray task on .+; fn "
        r"must return a result, or raise an Exception"
        if _CAN_TELL
        else r"gpu_map: item 0 \(5\) stopped on KeyboardInterrupt .* and Ray \S+ cannot tell which",
    ):
        dk.gpu_map(interrupt, [5], devices="cpu", executor="ray")


def test_a_result_ray_cannot_serialize_is_named_as_the_local_executor_names_it(
    cluster: Any,
) -> None:
    # Before, Ray's own traceback, with terminal colour codes in it; then a CPU task's
    # message lacked the "(the CPU)" that the task's own messages carry.
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(lock, [7], devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.fullmatch(
        r"gpu_map: the result of item 0 \(7\) cannot be sent back from a Ray task on \S+ "
        r"\(the CPU\): "
        r"TypeError: cannot pickle '_thread.lock' object. Return picklable data: numbers, "
        r"strings, tensors, or containers of them.",
        message,
    ), message
    assert caught.value.index == 0


def test_a_failure_in_the_task_outside_fn_is_not_blamed_on_the_result(cluster: Any) -> None:
    # Before: "the result of item 0 (3) cannot be sent back from a Ray task on ...: KeyError:
    # 'CUDA_VISIBLE_DEVICES'. Return picklable data", for a failure of devicekit's own code
    # in the task (here, putting back the CUDA_VISIBLE_DEVICES it hid), after fn returned.
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(unbalance, [3], devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.match(
        r"gpu_map: the Ray task for item 0 \(3\) failed in a Ray task on .+ \(the CPU\), outside "
        r"fn \(in devicekit's code around it\): KeyError: 'CUDA_VISIBLE_DEVICES'. The task's "
        r"traceback:\n",
        message,
    ), message
    assert "cannot be sent back" not in message


@pytest.mark.skipif(not _CAN_TELL, reason="Ray before 2.54 cannot tell a cancellation")
def test_a_task_ray_cancels_is_a_cancellation_not_fn_s_keyboard_interrupt(
    cluster: Any, tmp_path: Path
) -> None:
    # Before, _run caught the KeyboardInterrupt by which ray.cancel() (without force) stops
    # a running task, and answered "fn raised KeyboardInterrupt". gpu_map's own tasks are
    # submitted as here; a cancel of the task that called gpu_map reaches them this way.
    from devicekit import _raytask
    from devicekit._rayfaults import TASK_NAME, ray_failed

    task = ray.remote(num_cpus=1, retry_exceptions=False)(_raytask.run).options(name=TASK_NAME)
    started = tmp_path / "started"
    ref = task.remote([ray.put(started_then_sleep)], str(started), True)
    deadline = time.monotonic() + TIMEOUT
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists()
    ray.cancel(ref)  # not forced: Ray raises KeyboardInterrupt in the task
    with pytest.raises(ray.exceptions.TaskCancelledError) as caught:
        ray.get(ref, timeout=TIMEOUT)
    message = ray_failed(ray, caught.value, 0, "x")
    assert message.startswith(
        "gpu_map: the Ray task for item 0 ('x') failed: ray::devicekit.gpu_map()"
    ), message
    assert re.search(r"TaskCancelledError: Task: \S+ was cancelled\.\s*$", message), message


def test_an_item_ray_cannot_rebuild_in_its_worker_is_named_with_the_fix(cluster: Any) -> None:
    # Before, Ray's words: "the Ray task for item 1 (...) failed: ray::_run() (pid=...) At
    # least one of the input arguments for this task could not be computed: ...".
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(math.sqrt, [4, OnlyHere()], devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.match(
        r"gpu_map: item 1 \(<.*>\) could not be unpickled in a Ray task on .+ \(the CPU\): "
        r"ValueError: this item cannot be rebuilt in a Ray worker. Each item is rebuilt in its "
        r"worker from its pickle: pass data .* The worker's traceback:\nTraceback",
        message,
        re.DOTALL,
    ), message
    assert "in _rebuild_in" in message
    assert "\x1b" not in message
    assert caught.value.index == 1


def test_a_fn_ray_cannot_rebuild_in_its_worker_is_not_blamed_on_the_item(cluster: Any) -> None:
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(BuiltOnlyHere(), [4], devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.match(
        r"gpu_map: fn could not be rebuilt in a Ray task on .+ \(the CPU\), for item 0 \(4\): "
        r"ModuleNotFoundError: No module named 'only_on_the_driver'. Ray sends fn by reference",
        message,
    ), message


def test_a_result_whose_pickling_exits_is_not_retried(cluster: Any, tmp_path: Path) -> None:
    # Before, sys.exit() in the result's __reduce__ ended the worker after the task returned:
    # Ray retried it three times (fn ran four times), then "The worker died unexpectedly".
    jobs = [(str(tmp_path), item, "exits") for item in range(3)]
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(noted, jobs, devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.match(
        r"gpu_map: the result of item 1 \(.*\) cannot be sent back from a Ray task on .+: "
        r"pickling it called sys.exit\(5\) \(SystemExit and KeyboardInterrupt are not "
        r"Exceptions\); it was not retried",
        message,
    ), message
    assert len(list(tmp_path.glob("1-*"))) == 1  # fn ran once for item 1
    assert caught.value.index == 1


@pytest.mark.parametrize("kind", ["lambda, then exits", "local class, then exits"])
def test_a_result_whose_pickling_exits_after_a_lambda_is_not_retried(
    cluster: Any, tmp_path: Path, kind: str
) -> None:
    # Before, the dry run (the standard pickler) gave up at the lambda or the local class,
    # which Ray's pickler takes: Ray's pickling then ended the worker, and fn ran four times.
    jobs = [(str(tmp_path), item, kind) for item in range(3)]
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(noted, jobs, devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.match(
        r"gpu_map: the result of item 1 \(.*\) cannot be sent back from a Ray task on .+: "
        r"pickling it called sys.exit\(5\)",
        message,
    ), message
    assert len(list(tmp_path.glob("1-*"))) == 1  # fn ran once for item 1


@pytest.mark.parametrize(
    ("task", "name"), [(locked, "locked"), (_run, "_run")], ids=["locked", "_run"]
)
def test_an_objectref_item_whose_task_s_result_was_unpicklable_is_not_blamed_on_fn(
    cluster: Any, task: Any, name: str
) -> None:
    # Before: "the result of item 0 (ObjectRef(...)) cannot be sent back ...", though fn
    # never ran: the item's own task could not send its result back. And devicekit's task
    # was Ray's "_run" too (its function's name), so the failure of a user's upstream task
    # of that name read as devicekit's.
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(math.sqrt, [task.remote()], devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.match(
        r"gpu_map: the Ray task for item 0 \(.*\) failed: ray::devicekit\.gpu_map\(\) .*\n  At "
        r"least one of the input arguments for this task could not be computed:\n"
        rf"ray.exceptions.RayTaskError: ray::{name}\(\)",
        message,
    ), message
    assert "TypeError: cannot pickle '_thread.lock' object" in message
    assert "cannot be sent back" not in message


@pytest.mark.parametrize("holds", ["nothing else", "a tensor"])
def test_an_item_whose_unpickling_exits_fails_at_once_and_is_not_retried(
    cluster: Any, tmp_path: Path, holds: str
) -> None:
    # Before, Ray rebuilt the item before the task ran, where sys.exit() ended the worker:
    # Ray ran the task four times, then "The worker died unexpectedly". With a tensor the
    # item travels by ray.put, else as its pickle; the task unpacks either.
    import torch

    item = [ExitsWhenUnpickled(str(tmp_path))] + ([torch.ones(2)] if holds == "a tensor" else [])
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(len, [[1], item], devices="cpu", executor="ray")
    message = str(caught.value)
    assert re.match(
        r"gpu_map: item 1 \(\[.*\]\) could not be unpickled in a Ray task on .+ \(the CPU\): "
        r"rebuilding it called sys.exit\(3\). Each item is rebuilt in its worker from its "
        r"pickle: pass data .* The worker's traceback:\n",
        message,
        re.DOTALL,
    ), message
    assert "in __setstate__" in message
    assert caught.value.index == 1
    assert len(list(tmp_path.glob("unpickled-*"))) == 1  # one attempt: not run again


def test_a_result_whose_rebuilding_here_exits_is_a_worker_error(
    cluster: Any, tmp_path: Path
) -> None:
    # Before, SystemExit(4) left gpu_map, and a script ended without a word.
    jobs = [(str(tmp_path), item, "exits here") for item in range(3)]
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(noted, jobs, devices="cpu", executor="ray")
    assert re.match(
        r"gpu_map: the result of item 1 \(.*\) came back from its Ray task, but rebuilding it "
        r"here called sys.exit\(4\) \(SystemExit and KeyboardInterrupt are not Exceptions\); "
        r"it was not retried",
        str(caught.value),
    ), str(caught.value)
    assert len(list(tmp_path.glob("1-*"))) == 1
    assert caught.value.index == 1


def test_a_result_whose_rebuilding_here_interrupts_says_so(cluster: Any, tmp_path: Path) -> None:
    # Before, a bare KeyboardInterrupt, as if Ctrl-C had been pressed.
    jobs = [(str(tmp_path), item, "interrupts here") for item in range(2)]
    with pytest.raises(
        KeyboardInterrupt,
        match=r"gpu_map: while the result of item 1 \(.*\) was rebuilt here: Ctrl-C, or code "
        r"in that result",
    ):
        dk.gpu_map(noted, jobs, devices="cpu", executor="ray")


def test_a_result_this_process_cannot_rebuild_is_named(cluster: Any, tmp_path: Path) -> None:
    # Before: "the Ray task for item 1 (...) failed: System error: No module named ...".
    jobs = [(str(tmp_path), item, "fails here") for item in range(2)]
    with pytest.raises(
        dk.WorkerError,
        match=r"gpu_map: the result of item 1 \(.*\) came back from its Ray task, but cannot "
        r"be rebuilt here: ModuleNotFoundError: No module named 'only_on_the_cluster'. Return",
    ):
        dk.gpu_map(noted, jobs, devices="cpu", executor="ray")


def test_two_tasks_share_a_gpu_with_two_workers_per_device(cluster: Any, tmp_path: Path) -> None:
    jobs = [(str(tmp_path), item, 4) for item in range(4)]
    results = dk.gpu_map(meet, jobs, workers_per_device=2, executor="ray")
    assert [count for _, count in results] == [4, 4, 4, 4]  # all four ran at the same time
    assert collections.Counter(visible for visible, _ in results) == {"0": 2, "1": 2}


def test_progress(cluster: Any, capsys: pytest.CaptureFixture[str]) -> None:
    dk.gpu_map(math.sqrt, range(3), devices="cpu", executor="ray", progress=True)
    err = capsys.readouterr().err
    # a tqdm bar ("gpu_map: 100%|...| 3/3") where tqdm is installed, else a line
    assert re.search(r"gpu_map: (3/3|100%.*3/3)", err), err


def test_gpus_named_here_are_refused_on_a_running_cluster(
    cluster: Any, fake_accelerator: FakeAccelerator
) -> None:
    fake_accelerator("cuda", 2)
    with pytest.raises(ValueError, match=r"names GPUs of this machine, but gpu_map runs on a Ray"):
        dk.gpu_map(math.sqrt, [1], devices=[1], executor="ray")


def test_devices_cuda_runs_gpu_tasks_on_the_cluster_from_a_cpu_only_driver(cluster: Any) -> None:
    # Before: refused with "this torch build has no CUDA support ... install a torch build
    # with CUDA", though this driver only submits tasks to the cluster's (logical) GPUs.
    if torch.cuda.is_available():
        pytest.skip("needs a driver without a GPU")
    results = dk.gpu_map(where, range(2), devices="cuda", executor="ray")
    assert [item for item, _, _ in results] == [0, 1]
    assert all(visible in {"0", "1"} and ids == [visible] for _, visible, ids in results)


_CONNECT = """
import json, ray, devicekit as dk
from tests.compat.test_ray import where
results = dk.gpu_map(where, range(2), executor="ray")
print(json.dumps({"visible": sorted({visible for _, visible, _ in results}),
                  "connected": ray.is_initialized()}))
"""


def test_ray_address_names_the_cluster_to_use(cluster: Any) -> None:
    # Without a GPU here, tasks that see one ran on the cluster's logical GPUs: a local
    # cluster started instead would have none.
    address = ray.get_runtime_context().gcs_address
    found = run_python(_CONNECT, env={"RAY_ADDRESS": address}, timeout=TIMEOUT)
    assert found["visible"]
    assert set(found["visible"]) <= {"0", "1"}
    assert found["connected"] is False  # it disconnected after
    assert ray.cluster_resources().get("GPU") == 2  # and the cluster runs on


@pytest.mark.gpu
def test_try_gpu_in_a_task_is_the_gpu_ray_assigned(no_cluster: None) -> None:
    results = dk.gpu_map(on_gpu, range(2), executor="ray")  # a cluster of this machine's GPUs
    assert results == [("cuda:0", 1, "cuda:0")] * 2


# --- Ctrl-C ----------------------------------------------------------------------------------

_INTERRUPTED = """
import json, os, sys, time
import ray
import devicekit as dk

DIRECTORY = sys.argv[1]  # read here: in a Ray worker, sys.argv is the worker's

def sleeper(item):
    open(os.path.join(DIRECTORY, f"started-{item}"), "w").close()
    time.sleep(600)

ray.init(num_cpus=2, include_dashboard=False)
try:
    dk.gpu_map(sleeper, range(4), devices="cpu", executor="ray")
except KeyboardInterrupt:
    # Cancelled tasks give their CPUs back; tasks left running would hold them 10 minutes.
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    print(json.dumps({"free_cpus": ray.available_resources().get("CPU", 0)}))
"""


def test_ctrl_c_cancels_the_outstanding_tasks(tmp_path: Path) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_WORKS + textwrap.dedent(_INTERRUPTED), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
            assert driver.poll() is None, driver.communicate()
            time.sleep(0.1)
        assert len(list(tmp_path.glob("started-*"))) == 2  # both CPUs busy, two tasks queued
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=TIMEOUT)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert json.loads(out.strip().splitlines()[-1]) == {"free_cpus": 2.0}, err
    assert len(list(tmp_path.glob("started-*"))) == 2  # the queued ones never started


def test_to_device_tells_of_an_object_ref_and_how_to_get_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a batch holding a Ray reference came back with it, in silence.
    monkeypatch.setattr(_mover, "looks_left", weakref.WeakKeyDictionary())  # none told yet
    ref = ray.ObjectRef.from_random()  # no cluster needed: nothing is fetched
    with pytest.warns(
        RuntimeWarning,
        match=r"returned a ray\.ObjectRef as it is: .* Get the value first \(ray\.get\(ref\)\)",
    ):
        moved = dk.to_device({"ref": ref, "x": torch.ones(1)}, "meta")
    assert moved["ref"] is ref
    assert moved["x"].is_meta
