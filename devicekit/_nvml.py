"""NVML: started lazily under a lock, waited for within a bound; its GPUs listed; shut down at exit.

This module knows NVML and nothing of torch; `_nvmlread` reads one GPU
through the session kept here. Every field NVML cannot give on a
given GPU (not supported, no permission, an old driver, a GPU lost since the
last call) reads as ``None``, and so does every value NVML gives that cannot be
true (its "not available" sentinels, a utilization over 100 %, more memory used
than the GPU has); nothing here raises because of one missing field.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ._gpuinfo import GPUInfo, GPUProcess
from ._nvmlbound import Job, bounded, bounded_each
from ._nvmlstart import (
    DEFAULT_TIMEOUT,
    NO_PERMISSION,
    NVML_GONE,
    NVML_GONE_CODES,
    RETRY_AFTER,
    TIMEOUT_VAR,
    Starting,
    error_code,
    start_timeout,
    timeout_problem,
)

__all__ = [
    "ABSENT_CALLS",
    "DEFAULT_TIMEOUT",
    "FUNCTION_NOT_FOUND",
    "INSUFFICIENT_SIZE",
    "NOT_SUPPORTED",
    "NO_PERMISSION",
    "RETRY_AFTER",
    "TIMEOUT_VAR",
    "GPUInfo",
    "GPUProcess",
    "PhysicalGPU",
    "checked_number",
    "cuda_driver_version",
    "driver_version",
    "error_code",
    "failure_reason",
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
    "timeout_problem",
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


class _Session(Starting):
    """Every piece of NVML state in this process, in one place, with one `reset()`.

    NVML starts under a lock, bounded: a wedged driver can block ``nvmlInit``
    for good, and then the caller gets "NVML did not answer" instead of a hang
    (`_nvmlstart.Starting` says when it starts and when it is tried again).
    Every NVML call after the start runs in a unit of work bounded alike
    (`_nvmlbound`): one GPU's snapshot, the enumeration. Only the start and
    the enumeration wait under the lock, each for the bound at most.

    A child made by ``fork`` gets a fresh session (``os.register_at_fork``): a
    lock held by another thread at the moment of the fork would otherwise stay
    locked in the child forever, and the parent's handles and caches are not
    the child's to trust.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next query starts NVML again (tests; a forked child)."""
        self.reset_start()
        self.physical: list[PhysicalGPU] | None = None
        # Units of NVML work a query gave up waiting for, by key, still blocked or lately
        # returned: a GPU's NVML index, "enumeration", "system" (see `_nvmlbound`).
        self.wedged: dict[Hashable, Job] = {}
        # The driver's version and the CUDA version it supports: fixed while NVML runs
        # (NVML holds the driver open, so its kernel module cannot be swapped meanwhile).
        self.versions: tuple[str | None, int | None] | None = None
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
    ``nvmlInit``, or a count of the GPUs, that does not return within
    ``$DEVICEKIT_NVML_TIMEOUT`` seconds (default 30: a wedged driver) reads as
    not usable, with that reason, instead of hanging the caller. A start that
    failed is tried again 10 s later at the earliest, unless nothing can
    change it in this process (no driver library, no ``nvidia-ml-py``).

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
    ``at_most`` (a percentage over 100), cannot be a reading either, nor can
    anything that is not an integer (a binding that gave a ctypes value, a
    string, a NaN). None is honest there; the number would not be.
    """
    try:
        number = operator.index(value)  # ints only: int() would take "12" and 12.9
    except TypeError:
        return None
    if number < 0 or number == 2**bits - 1:
        return None
    return None if at_most is not None and number > at_most else number


def read_energy(handle: Any) -> float | None:
    """Joules the GPU behind ``handle`` consumed since the driver loaded; None without a counter.

    The counter exists from Volta on, and not for a MIG instance (it covers
    the whole board). The driver updates it every 20 to 100 ms. None too
    while the GPU does not answer (bounded as its snapshot is, under its key).
    """
    nv = library()
    if nv is None:
        return None
    owner = next((g for g in physical_gpus() if handle is g.handle or g.owns(handle)), None)
    millijoules, _ = bounded(
        _session.wedged,
        # A handle of no GPU listed now (listed before MIG changed): keyed by itself. Its
        # id is not reused while a read of it is blocked, which holds on to it.
        ("handle", id(handle)) if owner is None else owner.nvml_index,
        lambda: checked_number(_read(nv, nv.nvmlDeviceGetTotalEnergyConsumption, handle), bits=64),
        "reading an energy counter",
    )
    return None if millijoules is None else float(millijoules) / 1e3


def _versions(nv: Any) -> tuple[str | None, int | None]:
    """The driver's version and the CUDA version it supports; asked until both are known."""
    known = _session.versions
    if known is not None:
        return known
    doing = "reading the driver's version"
    answer, _ = bounded(_session.wedged, "system", lambda: _read_versions(nv), doing)
    if answer is None:
        return None, None
    if None not in answer:
        _session.versions = answer
    return answer


