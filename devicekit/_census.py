"""Live tensors, counted the way the garbage collector sees them.

``gc.get_objects()`` lists every container object Python tracks, tensors
included; the set of types among them is small, so finding the tensors is a
set lookup per object (100,000 tensors among 760,000 objects: 0.04 to 0.1 s
on a busy 2-core CPU, the whole census 0.11 to 0.15 s). Several tensors can
view one storage, so bytes are counted per storage, once: in a census by
group, in the group of the tensor that views most of it. A sparse tensor has
no storage of its own; the storages of its indices and values are its bytes.

What a census cannot see: tensors that no Python object refers to, such as
the activations autograd saves for the backward pass, and workspaces of C++
libraries. On CUDA, allocated bytes minus the census total is that memory.
Objects hidden by ``gc.freeze()`` are not listed by ``gc.get_objects()``:
`device_census` (for out-of-memory reports) finds them without unfreezing
them (`._frozen`), `census` (for ``find_leaks``, which freezes what existed
before) leaves them out, and counts only what a storage alive before grew by.

Nothing here keeps a reference to a tensor once it returns, and nothing
allocates on a device: shapes, dtypes and storage sizes are host-side fields.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from . import _frozen
from ._format import NOT_APPLICABLE, PlainResult, format_bytes, shown
from ._frozen import grown_bytes, live_tensors, recording, visible_tensors
from ._frozen import no_collection as _no_collection

__all__ = [
    "LiveTensor",
    "census",
    "device_census",
    "live_tensors",
    "only_new_objects",
    "storage_key",
]


@dataclass(frozen=True)
class LiveTensor(PlainResult):
    """One storage on a device and the tensor that views most of it.

    Attributes:
        shape: The tensor's shape.
        dtype: Such as ``"float32"``.
        bytes: The storage's size: what this tensor keeps alive.
        name: A parameter, gradient or buffer name (``"fc.weight.grad"``)
            when a module was given and the storage is one of its tensors;
            None (``-`` in tables) when it is not, or no module was given.
    """

    # As the out-of-memory report's table writes them.
    shape: tuple[int, ...] = field(metadata=shown(lambda shape: str(list(shape))))
    dtype: str
    bytes: int = field(metadata=shown(partial(format_bytes, digits=2)))
    # None is a tensor with no name (none of the module's), not an unknown one.
    name: str | None = field(default=None, metadata=shown(none=NOT_APPLICABLE))

    def __str__(self) -> str:
        shape = "[" + ", ".join(str(size) for size in self.shape) + "]"
        name = f"  {self.name}" if self.name else ""
        return f"{format_bytes(self.bytes, digits=2):>11}  {self.dtype:9} {shape}{name}"


@dataclass(frozen=True)
class DeviceCensus:
    """The live tensors of one device: unique storages, their bytes, and the largest."""

    count: int
    bytes: int
    largest: tuple[LiveTensor, ...]


@contextmanager
def only_new_objects() -> Iterator[None]:
    """Hide every object that exists now from the garbage collector until the block ends.

    See `._frozen.only_new_objects`: a census inside leaves them out, counts
    only what a storage alive now grows by, and `device_census` still sees them.
    """
    with _frozen.only_new_objects(_parts):
        yield


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
# What reading a tensor that has no real storage raises: sparse and wrapper subclasses
# (RuntimeError, NotImplementedError, TypeError), and a lazy module's parameters before
# its first call (ValueError): one in the process made every report fail.
_UNREADABLE = (RuntimeError, NotImplementedError, TypeError, ValueError)


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage ``tensor`` views; None when it has no real one.

    Sparse and wrapper-subclass tensors have no storage of their own (a
    nested tensor's values and a DTensor's local shard are tensors of their
    own, counted as such; a sparse tensor's parts: see `_parts`); meta and
    fake tensors own no memory.

    Examples:
        >>> import torch
        >>> storage_key(torch.ones(2, device="meta")), storage_key(torch.ones(2))[1]
        (None, 8)
        >>> jagged = torch.nested.nested_tensor([torch.ones(3)], layout=torch.jagged)
        >>> storage_key(jagged) is None  # its storage refuses data_ptr(); its values count
        True
    """
    try:
        storage = tensor.untyped_storage()
        if tensor.is_meta or (type(tensor) not in _PLAIN and storage.device.type == "meta"):
            return None  # a fake tensor says it is on a device, but its storage is meta
        # A wrapper subclass (a jagged nested tensor) has a storage that refuses its pointer.
        return storage.data_ptr(), storage.nbytes()
    except _UNREADABLE:
        return None


def storage_identity(tensor: torch.Tensor) -> int | None:
    """What tells the storage ``tensor`` views from every other live one; None without one.

    Its ``StorageImpl``'s address: unlike `storage_key`, a meta tensor has one,
    and two empty storages differ. For telling views of one tensor apart from
    copies, while both are alive.

    Examples:
        >>> import torch
        >>> weight = torch.ones(2, 2)
        >>> storage_identity(weight[0]) == storage_identity(weight.T)
        True
        >>> storage_identity(weight.clone()) == storage_identity(weight)
        False
    """
    try:
        return int(tensor.untyped_storage()._cdata)
    except _UNREADABLE:
        return None


