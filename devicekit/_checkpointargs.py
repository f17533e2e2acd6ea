"""``load()``'s arguments checked before the file is read: the path, ``mmap``, the keywords.

Each refusal names ``load()``, the file and the fix, where torch's own named
neither (a folder, a path of a thousand characters, ``mmap=True`` of a file
object, a misspelt keyword that reached the unpickler, a file object that
cannot seek, a ``pickle_module`` with ``weights_only=True``).
"""

from __future__ import annotations

import errno
import functools
import inspect
import io
import os
import pickle
from typing import Any

import torch

from ._format import close_match
from ._shortrepr import got, short_repr

__all__ = [
    "MMAP_LEGACY",
    "check_keywords",
    "check_mmap",
    "check_pickle_module",
    "check_seekable",
    "legacy_mmap",
    "not_a_file",
    "path_shown",
    "too_long",
]

_PATH_SHOWN = 300  # characters of a path a message shows: a real one, whole; a mistake, cut


# How torch refuses mmap=True for a legacy-format file (torch.serialization.load).
MMAP_LEGACY = "mmap can only be used with files saved with"


def check_mmap(path: object, mmap: object) -> None:
    """Refuse an ``mmap`` that is no bool, and ``mmap=True`` of a file object.

    None is torch's default; ``"yes"`` would read as True. torch's own refusal of a
    file object, *f must be a file path*, named neither ``load()`` nor the file.
    """
    if mmap is None:
        return
    if not isinstance(mmap, bool):
        raise TypeError(f"mmap must be True, False or None (torch's default), got {got(mmap)}")
    if mmap and not isinstance(path, (str, os.PathLike)):
        raise ValueError(
            f"load(path={path_shown(path)}, mmap=True): mmap maps a file on disk into memory, "
            f"so it needs the file's path, got a file object ({type(path).__name__}); "
            "pass the path, or leave mmap out"
        )


def check_pickle_module(path: object, pickle_module: object, weights_only: object) -> None:
    """Refuse a ``pickle_module`` of the caller's own with ``weights_only=True`` (the default).

    torch refuses the two together with a bare *"Can not safely load weights when
    explicit pickle_module is specified"*; torch.load alone turns ``weights_only``
    off where a ``pickle_module`` is given, but ``load()`` never does so unasked.
    """
    if pickle_module is None or weights_only is not True:
        return
    name = getattr(pickle_module, "__name__", None)
    shown = name if isinstance(name, str) else short_repr(pickle_module)
    raise ValueError(
        f"load(path={path_shown(path)}, pickle_module={shown}): a pickle_module of your own "
        "unpickles the file, so torch cannot check that it holds only tensors and plain data "
        "(weights_only=True, load()'s default); pass weights_only=False as well for a file "
        "you trust, or leave pickle_module out"
    )


def check_seekable(path: object) -> None:
    """Refuse a file object that cannot seek (a pipe, standard input, a download).

    torch.load seeks in the file; its own error from a pipe was a bare
    ``OSError: [Errno 29] Illegal seek``. Other errors of the probe (``EIO``, a
    closed file) are left for torch to meet, as before.
    """
    if isinstance(path, (str, os.PathLike)):
        return
    try:
        path.seek(path.tell())  # type: ignore[attr-defined]  # what torch.load does first
    except (OSError, ValueError, AttributeError, TypeError) as error:
        # io.UnsupportedOperation is an OSError; the rest (EIO, a closed file) torch meets too.
        if not isinstance(error, io.UnsupportedOperation) and (
            not isinstance(error, OSError) or error.errno != errno.ESPIPE
        ):
            return
        raise TypeError(
            f"load(path={path_shown(path)}): path is a file object that cannot seek "
            f"({type(path).__name__}: a pipe, standard input or a download), but torch.load "
            "seeks in the file; read it into memory first: dk.load(io.BytesIO(f.read()))"
        ) from None


def legacy_mmap(path: object) -> RuntimeError:
    """The refusal of ``mmap=True`` for a legacy file, said of ``load()`` and the file.

    torch's own put the path inside a ``torch.save(...)`` call, as what to save.
    """
    return RuntimeError(
        f"load(path={path_shown(path)}, mmap=True): this checkpoint is in torch's legacy "
        "format (saved with _use_new_zipfile_serialization=False, or by torch before "
        "1.6), which cannot be memory-mapped; load it with mmap=False, or save it "
        "again with torch.save's default format to memory-map it"
    )


# What checkpoints are usually named, to point at them in a folder given as the path.
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar", ".safetensors")


