"""NVML: started lazily, once, under a lock; read field by field; shut down at exit.

This module knows NVML and nothing of torch. Every field NVML cannot give on a
given GPU (not supported, no permission, an old driver) reads as ``None``;
nothing here raises because of one missing field.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
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
_FUNCTION_NOT_FOUND = 13
_RM_VERSION_MISMATCH = 18
_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for unsigned long long

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
    """Whether NVML can be queried here. Starts NVML on first use (never CUDA).

    Examples:
        >>> import devicekit as dk
        >>> dk.nvml_available() == (dk.nvml_error() is None)
        True
    """
    return library() is not None


def nvml_error() -> str | None:
    """Why NVML is not usable here (no driver, driver not loaded...), or None when it is.

    Examples:
        >>> import devicekit as dk
        >>> reason = dk.nvml_error()
        >>> reason is None or isinstance(reason, str)
        True
    """
    library()
    return _session.error


def _read(nv: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Call one NVML function; None when this GPU or driver cannot answer."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def read_energy(handle: Any) -> float | None:
    """Joules the GPU behind ``handle`` consumed since the driver loaded; None without a counter.

    The counter exists from Volta on, and not for a MIG instance (it covers
    the whole board). The driver updates it every 20 to 100 ms.
    """
    nv = library()
    if nv is None:
        return None
    millijoules = _read(nv, nv.nvmlDeviceGetTotalEnergyConsumption, handle)
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
    version = _read(nv, nv.nvmlSystemGetCudaDriverVersion_v2)
    if version is None:
        version = _read(nv, nv.nvmlSystemGetCudaDriverVersion)
    if version is None:
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
    """Every GPU NVML sees, in NVML index order (cached after the first call)."""
    nv = library()
    if nv is None:
        return []
    if _session.physical is None:
        with _session.lock:
            if _session.physical is None:
                _session.physical = _enumerate(nv)
    return _session.physical


def _enumerate(nv: Any) -> list[PhysicalGPU]:
    count = _read(nv, nv.nvmlDeviceGetCount) or 0
    found = []
    for index in range(count):
        handle = _read(nv, nv.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
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
                sm_clock_max=_read(nv, nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM),
                mig_enabled=None if mig_mode is None else mig_mode[0] == 1,
                mig=_mig_instances(nv, handle) if mig_mode and mig_mode[0] == 1 else (),
            )
        )
    return found


def _mig_instances(nv: Any, handle: Any) -> tuple[tuple[str, Any], ...]:
    instances = []
    for slot in range(_read(nv, nv.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
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
    h = gpu.handle if handle is None else handle
    key = (uuid or gpu.uuid) or f"nvml:{gpu.nvml_index}"  # stable, unlike id(handle)
    skip = _session.unsupported.get(key)  # usually None: then nothing is looked up per call

    def read(fn: Callable[..., Any], *args: Any) -> Any:
        if skip and _call_name(fn, args) in skip:
            return None
        try:
            return fn(h, *args)
        except nv.NVMLError as error:
            if _code(error) == _NOT_SUPPORTED:
                _session.unsupported.setdefault(key, set()).add(_call_name(fn, args))
            return None

    total, used, free = _memory(nv, h)
    rates = read(nv.nvmlDeviceGetUtilizationRates)
    power, energy = _power_and_energy(nv, h, read)
    limit = read(nv.nvmlDeviceGetEnforcedPowerLimit)
    mask = _throttle_mask(nv, h)
    mode = read(nv.nvmlDeviceGetComputeMode)
    return GPUInfo(
        torch_index=torch_index,
        nvml_index=gpu.nvml_index,
        uuid=gpu.uuid if uuid is None else uuid,
        name=gpu.name if handle is None else _text(read(nv.nvmlDeviceGetName)),
        pci_bus_id=gpu.pci_bus_id,
        memory_total=total,
        memory_used=used,
        memory_free=free,
        utilization=None if rates is None else rates.gpu,
        memory_utilization=None if rates is None else rates.memory,
        temperature=read(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
        power_draw=None if power is None else power / 1000,
        power_limit=None if limit is None else limit / 1000,
        sm_clock=read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
        sm_clock_max=gpu.sm_clock_max,
        memory_clock=read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
        throttle_reasons=None if mask is None else throttle_names(mask),
        fan_speed=read(nv.nvmlDeviceGetFanSpeed),
        compute_mode=None if mode is None else _COMPUTE_MODES.get(mode, str(mode)),
        mig_enabled=gpu.mig_enabled,
        processes=_processes(nv, h),
        energy=None if energy is None else energy / 1000,
    )


def _call_name(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    return f"{fn.__name__}{args}"


# Fields NVML can read in one call (nvmlDeviceGetFieldValues). Only power and the
# energy counter among GPUInfo's per-refresh fields have field IDs.
_FI_POWER_INSTANT = 186  # mW
_FI_TOTAL_ENERGY = 83  # mJ since the driver loaded
_VALUE_KINDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _power_and_energy(
    nv: Any, handle: Any, read: Callable[..., Any]
) -> tuple[float | None, float | None]:
    """Power (mW) and energy (mJ): one batched call where the driver has it, else two calls."""
    power = energy = None
    if _session.field_values is not False:
        try:
            values = nv.nvmlDeviceGetFieldValues(handle, [_FI_POWER_INSTANT, _FI_TOTAL_ENERGY])
            _session.field_values = True
            power, energy = (_field(value) for value in values)
        except (nv.NVMLError, AttributeError, TypeError) as error:
            if _session.field_values is None and _code(error) != _NO_PERMISSION:
                _session.field_values = False
    if power is None:
        power = read(nv.nvmlDeviceGetPowerUsage)
    if energy is None and _session.field_values is not True:
        energy = read(nv.nvmlDeviceGetTotalEnergyConsumption)
    return power, energy


def _field(value: Any) -> float | None:
    """One field of a batch: None unless NVML answered it."""
    if value.nvmlReturn != 0:
        return None
    kind = int(value.valueType)
    if not 0 <= kind < len(_VALUE_KINDS):
        return None
    number = getattr(value.value, _VALUE_KINDS[kind])
    return None if number == _NOT_AVAILABLE else float(number)


def _memory(nv: Any, handle: Any) -> tuple[int | None, int | None, int | None]:
    # v2 reports "used" without the driver's reserved memory, as nvidia-smi does.
    info = None
    if _session.memory_v2 is not False:
        try:
            info = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
            _session.memory_v2 = True
        except (nv.NVMLError, TypeError, AttributeError) as error:
            if _session.memory_v2 is None and _code(error) != _NO_PERMISSION:
                _session.memory_v2 = False
    if info is None:
        info = _read(nv, nv.nvmlDeviceGetMemoryInfo, handle)
    if info is None:
        return None, None, None
    return int(info.total), int(info.used), int(info.free)


def _throttle_mask(nv: Any, handle: Any) -> int | None:
    names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
    for name in names if _session.throttle_call is None else (_session.throttle_call,):
        fn = getattr(nv, name, None)
        if fn is None:
            continue
        try:
            mask = int(fn(handle))
        except nv.NVMLError as error:
            if _code(error) == _FUNCTION_NOT_FOUND:
                continue
            return None
        _session.throttle_call = name
        return mask
    return None


def _code(error: BaseException) -> int | None:
    return getattr(error, "value", None)


def _processes(nv: Any, handle: Any) -> tuple[GPUProcess, ...] | None:
    found: list[GPUProcess] = []
    for kind in ("compute", "graphics"):
        entries = _process_entries(nv, handle, kind)
        if entries is None:
            return None
        for entry in entries:
            memory = entry.usedGpuMemory
            used = None if memory is None or memory == _NOT_AVAILABLE else int(memory)
            pid = int(entry.pid)
            name = _process_name(pid)
            visible = name is not None or pid not in _session.foreign_pids
            found.append(GPUProcess(pid, name, used, kind, pid_visible=visible))
    return tuple(found)


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = (("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong))


def _process_entries(nv: Any, handle: Any, kind: str) -> list[Any] | None:
    """Probe v3, then v2, then v1 of NVML's process query; remember what works."""
    name = f"nvmlDeviceGet{kind.capitalize()}RunningProcesses"
    known = _session.process_versions.get(kind)
    for version in (3, 2, 1) if known is None else (known,):
        try:
            if version == 1:  # the unversioned C symbol is v1; the binding has no v1 wrapper
                entries = _processes_v1(nv, handle, name)
            else:
                entries = getattr(nv, f"{name}_v{version}")(handle)
        except nv.NVMLError as error:
            if _code(error) == _FUNCTION_NOT_FOUND:
                continue
            return None
        except AttributeError:  # an old binding without this wrapper
            continue
        _session.process_versions[kind] = version
        return list(entries)
    return None


def _processes_v1(nv: Any, handle: Any, symbol: str) -> list[Any]:
    fn = nv._nvmlGetFunctionPointer(symbol)
    count = ctypes.c_uint(0)
    result = fn(handle, ctypes.byref(count), None)
    if result == 0:
        return []
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
