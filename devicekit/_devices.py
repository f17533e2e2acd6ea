"""What a device is to devicekit: every device argument is read, checked and refused here.

"Accelerator" is what ``torch.accelerator`` reports for this torch build: CUDA
(which includes ROCm), XPU or MPS; `_accelerators` says which, and how many
devices this process sees, without initializing any.

Every public function that takes a device calls `resolve_device()` (or
`resolve_devices()` for a list), so the same input means the same device
everywhere, and a device this process does not have is refused the same way
everywhere: with a [`DeviceNotFoundError`][devicekit.DeviceNotFoundError] that names the
parameter, what was given, what this process has, and the fix.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping

import torch

from ._accelerators import (
    CPU,
    META,
    accelerator_count,
    accelerator_type,
    constant_when_traced,
    default_cuda_device,
    try_all_gpus,
)
from ._devicewords import device_type, fix_for, parses, unreadable
from ._errors import DeviceNotFoundError
from ._format import article, first_line, plural, shorten
from ._options import check_index, is_one_index, tensor_got
from ._shortrepr import got, short_repr
from ._visible import ENV_VAR

__all__ = [
    "DeviceLike",
    "describe_devices",
    "parse_cuda_index",
    "parse_cuda_indices",
    "parse_devices",
    "resolve_cuda_devices",
    "resolve_device",
    "resolve_devices",
]

DeviceLike = torch.device | str | int
"""What devicekit accepts as a device: ``torch.device("cuda", 1)``, ``"cuda:1"`` or ``1``.

