"""Shared test setup: the ``gpu`` marker and helpers to run code in a fresh interpreter."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import devicekit


def _visible_gpus() -> int:
    # device_count() asks NVML, so deciding whether to skip does not start CUDA
    # in the test process (which would make visible_devices() refuse to run).
    return torch.cuda.device_count() if torch.version.cuda else 0


GPU_COUNT = _visible_gpus()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_COUNT:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


requires_two_gpus = pytest.mark.skipif(GPU_COUNT < 2, reason="needs two or more visible GPUs")


CTRL_C_WORKS = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
"""The first line of a child that must take Ctrl-C as Python does.

A shell starts background jobs with SIGINT ignored, children inherit that, and
Python raises no KeyboardInterrupt where SIGINT was ignored at start: a Ctrl-C
test run from such a job would wait forever for a child that never hears it.
"""


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    """Run ``code`` in a fresh interpreter and return the JSON it prints on its last line."""
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def competing_gpu_process() -> Iterator[subprocess.Popen[str]]:
    """Another process multiplying matrices on the GPU in a loop, until the test ends."""
    hammer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch; a = torch.randn(4096, 4096, device='cuda'); print('ready', flush=True)\n"
            "while True:\n    a @ a",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hammer.stdout is not None
        assert hammer.stdout.readline().strip() == "ready"
        yield hammer
    finally:
        hammer.kill()
        hammer.wait()


FakeAccelerator = Callable[[str | None, int], None]


@pytest.fixture
def fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> FakeAccelerator:
    """Pretend the torch build has ``kind`` with ``count`` devices (the device model only).

    Patched in every devicekit module that imported the two functions, so the
    whole library sees the same fake. Nothing can run on the fake devices.
    """
    from devicekit import _accelerators

    # Import every module first: one first imported under the fake would keep the fake
    # functions it imported by name for the rest of the session (the undo restores only
    # the modules patched here), and later tests would see this test's machine.
    for info in pkgutil.iter_modules(devicekit.__path__):
        if not info.name.startswith("__"):  # __main__ would run the command
            importlib.import_module(f"devicekit.{info.name}")
    replaced = {
        _accelerators.accelerator_type,
        _accelerators.accelerator_count,
    }  # and, later, fakes

    def install(kind: str | None, count: int) -> None:
        fakes = {"accelerator_type": lambda: kind, "accelerator_count": lambda: count}
        for name, module in list(sys.modules.items()):
            if name == "devicekit" or not name.startswith("devicekit."):
                continue
            for attr, fake in fakes.items():
                if getattr(module, attr, None) in replaced:
                    monkeypatch.setattr(module, attr, fake)
        replaced.update(fakes.values())

    return install


@pytest.fixture
def nvml_session(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], None]:
    """Install a ``pynvml`` stand-in (or None: not installed) with devicekit's NVML state reset.

    A stand-in machine comes with a CUDA build of torch: where torch has no
    CUDA, ``torch.version.cuda`` is patched to the CUDA version the fake driver
    supports, since without CUDA no GPU is ``cuda:N``. To test a torch build
    without CUDA, patch ``torch.version.cuda`` to None *after* installing.
    """
    from devicekit import _nvml

    def install(module: Any) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", module)
        monkeypatch.setattr(_nvml, "_session", _nvml._Session())  # one object, all NVML state
        monkeypatch.setattr("atexit.register", lambda *args: None)
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
            monkeypatch.delenv(name, raising=False)
        if module is not None and torch.version.cuda is None:
            monkeypatch.setattr(torch.version, "cuda", getattr(module, "torch_cuda", "12.0"))

    return install


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any, timeout: float = 180) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes; fail on a hang.

    ``fn`` must be a module-level function (spawned processes import it). A
    rank that raises fails the call with its traceback; ranks still running
    after ``timeout`` seconds are killed and the call fails.
    """
    import time

    import torch.multiprocessing as mp

    context = mp.start_processes(
        fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
                process.join(timeout=10)
            pytest.fail(f"{world} ranks of {fn.__name__} still ran after {timeout} s: a hang")
