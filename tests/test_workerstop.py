"""Stopping workers: Ctrl-C, a killed parent, workers that ignore SIGTERM, what fn started."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import devicekit as dk

from .conftest import CTRL_C_WORKS, run_python
from .mapfns import (
    REPO,
    alive,
    importable,
    start_a_child,
    wait_for,
    written,
)


def test_ctrl_c_with_many_items_queued_stops_the_workers_and_exits() -> None:
    script = textwrap.dedent(
        """
        import time, devicekit as dk
        from tests.mapfns import where
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
    env = importable(DK_TEST_PIDS=str(pids), **(env or {}))
    command = [sys.executable, "-c", textwrap.dedent(script)]
    if main is not None:
        main.write_text(textwrap.dedent(script))
        command = [sys.executable, str(main)]
    parent = subprocess.Popen(command, cwd=REPO, env=env)
    try:
        assert wait_for(lambda: len(os.listdir(pids)) >= workers, 60), "workers never ran"
        found = [int(name) for name in os.listdir(pids)]
        assert all(alive(pid) for pid in found)
    finally:
        parent.kill()  # SIGKILL: the parent runs no cleanup at all
        parent.wait(timeout=30)
    try:
        assert wait_for(lambda: not any(alive(pid) for pid in found), seconds), "orphans survived"
    finally:
        for pid in found:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_busy_workers_end_when_their_parent_is_killed(tmp_path: Any) -> None:
    script = """
    import devicekit as dk
    from tests.mapfns import pid_and_wait
    if __name__ == "__main__":
        dk.gpu_map(pid_and_wait, range(2), devices=["cpu", "cpu"])
    """
    _kill_parent_and_watch(script, 2, tmp_path)


