"""NVML: started lazily under a lock, waited for within a bound; its GPUs listed; shut down at exit.

This module knows NVML and nothing of torch; `_nvmlread` reads one GPU
through the session kept here. Every field NVML cannot give on a
given GPU (not supported, no permission, an old driver, a GPU lost since the
last call) reads as ``None``, and so does every value NVML gives that cannot be
true (its "not available" sentinels, a utilization over 100 %, more memory used
than the GPU has); nothing here raises because of one missing field.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._gpuinfo import GPUInfo, GPUProcess

__all__ = [
    "ABSENT_CALLS",
    "DEFAULT_TIMEOUT",
    "FUNCTION_NOT_FOUND",
    "INSUFFICIENT_SIZE",
    "NOT_SUPPORTED",
    "RETRY_AFTER",
    "TIMEOUT_VAR",
    "GPUInfo",
    "GPUProcess",
    "PhysicalGPU",
    "checked_number",
    "cuda_driver_version",
    "driver_version",
    "error_code",
    "library",
    "logger",
    "lost_gpus",
    "lost_reason",
    "mig_instances",
    "nvml_available",
    "nvml_error",
    "nvml_text",
    "physical_gpus",
    "read_energy",
    "session",
    "start_timeout",
]

logger = logging.getLogger("devicekit")

# NVML return codes (stable across drivers; pynvml exposes the same numbers).
NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
INSUFFICIENT_SIZE = 7
FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_RM_VERSION_MISMATCH = 18
_ARGUMENT_VERSION_MISMATCH = 25
# What a driver answers for a call (or a version of one) it does not have. Only these
# say "this driver lacks it"; any other error is about one GPU, or one moment.
ABSENT_CALLS = frozenset({FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH})

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
_NOT_INSTALLED = "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
# Start failures no retry can change while the process runs: no driver library on the
# machine (a container started without GPUs). A driver not loaded yet, no permission
# yet, or an error NVML does not explain, may change: those are tried again.
_PERMANENT = frozenset({_LIBRARY_NOT_FOUND})

TIMEOUT_VAR = "DEVICEKIT_NVML_TIMEOUT"
# Well above a slow but healthy start: without persistence mode nvmlInit initializes
# every GPU, which takes seconds on an 8-GPU machine; a hung one never returns.
DEFAULT_TIMEOUT = 30.0
# Seconds before a failed start is tried again: often enough for a notebook that began
# before the driver loaded, and never a loop (`devicekit watch -n 0.1` asks ten times a
# second; a failed nvmlInit is tried once per 10 s of it).
RETRY_AFTER = 10.0


class _Session:
    """Every piece of NVML state in this process, in one place, with one `reset()`.

    NVML starts under a lock, in a daemon thread the caller waits for at most
    `start_timeout()` seconds: a wedged driver can block ``nvmlInit`` for good,
    and then the caller gets "NVML did not answer" instead of a hang. While
    that start is still blocked no second one begins; if it ever returns, the
    next query takes its result. A start that failed is tried again
    `RETRY_AFTER` seconds later, at the earliest (a driver loaded after this
    process started is then seen), except where nothing can change while the
    process runs (`_PERMANENT`).

    A child made by ``fork`` gets a fresh session (``os.register_at_fork``): a
    lock held by another thread at the moment of the fork would otherwise stay
    locked in the child forever, and the parent's handles and caches are not
    the child's to trust.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next query starts NVML again (tests; a forked child)."""
        self.lock = threading.Lock()
        self.tried = False
        self.module: Any = None
        self.error: str | None = None
        # When (time.monotonic()) the last start failed, if it may be tried again; None
        # while NVML runs, and for a failure no retry can change.
        self.failed_at: float | None = None
        # A start whose caller gave up waiting: its thread is still blocked in nvmlInit.
        self.blocked: _Start | None = None
        self.physical: list[PhysicalGPU] | None = None
        # Why NVML, started, could not count the GPUs at the last try (not cached: the
        # next query tries again), or None.
        self.count_error: str | None = None
        # NVML index -> why, for each GPU NVML counts but could not open because it is
        # lost (fallen off the bus) or needs a reset.
        self.lost: dict[int, str] = {}
        # GPU UUID -> calls it answered NOT_SUPPORTED. A GPU will not start supporting
        # them, and asking again is slow (0.14 ms for an H100's fan speed).
        self.unsupported: dict[str, set[str]] = {}
        # Which variant of a versioned NVML call works with this driver, found once.
        self.memory_v2: bool | None = None
        self.field_values: bool | None = None  # nvmlDeviceGetFieldValues, for a batch
        self.throttle_call: str | None = None
        self.process_versions: dict[str, int] = {}  # "compute"/"graphics" -> 3, 2 or 1
        # PIDs NVML reported that do not exist in this PID namespace (a container).
        self.foreign_pids: set[int] = set()
        # UUIDs of cuda:0, cuda:1... as CUDA orders them, per (CUDA_VISIBLE_DEVICES,
        # CUDA_DEVICE_ORDER), asked of a child process; and once CUDA has started here,
        # the order it really uses (it no longer follows the variables).
        self.child_orders: dict[tuple[str | None, str | None], list[str] | None] = {}
        self.cuda_order: list[str] | None = None
        # (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, CUDA started) -> the visible GPUs, in
        # torch order (devicekit._gpus works them out; entries are _gpus._Visible).
        self.visible: dict[tuple[str | None, str | None, bool], Any] = {}

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
            self.module, self.error, self.failed_at = None, _NOT_INSTALLED, None
            self.tried = True
            return
        try:
            timeout = start_timeout()
        except ValueError as error:
            # The reason NVML is unavailable, where status() and the CLI say it, rather
            # than a traceback out of every query; read again at each one (no driver
            # call), so a corrected variable counts at once.
            self.module, self.error = None, str(error)
            return
        attempt = _Start(pynvml, timeout)
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
            f"NVML did not answer in {timeout:g} s: nvmlInit is blocked in the NVIDIA driver "
            "(a hung GPU or a wedged driver: look for Xid errors in `dmesg`); if this machine "
            f"is only slow to start NVML (GPUs without persistence mode), set {TIMEOUT_VAR} "
            "to more seconds"
        )
        self.blocked = attempt
        self.tried = True

    def _take(self, attempt: _Start) -> None:
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

    def mig_changed(self) -> None:
        """Forget the enumeration: a GPU's MIG mode or instances changed since it was made.

        The next query opens every GPU again and lists its MIG instances as they
        are now; which GPUs are visible, and CUDA's order of them in a new child
        process, follow from that list, so they go too. What this process's own
        CUDA uses (`cuda_order`) does not change: CUDA keeps its first view.
        """
        self.physical = None
        self.visible.clear()
        self.child_orders.clear()