_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def _parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors whose storages hold ``tensor``'s data: itself, or a sparse tensor's parts.

    A sparse tensor's indices and values have no Python object until asked
    for, so the garbage collector does not list them: without this a 1 GiB
    sparse tensor counted 0 bytes. Asking makes host-side views, no copies.
    A (strided) nested tensor is described by its flat buffer, since it has
    no single shape; a jagged one is a wrapper whose inner tensors count.

    Examples:
        >>> import torch
        >>> sparse = torch.eye(3).to_sparse()
        >>> [tuple(part.shape) for part in _parts(sparse)]
        [(2, 3), (3,)]
        >>> [tuple(part.shape) for part in _parts(sparse.to_sparse_csr())]
        [(4,), (3,), (3,)]
        >>> nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])
        >>> [tuple(part.shape) for part in _parts(nested)]
        [(5,)]
    """
    layout = tensor.layout
    if layout == torch.strided and not tensor.is_nested:
        return (tensor,)
    try:
        if layout == torch.strided:  # a nested tensor: its buffer, flat (it has no one shape)
            return (tensor.values(),)
        if layout == torch.sparse_coo:
            return (tensor._indices(), tensor._values())
        names = _COMPRESSED.get(layout)
        if names is not None:
            return (*(getattr(tensor, name)() for name in names), tensor.values())
    except _UNREADABLE:
        return ()
    return (tensor,)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _widest(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` views of its storage, to choose which view describes a storage."""
    try:
        return int(tensor.nbytes)
    except _UNREADABLE:
        return 0


def device_census(
    device: torch.device, *, names: Mapping[int, str] | None = None, top: int = 10
) -> DeviceCensus:
    """The storages live on ``device``, their total bytes, and the ``top`` largest.

    Sees tensors frozen by ``gc.freeze()`` too, and leaves them frozen (see `._frozen`).

    Args:
        device: The device to count.
        names: Storage data pointers mapped to names (parameters, gradients).
        top: How many of the largest storages to describe.

    Examples:
        >>> import torch
        >>> kept = torch.ones(1000).to_sparse()  # indices (1, 1000) int64 and values (1000,)
        >>> device_census(torch.device("cpu"), top=0).bytes >= 1000 * 8 + 1000 * 4
        True
        >>> weights = torch.ones(250_000)  # 1 MB, made before the freeze
        >>> with only_new_objects():  # as in find_batch_size
        ...     device_census(torch.device("cpu"), top=0).bytes >= 1_000_000
        True
    """
    names = names or {}
    # pointer -> (storage bytes, bytes of the widest view, that view)
    storages: dict[int, tuple[int, int, torch.Tensor]] = {}
    with _no_collection():
        tensors = visible_tensors()
        for tensor in tensors:
            if tensor.device != device:
                continue
            for part in _parts(tensor):
                key = storage_key(part)
                if key is None or key[1] == 0:
                    continue
                seen = storages.get(key[0])
                width = _widest(part)
                if seen is None or width > seen[1]:  # show the view that covers most of it
                    storages[key[0]] = (key[1], width, part)
        # Of storages of one size, a named one first: the model's weight tells more than a
        # stray tensor as large (a gradient of another model, not yet collected).
        largest = heapq.nlargest(
            top, storages.items(), key=lambda item: (item[1][0], item[0] in names)
        )
        described = tuple(
            LiveTensor(tuple(view.shape), _dtype_name(view.dtype), size, names.get(pointer))
            for pointer, (size, _, view) in largest
        )
        total = sum(entry[0] for entry in storages.values())
        count = len(storages)
        tensors.clear()  # no tensor outlives the census
        storages.clear()
        largest.clear()
    return DeviceCensus(count, total, described)


GroupKey = tuple[str, str, tuple[int, ...] | None, Hashable | None]
"""(device, dtype, shape, creation site) of a group of tensors; shape None for a nested tensor."""


