"""Why a device argument cannot be read, and what it most likely means: `_devices`' words.

Only `_devices` reads device arguments; this module words its refusals, so
that the device model itself stays short.
"""

from __future__ import annotations

import torch

from ._shortrepr import short_repr

__all__ = ["device_type", "fix_for", "parses", "unreadable"]

# Device types that a backend's package adds by renaming torch's spare one (privateuse1):
# until it is imported, torch cannot even parse the name.
_RENAMED_BY = {"npu": "torch_npu", "musa": "torch_musa"}


def fix_for(value: object, name: str) -> str:
    """The fix for an object given as a device that only stands near one, or ``""``."""
    if isinstance(value, torch.cuda.device):  # the context manager, not a device
        index = value.idx if isinstance(value.idx, int) and value.idx >= 0 else None
        meant = "'cuda'" if index is None else f"torch.device('cuda', {index}) or 'cuda:{index}'"
        return f" (the torch.cuda.device context manager); pass {meant}"
    devices = (torch.device, str, int)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], devices):
        return f"; pass one device, not a list of them ({name}={short_repr(value[0])})"
    if isinstance(value, torch.nn.Module):
        return "; pass next(model.parameters()).device to use the device a model is on"
    return ""


def unreadable(value: str, name: str, reason: str) -> ValueError:
    """The error for a string torch cannot parse, with the string it most likely means."""
    kind, colon, index = value.strip().lower().partition(":")
    kind = device_type(kind)
    fixed = kind + colon + index
    if fixed != value and parses(fixed):
        fix = f"write {short_repr(fixed)} (device types are lower case, without spaces)"
        if value.strip().lower().startswith("gpu"):
            fix = (
                f"write {short_repr(fixed)}, or dk.try_gpu() to use whichever accelerator this "
                "machine has"
            )
        return ValueError(f"{name}={short_repr(value)} is not a device torch knows; {fix}")
    if colon and parses(kind):
        # Stripped as text: int() refuses past 4300 digits, and such an index parses nowhere.
        digits = index.lstrip("0") or "0"
        if index.isascii() and index.isdigit() and parses(f"{kind}:{digits}"):
            # torch reads no leading zero: "cuda:00" is refused, though written in digits.
            return ValueError(
                f"{name}={short_repr(value)} is not a device torch knows ({reason}): torch reads "
                f"no leading zero in the index; write '{kind}:{digits}'"
            )
        return ValueError(
            f"{name}={short_repr(value)} is not a device torch knows ({reason}): the index after "
            f"':' must be a non-negative integer written with the digits 0-9, such as '{kind}:1', "
            f"or leave it out ('{kind}')"
        )
    # torch's own message lists every type it knows (twenty of them): say the common ones.
    common = "it knows cpu, cuda, mps, xpu, meta and a few more"
    known = common if "Expected one" in reason else reason
    if kind in _RENAMED_BY:  # torch learns the name only when the backend's package loads
        package = _RENAMED_BY[kind]
        return ValueError(
            f"{name}={short_repr(value)} is not a device torch knows ({known}); {package} "
            f"registers '{kind}' when imported: import {package} first, or use dk.try_gpu() "
            "to fall back to the CPU"
        )
    return ValueError(
        f"{name}={short_repr(value)} is not a device torch knows ({known}); write 'cpu', 'cuda', "
        "'cuda:1', or an index such as 1"
    )


def device_type(text: str) -> str:
    """The device type ``text`` starts with, lower case; torch calls GPUs "cuda"."""
    kind = text.strip().lower().partition(":")[0]
    return "cuda" if kind == "gpu" else kind  # dk.try_gpu() is "whichever accelerator"


def parses(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True
