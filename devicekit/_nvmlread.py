"""One snapshot of one GPU: every field NVML gives, checked, as a `GPUInfo`.

`_nvml` owns the session (start, enumeration, what a driver lacks); this module
reads a GPU field by field through it. A field NVML cannot give, or gives as a
value that cannot be true, is ``None``; a GPU lost part way stops the snapshot,
and its ``error`` says why. The snapshot is one unit of bounded work
(`_nvmlbound`): a GPU whose calls block in the driver gets every reading None
and an ``error`` saying NVML did not answer, and the other GPUs are read.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Hashable
from typing import Any

from . import _nvmlsanity
from ._gpuinfo import GPUInfo, GPUProcess
from ._nvml import (
    ABSENT_CALLS,
    FUNCTION_NOT_FOUND,
    INSUFFICIENT_SIZE,
    NO_PERMISSION,
    NOT_SUPPORTED,
    PhysicalGPU,
    checked_number,
    error_code,
    failure_reason,
    library,
    logger,
    lost_reason,
    mig_instances,
    nvml_text,
    session,
)
from ._nvmlbound import bounded_each

__all__ = ["foreign_pids", "read_gpu", "read_gpus", "throttle_names"]

_PROCESS_LIST_TRIES = 3  # a process can start between NVML's "how many" and "list them"

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

_KNOWN_BITS = sum(_THROTTLE_NAMES)


def throttle_names(mask: int) -> tuple[str, ...]:
    """Readable names of the bits set in an NVML clocks-event (throttle) mask.

    A bit this table lacks (a newer driver's reason) is named by its value,
    never dropped: a GPU whose clocks are held must not read as held by nothing.

    Examples:
        >>> throttle_names(0x4 | 1 << 40)
        ('power_cap', 'reason_0x10000000000')
    """
    known = [name for bit, name in _THROTTLE_NAMES.items() if mask & bit]
    rest = mask & ~_KNOWN_BITS
    return (*known, *(f"reason_{1 << i:#x}" for i in range(rest.bit_length()) if rest >> i & 1))


def read_gpu(
    gpu: PhysicalGPU, *, torch_index: int | None, handle: Any = None, uuid: str | None = None
) -> GPUInfo:
    """One snapshot of ``gpu`` (or of one of its MIG instances, given its handle and uuid).

    Bounded: where NVML does not answer within ``$DEVICEKIT_NVML_TIMEOUT``
    seconds, every reading is None and ``error`` says so. Keyed by the GPU, so
    that its MIG instances, too, answer at once while a read of it is blocked.
    """
    return read_gpus([(gpu, torch_index, handle, uuid)])[0]


def read_gpus(targets: list[tuple[PhysicalGPU, int | None, Any, str | None]]) -> list[GPUInfo]:
    """A snapshot of each ``(gpu, torch_index, handle, uuid)``, as `read_gpu` takes them.

    All are read at once, each GPU in a worker of its own, and waited for
    with one ``$DEVICEKIT_NVML_TIMEOUT``: however many GPUs do not answer, a
    query waits that long at most, not that long per GPU.
    """
    nv = library()
    units: list[tuple[Hashable, Callable[[], GPUInfo], str]] = [
        (
            gpu.nvml_index,
            functools.partial(_snapshot, nv, gpu, index, handle, uuid),
            _doing(gpu),
        )
        for gpu, index, handle, uuid in targets
    ]
    answers = bounded_each(session().wedged, units)
    return [
        _unanswered(*target, why) if info is None else info
        for target, (info, why) in zip(targets, answers, strict=True)
    ]


def _doing(gpu: PhysicalGPU) -> str:
    return f"reading the GPU at NVML index {gpu.nvml_index} ({gpu.pci_bus_id or gpu.uuid})"


def _unanswered(
    gpu: PhysicalGPU, torch_index: int | None, handle: Any, uuid: str | None, why: str | None
) -> GPUInfo:
    """What the enumeration knows of a GPU NVML did not answer for; every reading unknown."""
    fields: dict[str, Any] = {field.name: None for field in dataclasses.fields(GPUInfo)}
    fields.update(
        torch_index=torch_index,
        nvml_index=gpu.nvml_index,
        uuid=gpu.uuid if uuid is None else uuid,
        name=gpu.name if handle is None else None,
        pci_bus_id=gpu.pci_bus_id,
        sm_clock_max=gpu.sm_clock_max,
        mig_enabled=None if handle is None else gpu.mig_enabled,
        error=why,
    )
    return GPUInfo(**fields)


def _snapshot(
    nv: Any, gpu: PhysicalGPU, torch_index: int | None, handle: Any, uuid: str | None
) -> GPUInfo:
    snap = _Snapshot(
        nv,
        gpu.handle if handle is None else handle,
        (uuid or gpu.uuid) or f"nvml:{gpu.nvml_index}",  # stable, unlike id(handle)
    )
    if handle is None:
        mig_enabled = _mig_mode(snap, gpu)
    else:
        mig_enabled = gpu.mig_enabled
        _check_mig_instance(snap, gpu, uuid)
    total, used, free = _memory(snap)
    rates = snap.read(nv.nvmlDeviceGetUtilizationRates)
    power, energy = _power_and_energy(snap)
    limit = _nvmlsanity.power_limit(snap.read(nv.nvmlDeviceGetEnforcedPowerLimit))
    mask = _throttle_mask(snap)
    mode = _nvmlsanity.compute_mode_name(snap.read(nv.nvmlDeviceGetComputeMode))
    processes = _processes(snap, total)
    info = GPUInfo(
        torch_index=torch_index,
        nvml_index=gpu.nvml_index,
        uuid=gpu.uuid if uuid is None else uuid,
        name=gpu.name if handle is None else nvml_text(snap.read(nv.nvmlDeviceGetName)),
        pci_bus_id=gpu.pci_bus_id,
        memory_total=total,
        memory_used=used,
        memory_free=free,
        utilization=None if rates is None else checked_number(rates.gpu, at_most=100),
        memory_utilization=None if rates is None else checked_number(rates.memory, at_most=100),
        temperature=checked_number(snap.read(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)),
        power_draw=None if power is None else power / 1000,
        power_limit=limit,
        sm_clock=checked_number(snap.read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM)),
        sm_clock_max=gpu.sm_clock_max,
        memory_clock=checked_number(snap.read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM)),
        throttle_reasons=None if mask is None else throttle_names(mask),
        fan_speed=checked_number(snap.read(nv.nvmlDeviceGetFanSpeed)),  # may pass 100 %, NVML says
        compute_mode=mode,
        mig_enabled=mig_enabled,
        processes=processes,
        energy=None if energy is None else energy / 1000,
        error=snap.lost,
    )
    if snap.lost is None and snap.failure is not None and not _any_reading(info):
        # Every call failed (NVML_ERROR_UNKNOWN, a timeout): a GPU that answers nothing
        # is not one to pick, nor one that doctor may call fine.
        return dataclasses.replace(info, error=f"NVML answered no reading: {snap.failure}")
    return info


_READINGS = tuple(
    field.name
    for field in dataclasses.fields(GPUInfo)
    if field.name
    not in ("torch_index", "nvml_index", "uuid", "name", "pci_bus_id", "sm_clock_max", "error")
)


def _any_reading(info: GPUInfo) -> bool:
    """Whether NVML answered at least one of this snapshot's readings."""
    return any(getattr(info, name) is not None for name in _READINGS)


def _mig_mode(snap: _Snapshot, gpu: PhysicalGPU) -> bool | None:
    """Whether MIG is on now; a change since the enumeration (or new instances) renews it.

    ``nvidia-smi -mig 1`` (with a GPU reset where the GPU needs one) changes the
    mode while NVML runs, and instances can be created or destroyed at any time:
    the enumeration would otherwise keep listing the GPU as it was.
    """
    mode = snap.read(snap.nv.nvmlDeviceGetMigMode)
    enabled = None if mode is None else mode[0] == 1
    if gpu.mig_enabled is not None and enabled is not None:
        if enabled != gpu.mig_enabled:
            session().mig_changed()
        elif enabled:
            listed = [mig_uuid for mig_uuid, _ in gpu.mig]
            if [mig_uuid for mig_uuid, _ in mig_instances(snap.nv, gpu.handle)] != listed:
                session().mig_changed()
    return enabled


def _check_mig_instance(snap: _Snapshot, gpu: PhysicalGPU, uuid: str | None) -> None:
    """Make sure a MIG instance's handle still names that instance, or say it is gone.

    A handle outlives its instance: once the instance is destroyed (or MIG
    turned off), it answers with an error, or, reused, with another
    instance's readings, which would be reported under this one's UUID. One
    call (its UUID) tells; where it does not answer, or the GPU's MIG setup
    was found changed since ``gpu`` was listed, the GPU's instances as they
    are now decide.
    """
    nv = snap.nv
    try:
        answered = nvml_text(nv.nvmlDeviceGetUUID(snap.handle))
    except nv.NVMLError as error:
        snap.lost = lost_reason(error)  # the whole GPU is lost: that is the reason
        if snap.lost is not None:
            return
        answered = None
    if answered is not None and answered != uuid:  # reused: another instance's readings
        why = f"its handle now answers as {answered}"
    else:
        listed_now = any(known is gpu for known in session().physical or ())
        if answered == uuid and listed_now:
            return
        current = [mig_uuid for mig_uuid, _ in mig_instances(nv, gpu.handle)]
        if uuid in current:
            return  # it exists: a failure this once, which its fields report one by one
        why = "it no longer exists on this GPU"
    session().mig_changed()
    snap.lost = (
        f"MIG instance {uuid} cannot be read: {why} (its GPU's MIG mode or instances changed "
        "since devicekit listed them; the next query lists them as they are now)"
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
        self.state = session()  # what this process learnt of the driver: calls it lacks
        self.skip = self.state.unsupported.get(key)  # usually None: nothing looked up per call
        self.lost: str | None = None
        # The first failure that is neither "not supported" nor "no permission".
        self.failure: str | None = None

    def skips(self, name: str) -> bool:
        """Whether this GPU answered *not supported* to ``name`` before, or is lost now."""
        return self.lost is not None or bool(self.skip and name in self.skip)

    def failed(self, name: str, error: BaseException) -> None:
        """Remember what ``error`` says about this GPU, beyond this one call."""
        code = error_code(error)
        if code == NOT_SUPPORTED:  # a GPU will not start supporting it
            self.state.unsupported.setdefault(self.key, set()).add(name)
        elif self.lost is None:
            self.lost = lost_reason(error)
            if self.failure is None and code != NO_PERMISSION:
                self.failure = failure_reason(error)

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
    if snap.state.field_values is not False and not snap.skips("nvmlDeviceGetFieldValues"):
        try:
            values = nv.nvmlDeviceGetFieldValues(snap.handle, [_FI_POWER_INSTANT, _FI_TOTAL_ENERGY])
        except (AttributeError, TypeError):  # a binding without the call
            snap.state.field_values = False
        except nv.NVMLError as error:
            if error_code(error) in ABSENT_CALLS:  # the driver lacks it: never ask again
                snap.state.field_values = False
            else:  # this GPU, this moment: the single calls below answer, or say why not
                snap.failed("nvmlDeviceGetFieldValues", error)
        else:
            snap.state.field_values = batched = True
            fields = [_field(value) for value in values]
            if len(fields) == 2:
                power, energy = fields
    if power is None:
        power = checked_number(snap.read(nv.nvmlDeviceGetPowerUsage))
    if energy is None and not batched:  # a batch's "not supported" for a field is final
        energy = checked_number(snap.read(nv.nvmlDeviceGetTotalEnergyConsumption), bits=64)
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
    return checked_number(number, bits=_VALUE_BITS[kind])


def _memory(snap: _Snapshot) -> tuple[int | None, int | None, int | None]:
    """Total, used and free bytes, each None where it cannot be true (`_nvmlsanity.memory`)."""
    nv = snap.nv
    # v2 reports "used" without the driver's reserved memory, as nvidia-smi does.
    info = None
    if snap.state.memory_v2 is not False and not snap.skips("nvmlDeviceGetMemoryInfo_v2"):
        try:
            info = nv.nvmlDeviceGetMemoryInfo(snap.handle, version=nv.nvmlMemory_v2)
            snap.state.memory_v2 = True
        except (TypeError, AttributeError):  # a binding without the version argument
            snap.state.memory_v2 = False
        except nv.NVMLError as error:
            if error_code(error) in ABSENT_CALLS:  # the driver lacks v2: v1 from now on
                snap.state.memory_v2 = False
            else:  # this GPU or this moment only; it decides nothing for the others
                snap.failed("nvmlDeviceGetMemoryInfo_v2", error)
    if info is None:
        info = snap.read(nv.nvmlDeviceGetMemoryInfo)
    if info is None:
        return None, None, None
    return _nvmlsanity.memory(info.total, info.used, info.free)


def _throttle_mask(snap: _Snapshot) -> int | None:
    nv, state = snap.nv, snap.state
    names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
    for name in names if state.throttle_call is None else (state.throttle_call,):
        fn = getattr(nv, name, None)
        if fn is None:
            continue
        if snap.skips(name):
            return None
        try:
            mask = fn(snap.handle)
        except nv.NVMLError as error:
            if error_code(error) == FUNCTION_NOT_FOUND:
                continue
            snap.failed(name, error)
            return None
        state.throttle_call = name
        # All ones is "not available", not every reason at once.
        return checked_number(mask, bits=64)
    return None


def _processes(snap: _Snapshot, total: int | None) -> tuple[GPUProcess, ...] | None:
    """The GPU's processes; a PID or a memory NVML cannot give (or that cannot be) is None."""
    found: list[GPUProcess] = []
    for kind in ("compute", "graphics"):
        entries = _process_entries(snap, kind)
        if entries is None:
            return None
        for entry in entries:
            used = _nvmlsanity.process_memory(entry.usedGpuMemory, total)
            pid = _nvmlsanity.process_pid(entry.pid)
            if pid is None:  # no PID to look up: no name, and no PID namespace to claim
                found.append(GPUProcess(None, None, used, kind))
                continue
            name = _process_name(pid)
            visible = name is not None or pid not in snap.state.foreign_pids
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
    known = snap.state.process_versions.get(kind)
    for version in (3, 2, 1) if known is None else (known,):
        for _ in range(_PROCESS_LIST_TRIES):
            try:
                if version == 1:  # the unversioned C symbol is v1; the binding has no v1 wrapper
                    entries = _processes_v1(nv, snap.handle, name)
                else:
                    entries = getattr(nv, f"{name}_v{version}")(snap.handle)
            except nv.NVMLError as error:
                if error_code(error) == INSUFFICIENT_SIZE:
                    continue
                if error_code(error) in ABSENT_CALLS:
                    break  # this driver lacks this version: try the older one
                snap.failed(name, error)
                return None
            except AttributeError:  # an old binding without this wrapper
                break
            snap.state.process_versions[kind] = version
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
    if result != INSUFFICIENT_SIZE:  # not "there are processes": an error
        nv._nvmlCheckReturn(result)
    count.value = count.value * 2 + 5
    entries = (_ProcessInfoV1 * count.value)()
    nv._nvmlCheckReturn(fn(handle, ctypes.byref(count), entries))
    return list(entries[: count.value])


def foreign_pids() -> frozenset[int]:
    """PIDs NVML reported that do not exist in this PID namespace (a container's view)."""
    return frozenset(session().foreign_pids)


def _process_name(pid: int) -> str | None:
    # os.open/os.read: a fifth of the cost of open() with a text wrapper, per process
    # and snapshot. The name is the process's own choice: printers escape it.
    try:
        fd = os.open(f"/proc/{pid}/comm", os.O_RDONLY)
    except FileNotFoundError:
        if not session().foreign_pids:
            logger.warning(
                "NVML reported PID %d, which does not exist in this PID namespace: inside a "
                "container NVML shows host PIDs, so process names are unknown here.",
                pid,
            )
        session().foreign_pids.add(pid)
        return None
    except OSError:  # hidepid or another user's process: it exists, its name is private
        return None
    try:
        return os.read(fd, 64).decode("utf-8", "replace").strip() or None
    except OSError:
        return None
    finally:
        os.close(fd)
