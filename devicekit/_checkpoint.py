"""Loading checkpoints onto the device at hand: `load()`."""

from __future__ import annotations

import os
import pickle
from typing import IO, Any

import torch

from ._devices import DeviceLike, resolve_device, try_gpu
from ._errors import CheckpointError
from ._format import first_line
from ._options import check_path

__all__ = ["load"]


def load(
    path: str | os.PathLike[str] | IO[bytes], device: DeviceLike | None = None, **kwargs: Any
) -> Any:
    """``torch.load`` onto ``device``, whatever device the checkpoint was saved from.

    A checkpoint saved on ``cuda:1`` loads on a CPU-only or one-GPU machine:
    every tensor is mapped to ``device``. ``weights_only=True`` is the default,
    so loading never runs code from the file; pass ``weights_only=False`` only
    for files you trust.

    Args:
        path: The file to load: a path, or a binary file object with
            ``read()`` and ``seek()``.
        device: Where the tensors go, a [`DeviceLike`][devicekit.DeviceLike].
            Default: [`try_gpu()`][devicekit.try_gpu].
        **kwargs: Passed to ``torch.load`` (``weights_only``, ``mmap``...).

    Returns:
        What ``torch.load`` returns, with its tensors on ``device``.

    Raises:
        TypeError: ``path`` is neither a path nor a binary file, or both
            ``device`` and ``map_location`` were given.
        DeviceNotFoundError: This torch build or machine has no such device.
        CheckpointError: The file is not one ``torch.save`` wrote (empty,
            cut short, or another format); torch's own error is its cause.
        pickle.UnpicklingError: With ``weights_only=True``, the file holds
            objects other than tensors and plain data (torch's message
            lists them, and how to allow them).

    Examples:
        >>> import io, torch, devicekit as dk
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> _ = buffer.seek(0)
        >>> dk.load(buffer, "cpu")
        {'w': tensor([1., 1.])}
    """
    check_path(path, name="path", fix="pass the checkpoint's path", file_objects=True)
    if "map_location" in kwargs:
        if device is not None:
            raise TypeError("load() takes device or map_location, not both; pass only device")
        map_location = kwargs.pop("map_location")
    else:
        map_location = try_gpu() if device is None else resolve_device(device)
    kwargs.setdefault("weights_only", True)
    try:
        return torch.load(path, map_location=map_location, **kwargs)
    except (KeyError, EOFError, pickle.UnpicklingError, RuntimeError) as error:
        if not _unreadable(error):
            raise  # torch's own message says it best (weights_only refusals, device errors)
        name = repr(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else "the file"
        raise CheckpointError(
            f"load(path={name}): not a checkpoint torch.load can read ({type(error).__name__}: "
            f"{first_line(error) or 'no message'}); it is empty, cut short, or not written by "
            "torch.save. Check the path, and save it again if it was cut short"
        ) from error


def _unreadable(error: BaseException) -> bool:
    """Whether torch.load failed because the bytes are not a checkpoint, not for another reason."""
    if isinstance(error, pickle.UnpicklingError):
        return not str(error).startswith("Weights only load failed")
    if isinstance(error, RuntimeError):
        return "PytorchStreamReader" in str(error)
    return True  # KeyError and EOFError: the unpickler read bytes that are not a pickle
