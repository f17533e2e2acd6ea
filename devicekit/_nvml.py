"""NVML: started lazily under a lock, waited for within a bound; its GPUs listed; shut down at exit.

This module knows NVML and nothing of torch; `_nvmlread` reads one GPU
through the session kept here. Every field NVML cannot give on a
given GPU (not supported, no permission, an old driver, a GPU lost since the
last call) reads as ``None``, and so does every value NVML gives that cannot be
true (its "not available" sentinels, a utilization over 100 %, more memory used
than the GPU has); nothing here raises because of one missing field.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._gpuinfo import GPUInfo, GPUProcess
from ._nvmlstart import (
    DEFAULT_TIMEOUT,
    NOT_INSTALLED,
    RETRY_AFTER,
    TIMEOUT_VAR,
    Start,
    error_code,
    start_timeout,
)

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
INSUFFICIENT_SIZE = 7
FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_ARGUMENT_VERSION_MISMATCH = 25
# What a driver answers for a call (or a version of one) it does not have. Only these
# say "this driver lacks it"; any other error is about one GPU, or one moment.
ABSENT_CALLS = frozenset({FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH})


class _Session:
    """Every piece of NVML state in this process, in one place, with one `reset()`.

    NVML starts under a lock, in a daemon thread the caller waits for at most
    `start_timeout()` seconds (see `_nvmlstart`): a wedged driver can block ``nvmlInit`` for good,
    and then the caller gets "NVML did not answer" instead of a hang. While
    that start is still blocked no second one begins; if it ever returns, the
    next query takes its result. A start that failed is tried again
    `RETRY_AFTER` seconds later, at the earliest (a driver loaded after this
    process started is then seen), except where nothing can change while the
    process runs (`_nvmlstart.PERMANENT`).

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
        self.blocked: Start | None = None
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
            self.module, self.error, self.failed_at = None, NOT_INSTALLED, None
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
            f"NVML did not answer in {timeout:g} s: nvmlInit is blocked in the NVIDIA driver "
            "(a hung GPU or a wedged driver: look for Xid errors in `dmesg`); if this machine "
            f"is only slow to start NVML (GPUs without persistence mode), set {TIMEOUT_VAR} "
            "to more seconds"
        )
        self.blocked = attempt
        self.tried = True

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
