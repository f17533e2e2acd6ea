"""Which physical GPU is ``cuda:N``? And snapshots keyed by that index.

NVML numbers GPUs by PCI bus. CUDA numbers them fastest first (unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) and then keeps and reorders only those
``CUDA_VISIBLE_DEVICES`` lists. Reading NVML device ``N`` for ``cuda:N`` is wrong
as soon as either applies. devicekit maps through UUIDs instead:

1. CUDA's order of all GPUs: PCI bus order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
   or when every GPU is the same model (then "fastest first" ties, and CUDA
   breaks ties by PCI bus), or not needed when ``CUDA_VISIBLE_DEVICES`` lists
   UUIDs. Otherwise (mixed models, or MIG on), a short-lived child process asks
   CUDA itself, so the caller's process never starts CUDA. The answer is
   cached per value of the two variables.
2. ``CUDA_VISIBLE_DEVICES`` applied to that order, with CUDA's rules
   (indices, unique ``GPU-`` UUID prefixes, ``MIG-`` UUIDs). A CUDA process
   enumerates one MIG instance at most, so a list of several ``MIG-`` UUIDs
   is a question for the child too (without it: the first one).

A CUDA device NVML cannot place (a UUID in CUDA's order that NVML does not
list) ends the list there, as a bad ``CUDA_VISIBLE_DEVICES`` entry does: the
devices after it cannot be numbered for certain, and ``result[i]`` must be
``cuda:i``.

A torch build without CUDA (CPU, ROCm, XPU, MPS) has no ``cuda:N`` for an
NVIDIA GPU, so there it sees none, whatever NVML lists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from . import _nvml, _nvmlread
from ._accelerators import accelerator_count, accelerator_type
from ._devices import DeviceLike, parse_cuda_index
from ._errors import GPUNotFoundError
from ._findings import (
    NO_STATUS,
    names_no_gpu,
    no_gpu_reason,
    nvml_cannot_read,
    nvml_describes,
)
from ._keywords import suggest_keywords
from ._nvml import GPUInfo, PhysicalGPU
from ._options import check_flag
from ._shortrepr import short_repr
from ._visible import ENV_VAR, parse_visible_devices, torch_cuda_initialized, uuid_matches

__all__ = [
    "cuda_devices_torch_sees",
    "gpu",
    "gpus",
    "nvml_handle",
    "torch_has_cuda",
    "unread_by_nvml",
    "visible_gpus",
    "why_none_visible",
]

_ORDER_VAR = "CUDA_DEVICE_ORDER"


@dataclass(frozen=True)
class _Visible:
    """One device torch can see: its physical GPU, and a MIG instance's handle if it is one."""

    gpu: PhysicalGPU
    handle: Any = None
    uuid: str | None = None


def _normalized(uuid: str | None) -> str:
    if uuid is None:
        return ""
    for prefix in ("GPU-", "MIG-"):
        uuid = uuid.removeprefix(prefix)
    return uuid.lower()


def _needs_cuda_to_order(physical: list[PhysicalGPU], entries: list[int | str] | None) -> bool:
    if entries and isinstance(entries[0], str):
        # UUIDs name the devices and their order outright; but of several MIG
        # instances CUDA enumerates only one, and only CUDA says which.
        return sum(str(entry).startswith("MIG-") for entry in entries) > 1
    if any(gpu.mig for gpu in physical):
        return True  # CUDA enumerates MIG instances; only CUDA knows their order
    if any(gpu.pci_bus_id is None for gpu in physical):
        return True  # CUDA's order is by PCI bus: where one is unknown, CUDA says
    if os.environ.get(_ORDER_VAR) == "PCI_BUS_ID":
        return False
    return len({gpu.name for gpu in physical}) > 1  # mixed models: "fastest first" decides


_CHILD = """
import json, torch
props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
print(json.dumps([str(p.uuid) for p in props]))
"""


def isolated_python(code: str) -> list[str]:
    """The command that runs ``code`` in a child Python that cannot import the user's files.

    ``python -c`` puts the working directory first on ``sys.path``, so a
    ``json.py`` or ``torch.py`` there would run in the child. ``-P`` (Python
    3.11+) leaves it out; the caller also runs the child in an empty directory,
    which covers Python 3.10. ``PYTHONPATH`` and the user's site-packages stay:
    that is where torch may be installed.
    """
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c", code]