class _Start:
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
            self.final = code in _PERMANENT
        except Exception as error:  # noqa: BLE001 - not NVML's answer: raised to the caller
            self.unexpected = error
        else:
            self.module = pynvml
            # Registered by the start that succeeded, whoever takes its result (a start
            # that returns after its caller gave up still holds one NVML reference).
            atexit.register(_shutdown, pynvml, self.timeout)
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


def _shutdown(pynvml: Any, timeout: float) -> None:
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


_session = _Session()


def _after_fork_in_child() -> None:
    _session.reset()  # whichever session is current (tests swap it)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def session() -> _Session:
    """This process's NVML session (its caches live there)."""
    return _session


def library() -> Any:
    """The started ``pynvml`` module, or None when NVML is not usable here."""
    return _session.start()


def nvml_available() -> bool:
    """Whether NVML can be queried here: it starts, and counts the GPUs. Never starts CUDA.

    Examples:
        >>> import devicekit as dk
        >>> dk.nvml_available() == (dk.nvml_error() is None)
        True
    """
    return nvml_error() is None


def nvml_error() -> str | None:
    """Why NVML is not usable here (no driver, driver not loaded...), or None when it is.

    Also not usable: an NVML that starts but cannot count the GPUs (a GPU that
    fell off the bus can do that); that is asked again on the next query. An
    ``nvmlInit`` that does not return within ``$DEVICEKIT_NVML_TIMEOUT``
    seconds (default 30: a wedged driver) reads as not usable, with that
    reason, instead of hanging the caller. A start that failed is tried again
    10 s later at the earliest, unless nothing can change it in this process
    (no driver library, no ``nvidia-ml-py``).

    Examples:
        >>> import devicekit as dk
        >>> reason = dk.nvml_error()
        >>> reason is None or isinstance(reason, str)
        True
    """
    if library() is None:
        return _session.error
    physical_gpus()
    return _session.count_error


