"""NVML: started lazily, once, under a lock; read field by field; shut down at exit.

This module knows NVML and nothing of torch. Every field NVML cannot give on a
given GPU (not supported, no permission, an old driver, a GPU lost since the
last call) reads as ``None``, and so does every value NVML gives that cannot be
true (its "not available" sentinels, a utilization over 100 %, more memory used
than the GPU has); nothing here raises because of one missing field.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._gpuinfo import GPUInfo, GPUProcess

__all__ = [
    "GPUInfo",
    "GPUProcess",
    "PhysicalGPU",
    "cuda_driver_version",
    "driver_version",
    "library",
    "lost_gpus",
    "nvml_available",
    "nvml_error",
    "physical_gpus",
    "read_energy",
    "read_gpu",
]

logger = logging.getLogger("devicekit")

# NVML return codes (stable across drivers; pynvml exposes the same numbers).
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_INSUFFICIENT_SIZE = 7
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_RM_VERSION_MISMATCH = 18
_ARGUMENT_VERSION_MISMATCH = 25
# What a driver answers for a call (or a version of one) it does not have. Only these
# say "this driver lacks it"; any other error is about one GPU, or one moment.
_ABSENT = frozenset({_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH})
_PROCESS_LIST_TRIES = 3  # a process can start between NVML's "how many" and "list them"

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


class _Session:
    """Every piece of NVML state in this process, in one place, with one `reset()`.

    NVML starts at most once per session, under a lock. A child made by
    ``fork`` gets a fresh session (``os.register_at_fork``): a lock held by
    another thread at the moment of the fork would otherwise stay locked in
    the child forever, and the parent's handles and caches are not the
    child's to trust.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next query starts NVML again (tests; a forked child)."""
        self.lock = threading.Lock()
        self.tried = False
        self.module: Any = None
        self.error: str | None = None
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
        if self.tried:  # fast path: no lock once started (or failed)
            return self.module
        with self.lock:
            if not self.tried:
                self.module, self.error = _start()
                self.tried = True
        return self.module


def _start() -> tuple[Any, str | None]:
    try:
        import pynvml  # noqa: PLC0415 - lazy on purpose: no NVML work until asked
    except ImportError:
        return None, "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        code = getattr(error, "value", None)
        return None, _INIT_ERRORS.get(code, f"NVML failed to start: {error}")  # type: ignore[arg-type]
    atexit.register(_shutdown, pynvml)
    return pynvml, None


def _shutdown(pynvml: Any) -> None:
    with contextlib.suppress(pynvml.NVMLError):  # at exit there is nobody left to tell
        pynvml.nvmlShutdown()


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
    fell off the bus can do that); that is asked again on the next query.

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


def _text(value: Any) -> str | None:
    """A string NVML gave: ``bytes`` from older bindings, ``str`` from newer ones."""
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _number(value: Any, *, at_most: int | None = None, bits: int = 32) -> int | None:
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
    millijoules = _number(_read(nv, nv.nvmlDeviceGetTotalEnergyConsumption, handle), bits=64)
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
    return None if nv is None else _text(_read(nv, nv.nvmlSystemGetDriverVersion))


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
    version = _number(_read(nv, nv.nvmlSystemGetCudaDriverVersion_v2))
    if version is None:
        version = _number(_read(nv, nv.nvmlSystemGetCudaDriverVersion))
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
    mig_enabled: bool | None  # changing it needs a GPU reset, which invalidates handles
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
    found = []
    for index in range(count):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as error:
            # Skipped, as CUDA skips a GPU it cannot open, so that the PCI order of
            # the others still numbers them as CUDA does (a job scheduler's cgroup
            # leaves NVML counting GPUs it denies this process: no finding there).
            reason = _lost_reason(error)
            if reason is not None:
                _session.lost[index] = reason
            continue
        pci = _read(nv, nv.nvmlDeviceGetPciInfo, handle)
        mig_mode = _read(nv, nv.nvmlDeviceGetMigMode, handle)
        found.append(
            PhysicalGPU(
                nvml_index=index,
                handle=handle,
                uuid=_text(_read(nv, nv.nvmlDeviceGetUUID, handle)),
                name=_text(_read(nv, nv.nvmlDeviceGetName, handle)),
                pci_bus_id=None if pci is None else _text(pci.busId),
                sm_clock_max=_number(
                    _read(nv, nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM)
                ),
                mig_enabled=None if mig_mode is None else mig_mode[0] == 1,
                mig=_mig_instances(nv, handle) if mig_mode and mig_mode[0] == 1 else (),
            )
        )
    return found