def _order_from_cuda() -> list[str] | None:
    """UUIDs of cuda:0, cuda:1, ... as CUDA orders them, asked of a child process (cached)."""
    session = _nvml.session()
    key = (os.environ.get(ENV_VAR), os.environ.get(_ORDER_VAR))
    if key not in session.child_orders:
        try:
            with tempfile.TemporaryDirectory(prefix="devicekit-") as empty:
                result = subprocess.run(
                    isolated_python(_CHILD),
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                    cwd=empty,
                )
            session.child_orders[key] = json.loads(result.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
            _nvml.logger.warning(
                "could not ask CUDA for its device order (%s); assuming PCI bus order", error
            )
            session.child_orders[key] = None
    return session.child_orders[key]


def _order_in_this_process() -> list[str] | None:
    """Once CUDA has started here: the UUIDs of the devices torch uses, in its order.

    CUDA read ``CUDA_VISIBLE_DEVICES`` when it started and keeps that view, even
    if the variable changed since (a ``visible_devices`` block that ended, say),
    so from then on the variable no longer says which GPU is ``cuda:N``; torch
    does. Asking it is safe once CUDA is initialized, and cached: the answer
    cannot change for the life of the process.
    """
    if not torch_cuda_initialized():
        return None
    session = _nvml.session()
    if session.cuda_order is None:
        count = torch.cuda.device_count()
        session.cuda_order = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    return session.cuda_order


def torch_has_cuda() -> bool:
    """Whether this torch build can drive NVIDIA GPUs at all: a CUDA build.

    Read from the build (ROCm builds, too, leave ``torch.version.cuda`` None),
    so it starts nothing.
    """
    return torch.version.cuda is not None


def why_none_visible() -> str:
    """Why this process sees no GPU, and the fix, as one clause for an error message.

    Where ``CUDA_VISIBLE_DEVICES`` names no GPU of this machine first
    (``7`` on four GPUs), that is the reason, as ``dk.status()`` says; it
    read "install the driver", with the driver and four GPUs right there.
    """
    physical = _nvml.physical_gpus()
    if not torch_has_cuda():
        return no_gpu_reason(accelerator_type(), _nvml.nvml_error(), len(physical))
    lost = _nvml.lost_gpus()
    uuids = [gpu.uuid for gpu in physical] + [None] * len(lost)
    listed = names_no_gpu(os.environ.get(ENV_VAR), 0, uuids, len(physical) + len(lost))
    return no_gpu_reason(accelerator_type(), _nvml.nvml_error(), listed=listed)


def cuda_devices_torch_sees() -> int:
    """How many ``cuda:N`` torch counts; 0 where its accelerator is not CUDA.

    Counted by torch, which asks NVML first and then the driver, so nothing starts.
    """
    return accelerator_count() if accelerator_type() == "cuda" else 0


def unread_by_nvml() -> str | None:
    """The GPUs torch sees where NVML cannot read them (`nvml_cannot_read`); else None."""
    error = _nvml.nvml_error()
    if error is None:
        return None
    count = cuda_devices_torch_sees()
    return nvml_cannot_read(count, error) if count else None


def visible_gpus() -> list[_Visible]:
    """The GPUs this process can see, in torch index order (``cuda:0`` first).

    A function of the two variables (or, once CUDA has started, of CUDA's own
    order), so it is worked out once per value and kept in the NVML session.
    """
    physical = _nvml.physical_gpus()
    if not physical or not torch_has_cuda():
        # Without CUDA no GPU is cuda:N. Asking a child's CUDA for its order would
        # say so only on machines of mixed models: one model skips the child and
        # would number the GPUs as if torch could use them.
        return []
    session = _nvml.session()
    key = (os.environ.get(ENV_VAR), os.environ.get(_ORDER_VAR), torch_cuda_initialized())
    visible = session.visible.get(key)
    if visible is None:
        visible = session.visible[key] = _visible_now(physical)
    return visible


def _visible_now(physical: list[PhysicalGPU]) -> list[_Visible]:
    started = _order_in_this_process()
    if started is not None:
        return _match_uuids(physical, started)
    entries = parse_visible_devices()
    if _needs_cuda_to_order(physical, entries):
        order = _order_from_cuda()
        if order is not None:
            return _match_uuids(physical, order)
    in_order = _by_pci_bus(physical)
    lost = _nvml.lost_gpus()
    if lost and not (entries and isinstance(entries[0], str)):
        # NVML numbers GPUs by PCI bus, as CUDA does: one it could not open keeps its
        # place in CUDA's order, so the GPUs after it cannot be numbered for certain.
        # Before, the next GPU took its cuda:N, and pick_gpu sent work to the lost one.
        in_order = [gpu for gpu in in_order if gpu.nvml_index < min(lost)]
    return _apply_visible_devices(in_order, entries)


def _by_pci_bus(physical: list[PhysicalGPU]) -> list[PhysicalGPU]:
    """The GPUs in PCI bus order, CUDA's default; NVML's own order where a bus is unknown.

    NVML enumerates by PCI bus too. Sorting an unknown bus as ``""`` put that
    GPU first, and gave it another GPU's ``cuda:N``.
    """
    if any(gpu.pci_bus_id is None for gpu in physical):
        return sorted(physical, key=lambda gpu: gpu.nvml_index)
    return sorted(physical, key=lambda gpu: gpu.pci_bus_id or "")


def _match_uuids(physical: list[PhysicalGPU], order: list[str]) -> list[_Visible]:
    by_uuid: dict[str, _Visible] = {}
    for gpu in physical:
        if gpu.uuid is not None:
            by_uuid[_normalized(gpu.uuid)] = _Visible(gpu)
        for mig_uuid, handle in gpu.mig:
            by_uuid[_normalized(mig_uuid)] = _Visible(gpu, handle, mig_uuid)
    matched: list[_Visible] = []
    for uuid in order:
        found = by_uuid.get(_normalized(uuid))
        if found is None:
            # Skipping it would give every later device the index of the one before.
            count = len(matched)
            described = {0: "none of torch's devices", 1: "only cuda:0"}.get(
                count, f"only cuda:0 to cuda:{count - 1}"
            )
            _nvml.logger.warning(
                "cuda:%d (UUID %s) is not a device NVML lists here, so devicekit describes %s",
                count,
                uuid,
                described,
            )
            break
        matched.append(found)
    return matched


def _apply_visible_devices(
    in_cuda_order: list[PhysicalGPU], entries: list[int | str] | None
) -> list[_Visible]:
    if entries is None:
        return [_Visible(gpu) for gpu in in_cuda_order]
    visible: list[_Visible] = []
    for entry in entries:
        found = _find(entry, in_cuda_order)
        if found is None:  # CUDA stops at the first entry it cannot place
            break
        if any(v.gpu is found.gpu and v.uuid == found.uuid for v in visible):
            return []  # a duplicate hides everything
        visible.append(found)
    if any(v.handle is not None for v in visible):
        # CUDA enumerates one MIG instance per process, the first one listed (the
        # child process, when it could be asked, said so for this CUDA itself).
        return visible[:1]
    return visible


def _find(entry: int | str, in_cuda_order: list[PhysicalGPU]) -> _Visible | None:
    if isinstance(entry, int):
        return _Visible(in_cuda_order[entry]) if entry < len(in_cuda_order) else None
    if entry.startswith("MIG-"):
        for gpu in in_cuda_order:
            for mig_uuid, handle in gpu.mig:
                if mig_uuid.startswith(entry) or _normalized(mig_uuid) == _normalized(entry):
                    return _Visible(gpu, handle, mig_uuid)
        return None
    matches = uuid_matches(entry, [gpu.uuid for gpu in in_cuda_order])
    return _Visible(in_cuda_order[matches[0]]) if len(matches) == 1 else None  # ambiguous: none


def nvml_handle(torch_index: int) -> Any:
    """The NVML handle of ``cuda:<torch_index>`` (a MIG instance's own), or None."""
    visible = visible_gpus()
    if not 0 <= torch_index < len(visible):
        return None
    entry = visible[torch_index]
    return entry.gpu.handle if entry.handle is None else entry.handle


def _snapshot(visible: _Visible, torch_index: int | None) -> GPUInfo:
    return _nvmlread.read_gpu(
        visible.gpu, torch_index=torch_index, handle=visible.handle, uuid=visible.uuid
    )


def _snapshots(targets: list[tuple[_Visible, int | None]]) -> list[GPUInfo]:
    """A snapshot of each, all read at once: GPUs that hang together cost one wait, not one each."""
    return _nvmlread.read_gpus([(v.gpu, index, v.handle, v.uuid) for v, index in targets])


@suggest_keywords
def gpus(*, all: bool = False) -> list[GPUInfo]:
    """Snapshot every GPU this process can see, in torch index order.

    ``result[i]`` describes ``cuda:i``, whatever ``CUDA_VISIBLE_DEVICES`` and
    ``CUDA_DEVICE_ORDER`` say, because devicekit maps torch indices to NVML
    devices through their UUIDs. Never initializes CUDA in this process.

    Args:
        all: Snapshot every GPU on the machine instead, in NVML order, with
            ``torch_index=None`` for those this process cannot use (hidden by
            ``CUDA_VISIBLE_DEVICES``, or all of them when torch has no CUDA).
            A GPU in MIG mode is followed by its MIG instances, which are the
            devices CUDA can use; the GPU itself is not one.

    Returns:
        One [`GPUInfo`][devicekit.GPUInfo] per GPU. An empty list when there is
        no ``cuda:0``: without NVML (see [`nvml_error()`][devicekit.nvml_error]),
        and with a torch build without CUDA, even on a GPU machine
        ([`status()`][devicekit.status] says why).

    Examples:
        >>> import devicekit as dk
        >>> [info.torch_index for info in dk.gpus()] == list(range(len(dk.gpus())))
        True
    """
    check_flag(all, name="all")
    visible = visible_gpus()
    if not all:
        return _snapshots([(v, index) for index, v in enumerate(visible)])
    torch_index = {(v.gpu.nvml_index, v.uuid): i for i, v in enumerate(visible)}
    every = []
    for gpu in _nvml.physical_gpus():
        every.append(_Visible(gpu))
        # A GPU in MIG mode is not a CUDA device itself; its instances are.
        every.extend(_Visible(gpu, handle, uuid) for uuid, handle in gpu.mig)
    return _snapshots([(v, torch_index.get((v.gpu.nvml_index, v.uuid))) for v in every])


def gpu_index(index: object) -> int:
    """The torch index ``index`` names for `gpu()` and ``Status.gpu()``, as `parse_cuda_index`.

    Examples:
        >>> gpu_index("cuda:1"), gpu_index(1)
        (1, 1)
    """
    return parse_cuda_index(index, name="index")


@suggest_keywords
def gpu(index: DeviceLike = 0) -> GPUInfo:
    """Snapshot one GPU, named the way torch names it: ``1``, ``"cuda:1"`` or a ``torch.device``.

    Only a CUDA build of torch has ``cuda:N``; with any other build, use
    ``dk.gpus(all=True)`` to describe the machine's GPUs.

    Args:
        index: The torch index of the GPU (``1``), ``"cuda:1"``, or a
            ``torch.device``; ``"cuda"`` is the current CUDA device.

    Returns:
        Its [`GPUInfo`][devicekit.GPUInfo].

    Raises:
        GPUNotFoundError: No such GPU is visible (the message lists the ones
            that are), or none is (the message says why: no NVML, or no
            CUDA in torch). A [`DeviceNotFoundError`][devicekit.DeviceNotFoundError].
        TypeError: ``index`` is a bool or not a device.
        ValueError: ``index`` is negative or names a device that is not CUDA.

    Examples:
        >>> import devicekit as dk
        >>> if dk.gpus():
        ...     assert dk.gpu("cuda:0").uuid == dk.gpus()[0].uuid
    """
    wanted = gpu_index(index)
    visible = visible_gpus()
    if wanted < len(visible):
        return _snapshot(visible[wanted], wanted)
    where = f"index={short_repr(index)}: cuda:{wanted}"
    unread = None if visible else unread_by_nvml()
    if unread is not None:
        beyond = wanted >= cuda_devices_torch_sees()  # torch has no such GPU either
        said = "does not exist;" if beyond else "cannot be described:"
        raise GPUNotFoundError(f"{where} {said} {unread}{NO_STATUS}")
    names = [f"cuda:{i} ({v.gpu.name})" for i, v in enumerate(visible)]
    undescribed = _undescribed(wanted, visible, names)
    if undescribed is not None:
        raise GPUNotFoundError(f"{where} cannot be described: {undescribed}")
    if not visible:
        machine = _nvml.physical_gpus()
        also = "; dk.gpus(all=True) describes them all the same" if machine else ""
        raise GPUNotFoundError(
            f"{where} cannot be described: this process sees no GPU: {why_none_visible()}{also}"
        )
    raise GPUNotFoundError(f"{where} does not exist; this process sees {', '.join(names)}")


def _undescribed(wanted: int, visible: list[_Visible], names: list[str]) -> str | None:
    """Why ``cuda:<wanted>``, which torch sees, has no NVML status; None where torch lacks it.

    torch may count more CUDA devices than devicekit could match to NVML's
    GPUs: one NVML could not open (lost, or needing a reset), or one whose
    UUID NVML could not read. Such a ``cuda:N`` exists: "does not exist"
    would contradict the ``devices`` line of ``dk.status()``, which lists it.
    """
    if _nvml.nvml_error() is not None or not torch_has_cuda():
        return None  # no NVML: unread_by_nvml says why; no CUDA: no cuda:N at all
    torch_sees = cuda_devices_torch_sees()
    if wanted >= torch_sees:
        return None
    reasons = [
        f"NVML could not open the GPU at NVML index {i}: {why}"
        for i, why in _nvml.lost_gpus().items()
    ]
    placed = {v.gpu.nvml_index for v in visible}
    reasons += [
        f"NVML could not read the UUID of the GPU at NVML index {gpu.nvml_index}, so it cannot "
        "be matched to a cuda:N"
        for gpu in _nvml.physical_gpus()
        if gpu.uuid is None and gpu.nvml_index not in placed
    ]
    why = "; ".join(reasons) or "NVML could not match it to a GPU it lists"
    return f"{nvml_describes(torch_sees, names)}: {why}"