def census(site: Callable[[torch.Tensor], Hashable | None]) -> dict[GroupKey, tuple[int, int]]:
    """Every live tensor on every device, grouped: key -> (tensors, bytes of their storages).

    Each storage's bytes count once in the whole census, in the group of the
    tensor that views most of it (the first such tensor on a tie): a view kept
    beside its base adds a tensor to its group, not the base's bytes again. A
    tensor whose site is unknown takes the site of a tensor it shares memory
    with, where one is known. Inside `only_new_objects` it lists only what
    was made since, and a storage alive when that began counts only the bytes
    it grew by (a new view of an old tensor adds no memory).

    The collector stays paused for the whole census, the grouping after the
    reading included: the grouping makes a few tuples per tensor, and the
    collections they triggered walked every tensor again (120,000 tensors:
    0.92 s with them, 0.2 s without).

    Args:
        site: Where a tensor was created (any hashable: ``file:line``), or
            None when unknown. Called once per tensor, so it must be cheap.

    Examples:
        >>> import torch
        >>> base = torch.ones(1000)
        >>> kept = (base, base[:10], base.view(10, 100))
        >>> groups = census(lambda tensor: "here" if any(tensor is k for k in kept) else None)
        >>> [groups[("cpu", "float32", shape, "here")] for shape in [(1000,), (10,), (10, 100)]]
        [(1, 4000), (1, 0), (1, 0)]
        >>> nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])
        >>> census(lambda tensor: "nested" if tensor is nested else None)[
        ...     ("cpu", "float32", None, "nested")
        ... ]
        (1, 20)
    """
    # (device, pointer) -> (storage bytes, bytes of the widest view, its group)
    owners: dict[tuple[str, int], tuple[int, int, GroupKey]] = {}
    read: list[tuple[GroupKey, list[tuple[int, int, int]]]] = []
    unsited = False  # a tensor with no known site, that may take one from its storage
    recorded = recording()  # inside only_new_objects: storages alive before are known
    devices: dict[torch.device, str] = {}  # str(device) made one string per tensor
    dtypes: dict[torch.dtype, str] = {}
    with _no_collection():
        tensors = live_tensors()
        for tensor in tensors:
            nested = tensor.is_nested
            if type(tensor) in _PLAIN and tensor.layout == _STRIDED and not nested:
                # Nearly every tensor: read inline, without `_storages`' calls per part.
                try:
                    storage = tensor.untyped_storage()
                    if tensor.is_meta:
                        continue
                    size = storage.nbytes()
                    if recorded:  # of a storage alive before, only what it grew by since
                        size = grown_bytes(storage, size)
                    keys = [(storage.data_ptr(), size, tensor.nbytes)]
                except _UNREADABLE:
                    continue
            else:
                found = _storages(tensor, recorded=recorded)
                if found is None:
                    continue  # no memory of its own (meta, fake), or unreadable
                keys = found
            device = tensor.device
            name = devices.get(device)
            if name is None:
                name = devices[device] = str(device)
            dtype = tensor.dtype
            dtype_name = dtypes.get(dtype)
            if dtype_name is None:
                dtype_name = dtypes[dtype] = _dtype_name(dtype)
            where = site(tensor)
            group = (name, dtype_name, None if nested else tuple(tensor.shape), where)
            read.append((group, keys))
            unsited = unsited or where is None
        tensors.clear()
        counts = _group(read, _storage_sites(read) if unsited else {}, owners)
        sizes = dict.fromkeys(counts, 0)
        for size, _, group in owners.values():
            sizes[group] += size
        read.clear()
        owners.clear()
    return {group: (count, sizes[group]) for group, count in counts.items()}


def _storages(tensor: torch.Tensor, *, recorded: bool) -> list[tuple[int, int, int]] | None:
    """(pointer, storage bytes, bytes viewed) per storage of ``tensor``; None if unreadable.

    ``recorded``: count of a storage alive when `only_new_objects` began only
    what it grew by since.
    """
    found = []
    for part in _parts(tensor):
        key = storage_key(part)
        if key is None:
            return None
        size = grown_bytes(part.untyped_storage(), key[1]) if recorded else key[1]
        found.append((key[0], size, _widest(part)))
    return found or None


def _storage_sites(
    read: list[tuple[GroupKey, list[tuple[int, int, int]]]],
) -> dict[tuple[str, int], Hashable]:
    """The first known creation site of each storage that a tensor with no site views."""
    wanted = {(group[0], key[0]) for group, keys in read if group[3] is None for key in keys}
    sites: dict[tuple[str, int], Hashable] = {}
    for group, keys in read:
        if group[3] is not None:
            for pointer, _, _ in keys:
                place = (group[0], pointer)
                if place in wanted and place not in sites:
                    sites[place] = group[3]
    return sites


def _group(
    read: list[tuple[GroupKey, list[tuple[int, int, int]]]],
    sites: dict[tuple[str, int], Hashable],
    owners: dict[tuple[str, int], tuple[int, int, GroupKey]],
) -> dict[GroupKey, int]:
    """Tensors per group; fills ``owners`` with each storage's widest view's group."""
    counts: dict[GroupKey, int] = {}
    for seen, keys in read:
        group = seen
        if group[3] is None and sites:
            # No site of its own, yet it shares memory with a tensor made at a known line:
            # the base of an alias (x.as_subclass(C) keeps x alive, and x's note is lost
            # when torch keeps its Python object for the alias), made where that was.
            places = ((group[0], pointer) for pointer, _, _ in keys)
            group = (*group[:3], next((sites[p] for p in places if p in sites), None))
        counts[group] = counts.get(group, 0) + 1
        for pointer, size, width in keys:
            owner = owners.get((group[0], pointer))
            if owner is None or width > owner[1]:
                owners[group[0], pointer] = (size, width, group)
    return counts
