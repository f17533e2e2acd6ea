"""The user's line: the first frame outside torch, devicekit and the stdlib, as ``file:line``.

``detect_syncs`` names the line that made the host wait, ``find_leaks`` the line
that created a tensor, ``explain_oom`` the line that allocated a block. Each
walks a stack past torch's and devicekit's own frames, and the standard
library's, to the first frame the user wrote: a tensor copied by
``copy.deepcopy`` or logged through ``logging`` was the user's line's doing,
not ``copy.py``'s. Packages installed in ``site-packages`` (torchvision,
transformers) count as the user's, and so does code with no file: ``<stdin>``
at a REPL, ``<string>`` under ``exec``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import types
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = [
    "UNKNOWN_LOCATION",
    "caller_stacklevel",
    "first_user_location",
    "is_installed",
    "is_user",
    "user_location",
]

UNKNOWN_LOCATION = "<unknown>"
"""The location of a frame that could not be found."""

# Frames inside these folders are not "the user's line".
_SKIPPED = (
    *(str(folder) + os.sep for folder in (Path(torch.__file__).parent, Path(__file__).parent)),
    *(str(Path(module.__file__ or "")) for module in (warnings, contextlib)),
    "<frozen ",  # the standard library's frozen modules: <frozen runpy>, <frozen importlib...>
)
# The standard library's folder, as imports name it and as sysconfig does (a venv's
# "platstdlib" holds its site-packages, so it is not one of them).
_STDLIB = tuple(
    sorted(
        {
            str(Path(folder)) + os.sep
            for folder in (os.path.dirname(os.__file__), sysconfig.get_path("stdlib"))
        }
    )
)
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_DEVICEKIT = str(Path(__file__).parent) + os.sep
_CONTEXTLIB = contextlib.__file__


def is_user(filename: str) -> bool:
    """Whether a frame in ``filename`` is the user's: not torch's, devicekit's or the stdlib's.

    Folders end in a separator here: ``.../torch`` must not hide ``.../torchvision``.
    A package in a ``site-packages`` folder inside the standard library's (a
    Python without a venv) is the user's.

    Examples:
        >>> import copy, torch
        >>> is_user("train.py"), is_user("<stdin>"), is_user(copy.__file__), is_user(torch.__file__)
        (True, True, False, False)
    """
    if filename.startswith(_SKIPPED):
        return False
    return not filename.startswith(_STDLIB) or any(part in filename for part in _INSTALLED)


def is_installed(filename: str) -> bool:
    """Whether ``filename`` is in an installed package, which `is_user` counts as the user's.

    ``find_leaks`` names the first line of the user's own code, with the
    line inside transformers as a detail.

    Examples:
        >>> is_installed("/venv/lib/python3.11/site-packages/transformers/activations.py")
        True
        >>> is_installed("train.py")
        False
    """
    return any(part in filename for part in _INSTALLED)


def user_location(depth: int = 1) -> str:
    """``file:line`` of the first user frame above the caller's (``depth`` frames up)."""
    frame: types.FrameType | None = sys._getframe(depth)
    while frame is not None and not is_user(frame.f_code.co_filename):
        frame = frame.f_back
    return UNKNOWN_LOCATION if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the line that called devicekit.

    Call it in the frame that calls ``warnings.warn``: it counts that frame
    and each devicekit frame above it, however many wrappers (a
    `suggest_keywords` frame) stand between the public call and the warning,
    and ``contextlib``'s frames among them: a devicekit block entered by a
    ``with``, by a decorator (``ContextDecorator``) or by an ``ExitStack``.
    """
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_DEVICEKIT) or frame.f_code.co_filename == _CONTEXTLIB
    ):
        frame = frame.f_back
        level += 1
    return level


def first_user_location(frames: Iterable[tuple[str, int]]) -> str:
    """The first user frame of ``(filename, line)`` pairs listed innermost first.

    Examples:
        >>> import torch
        >>> from devicekit._frames import first_user_location
        >>> first_user_location([(torch.__file__, 3), ("train.py", 12), ("main.py", 1)])
        'train.py:12'
    """
    for filename, line in frames:
        if is_user(filename):
            return f"{filename}:{line}"
    return UNKNOWN_LOCATION