def not_a_file(path: str | bytes, error: OSError) -> str:
    """Why ``path`` could not be opened (a wrong path, a folder), and what is there instead."""
    text = os.fsdecode(path)
    if not text:  # abspath("") is the working directory, which is no file to look for
        return "load(path=''): the path is empty; pass the checkpoint file's path"
    shown = short_repr(text, _PATH_SHOWN)
    where = os.path.abspath(text)
    if isinstance(error, IsADirectoryError):
        try:
            inside = sorted(n for n in os.listdir(where) if n.endswith(_CHECKPOINT_SUFFIXES))
        except OSError:
            inside = []
        hint = (
            f"; it holds {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}: pass one"
            if inside
            else "; pass the checkpoint file inside it"
        )
        return f"load(path={shown}): {where} is a folder, not a checkpoint file{hint}"
    if isinstance(error, NotADirectoryError):
        return _file_as_folder(text, shown)
    folder = os.path.dirname(where)
    if not os.path.isdir(folder):
        hint = f"; the folder {folder} does not exist either"
    else:
        try:
            # Files only: a checkpoint is one ("/nope.pt" suggested the folder "/opt").
            with os.scandir(folder) as entries:
                files = [e.name for e in entries if e.is_file()]
            near = close_match(os.path.basename(where), files)
        except OSError:
            near = None
        hint = f"; did you mean {os.path.join(os.path.dirname(text), near)!r}?" if near else ""
    relative = "" if os.path.isabs(text) else f" (relative to the working directory, {os.getcwd()})"
    return f"load(path={shown}): there is no file {where}{relative}{hint}"


def _file_as_folder(text: str, shown: str) -> str:
    """Why a path that goes through a file as if it were a folder was refused (``ENOTDIR``)."""
    parts = text.split(os.sep)
    for count in range(1, len(parts)):
        before = os.sep.join(parts[:count])
        if before and os.path.exists(before) and not os.path.isdir(before):
            if not any(parts[count:]):  # "sd.pt/": only separators after the file
                return (
                    f"load(path={shown}): {os.path.abspath(before)} is a file, but the path "
                    f"ends in {os.sep!r}, which names a folder; pass the path without it: "
                    f"{short_repr(before, _PATH_SHOWN)}"
                )
            return (
                f"load(path={shown}): {os.path.abspath(before)} is a file, not a folder, so "
                "there is nothing inside it; check the path"
            )
    return f"load(path={shown}): a part of the path is a file, not a folder; check the path"


def too_long(path: str | bytes) -> str:
    """Why a path the system refuses as too long was refused: often not a path at all."""
    text = os.fsdecode(path)
    return (
        f"load(path={short_repr(text, _PATH_SHOWN)}): a path of {len(text)} characters, longer "
        "than this system takes (a file name of 255 bytes at most); pass the checkpoint "
        "file's path, or io.BytesIO(data) for a checkpoint's bytes"
    )


# The pickle module's load() and Unpickler take these; torch.load passes them on.
_PICKLE_KEYWORDS = ("encoding", "errors", "fix_imports", "buffers")


@functools.cache
def _keywords() -> tuple[str, ...]:
    """The keywords ``load()`` passes on: this torch.load's own, and the pickle's."""
    parameters = inspect.signature(torch.load).parameters.values()
    own = [
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "f"
    ]
    return (*own, *_PICKLE_KEYWORDS)


def check_keywords(kwargs: dict[str, Any]) -> None:
    """Refuse, before the file is read, a keyword neither torch.load nor its unpickler takes.

    Torch would pass it to the unpickler, whose ``TypeError`` names neither
    ``load`` nor the keyword meant. A ``pickle_module`` of the caller's own
    (with ``weights_only=False``: see `check_pickle_module`) may take keywords
    of its own, so then every keyword goes through.

    Examples:
        >>> check_keywords({"maplocation": "cpu"})
        Traceback (most recent call last):
        ...
        TypeError: load() got an unexpected keyword argument 'maplocation'; did you mean \
map_location? ...
    """
    if kwargs.get("pickle_module") not in (None, pickle):
        return
    known = ("device", "verify", *_keywords())
    for key in kwargs:
        if key in known:
            continue
        match = close_match(key, known)
        fix = f"did you mean {match}?" if match else "check the spelling."
        raise TypeError(
            f"load() got an unexpected keyword argument {short_repr(key)}; {fix} load() takes "
            f"{', '.join(known)}"
        )


def path_shown(path: object) -> str:
    """How messages name the file: its path, a file object's name, or "the file"."""
    if isinstance(path, (str, os.PathLike)):
        return short_repr(os.fsdecode(path), _PATH_SHOWN)
    name = getattr(path, "name", None)
    return short_repr(name, _PATH_SHOWN) if isinstance(name, str) else "the file"
