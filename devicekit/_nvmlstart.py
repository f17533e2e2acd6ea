"""Starting NVML: when to start and try again, one bounded ``nvmlInit``, the shutdown at exit.

A wedged driver can block ``nvmlInit`` (and ``nvmlShutdown``) for good, so
each runs in a daemon thread its caller waits for at most `start_timeout()`
seconds. `Starting`, the start half of `_nvml`'s session, decides when to
start and when to try again; `Start` is one attempt. What comes after the
start is bounded in `_nvmlbound`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
from typing import Any

from ._frames import caller_stacklevel

__all__ = [
    "DEFAULT_TIMEOUT",
    "NOT_INSTALLED",
    "NO_PERMISSION",
    "NVML_GONE",
    "NVML_GONE_CODES",
    "NVML_SILENT",
    "PERMANENT",
    "RETRY_AFTER",
    "TIMEOUT_VAR",
    "Start",
    "Starting",
    "error_code",
    "shutdown",
    "start_timeout",
    "timeout_problem",
    "timeout_seconds",
]

# NVML's return codes for a start that failed (pynvml exposes the same numbers).
_UNINITIALIZED = 1
NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_RM_VERSION_MISMATCH = 18

_INIT_ERRORS = {
    _LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 was not found: no NVIDIA driver is installed here",
    _DRIVER_NOT_LOADED: (
        "the NVIDIA driver is not loaded (no nvidia kernel module; in a container, "
        "start it with --gpus all)"
    ),
    NO_PERMISSION: "no permission to talk to the NVIDIA driver (check /dev/nvidia* permissions)",
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
# How a GPU's error starts when NVML stopped answering for every GPU after it had
# started (the driver unloaded or updated): findings give a restart, not a GPU reset.
NVML_GONE = "NVML stopped answering for the whole machine"
# The answers that say so: uninitialized (shut down under us), the driver unloaded, or
# the driver replaced by another version. At the start they are start failures.
NVML_GONE_CODES = frozenset({_UNINITIALIZED, _DRIVER_NOT_LOADED, _RM_VERSION_MISMATCH})
# How every "blocked in the driver" reason starts: a wedged driver, a fault to fix.
NVML_SILENT = "NVML did not answer in"
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


class Starting:
    """When NVML starts, and what the last start answered: the start half of `_nvml`'s session.

    NVML starts under a lock, in a daemon thread the caller waits for at most
    `start_timeout()` seconds: a wedged driver can block ``nvmlInit`` for good,
    and then the caller gets "NVML did not answer" instead of a hang. While
    that start is still blocked no second one begins; if it ever returns, the
    next query takes its result. A start that failed is tried again
    `RETRY_AFTER` seconds later, at the earliest (a driver loaded after this
    process started is then seen), except where nothing can change while the
    process runs (`PERMANENT`).
    """

    def reset_start(self) -> None:
        """Forget every start: the next query starts NVML again."""
        self.lock = threading.Lock()  # the session's: the enumeration runs under it too
        self.tried = False
        self.module: Any = None
        self.error: str | None = None
        # When (time.monotonic()) the last start failed, if it may be tried again; None
        # while NVML runs, and for a failure no retry can change.
        self.failed_at: float | None = None
        # A start whose caller gave up waiting: its thread is still blocked in nvmlInit.
        self.blocked: Start | None = None
        self.warned: set[str] = set()  # malformed timeouts already warned about

    def start(self) -> Any:
        """The started ``pynvml`` module, starting it if due; None while NVML is not usable."""
        module = self.module
        if module is not None:  # fast path: no lock once started
            return module
        if self.tried and self.blocked is None and not self._retry_due():
            return None  # failed, and not to be tried again yet (or ever)
        with self.lock:
            if self.module is None:
                if self.blocked is not None:
                    self._take(self.blocked)  # if that start has returned since
                elif not self.tried or self._retry_due():
                    self._begin()
        return self.module

    def _retry_due(self) -> bool:
        failed_at = self.failed_at
        return failed_at is not None and time.monotonic() - failed_at >= RETRY_AFTER

    def _begin(self) -> None:
        """Start NVML and wait for it, at most `start_timeout()` seconds (under the lock).

        ``tried``, ``blocked`` and ``failed_at`` are read without the lock (the
        fast path in `start`), so each outcome sets them last, once the answer
        they describe is in place.
        """
        try:
            import pynvml  # noqa: PLC0415 - lazy on purpose: no NVML work until asked
        except ImportError:
            # Importing is no driver call, so it cannot hang; a package installed
            # later needs a new process, as any import does.
            self.module, self.error, self.failed_at = None, NOT_INSTALLED, None
            self.tried = True
            return
        timeout = start_timeout()
        self._warn_timeout()
        attempt = Start(pynvml, timeout)
        thread = threading.Thread(target=attempt.run, name="devicekit-nvml-start", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            # Python 3.12+ starts no thread while the interpreter exits (an atexit handler
            # asking for status): start NVML here, unbounded, as the only way to answer.
            attempt.run()
        if attempt.done.wait(timeout):
            self._take(attempt)
            return
        self.module, self.failed_at = None, None  # not retried while it is still blocked
        self.error = (
            f"{NVML_SILENT} {timeout:g} s: nvmlInit is blocked in the NVIDIA driver "
            "(a hung GPU or a wedged driver: look for Xid errors in `dmesg`); if this machine "
            f"is only slow to start NVML (GPUs without persistence mode), set {TIMEOUT_VAR} "
            "to more seconds"
        )
        self.blocked = attempt
        self.tried = True

    def _warn_timeout(self) -> None:
        """Warn, once per value, that ``$DEVICEKIT_NVML_TIMEOUT`` is malformed.

        A typo in it used to keep NVML from starting: ``dk.gpus()`` was empty
        and ``pick_gpu()`` the CPU, without a word. Now the default bound
        holds, this warning names the variable, and ``dk.status()`` and
        ``devicekit doctor`` carry it as a finding.
        """
        problem = timeout_problem()
        if problem is None or problem in self.warned:
            return
        self.warned.add(problem)
        warnings.warn(problem, RuntimeWarning, stacklevel=caller_stacklevel())

    def _take(self, attempt: Start) -> None:
        """Adopt the result of ``attempt`` once it has one; until then change nothing."""
        if not attempt.done.is_set():
            return
        if attempt.unexpected is not None:
            self.blocked = None
            self.tried = False  # not NVML's answer: the next query starts afresh
            raise attempt.unexpected
        self.module, self.error = attempt.module, attempt.error
        self.failed_at = None if attempt.module is not None or attempt.final else attempt.ended
        self.tried = True
        self.blocked = None


def start_timeout() -> float:
    """Seconds a query waits for NVML to start, or to read: ``$DEVICEKIT_NVML_TIMEOUT``, else 30.

    ``inf``, and any value past what a wait can take (``threading.TIMEOUT_MAX``,
    about 292 years), is no bound: the wait is that long. A malformed value
    (`timeout_problem` says why) is no reason to leave the GPUs unread: the
    default is used, and the start warns about it.

    Examples:
        >>> import os
        >>> os.environ.get("DEVICEKIT_NVML_TIMEOUT") is None and start_timeout() == 30.0
        True
    """
    text = os.environ.get(TIMEOUT_VAR, "").strip()
    seconds = timeout_seconds(text)
    if seconds is None:
        return DEFAULT_TIMEOUT
    # Past TIMEOUT_MAX a lock's or an event's wait raises OverflowError (1e10 did, from
    # every query): that long is no bound in practice, so wait that long.
    return min(seconds, threading.TIMEOUT_MAX)


def timeout_problem() -> str | None:
    """What is wrong with ``$DEVICEKIT_NVML_TIMEOUT``, and the fix; None when it is fine or unset.

    Examples:
        >>> import os
        >>> os.environ.get("DEVICEKIT_NVML_TIMEOUT") is None and timeout_problem() is None
        True
    """
    text = os.environ.get(TIMEOUT_VAR, "").strip()
    if not text or timeout_seconds(text) is not None:
        return None
    return (
        f"{TIMEOUT_VAR}={text!r} is not a number of seconds above 0, so devicekit waits the "
        f"default {DEFAULT_TIMEOUT:g} s for NVML to start or to read a GPU; set it to seconds "
        "above 0, such as 60, or inf for no bound, or unset it"
    )


def timeout_seconds(text: str) -> float | None:
    """``text`` as seconds above 0 (``inf`` included); None when empty or malformed."""
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if seconds > 0 else None  # nan > 0 is False: nan is malformed too


def shutdown(pynvml: Any, timeout: float) -> None:
    """``nvmlShutdown`` at exit, bounded as the start is: a wedged driver must not hang the exit.

    Skipped while a call of this process is still blocked in the driver (a
    query gave up on it, `_nvmlbound`): the shutdown would most likely wait
    out its bound behind it, and the driver frees what a process held when
    it ends.
    """
    from ._nvmlbound import calls_blocked  # noqa: PLC0415 - it imports this module

    if calls_blocked():
        return
    done = threading.Event()

    def run() -> None:
        try:
            # At exit there is nobody left to tell, whatever the binding raised.
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
        finally:
            done.set()  # the exit waits for this: set it however the call ended

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
