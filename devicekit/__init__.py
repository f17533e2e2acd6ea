"""devicekit: PyTorch device handling that is correct, fast and visible.

Importing devicekit never initializes CUDA, and imports nothing heavy: each
name is loaded from its private module the first time it is used (so
``import devicekit`` and ``devicekit --help`` do not wait for torch). The whole
public API is listed in ``__all__``; everything else is private.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._accelerators import try_all_gpus as try_all_gpus
    from ._accelerators import try_gpu as try_gpu
    from ._batchsize import find_batch_size as find_batch_size
    from ._bench import BenchReport as BenchReport
    from ._bench import BenchResult as BenchResult
    from ._bench import bench as bench
    from ._benchblock import Benchmark as Benchmark
    from ._census import LiveTensor as LiveTensor
    from ._checkpoint import load as load
    from ._checks import assert_same_device as assert_same_device
    from ._claims import claim_gpu as claim_gpu
    from ._claims import release_gpu as release_gpu
    from ._compare import Comparison as Comparison
    from ._compare import ComparisonRow as ComparisonRow
    from ._compare import compare as compare
    from ._conditions import Conditions as Conditions
    from ._dataparallel import data_parallel as data_parallel
    from ._devices import DeviceLike as DeviceLike
    from ._doctor import Diagnosis as Diagnosis
    from ._doctor import doctor as doctor
    from ._errors import CheckpointError as CheckpointError
    from ._errors import CUDAInitializedError as CUDAInitializedError
    from ._errors import DevicekitError as DevicekitError
    from ._errors import DeviceMismatchError as DeviceMismatchError
    from ._errors import DeviceNotFoundError as DeviceNotFoundError
    from ._errors import DeviceOutOfMemoryError as DeviceOutOfMemoryError
    from ._errors import GPUNotFoundError as GPUNotFoundError
    from ._errors import GPUUnavailableError as GPUUnavailableError
    from ._errors import RanksDisagreeError as RanksDisagreeError
    from ._errors import RanksOutOfStepError as RanksOutOfStepError
    from ._errors import SyncError as SyncError
    from ._errors import TensorCopyError as TensorCopyError
    from ._errors import WorkerError as WorkerError
    from ._errors import WorkerTimeoutError as WorkerTimeoutError
    from ._findings import Finding as Finding
    from ._gpuinfo import GPUInfo as GPUInfo
    from ._gpuinfo import GPUProcess as GPUProcess
    from ._gpumap import gpu_map as gpu_map
    from ._gpus import gpu as gpu
    from ._gpus import gpus as gpus
    from ._job import JobFlag as JobFlag
    from ._job import JobStatus as JobStatus
    from ._job import RankStatus as RankStatus
    from ._job import job_status as job_status
    from ._launch import local_device as local_device
    from ._leaks import DeviceGrowth as DeviceGrowth
    from ._leaks import Leak as Leak
    from ._leaks import LeakReport as LeakReport
    from ._leaks import find_leaks as find_leaks
    from ._logbuffer import LogBuffer as LogBuffer
    from ._logdeliver import Record as Record
    from ._logdeliver import Sink as Sink
    from ._measure import benchmark as benchmark
    from ._measurement import Measurement as Measurement
    from ._memory import DeviceMemory as DeviceMemory
    from ._memory import MemoryReport as MemoryReport
    from ._memory import free_memory as free_memory
    from ._memoryscope import MemoryScope as MemoryScope
    from ._memoryscope import ScopeReport as ScopeReport
    from ._memoryscope import memory_scope as memory_scope
    from ._modulecheck import check_module as check_module
    from ._nvml import cuda_driver_version as cuda_driver_version
    from ._nvml import driver_version as driver_version
    from ._nvml import nvml_available as nvml_available
    from ._nvml import nvml_error as nvml_error
    from ._oom import explain_oom as explain_oom
    from ._oomreport import AllocationSite as AllocationSite
    from ._oomreport import OOMReport as OOMReport
    from ._parallel import GPUPool as GPUPool
    from ._parallel import gpu_pool as gpu_pool
    from ._pick import pick_gpu as pick_gpu
    from ._pick import pick_gpus as pick_gpus
    from ._placement import to_device as to_device
    from ._scopedenv import visible_devices as visible_devices
    from ._sinkadapters import ProgressBarSink as ProgressBarSink
    from ._sinkadapters import TensorBoardSink as TensorBoardSink
    from ._sinks import CSVSink as CSVSink
    from ._status import Status as Status
    from ._status import status as status
    from ._straggler import StragglerDetector as StragglerDetector
    from ._stragglerreport import RankTimes as RankTimes
    from ._stragglerreport import Straggler as Straggler
    from ._stragglerreport import StragglerReport as StragglerReport
    from ._syncs import SyncReport as SyncReport
    from ._syncs import detect_syncs as detect_syncs
    from ._timing import TimedFunction as TimedFunction
    from ._timing import Timer as Timer
    from ._visible import parse_visible_devices as parse_visible_devices

# Where each public name lives; tests/test_init.py checks this against the imports
# above and __all__.
_EXPORTS: dict[str, str] = {
    "find_batch_size": "._batchsize",
    "bench": "._bench",
    "BenchReport": "._bench",
    "BenchResult": "._bench",
    "LiveTensor": "._census",
    "load": "._checkpoint",
    "assert_same_device": "._checks",
    "check_module": "._modulecheck",
    "claim_gpu": "._claims",
    "release_gpu": "._claims",
    "compare": "._compare",
    "Comparison": "._compare",
    "ComparisonRow": "._compare",
    "Conditions": "._conditions",
    "data_parallel": "._dataparallel",
    "DeviceLike": "._devices",
    "try_all_gpus": "._accelerators",
    "try_gpu": "._accelerators",
    "Diagnosis": "._doctor",
    "doctor": "._doctor",
    "CheckpointError": "._errors",
    "CUDAInitializedError": "._errors",
    "DevicekitError": "._errors",
    "DeviceMismatchError": "._errors",
    "DeviceNotFoundError": "._errors",
    "DeviceOutOfMemoryError": "._errors",
    "GPUNotFoundError": "._errors",
    "GPUUnavailableError": "._errors",
    "RanksDisagreeError": "._errors",
    "RanksOutOfStepError": "._errors",
    "SyncError": "._errors",
    "TensorCopyError": "._errors",
    "WorkerError": "._errors",
    "WorkerTimeoutError": "._errors",
    "Finding": "._findings",
    "GPUInfo": "._gpuinfo",
    "GPUProcess": "._gpuinfo",
    "gpu": "._gpus",
    "gpus": "._gpus",
    "pick_gpu": "._pick",
    "pick_gpus": "._pick",
    "job_status": "._job",
    "JobFlag": "._job",
    "JobStatus": "._job",
    "RankStatus": "._job",
    "local_device": "._launch",
    "DeviceGrowth": "._leaks",
    "find_leaks": "._leaks",
    "Leak": "._leaks",
    "LeakReport": "._leaks",
    "LogBuffer": "._logbuffer",
    "Record": "._logdeliver",
    "Sink": "._logdeliver",
    "benchmark": "._measure",
    "Measurement": "._measurement",
    "DeviceMemory": "._memory",
    "free_memory": "._memory",
    "memory_scope": "._memoryscope",
    "MemoryReport": "._memory",
    "MemoryScope": "._memoryscope",
    "ScopeReport": "._memoryscope",
    "cuda_driver_version": "._nvml",
    "driver_version": "._nvml",
    "nvml_available": "._nvml",
    "nvml_error": "._nvml",
    "explain_oom": "._oom",
    "AllocationSite": "._oomreport",
    "OOMReport": "._oomreport",
    "gpu_map": "._gpumap",
    "gpu_pool": "._parallel",
    "GPUPool": "._parallel",
    "to_device": "._placement",
    "visible_devices": "._scopedenv",
    "CSVSink": "._sinks",
    "ProgressBarSink": "._sinkadapters",
    "TensorBoardSink": "._sinkadapters",
    "Status": "._status",
    "status": "._status",
    "RankTimes": "._stragglerreport",
    "Straggler": "._stragglerreport",
    "StragglerDetector": "._straggler",
    "StragglerReport": "._stragglerreport",
    "detect_syncs": "._syncs",
    "SyncReport": "._syncs",
    "Benchmark": "._benchblock",
    "TimedFunction": "._timing",
    "Timer": "._timing",
    "parse_visible_devices": "._visible",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'devicekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AllocationSite",
    "BenchReport",
    "BenchResult",
    "Benchmark",
    "CSVSink",
    "CUDAInitializedError",
    "CheckpointError",
    "Comparison",
    "ComparisonRow",
    "Conditions",
    "DeviceGrowth",
    "DeviceLike",
    "DeviceMemory",
    "DeviceMismatchError",
    "DeviceNotFoundError",
    "DeviceOutOfMemoryError",
    "DevicekitError",
    "Diagnosis",
    "Finding",
    "GPUInfo",
    "GPUNotFoundError",
    "GPUPool",
    "GPUProcess",
    "GPUUnavailableError",
    "JobFlag",
    "JobStatus",
    "Leak",
    "LeakReport",
    "LiveTensor",
    "LogBuffer",
    "Measurement",
    "MemoryReport",
    "MemoryScope",
    "OOMReport",
    "ProgressBarSink",
    "RankStatus",
    "RankTimes",
    "RanksDisagreeError",
    "RanksOutOfStepError",
    "Record",
    "ScopeReport",
    "Sink",
    "Status",
    "Straggler",
    "StragglerDetector",
    "StragglerReport",
    "SyncError",
    "SyncReport",
    "TensorBoardSink",
    "TensorCopyError",
    "TimedFunction",
    "Timer",
    "WorkerError",
    "WorkerTimeoutError",
    "__version__",
    "assert_same_device",
    "bench",
    "benchmark",
    "check_module",
    "claim_gpu",
    "compare",
    "cuda_driver_version",
    "data_parallel",
    "detect_syncs",
    "doctor",
    "driver_version",
    "explain_oom",
    "find_batch_size",
    "find_leaks",
    "free_memory",
    "gpu",
    "gpu_map",
    "gpu_pool",
    "gpus",
    "job_status",
    "load",
    "local_device",
    "memory_scope",
    "nvml_available",
    "nvml_error",
    "parse_visible_devices",
    "pick_gpu",
    "pick_gpus",
    "release_gpu",
    "status",
    "to_device",
    "try_all_gpus",
    "try_gpu",
    "visible_devices",
]