def _why(error: BaseException) -> str:
    """An NVML error as a reason: what NVML says, and what it means where that is not plain."""
    code = _code(error)
    if code == _GPU_IS_LOST:
        return (
            "NVML says the GPU is lost: it stopped answering the driver (fallen off the bus, "
            "Xid 79 in the kernel log)"
        )
    if code == _RESET_REQUIRED:
        return "NVML says the GPU needs a reset before it can be used again"
    return f"{error} (NVML error {code})" if code is not None else str(error)


def _lost_reason(error: BaseException) -> str | None:
    """The reason a whole GPU cannot be read, when ``error`` is one (lost, needs a reset)."""
    return _why(error) if _code(error) in (_GPU_IS_LOST, _RESET_REQUIRED) else None


def lost_gpus() -> dict[int, str]:
    """NVML index -> why, for each GPU NVML counts but could not open: lost, or needing a reset."""
    physical_gpus()
    return dict(_session.lost)


def _mig_instances(nv: Any, handle: Any) -> tuple[tuple[str, Any], ...]:
    instances = []
    for slot in range(_number(_read(nv, nv.nvmlDeviceGetMaxMigDeviceCount, handle)) or 0):
        mig = _read(nv, nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        uuid = None if mig is None else _text(_read(nv, nv.nvmlDeviceGetUUID, mig))
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


_THROTTLE_NAMES = {
    0x1: "idle",
    0x2: "applications_clocks",
    0x4: "power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",
    0x400: "reliability",
}
_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def throttle_names(mask: int) -> tuple[str, ...]:
    """Readable names of the bits set in an NVML clocks-event (throttle) mask."""
    return tuple(name for bit, name in _THROTTLE_NAMES.items() if mask & bit)


def read_gpu(
    gpu: PhysicalGPU, *, torch_index: int | None, handle: Any = None, uuid: str | None = None
) -> GPUInfo:
    """One snapshot of ``gpu`` (or of one of its MIG instances, given its handle and uuid)."""
    nv = library()
    snap = _Snapshot(
        nv,
        gpu.handle if handle is None else handle,
        (uuid or gpu.uuid) or f"nvml:{gpu.nvml_index}",  # stable, unlike id(handle)
    )
    total, used, free = _memory(snap)
    rates = snap.read(nv.nvmlDeviceGetUtilizationRates)
    power, energy = _power_and_energy(snap)
    limit = _number(snap.read(nv.nvmlDeviceGetEnforcedPowerLimit))
    mask = _throttle_mask(snap)
    mode = _number(snap.read(nv.nvmlDeviceGetComputeMode))
    processes = _processes(snap)
    return GPUInfo(
        torch_index=torch_index,
        nvml_index=gpu.nvml_index,
        uuid=gpu.uuid if uuid is None else uuid,
        name=gpu.name if handle is None else _text(snap.read(nv.nvmlDeviceGetName)),
        pci_bus_id=gpu.pci_bus_id,
        memory_total=total,
        memory_used=used,
        memory_free=free,
        utilization=None if rates is None else _number(rates.gpu, at_most=100),
        memory_utilization=None if rates is None else _number(rates.memory, at_most=100),
        temperature=_number(snap.read(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)),
        power_draw=None if power is None else power / 1000,
        power_limit=None if limit is None else limit / 1000,
        sm_clock=_number(snap.read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM)),
        sm_clock_max=gpu.sm_clock_max,
        memory_clock=_number(snap.read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM)),
        throttle_reasons=None if mask is None else throttle_names(mask),
        fan_speed=_number(snap.read(nv.nvmlDeviceGetFanSpeed)),  # may pass 100 %, NVML says
        compute_mode=None if mode is None else _COMPUTE_MODES.get(mode, str(mode)),
        mig_enabled=gpu.mig_enabled,
        processes=processes,
        energy=None if energy is None else energy / 1000,
        error=snap.lost,
    )