def test_idle_pool_workers_end_when_their_parent_is_killed(tmp_path: Any) -> None:
    # A pool started from a thread gets no parent-death signal (it would fire when
    # that thread ends): idle workers see the parent's end of the pipe close.
    script = """
    import threading, time, devicekit as dk
    from tests.mapfns import write_pid
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
    from devicekit import _workerstart

    events: list[str] = []
    workers = [_workerstart.Worker(n, "cpu", _Stubborn(n, events), _Conn()) for n in (1, 2, 3)]
    _workerstart.stop_workers(workers, gently=False)
    assert events == [
        *("terminate 1", "terminate 2", "terminate 3", "join 1", "join 2", "join 3"),
        *("kill 1", "kill 2", "kill 3", "join 1", "join 2", "join 3"),
    ]


class _Interrupted(_Stubborn):
    """A stubborn stand-in whose first wait is cut short by a second Ctrl-C."""

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.events.count(f"join {self.number}") == 1 and self.number == 1:
            raise KeyboardInterrupt


def test_ctrl_c_keeps_the_results_that_had_finished(tmp_path: Path) -> None:
    # Before: Ctrl-C raised a bare KeyboardInterrupt, and every finished result was
    # lost (a WorkerError keeps them in .results; an interrupted sweep kept nothing).
    hanging = tmp_path / "hanging"
    result = run_python(
        textwrap.indent(CTRL_C_WORKS, " " * 8)
        + f"""
        import json, os, signal, threading, time, devicekit as dk
        from tests.mapfns import say_then_hang_on_two
        os.environ["DK_TEST_HANGING"] = {str(hanging)!r}

        def interrupt_once_item_two_hangs():
            while not os.path.exists({str(hanging)!r}):
                time.sleep(0.05)
            time.sleep(1.0)  # items 0 and 1 went back before 2 was sent: collected by now
            os.kill(os.getpid(), signal.SIGINT)  # a real signal: it wakes the map's wait

        threading.Thread(target=interrupt_once_item_two_hangs, daemon=True).start()
        try:
            dk.gpu_map(say_then_hang_on_two, range(4), devices=["cpu"])
        except KeyboardInterrupt as stop:
            print(json.dumps([stop.results, getattr(stop, "__notes__", None)]))
        """,
        timeout=200,
    )
    results, notes = result
    assert results == {"0": 0, "1": 10}  # JSON's keys are strings
    assert notes == [
        "devicekit: gpu_map was stopped. 2 of 4 items had finished: their results are in "
        "this error's .results (a dict by item index); the others were lost."
    ]


def test_a_ctrl_c_while_stopping_workers_still_kills_them() -> None:
    # Before, a second Ctrl-C during the wait after SIGTERM skipped the SIGKILL:
    # workers that ignore SIGTERM outlived the call (and held the program's exit).
    from devicekit import _workerstart

    events: list[str] = []
    workers = [_workerstart.Worker(n, "cpu", _Interrupted(n, events), _Conn()) for n in (1, 2)]
    with pytest.raises(KeyboardInterrupt):
        _workerstart.stop_workers(workers, gently=False)
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
        from tests.mapfns import pid_ignore_sigterm_and_wait
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
        assert wait_for(lambda: len(os.listdir(tmp_path)) >= 2, 60), "workers never ran"
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
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert process.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1]) == [[], 0]


def test_workers_that_ignore_sigterm_end_when_their_parent_is_killed(tmp_path: Any) -> None:
    # Before, the parent-death signal was SIGTERM: a worker whose fn (or a library)
    # ignored it outlived its killed parent, an orphan for as long as fn ran.
    script = """
    import devicekit as dk
    from tests.mapfns import pid_ignore_sigterm_and_wait
    if __name__ == "__main__":
        dk.gpu_map(pid_ignore_sigterm_and_wait, range(2), devices=["cpu", "cpu"])
    """
    _kill_parent_and_watch(script, 2, tmp_path)


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
    from tests.mapfns import pid_and_wait
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
        assert wait_for(lambda: len(os.listdir(pids)) >= 2, 60), "workers never started"
        found = [int(name) for name in os.listdir(pids)]
        for pid in found:  # what a terminal does: the same signal to every process
            os.kill(pid, signal.SIGINT)
        time.sleep(1)
        assert all(alive(pid) for pid in found)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        for pid in found:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert (process.returncode, stdout) == (0, "KeyboardInterrupt\n"), stderr
    assert "Traceback" not in stderr
    assert "KeyboardInterrupt" not in stderr  # no worker's
    assert not any(alive(pid) for pid in found)


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
            assert wait_for(lambda: not alive(pid), 10), "what fn started outlived the map"  # noqa: B023
    finally:
        for pid in started:
            if alive(pid):
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
            from tests.mapfns import start_a_child
            if __name__ == "__main__":
                dk.gpu_map(start_a_child, [0], devices=["cpu"])
            """
        )
    )
    caller = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=importable(DK_TEST_PIDS=str(tmp_path)),
        start_new_session=True,  # a group of its own, as a shell's job is
    )
    started: list[int] = []
    try:
        assert wait_for(lambda: written(tmp_path / "sleep"), 120), "fn started nothing"
        started = _started_pids(tmp_path)
        os.killpg(caller.pid, signal.SIGKILL)
        caller.wait(30)
        for pid in started:
            assert wait_for(lambda: not alive(pid), 30), "what fn started outlived the caller"  # noqa: B023
    finally:
        with contextlib.suppress(OSError):
            os.killpg(caller.pid, signal.SIGKILL)
        caller.wait(30)
        for pid in started:
            if alive(pid):
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
    from devicekit import _workerstart

    real_signal_each = _workerstart.signal_each
    gc.collect()  # a pool an earlier test dropped is stopped now, not through the patch below

    def signal_each(procs: dict[int, int], signum: int) -> list[int]:
        sent = real_signal_each(procs, signum)
        trapped = (tmp_path / "shell").exists()  # this test's stop, not another pool's
        if signum == signal.SIGTERM and trapped:  # let the trap start its process first
            assert wait_for(lambda: written(tmp_path / "shell.late"), 60)
        return sent

    monkeypatch.setattr(_workerstart, "signal_each", signal_each)
    monkeypatch.setattr(_workerstart, "_STOP_SECONDS", 0.5)  # the shell ignores SIGTERM: not long
    with dk.gpu_pool(devices=["cpu"]) as pool, pytest.raises(dk.WorkerTimeoutError):
        pool.map(trap_then_start_more, [str(tmp_path)], timeout=2)
    pids = []
    for name in ("shell", "shell.late"):
        with open(tmp_path / name) as file:
            pids.append(int(file.read()))
    try:
        for pid in pids:
            assert wait_for(lambda: not alive(pid), 10), "a process outlived the stop"  # noqa: B023
    finally:
        for pid in pids:
            if alive(pid):
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
    from devicekit import _workerstart, _workerstate

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
        assert _workerstart._started_by(pool._workers, {}) == {}


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
    from devicekit import _workerstart

    calls: list[int] = []

    def started_by(workers: list[Any], known: dict[int, int]) -> dict[int, int]:
        calls.append(1)
        if len(calls) == 2:  # the one before the SIGKILLs
            raise KeyboardInterrupt
        return {}

    monkeypatch.setattr(_workerstart, "_started_by", started_by)
    events: list[str] = []
    workers = [_workerstart.Worker(n, "cpu", _Stubborn(n, events), _Conn()) for n in (1, 2)]
    with pytest.raises(KeyboardInterrupt):
        _workerstart.stop_workers(workers, gently=False)
    assert events[-4:] == ["kill 1", "kill 2", "join 1", "join 2"]
    assert not any(worker.process.is_alive() for worker in workers)


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
            if alive(pid):
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
            assert wait_for(lambda: not alive(pid), 10), "what fn started outlived it"  # noqa: B023
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
            assert wait_for(lambda: not victim.alive(), 30)
            with caplog.at_level(logging.WARNING, logger="devicekit"):
                assert pool.map(abs, [-3]) == [3]
            for pid in (sh, sleep):
                assert wait_for(lambda: not alive(pid), 10), "what fn started outlived it"  # noqa: B023
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
        assert alive(stranger.pid), "an orderly close stopped a process fn never started"
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
        assert alive(daemon), "the end of gpu_map stopped a daemon fn had started"
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
        assert wait_for(lambda: _ticks_now() > started + 1, 60)
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
        assert wait_for(lambda: not alive(daemon), 10), "the daemon outlived the map"
    finally:
        if daemon is not None:
            with contextlib.suppress(OSError):
                os.kill(daemon, signal.SIGKILL)


