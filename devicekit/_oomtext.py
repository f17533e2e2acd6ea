"""What an out-of-memory message says: which device, how much was asked for, what was free.

torch's allocators each word it their own way, and the wording changed over
the years. The texts this module reads (``format_size`` prints ``bytes``,
``KiB``, ``MiB`` and ``GiB``, two decimals; MPS prints ``KB``, ``MB`` and ``GB``
but divides by 1024 all the same):

- CUDA, torch 2.1 and later: ``CUDA out of memory. Tried to allocate 20.00 MiB.
  GPU 0 has a total capacity of 79.19 GiB of which 3.06 MiB is free. Process
  1234 has 2.00 GiB memory in use. Including non-PyTorch memory, this process
  has 77.17 GiB memory in use. Of the allocated memory 76.10 GiB is allocated
  by PyTorch, and 512.50 MiB is reserved by PyTorch but unallocated. ...``
- CUDA before 2.1: ``CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0;
  7.93 GiB total capacity; 130.35 MiB already allocated; 47.06 MiB free;
  188.00 MiB reserved in total by PyTorch) ...``
- ROCm: the CUDA texts with ``HIP`` for ``CUDA`` (``HIP out of memory. Tried to
  allocate ...``); torch calls the device ``cuda`` there too.
- XPU: like CUDA 2.1 without the process lines, ``XPU out of memory. ...``
- MPS: ``MPS backend out of memory (MPS allocated: 3.11 GB, other allocations:
  5.42 GB, max allowed: 9.07 GB). Tried to allocate 720.00 MB on private pool.``
- CPU: ``DefaultCPUAllocator: can't allocate memory: you tried to allocate 123
  bytes. Error code 12 (Cannot allocate memory)`` (``not enough memory`` on Windows).
- Outside the caching allocator: ``CUDA error: out of memory`` (a kernel, a
  context; ``HIP error: out of memory`` or ``hipErrorOutOfMemory`` on ROCm), and
  the libraries' codes for a workspace or handle they could not allocate:
  ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUSOLVER_STATUS_ALLOC_FAILED``,
  ``CUSPARSE_STATUS_ALLOC_FAILED``, ``CUFFT_ALLOC_FAILED``, ``cuDNN error:
  CUDNN_STATUS_ALLOC_FAILED`` and their ``HIP...`` twins.
- NumPy's ``MemoryError``: ``Unable to allocate 4.00 EiB for an array with
  shape (4611686018427387904,) and data type uint8`` (binary units up to EiB).

Python's ``MemoryError`` is the host's memory running out, not one of torch's
errors: `is_oom` leaves it out (``explain_oom`` keeps it a ``MemoryError``),
and the callers that count it as out of memory say so.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

__all__ = ["OOMText", "is_oom", "parse_oom"]

_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB|PiB|EiB|KB|MB|GB|TB)\b"
_SCALE = {
    "bytes": 1,
    "B": 1,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
    "P": 2**50,
    "E": 2**60,
}
# What torch's out-of-memory messages say, each as its source words it: a RuntimeError
# that merely mentions memory ("out of memory budget") is the caller's own error.
_OOM_MESSAGE = re.compile(
    r"\b(?:CUDA|HIP|XPU) out of memory\."  # the caching allocators (HIP: ROCm's torch)
    r"|\bMPS backend out of memory\b"
    r"|\b(?:CUDA|HIP) error: out of memory\b"  # the runtime's own: a kernel, a context
    r"|\bCUDA driver error: out of memory\b"  # torch's check of a driver call
    r"|\bCuda failure '?out of memory\b"  # NCCL's (a communicator's buffers)
    r"|\bhipErrorOutOfMemory\b|\bcudaErrorMemoryAllocation\b"
    r"|\bDefaultCPUAllocator: (?:can't allocate memory|not enough memory)\b"
    # cuBLAS, cuSOLVER, cuSPARSE, cuFFT, cuDNN and their HIP twins: a workspace or handle
    r"|\b(?:CU|HIP)[A-Z]*_(?:STATUS_)?ALLOC_FAILED\b"
)


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(template.replace("{size}", _SIZE), re.IGNORECASE)


_REQUESTED = (_pattern(r"tried to allocate {size}"), _pattern(r"unable to allocate {size}"))
_TOTAL = (
    _pattern(r"total capacity of {size}"),
    _pattern(r"{size} total capacity"),
    _pattern(r"max allowed: {size}"),
)
_FREE = (_pattern(r"of which {size} is free"), _pattern(r"{size} free;"))
_ALLOCATED = (
    _pattern(r"Of the allocated memory {size} is allocated by PyTorch"),
    _pattern(r"{size} already allocated"),
    _pattern(r"MPS allocated: {size}"),
)
_UNALLOCATED = _pattern(r"{size} is reserved by PyTorch but unallocated")
_RESERVED = _pattern(r"{size} reserved in total by PyTorch")
_THIS_PROCESS = _pattern(r"this process has {size} memory in use")
_PROCESS = _pattern(r"Process (\d+) has {size} memory in use")
_KINDS = (
    # ROCm's torch says HIP, its device is cuda; the libraries' codes name no device
    (
        "cuda",
        re.compile(
            r"\bCUDA\b|\bHIP\b|\bhipError|\b(?:CU|HIP)[A-Z]*_(?:STATUS_)?ALLOC_F|\bCuda fail"
        ),
    ),
    ("xpu", re.compile(r"\bXPU\b")),
    ("mps", re.compile(r"\bMPS\b")),
    ("cpu", re.compile(r"CPUAllocator")),
)
_INDEX = re.compile(r"\bGPU (\d+)\b")


class OOMText(NamedTuple):
    """What one out-of-memory message says; None where it says nothing."""

    kind: str | None  # "cuda" (ROCm's "HIP" too), "xpu", "mps", "cpu"
    device_index: int | None
    requested: int | None
    total: int | None
    free: int | None
    allocated: int | None
    reserved: int | None
    this_process: int | None
    processes: tuple[tuple[int, int | None], ...]  # (pid, bytes) of the other processes it lists

    @property
    def device(self) -> torch.device | None:
        """The device the message names, or None when it names none."""
        if self.kind is None or self.kind == "cpu":
            return None if self.kind is None else torch.device("cpu")
        if self.kind == "mps":
            return torch.device("mps", 0)  # the one MPS device, as its tensors name it
        return None if self.device_index is None else torch.device(self.kind, self.device_index)


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error of torch, old or new, on any device.

    ``torch.OutOfMemoryError`` by its type; a ``RuntimeError`` only by one of
    the messages torch, the CUDA and HIP runtimes, their libraries' ``..._ALLOC_FAILED``
    codes, MPS, XPU and the CPU allocator really write (the module's list): the
    words "out of memory" alone are not enough.

    Examples:
        >>> import torch
        >>> from devicekit._oomtext import is_oom
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory."))
        True
        >>> is_oom(RuntimeError("CUDA error: out of memory")), is_oom(ValueError("out of memory"))
        (True, False)
        >>> is_oom(RuntimeError("expected Float but found Half (out of memory budget)"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    return _OOM_MESSAGE.search(str(error)) is not None


def _bytes(match: re.Match[str] | None, group: int = 1) -> int | None:
    if match is None:
        return None
    number, unit = float(match.group(group)), match.group(group + 1)
    return round(number * _SCALE[unit if unit in ("bytes", "B") else unit[0].upper()])


def _first(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        value = _bytes(pattern.search(text))
        if value is not None:
            return value
    return None


def parse_oom(text: str) -> OOMText:
    """Read an out-of-memory message; anything it does not say is None.

    Examples:
        >>> from devicekit._oomtext import parse_oom
        >>> parsed = parse_oom("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a "
        ...                    "total capacity of 79.19 GiB of which 3.06 MiB is free.")
        >>> parsed.device, parsed.requested
        (device(type='cuda', index=1), 20971520)
    """
    kind = next((name for name, pattern in _KINDS if pattern.search(text)), None)
    index = _INDEX.search(text)
    allocated = _first(_ALLOCATED, text)
    unallocated = _bytes(_UNALLOCATED.search(text))
    reserved = _bytes(_RESERVED.search(text))
    if reserved is None and allocated is not None and unallocated is not None:
        reserved = allocated + unallocated
    processes = tuple((int(match.group(1)), _bytes(match, 2)) for match in _PROCESS.finditer(text))
    return OOMText(
        kind=kind,
        device_index=None if index is None else int(index.group(1)),
        requested=_first(_REQUESTED, text),
        total=_first(_TOTAL, text),
        free=_first(_FREE, text),
        allocated=allocated,
        reserved=reserved,
        this_process=_bytes(_THIS_PROCESS.search(text)),
        processes=processes,
    )