def _read_versions(nv: Any) -> tuple[str | None, int | None]:
    cuda = checked_number(_read(nv, nv.nvmlSystemGetCudaDriverVersion_v2))
    if cuda is None:
        cuda = checked_number(_read(nv, nv.nvmlSystemGetCudaDriverVersion))
    return nvml_text(_read(nv, nv.nvmlSystemGetDriverVersion)), cuda


def driver_version() -> str | None:
    """The NVIDIA driver version, such as ``"580.159.04"``, or None without NVML.

    Examples:
        >>> import devicekit as dk
        >>> version = dk.driver_version()
        >>> version is None or version.count(".") >= 1
        True
    """
    nv = library()
    return None if nv is None else _versions(nv)[0]


def cuda_driver_version() -> str | None:
    """The newest CUDA version the driver supports, such as ``"13.0"``, or None.

    Examples:
        >>> import devicekit as dk
        >>> version = dk.cuda_driver_version()
        >>> version is None or "." in version
        True
    """
    nv = library()
    version = None if nv is None else _versions(nv)[1]
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

    def owns(self, handle: Any) -> bool:
        """Whether ``handle`` is one of this GPU's MIG instances, as listed."""
        return any(handle is mig for _, mig in self.mig)


def physical_gpus() -> list[PhysicalGPU]:
    """Every GPU NVML can open, in NVML index order (cached after the first count).

    Empty without NVML, and while NVML cannot count the GPUs (then
    `nvml_error()` says why, and the next call counts again). The count runs
    bounded (`_nvmlbound`), under the lock: queries waiting for the lock
    meanwhile wait for that bound at most, and then answer at once.
    """
    nv = library()
    if nv is None:
        return []
    physical = _session.physical
    if physical is None:
        with _session.lock:
            if _session.physical is None:
                doing = "counting and opening the GPUs"
                found, why = bounded(
                    _session.wedged, "enumeration", lambda: _enumerate(nv), doing, late=True
                )
                if found is None:
                    _session.count_error = why
                else:
                    _session.physical, _session.count_error, lost = found
                    if lost is not None:  # made afresh with the list: a GPU reset since may answer
                        _session.lost = lost
            physical = _session.physical
    return physical or []


def _enumerate(nv: Any) -> tuple[list[PhysicalGPU] | None, str | None, dict[int, str] | None]:
    """Open every GPU NVML counts: (the GPUs, None, the lost ones), or (None, why, None)."""
    try:
        count = int(nv.nvmlDeviceGetCount())
    except nv.NVMLError as error:
        # Not "no GPU": NVML started, so there is a driver, and it could not say.
        return None, f"NVML started but could not count the GPUs: {failure_reason(error)}", None
    lost = {}
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
                lost[index] = reason
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
    return found, None, lost


def failure_reason(error: BaseException) -> str:
    """An NVML error as a reason: what NVML says, and what it means where that is not plain."""
    code = error_code(error)
    if code in NVML_GONE_CODES:
        return (
            f"{NVML_GONE}: {error} (NVML error {code}); the NVIDIA driver was unloaded or "
            "updated since this process started NVML"
        )
    if code == _GPU_IS_LOST:
        return (
            "NVML says the GPU is lost: it stopped answering the driver (fallen off the bus, "
            "Xid 79 in the kernel log)"
        )
    if code == _RESET_REQUIRED:
        return "NVML says the GPU needs a reset before it can be used again"
    return f"{error} (NVML error {code})" if code is not None else str(error)


def lost_reason(error: BaseException) -> str | None:
    """The reason a whole GPU cannot be read, when ``error`` is one (lost, needs a reset).

    So is NVML gone for every GPU (the driver unloaded): no later call of the
    snapshot would answer either.
    """
    code = error_code(error)
    lost = code in (_GPU_IS_LOST, _RESET_REQUIRED) or code in NVML_GONE_CODES
    return failure_reason(error) if lost else None


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
    return persistence_modes([nvml_index])[nvml_index]


def persistence_modes(nvml_indices: list[int]) -> dict[int, bool | None]:
    """`persistence_mode` of each GPU, asked at once: hung GPUs cost one bound, not one each."""
    nv = library()
    gpus = {gpu.nvml_index: gpu for gpu in physical_gpus()}
    modes: dict[int, bool | None] = dict.fromkeys(nvml_indices)
    known = [index for index in modes if nv is not None and index in gpus]
    units: list[tuple[Hashable, Callable[[], Any], str]] = [
        (
            index,
            functools.partial(_read, nv, nv.nvmlDeviceGetPersistenceMode, gpus[index].handle),
            f"reading the persistence mode of the GPU at NVML index {index}",
        )
        for index in known
    ]
    for index, (mode, _) in zip(known, bounded_each(_session.wedged, units), strict=True):
        modes[index] = None if mode is None else mode == 1
    return modes