An int is an accelerator index (``1`` is ``cuda:1`` on a CUDA build); a string
is anything ``torch.device`` parses. ``"cuda"`` without an index is the
current CUDA device, and ``"cpu:0"`` is the CPU.
"""

_CPU, _META = CPU, META
_xpu_initialized: Callable[[], bool] = torch.xpu.is_initialized  # untyped in torch
_LABELS = {
    "cuda": "CUDA",
    "xpu": "XPU",
    "mps": "MPS",
    "hpu": "HPU",
    "xla": "XLA",
    "mtia": "MTIA",
    "maia": "MAIA",
    "ipu": "IPU",
    "ve": "VE",
    "fpga": "FPGA",
    "ideep": "IDEEP",
    "mkldnn": "MKL-DNN",
    "opengl": "OpenGL",
    "opencl": "OpenCL",
    "vulkan": "Vulkan",
}
# Device types whose torch.<type> module ships with every torch build: having the module
# says nothing. Any other type with a torch.<type> module was registered by an out-of-tree
# backend's package (habana_frameworks registers torch.hpu; torch_npu, torch.npu).
_IN_TREE = frozenset({"cpu", "meta", "cuda", "xpu", "mps", "mtia"})
# The package that makes each out-of-tree type work, for the message when it is missing.
_PACKAGES = {"hpu": "habana_frameworks.torch", "xla": "torch_xla"}
_EXPECTED = "a torch.device, a device string such as 'cuda:0', or an accelerator index"
# Device strings already read (torch.device() costs 0.3 µs, checking its type 0.5 µs):
# 'cpu' and 'meta' to their one device, which nothing later changes; an accelerator's
# to what it parses to, checked at each call ('cuda' is whichever device is current, and
# a visible_devices scope changes which exist). In-tree types only: a backend's package
# may rename torch's spare one after a string naming it was read.
_strings_read: dict[str, torch.device] = {}
_STRINGS_KEPT = 64  # a program names a handful; one that builds f"cuda:{i}" for each i stops here


# --- the device model ------------------------------------------------------------------


def describe_devices() -> str:
    """What this process has, for error messages: ``"2 GPUs are visible: cuda:0, cuda:1"``.

    Examples:
        >>> import devicekit as dk
        >>> from devicekit._devices import describe_devices
        >>> "cpu" in describe_devices() or "visible" in describe_devices()
        True
    """
    kind = accelerator_type()
    if kind is None:
        return f"this torch build ({torch.__version__}) has no accelerator; devices here: cpu"
    count = accelerator_count()
    visible = os.environ.get(ENV_VAR)
    scope = f" ({ENV_VAR}={short_repr(visible)})" if kind == "cuda" and visible is not None else ""
    label = "GPU" if kind in ("cuda", "xpu") else f"{_LABELS.get(kind, kind)} device"
    if count == 0:
        return (
            f"this torch build supports {_LABELS.get(kind, kind)}, but no {label} is "
            f"visible{scope}; devices here: cpu"
        )
    names = ", ".join(f"{kind}:{index}" for index in range(count))
    verb = "is" if count == 1 else "are"
    return f"{plural(count, label)} {verb} visible{scope}: {names}"


@constant_when_traced  # torch.compile: resolved at trace time, not traced (see there)
def resolve_device(value: object, *, name: str = "device") -> torch.device:
    """Read one device argument, check that this process has it, and return it canonical.

    Accepts a [`DeviceLike`][devicekit.DeviceLike]. Checks, without initializing CUDA, that the
    device type is known to torch, that this torch build supports it (or,
    for an out-of-tree backend such as ``hpu``, ``xla`` or ``npu``, that its
    package is imported), and that an indexed accelerator exists. A tensor is
    refused, never read as an index. Returns one canonical
    ``torch.device``: ``cpu:0`` becomes ``cpu``, and an accelerator without an
    index (``"cuda"``) becomes the current device (``cuda:0`` until CUDA has
    started), so that comparing it with a tensor's device is meaningful.

    Args:
        value: The argument as the user passed it.
        name: The parameter's name, for error messages.

    Returns:
        The ``torch.device``.

    Raises:
        TypeError: ``value`` is a bool, a tensor, or not a device at all.
        ValueError: A negative index, or a string torch cannot parse; the
            message gives the string it most likely means (``"CUDA:0"`` is
            ``'cuda:0'``).
        DeviceNotFoundError: This torch build or machine has no such device.

    Examples:
        >>> import torch
        >>> from devicekit._devices import resolve_device
        >>> resolve_device("cpu:0"), resolve_device(torch.device("meta"))
        (device(type='cpu'), device(type='meta'))
        >>> resolve_device(" CPU")
        Traceback (most recent call last):
        ...
        ValueError: device=' CPU' is not a device torch knows; write 'cpu' (device types are lower case, without spaces)
    """  # noqa: E501 - the expected output is one line
    if value is _CPU or value is _META:  # the hottest path: identity, no string built
        return value
    if value.__class__ is torch.device:  # the hot path: to_device with a device object
        device: torch.device = value
        # == compares in C; reading device.type builds a new string each time (0.2 µs).
        if device == _CPU:
            return _CPU
        if device == _META:
            return _META
    elif value.__class__ is str:  # the hot path too: to_device(batch, "cuda") every step
        device = _strings_read.get(value) or _read_string(value, name)
        if device is _CPU or device is _META:
            return device
    else:
        device = _parse(value, name)
    return _check(device, value, name)


def _read_string(value: str, name: str) -> torch.device:
    """The device a string names, by form only, kept for the next call (see `_strings_read`)."""
    device = _parse(value, name)
    kind = device.type
    if kind == "cpu":  # 'cpu:0' too
        device = _CPU
    elif kind == "meta":
        device = _META
    if kind in _IN_TREE and len(_strings_read) < _STRINGS_KEPT:
        _strings_read[value] = device
    return device


def resolve_devices(value: object, *, name: str = "devices") -> list[torch.device]:
    """Read a list-of-devices argument; a single device is a list of one.

    A string is one device (``"cpu"``, ``"cuda:1"``), never a sequence of
    letters; each entry is checked by `resolve_device()` and named in
    errors by its position (``devices[1]``).

    Raises:
        TypeError: ``value`` is a bool, a mapping, or not iterable.

    Examples:
        >>> from devicekit._devices import resolve_devices
        >>> resolve_devices("cpu"), resolve_devices(["cpu", "meta"])
        ([device(type='cpu')], [device(type='cpu'), device(type='meta')])
    """
    return [resolve_device(item, name=label) for label, item in _entries(value, name)]


def parse_devices(value: object, *, name: str = "devices") -> list[torch.device]:
    """Read a list-of-devices argument by form only: for devices of other machines.

    As `resolve_devices()`, but nothing is checked against this process: a
    Ray cluster's GPUs are not this machine's, and ``"cuda"`` stays without
    an index (any GPU the cluster assigns). An int is still an index of this
    build's accelerator (``1`` is ``cuda:1``), and a string torch cannot
    parse is refused as everywhere.

    Examples:
        >>> from devicekit._devices import parse_devices
        >>> parse_devices("cuda"), parse_devices(["cpu"])
        ([device(type='cuda')], [device(type='cpu')])
    """
    return [_parse(item, label) for label, item in _entries(value, name)]


def _not_found(diagnosis: str, fix: str, gpu_fix: str | None = None) -> DeviceNotFoundError:
    """``"{diagnosis}. {fix}"``, its parts kept for a caller that takes GPUs only.

    ``gpu_fix``: the part of ``fix`` that still holds where only GPUs are taken
    (``"Write 'cuda:0'"``); the rest (``'cpu'``, ``dk.try_gpu()``) may not.
    """
    error = DeviceNotFoundError(f"{diagnosis}. {fix}")
    error.diagnosis, error.gpu_fix = diagnosis, gpu_fix  # type: ignore[attr-defined]
    return error


def resolve_cuda_devices(value: object, *, name: str, why: str, fix: str) -> list[torch.device]:
    """`resolve_devices()`, refusing any device that is not CUDA with ``why`` as the reason.

    ``fix``: what to pass where there is no GPU. A device that does not
    exist is refused with it, not with `resolve_device`'s general advice
    (``'cpu'``, ``dk.try_gpu(0)``), which names devices this refuses.

    Examples:
        >>> from devicekit._devices import resolve_cuda_devices
        >>> resolve_cuda_devices([], name="devices", why="only GPUs are measured", fix="")
        []
    """
    devices = []
    for label, item in _entries(value, name):  # "devices[1]", or "devices" for one device
        try:
            device = resolve_device(item, name=label)
        except DeviceNotFoundError as error:  # its diagnosis, with a fix this call takes
            diagnosis = getattr(error, "diagnosis", None) or str(error)
            gpu_fix = getattr(error, "gpu_fix", None)
            own = f"{gpu_fix}. " if gpu_fix else ""
            raise DeviceNotFoundError(f"{diagnosis}. {own}{why}: {fix}") from None
        if device.type != "cuda":
            raise ValueError(
                f"{label}={str(device)!r} is not a CUDA device: {why}. Pass CUDA devices only, "
                f"or {fix}"
            )
        devices.append(device)
    return devices


def parse_cuda_index(value: object, *, name: str) -> int:
    """The CUDA index ``value`` names (``1``, ``"cuda:1"``, a ``torch.device``), by form only.

    For what NVML describes rather than what torch can use (``dk.gpu()``,
    ``pick_gpu(exclude=...)``): a CPU build of torch on a GPU machine still
    numbers its GPUs. ``"cuda"`` is the current device. The caller checks
    that the GPU exists, against the GPUs NVML sees.

    Raises:
        TypeError: ``value`` is a bool or not a device.
        ValueError: A negative index, or a device that is not CUDA.

    Examples:
        >>> from devicekit._devices import parse_cuda_index
        >>> parse_cuda_index("cuda:2", name="index"), parse_cuda_index(3, name="index")
        (2, 3)
    """
    if hasattr(value, "__index__") and not isinstance(value, (bool, torch.device, torch.Tensor)):
        return check_index(value, name=name)
    if isinstance(value, str):
        _refuse_cuda_text(value, name)
    device = value if value.__class__ is torch.device else _parse(value, name)
    assert isinstance(device, torch.device)
    if device.type != "cuda":
        raise ValueError(
            f"{name}={short_repr(value)} is not a CUDA device; pass a CUDA index "
            "such as 0 or 'cuda:0'"
        )
    index: int | None = device.index  # torch's stubs say int; it is None for "cuda"
    return int(default_cuda_device().index) if index is None else index


def _refuse_cuda_text(value: str, name: str) -> None:
    """Refuse a GPU index or UUID written as text, or any text torch cannot read, for a GPU.

    The shared fix ("write 'cpu', 'cuda', 'cuda:1', or an index") would offer
    'cpu', which a GPU argument then refuses, and say nothing of UUIDs.

    Examples:
        >>> _refuse_cuda_text("1", "index")
        Traceback (most recent call last):
        ...
        ValueError: index='1' is not a device torch knows; pass the torch index as an int, 1, \
