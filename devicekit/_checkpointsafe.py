"""`load()` of a safetensors file: loaded with the safetensors package, on every torch.

torch 2.13's ``torch.load`` hands a path ending in ``.safetensors`` to
``safetensors.torch.load_file`` when that package is installed (transformers
installs it), and refuses it otherwise; torch 2.6 reads one as a broken
pickle. Under ``dk.load`` that gave three answers for one file: a dict, a
``CheckpointError`` saying to use safetensors, or safetensors' own errors
(``device meta is invalid``; ``incomplete metadata`` for a file cut short,
with no path). devicekit tells a safetensors file by its first bytes, whatever
its name, and loads it the same way on every torch: onto ``device``, with
its damage a `CheckpointError` naming the path. The format keeps no
checksums, so ``verify=True`` warns that it checked none.
"""

from __future__ import annotations

import os
from typing import IO

import torch

from ._checkpointargs import path_shown
from ._checkpointcheck import not_verified
from ._errors import CheckpointError

__all__ = ["load_safetensors"]


def load_safetensors(
    path: str | os.PathLike[str] | IO[bytes],
    start: int | None,
    map_location: object,
    *,
    verify: bool,
) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at ``path``, on the device ``map_location`` names."""
    where = f"load(path={path_shown(path)}"
    if not isinstance(map_location, torch.device):
        raise TypeError(
            f"{where}): map_location is a {type(map_location).__name__}, but this is a "
            "safetensors file, which records no device to map from; pass device='cpu' (or "
            "another device) instead"
        )
    try:
        from safetensors.torch import load, load_file  # noqa: PLC0415 - an optional package
    except ImportError:
        raise CheckpointError(
            f"{where}): it is a safetensors file, not one torch.save wrote, and the safetensors "
            "package is not installed; pip install safetensors, then load it again (dk.load "
            "loads it, or safetensors.torch.load_file(path))"
        ) from None
    # safetensors places its tensors on a real device only: on meta, they are made on
    # the CPU, then moved (shapes and dtypes kept, the values dropped).
    on = "cpu" if map_location.type == "meta" else str(map_location)
    try:
        if isinstance(path, (str, os.PathLike)):
            tensors: dict[str, torch.Tensor] = load_file(path, device=on)
        else:
            path.seek(start or 0)  # known: its first bytes were read from there
            tensors = load(path.read())  # on the CPU: moved below
    except (OSError, MemoryError):
        raise  # the disk's or the host's, not the file's: as torch.load raises them
    except Exception as error:  # safetensors' SafetensorError, its Rust panics' Exception
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(
            f"{where}): a safetensors file cut short or damaged (safetensors says: {first}). "
            "Copy it again, or save it again"
        ) from error
    if any(tensor.device != map_location for tensor in tensors.values()):
        tensors = {name: tensor.to(map_location) for name, tensor in tensors.items()}
    if verify:
        not_verified(
            where, "a safetensors file keeps no checksums; only its header and sizes were checked"
        )
    return tensors