def _read(nv: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Call one NVML function; None when this GPU or driver cannot answer."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def nvml_text(value: Any) -> str | None:
    """A string NVML gave: ``bytes`` from older bindings, ``str`` from newer ones."""
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def checked_number(value: Any, *, at_most: int | None = None, bits: int = 32) -> int | None:
    """A reading NVML gives as an unsigned number; None where it cannot be one.

    NVML writes "not available" as all ones of the value's width (``bits``:
    ``0xFFFFFFFF`` for an unsigned int); a negative number, or one over
    ``at_most`` (a percentage over 100), cannot be a reading either. None is
    honest there; the number would not be.
    """
    if value is None:
        return None
    number = int(value)
    if number < 0 or number == 2**bits - 1:
        return None
    return None if at_most is not None and number > at_most else number


def read_energy(handle: Any) -> float | None:
    """Joules the GPU behind ``handle`` consumed since the driver loaded; None without a counter.

    The counter exists from Volta on, and not for a MIG instance (it covers
    the whole board). The driver updates it every 20 to 100 ms.
    """
    nv = library()
    if nv is None:
        return None
    millijoules = checked_number(_read(nv, nv.nvmlDeviceGetTotalEnergyConsumption, handle), bits=64)
    return None if millijoules is None else float(millijoules) / 1e3


def driver_version() -> str | None:
    """The NVIDIA driver version, such as ``"580.159.04"``, or None without NVML.

    Examples:
        >>> import devicekit as dk
        >>> version = dk.driver_version()
        >>> version is None or version.count(".") >= 1
        True
    """
    nv = library()
    return None if nv is None else nvml_text(_read(nv, nv.nvmlSystemGetDriverVersion))


def cuda_driver_version() -> str | None:
    """The newest CUDA version the driver supports, such as ``"13.0"``, or None.

    Examples:
        >>> import devicekit as dk
        >>> version = dk.cuda_driver_version()
        >>> version is None or "." in version
        True
    """
    nv = library()
    if nv is None:
        return None
    version = checked_number(_read(nv, nv.nvmlSystemGetCudaDriverVersion_v2))
    if version is None:
        version = checked_number(_read(nv, nv.nvmlSystemGetCudaDriverVersion))
    if not version:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


# --- reading -------------------------------------------------------------------------


@dataclass(frozen=True)
class PhysicalGPU:
    """What does not change while NVML runs: the handle and identity of one GPU."""

    nvml_index: int
    handle: Any
    uuid: str | None
    name: str | None
    pci_bus_id: str | None
    sm_clock_max: int | None
    # As enumerated. Both can change while NVML runs (`nvidia-smi -mig 1`, creating or
    # destroying instances): each snapshot reads the mode again, and a change, or a MIG
    # handle that no longer answers as its instance, makes the session enumerate again.
    mig_enabled: bool | None
    mig: tuple[tuple[str, Any], ...]  # (uuid, handle) of each MIG instance, if any


def physical_gpus() -> list[PhysicalGPU]:
    """Every GPU NVML can open, in NVML index order (cached after the first count).

    Empty without NVML, and while NVML cannot count the GPUs (then
    `nvml_error()` says why, and the next call counts again).
    """
    nv = library()
    if nv is None:
        return []
    physical = _session.physical
    if physical is None:
        with _session.lock:
            if _session.physical is None:
                _session.physical = _enumerate(nv)
            physical = _session.physical
    return physical or []


def _enumerate(nv: Any) -> list[PhysicalGPU] | None:
    """Open every GPU NVML counts; None (and `count_error` says why) when it cannot count."""
    try:
        count = int(nv.nvmlDeviceGetCount())
    except nv.NVMLError as error:
        # Not "no GPU": NVML started, so there is a driver, and it could not say.
        _session.count_error = f"NVML started but could not count the GPUs: {_why(error)}"
        return None
    _session.count_error = None
    _session.lost = {}  # made afresh with the list: a GPU reset since may answer now
    found = []
    for index in range(count):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as error:
            # Skipped, as CUDA skips a GPU it cannot open, so that the PCI order of
            # the others still numbers them as CUDA does (a job scheduler's cgroup
            # leaves NVML counting GPUs it denies this process: no finding there).
            reason = lost_reason(error)
            if reason is not None:
                _session.lost[index] = reason
            continue
        pci = _read(nv, nv.nvmlDeviceGetPciInfo, handle)
        mig_mode = _read(nv, nv.nvmlDeviceGetMigMode, handle)
        found.append(
            PhysicalGPU(
                nvml_index=index,
                handle=handle,
                uuid=nvml_text(_read(nv, nv.nvmlDeviceGetUUID, handle)),
                name=nvml_text(_read(nv, nv.nvmlDeviceGetName, handle)),
                pci_bus_id=None if pci is None else nvml_text(pci.busId),
                sm_clock_max=checked_number(
                    _read(nv, nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM)
                ),
                mig_enabled=None if mig_mode is None else mig_mode[0] == 1,
                mig=mig_instances(nv, handle) if mig_mode and mig_mode[0] == 1 else (),
            )
        )
    return found


def error_code(error: BaseException) -> int | None:
    """The NVML return code an ``NVMLError`` carries (None for any other error)."""
    return getattr(error, "value", None)


def _why(error: BaseException) -> str:
    """An NVML error as a reason: what NVML says, and what it means where that is not plain."""
    code = error_code(error)
    if code == _GPU_IS_LOST:
        return (
            "NVML says the GPU is lost: it stopped answering the driver (fallen off the bus, "
            "Xid 79 in the kernel log)"
        )
    if code == _RESET_REQUIRED:
        return "NVML says the GPU needs a reset before it can be used again"
    return f"{error} (NVML error {code})" if code is not None else str(error)


def lost_reason(error: BaseException) -> str | None:
    """The reason a whole GPU cannot be read, when ``error`` is one (lost, needs a reset)."""
    return _why(error) if error_code(error) in (_GPU_IS_LOST, _RESET_REQUIRED) else None


def lost_gpus() -> dict[int, str]:
    """NVML index -> why, for each GPU NVML counts but could not open: lost, or needing a reset."""
    physical_gpus()
    return dict(_session.lost)


def mig_instances(nv: Any, handle: Any) -> tuple[tuple[str, Any], ...]:
    """(UUID, handle) of each MIG instance the GPU behind ``handle`` has now."""
    instances = []
    for slot in range(checked_number(_read(nv, nv.nvmlDeviceGetMaxMigDeviceCount, handle)) or 0):
        mig = _read(nv, nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        uuid = None if mig is None else nvml_text(_read(nv, nv.nvmlDeviceGetUUID, mig))
        if uuid is not None:
            instances.append((uuid, mig))
    return tuple(instances)


def persistence_mode(nvml_index: int) -> bool | None:
    """Whether the driver keeps this GPU initialized between processes; None if unknown."""
    nv = library()
    gpu = next((g for g in physical_gpus() if g.nvml_index == nvml_index), None)
    if nv is None or gpu is None:
        return None
    mode = _read(nv, nv.nvmlDeviceGetPersistenceMode, gpu.handle)
    return None if mode is None else mode == 1