def test_every_ctrl_c_out_of_a_map_has_results() -> None:
    # A second Ctrl-C while the workers stop is a new KeyboardInterrupt: before, it
    # had no .results (they were on its __context__), nor had one during the start.
    from devicekit._parallel import _keep_results

    first = KeyboardInterrupt()
    first.results = {0: 0, 1: 10}  # type: ignore[attr-defined]
    dk._errors.add_note(first, "2 of 4 items had finished")

    def interrupted_twice() -> None:
        try:
            raise first
        except KeyboardInterrupt:
            raise KeyboardInterrupt  # noqa: B904 - a second Ctrl-C, as Python raises it

    with pytest.raises(KeyboardInterrupt) as caught:
        interrupted_twice()
    second = caught.value
    assert second.__context__ is first
    _keep_results(second)
    assert second.results == {0: 0, 1: 10}  # type: ignore[attr-defined]
    assert second.__notes__ == ["2 of 4 items had finished"]
    during_start = KeyboardInterrupt()
    _keep_results(during_start)
    assert during_start.results == {}  # type: ignore[attr-defined]
    assert not hasattr(during_start, "__notes__")


def _sigint_blocked(pid: int) -> bool:
    """Whether ``pid`` blocks SIGINT, from its ``/proc`` status (``SigBlk``, a hex mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    raise AssertionError(f"no SigBlk in /proc/{pid}/status")


def sigint_state(item: int) -> tuple[bool, bool]:
    """In a worker: (whether SIGINT is blocked, whether it is ignored)."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    return blocked, signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
def test_a_worker_starts_with_ctrl_c_held_and_runs_fn_with_it_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A terminal's Ctrl-C reaches the workers too. Before, one still importing
    # multiprocessing died of it with a traceback of its own (`EOFError: Ran out
    # of input`, or a KeyboardInterrupt in an import) under the caller's.
    from devicekit import _workerstart

    held_at_start: list[bool] = []
    read_start_time = _workerstart.child_start_time

    def look_first(pid: int) -> Any:  # runs as soon as the worker's process exists
        held_at_start.append(_sigint_blocked(pid))
        return read_start_time(pid)

    monkeypatch.setattr(_workerstart, "child_start_time", look_first)
    assert dk.gpu_map(sigint_state, [0], devices=["cpu"]) == [(False, True)]
    assert held_at_start == [True]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_ctrl_c_as_a_worker_starts_stops_that_worker_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, a Ctrl-C between the worker's start and its listing left it out of
    # the workers stopped: it ran on until the interpreter's exit.
    from devicekit import _workerstart

    started: list[Any] = []
    read_start_time = _workerstart.child_start_time

    def interrupted(pid: int) -> Any:
        started.append(pid)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # unheld, the KeyboardInterrupt is raised here
        return read_start_time(pid)

    monkeypatch.setattr(_workerstart, "child_start_time", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            dk.gpu_map(abs, [1, 2], devices=["cpu", "cpu"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert caught.value.results == {}  # type: ignore[attr-defined]
    assert len(started) == 1
    assert wait_for(lambda: not alive(started[0]), 30), "the started worker still runs"


def test_ctrl_c_before_any_worker_starts_has_results() -> None:
    # Before, a Ctrl-C while the items were read had no .results at all.
    def items() -> Any:
        yield 1
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        dk.gpu_map(abs, items(), devices=["cpu"])
    assert caught.value.results == {}  # type: ignore[attr-defined]
    with dk.gpu_pool(devices=["cpu"]) as pool, pytest.raises(KeyboardInterrupt) as caught:
        pool.map(abs, items())
    assert caught.value.results == {}  # type: ignore[attr-defined]