class _Snapshot:
    """One read of one GPU: its handle, what it does not support, and whether it is lost.

    Once a call says the GPU is lost (or needs a reset), the rest are not
    made: they would fail alike, and the snapshot's ``error`` says why every
    field is None.
    """

    def __init__(self, nv: Any, handle: Any, key: str) -> None:
        self.nv = nv
        self.handle = handle
        self.key = key
        self.skip = _session.unsupported.get(key)  # usually None: nothing looked up per call
        self.lost: str | None = None

    def skips(self, name: str) -> bool:
        """Whether this GPU answered *not supported* to ``name`` before, or is lost now."""
        return self.lost is not None or bool(self.skip and name in self.skip)

    def failed(self, name: str, error: BaseException) -> None:
        """Remember what ``error`` says about this GPU, beyond this one call."""
        if _code(error) == _NOT_SUPPORTED:  # a GPU will not start supporting it
            _session.unsupported.setdefault(self.key, set()).add(name)
        elif self.lost is None:
            self.lost = _lost_reason(error)

    def read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(handle, *args)``, or None when this GPU cannot answer it."""
        if self.lost is not None or (self.skip and _call_name(fn, args) in self.skip):
            return None
        try:
            return fn(self.handle, *args)
        except self.nv.NVMLError as error:
            self.failed(_call_name(fn, args), error)
            return None


def _call_name(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    return f"{getattr(fn, '__name__', fn)}{args}"


# Fields NVML can read in one call (nvmlDeviceGetFieldValues). Only power and the
# energy counter among GPUInfo's per-refresh fields have field IDs.
_FI_POWER_INSTANT = 186  # mW
_FI_TOTAL_ENERGY = 83  # mJ since the driver loaded
_VALUE_KINDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
_VALUE_BITS = (0, 32, 64, 64, 64, 32, 16)  # of each kind, for its "not available" value


def _power_and_energy(snap: _Snapshot) -> tuple[int | None, int | None]:
    """Power (mW) and energy (mJ): one batched call where the driver has it, else two calls."""
    nv = snap.nv
    power = energy = None
    batched = False
    if _session.field_values is not False and not snap.skips("nvmlDeviceGetFieldValues"):
        try:
            values = nv.nvmlDeviceGetFieldValues(snap.handle, [_FI_POWER_INSTANT, _FI_TOTAL_ENERGY])
        except (AttributeError, TypeError):  # a binding without the call
            _session.field_values = False
        except nv.NVMLError as error:
            if _code(error) in _ABSENT:  # the driver lacks it: never ask again
                _session.field_values = False
            else:  # this GPU, this moment: the single calls below answer, or say why not
                snap.failed("nvmlDeviceGetFieldValues", error)
        else:
            _session.field_values = batched = True
            fields = [_field(value) for value in values]
            if len(fields) == 2:
                power, energy = fields
    if power is None:
        power = _number(snap.read(nv.nvmlDeviceGetPowerUsage))
    if energy is None and not batched:  # a batch's "not supported" for a field is final
        energy = _number(snap.read(nv.nvmlDeviceGetTotalEnergyConsumption), bits=64)
    return power, energy


def _field(value: Any) -> int | None:
    """One field of a batch: None unless NVML answered it with a possible value."""
    if value.nvmlReturn != 0:
        return None
    kind = int(value.valueType)
    if not 0 <= kind < len(_VALUE_KINDS):
        return None
    number = getattr(value.value, _VALUE_KINDS[kind])
    if kind == 0:  # a double: power and energy come as integers, but say what it says
        return int(number) if math.isfinite(number) and number >= 0 else None
    return _number(number, bits=_VALUE_BITS[kind])


def _memory(snap: _Snapshot) -> tuple[int | None, int | None, int | None]:
    """Total, used and free bytes; used and free None when they cannot both be true."""
    nv = snap.nv
    # v2 reports "used" without the driver's reserved memory, as nvidia-smi does.
    info = None
    if _session.memory_v2 is not False and not snap.skips("nvmlDeviceGetMemoryInfo_v2"):
        try:
            info = nv.nvmlDeviceGetMemoryInfo(snap.handle, version=nv.nvmlMemory_v2)
            _session.memory_v2 = True
        except (TypeError, AttributeError):  # a binding without the version argument
            _session.memory_v2 = False
        except nv.NVMLError as error:
            if _code(error) in _ABSENT:  # the driver lacks v2: v1 from now on
                _session.memory_v2 = False
            else:  # this GPU or this moment only; it decides nothing for the others
                snap.failed("nvmlDeviceGetMemoryInfo_v2", error)
    if info is None:
        info = snap.read(nv.nvmlDeviceGetMemoryInfo)
    if info is None:
        return None, None, None
    total, used, free = (_number(getattr(info, f), bits=64) for f in ("total", "used", "free"))
    if total is not None and any(part is not None and part > total for part in (used, free)):
        # More used (or free) than the GPU has: NVML's unsigned arithmetic wrapped, or
        # the driver miscounted. Neither number can be trusted; the total can.
        return total, None, None
    return total, used, free


def _throttle_mask(snap: _Snapshot) -> int | None:
    nv = snap.nv
    names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
    for name in names if _session.throttle_call is None else (_session.throttle_call,):
        fn = getattr(nv, name, None)
        if fn is None:
            continue
        if snap.skips(name):
            return None
        try:
            mask = fn(snap.handle)
        except nv.NVMLError as error:
            if _code(error) == _FUNCTION_NOT_FOUND:
                continue
            snap.failed(name, error)
            return None
        _session.throttle_call = name
        return _number(mask, bits=64)  # all ones is "not available", not every reason at once
    return None


def _code(error: BaseException) -> int | None:
    return getattr(error, "value", None)


def _processes(snap: _Snapshot) -> tuple[GPUProcess, ...] | None:
    found: list[GPUProcess] = []
    for kind in ("compute", "graphics"):
        entries = _process_entries(snap, kind)
        if entries is None:
            return None
        for entry in entries:
            used = _number(entry.usedGpuMemory, bits=64)  # None on Windows (WDDM), some MIG
            pid = int(entry.pid)
            name = _process_name(pid)
            visible = name is not None or pid not in _session.foreign_pids
            found.append(GPUProcess(pid, name, used, kind, pid_visible=visible))
    return tuple(found)


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = (("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong))


def _process_entries(snap: _Snapshot, kind: str) -> list[Any] | None:
    """Probe v3, then v2, then v1 of NVML's process query; remember what works.

    NVML lists processes in two calls, "how many" and "list them"; a process
    that starts in between makes the second answer *insufficient size*. That
    is a race, not an error: the list is asked for again, a few times.
    """
    nv = snap.nv
    name = f"nvmlDeviceGet{kind.capitalize()}RunningProcesses"
    if snap.skips(name):
        return None
    known = _session.process_versions.get(kind)
    for version in (3, 2, 1) if known is None else (known,):
        for _ in range(_PROCESS_LIST_TRIES):
            try:
                if version == 1:  # the unversioned C symbol is v1; the binding has no v1 wrapper
                    entries = _processes_v1(nv, snap.handle, name)
                else:
                    entries = getattr(nv, f"{name}_v{version}")(snap.handle)
            except nv.NVMLError as error:
                if _code(error) == _INSUFFICIENT_SIZE:
                    continue
                if _code(error) in _ABSENT:
                    break  # this driver lacks this version: try the older one
                snap.failed(name, error)
                return None
            except AttributeError:  # an old binding without this wrapper
                break
            _session.process_versions[kind] = version
            return list(entries)
        else:
            return None  # processes came and went faster than NVML could list them
    return None


def _processes_v1(nv: Any, handle: Any, symbol: str) -> list[Any]:
    fn = nv._nvmlGetFunctionPointer(symbol)
    count = ctypes.c_uint(0)
    result = fn(handle, ctypes.byref(count), None)
    if result == 0:
        return []
    if result != _INSUFFICIENT_SIZE:  # not "there are processes": an error
        nv._nvmlCheckReturn(result)
    count.value = count.value * 2 + 5
    entries = (_ProcessInfoV1 * count.value)()
    nv._nvmlCheckReturn(fn(handle, ctypes.byref(count), entries))
    return list(entries[: count.value])


def foreign_pids() -> frozenset[int]:
    """PIDs NVML reported that do not exist in this PID namespace (a container's view)."""
    return frozenset(_session.foreign_pids)


def _process_name(pid: int) -> str | None:
    # os.open/os.read: a fifth of the cost of open() with a text wrapper, per process
    # and snapshot. The name is the process's own choice: printers escape it.
    try:
        fd = os.open(f"/proc/{pid}/comm", os.O_RDONLY)
    except FileNotFoundError:
        if not _session.foreign_pids:
            logger.warning(
                "NVML reported PID %d, which does not exist in this PID namespace: inside a "
                "container NVML shows host PIDs, so process names are unknown here.",
                pid,
            )
        _session.foreign_pids.add(pid)
        return None
    except OSError:  # hidepid or another user's process: it exists, its name is private
        return None
    try:
        return os.read(fd, 64).decode("utf-8", "replace").strip() or None
    except OSError:
        return None
    finally:
        os.close(fd)