or write 'cuda:1'
    """
    text = value.strip()
    if text.upper().startswith(("GPU-", "MIG-")):
        fix = (
            "pass its torch index, such as 0 or 'cuda:0', not a UUID (dk.gpus(all=True) lists "
            "each GPU's uuid with its torch_index)"
        )
    elif text.isascii() and text.isdigit() and len(text) < 20:  # int() refuses 4300 digits
        fix = f"pass the torch index as an int, {int(text)}, or write 'cuda:{int(text)}'"
    elif not parses(value) and not parses(device_type(text)):
        fix = "pass a GPU's torch index, such as 0 or 'cuda:0'"
    else:
        return  # a device torch reads, or a known type miswritten (unreadable() says how)
    raise ValueError(f"{name}={short_repr(value)} is not a device torch knows; {fix}")


def parse_cuda_indices(value: object, *, name: str) -> list[int]:
    """`parse_cuda_index()` for a list-of-devices argument; one device is a list of one."""
    return [parse_cuda_index(item, name=label) for label, item in _entries(value, name)]


def _entries(value: object, name: str) -> list[tuple[str, object]]:
    """A list-of-devices argument as (name for errors, entry) pairs; one device is one entry."""
    if isinstance(value, (str, torch.device, torch.Tensor)) or is_one_index(value):
        return [(name, value)]  # a tensor is one (refused) entry, never a list of indices
    if isinstance(value, (bool, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be a device or a list of devices ({_EXPECTED} each), got {got(value)}"
        )
    return [(f"{name}[{index}]", item) for index, item in enumerate(value)]


def _parse(value: object, name: str) -> torch.device:
    """The device ``value`` writes, by form only: nothing is checked against the machine."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {_EXPECTED}, got {got(value)}")
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError as error:
            raise unreadable(value, name, shorten(first_line(error), 120)) from None
    if isinstance(value, torch.device):
        return value
    if hasattr(value, "__index__"):
        # A one-element integer tensor has __index__: reading its value as a device index
        # would move data to wherever the number points (torch's own x.to(other) means
        # other's device and dtype instead). A plain int skips the isinstance (50 ns).
        if value.__class__ is not int and isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name} must be {_EXPECTED}, got {tensor_got(value)}; pass tensor.device to use "
                "the device a tensor is on"
            )
        if value.__class__ is not int and not is_one_index(value):  # an array of several integers
            raise TypeError(f"{name} must be {_EXPECTED}, got {got(value)}")
        index = check_index(value, name=name)
        kind = accelerator_type()
        if kind is None:
            raise _not_found(
                f"{name}={short_repr(value)} means accelerator {index}, but {describe_devices()}",
                f"Pass 'cpu', or dk.try_gpu({index}) to fall back to the CPU when there is no GPU.",
            )
        return torch.device(kind, index)
    raise TypeError(f"{name} must be {_EXPECTED}, got {got(value)}{fix_for(value, name)}")


