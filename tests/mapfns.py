"""What the gpu_map tests run in workers, and the helpers several test files share.

A worker finds fn by module and name: these live in a module of their own so
that every test file and every subprocess a test starts imports them as
``tests.mapfns``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

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


def hang_on_two(item: int) -> int:
    if item == 2:
        time.sleep(60)  # far beyond the test's timeout, well within its subprocess's
    return item * 10


def say_then_hang_on_two(item: int) -> int:
    """``hang_on_two``, but item 2 first creates the file ``$DK_TEST_HANGING``."""
    if item == 2:
        with open(os.environ["DK_TEST_HANGING"], "w"):
            pass
    return hang_on_two(item)


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


def pid_ignore_sigterm_and_wait(item: int) -> int:
    """Ignore SIGTERM (as some libraries' handlers do), write this worker's PID, stay busy."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return pid_and_wait(item)


def cuda_results(item: int) -> dict[str, Any]:

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


def importable(**env: str) -> dict[str, str]:
    """This environment, with the repository on ``PYTHONPATH`` and ``env`` on top."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **env}


def run_python_args(
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
        env=importable(**(env or {})),
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def run_in_repo(
    script: str, *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``python -c`` from the repository (its functions importable there)."""
    return run_python_args(["-c", script], env=env, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


MB = 1 << 20


def peak_and_rss(pid: int | str) -> tuple[int, int]:
    """A process's peak resident memory since its last reset, and its resident memory now."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def echo(item: Any) -> Any:
    return item


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
    assert wait_for(lambda: written(f"{folder}/sleep"), 60)
    if item == 0:
        time.sleep(60)  # past the map's timeout
    if item == 1:
        raise ValueError("fn fails, and its worker is stopped")
    return item  # they run on, until the pool closes


def written(path: Any) -> bool:
    """Whether ``path`` exists and has something in it (a PID, once the shell wrote it)."""
    return os.path.exists(path) and os.path.getsize(path) > 0


def sleeps_a_minute(size: int) -> None:
    """A trial (or item) that outlasts any test that waits for it."""
    time.sleep(60)
