"""Starting NVML: one bounded ``nvmlInit``, what its failures mean, and the shutdown at exit.

A wedged driver can block ``nvmlInit`` (and ``nvmlShutdown``) for good, so
each runs in a daemon thread its caller waits for at most `start_timeout()`
seconds. `_nvml`'s session decides when to start and when to try again; this
module knows one attempt.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT",
    "NOT_INSTALLED",
    "PERMANENT",
    "RETRY_AFTER",
    "TIMEOUT_VAR",
    "Start",
    "error_code",
    "shutdown",
    "start_timeout",
]

# NVML's return codes for a start that failed (pynvml exposes the same numbers).
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_RM_VERSION_MISMATCH = 18

_INIT_ERRORS = {
    _LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 was not found: no NVIDIA driver is installed here",
    _DRIVER_NOT_LOADED: (
        "the NVIDIA driver is not loaded (no nvidia kernel module; in a container, "
        "start it with --gpus all)"
    ),
    _NO_PERMISSION: "no permission to talk to the NVIDIA driver (check /dev/nvidia* permissions)",
    _RM_VERSION_MISMATCH: (
        "the NVIDIA driver library and kernel module versions differ (reboot after a driver update)"
    ),
}
NOT_INSTALLED = "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
# Start failures no retry can change while the process runs: no driver library on the
# machine (a container started without GPUs). A driver not loaded yet, no permission
# yet, or an error NVML does not explain, may change: those are tried again.
PERMANENT = frozenset({_LIBRARY_NOT_FOUND})

TIMEOUT_VAR = "DEVICEKIT_NVML_TIMEOUT"
# Well above a slow but healthy start: without persistence mode nvmlInit initializes
# every GPU, which takes seconds on an 8-GPU machine; a hung one never returns.
DEFAULT_TIMEOUT = 30.0
# Seconds before a failed start is tried again: often enough for a notebook that began
# before the driver loaded, and never a loop (`devicekit watch -n 0.1` asks ten times a
# second; a failed nvmlInit is tried once per 10 s of it).
RETRY_AFTER = 10.0


class Start:
    """One call of ``nvmlInit``, in its own thread, and what it answered."""

    def __init__(self, pynvml: Any, timeout: float) -> None:
        self.pynvml = pynvml
        self.timeout = timeout  # kept for the shutdown at exit, which is bounded alike
        self.done = threading.Event()
        self.module: Any = None
        self.error: str | None = None
        self.final = False  # a failure no retry in this process can change
        self.ended = 0.0
        self.unexpected: Exception | None = None

    def run(self) -> None:
        pynvml = self.pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            code = error_code(error)
            self.error = _INIT_ERRORS.get(code, f"NVML failed to start: {error}")  # type: ignore[arg-type]
            self.final = code in PERMANENT
        except Exception as error:  # noqa: BLE001 - not NVML's answer: raised to the caller
            self.unexpected = error
        else:
            self.module = pynvml
            # Registered by the start that succeeded, whoever takes its result (a start
            # that returns after its caller gave up still holds one NVML reference).
            atexit.register(shutdown, pynvml, self.timeout)
        finally:
            self.ended = time.monotonic()
            self.done.set()


def start_timeout() -> float:
    """Seconds a query waits for NVML to start: ``$DEVICEKIT_NVML_TIMEOUT``, else 30.

    Raises:
        ValueError: ``$DEVICEKIT_NVML_TIMEOUT`` is not a finite number of
            seconds above 0.
    """
    text = os.environ.get(TIMEOUT_VAR, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{TIMEOUT_VAR}={text!r}: expected a finite number of seconds above 0 for "
            f"NVML to start, such as 60; unset it for the default, {DEFAULT_TIMEOUT:g}"
        )
    return seconds


def shutdown(pynvml: Any, timeout: float) -> None:
    """``nvmlShutdown`` at exit, bounded as the start is: a wedged driver must not hang the exit."""
    done = threading.Event()

    def run() -> None:
        with contextlib.suppress(pynvml.NVMLError):  # at exit there is nobody left to tell
            pynvml.nvmlShutdown()
        done.set()

    try:
        threading.Thread(target=run, name="devicekit-nvml-shutdown", daemon=True).start()
    except RuntimeError:
        # Python 3.12+ starts no thread in an atexit handler, so the call cannot be
        # bounded there; skip it: the driver frees what a process held when it ends.
        return
    done.wait(timeout)


def error_code(error: BaseException) -> int | None:
    """The NVML return code an ``NVMLError`` carries (None for any other error)."""
    return getattr(error, "value", None)