def _check(device: torch.device, value: object, name: str) -> torch.device:
    kind = device.type
    if kind == "cpu":
        return _CPU
    if kind == "meta":
        return _META
    index: int | None = device.index  # torch's stubs say int; it is None for "cuda"
    if kind == accelerator_type():
        count = accelerator_count()
        if index is None and count > 0:
            if kind == "cuda":
                return default_cuda_device()
            if kind == "xpu" and _xpu_initialized():  # asking earlier would start it
                return torch.device(kind, torch.xpu.current_device())
            return torch.device(kind, 0)
        if index is not None and index < count:
            return device
        fallback = "dk.try_gpu()" if index is None else f"dk.try_gpu({index})"
        raise _not_found(
            f"{name}={short_repr(value)} does not exist: {describe_devices()}",
            f"Use one of those, or {fallback} to fall back to the CPU when there is no such "
            "device.",
            # To a caller that takes GPUs only, "those" must hold one: here only the CPU.
            gpu_fix="Use one of those" if count else None,
        )
    if kind not in _IN_TREE and _registered(kind):  # an out-of-tree backend: hpu, npu, xla
        return device  # its package owns the device count; torch checks the index on use
    if kind == torch._C._get_privateuse1_backend_name():  # an out-of-tree backend, such as npu
        # Its package registers torch.<kind> when imported; without it, the first copy
        # fails inside torch with "No module named 'torch.privateuseone'".
        raise _not_found(
            f"{name}={short_repr(value)} names the out-of-tree (PrivateUse1) backend {kind!r}, but "
            f"no such backend is registered with this torch build ({torch.__version__}): there is "
            f"no torch.{kind} module; devices here: {_here()}",
            "Import the backend's package (such as torch_npu) first, or use dk.try_gpu() to fall "
            "back to the CPU when there is no GPU.",
        )
    label = _LABELS.get(kind, kind)
    if kind == "hip":  # torch's tensors never use it: ROCm builds present AMD GPUs as cuda
        written = "cuda" if index is None else f"cuda:{index}"
        raise _not_found(
            f"{name}={short_repr(value)} names a HIP device, but torch calls AMD GPUs 'cuda', on "
            f"ROCm builds too; devices here: {_here()}",
            f"Write {written!r} (this build is {torch.__version__}), or dk.try_gpu() to fall back "
            "to the CPU when there is no GPU.",
            gpu_fix=f"Write {written!r}",
        )
    if kind in _PACKAGES:  # no torch build has it: a package adds it
        raise _not_found(
            f"{name}={short_repr(value)} names {article(label)} {label} device, which torch "
            f"({torch.__version__}) supports only once {_PACKAGES[kind]} is imported, and it is "
            f"not; devices here: {_here()}",
            f"Import {_PACKAGES[kind]} first, or use dk.try_gpu() to fall back to the CPU when "
            "there is no GPU.",
        )
    raise _not_found(
        f"{name}={short_repr(value)} names {article(label)} {label} device, but this torch build "
        f"({torch.__version__}) has no {label} support; devices here: {_here()}",
        f"Install a torch build with {label} to use it, or dk.try_gpu() to fall back to the CPU "
        "when there is no GPU.",
    )


def _registered(kind: str) -> bool:
    """Whether an out-of-tree backend's package has made ``kind`` a device torch can use."""
    if kind == "xla":  # torch_xla registers no torch.xla module, but its import is what counts
        return "torch_xla" in sys.modules
    return getattr(torch, kind, None) is not None  # torch._register_device_module(kind, ...)


def _here() -> str:
    return ", ".join(["cpu", *(str(d) for d in try_all_gpus() if d.type != "cpu")])
