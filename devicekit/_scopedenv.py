"""Setting an environment variable for a block, ``CUDA_VISIBLE_DEVICES`` above all.

The variable is read once, when the CUDA driver starts in a process. Setting it
later changes nothing for that process, only for the processes it starts, so
[`visible_devices()`][devicekit.visible_devices] refuses to pretend otherwise.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ._blocks import EnterOnce
from ._errors import CUDAInitializedError
from ._frames import caller_stacklevel
from ._keywords import suggest_keywords
from ._options import check_flag
from ._shortrepr import short_repr
from ._visible import ENV_VAR, cuda_started, parse_visible_devices
from ._visiblearg import normalize_devices

__all__ = ["scoped_env", "visible_devices"]


class _Scope:
    """One open `scoped_env` block: the value it replaced, which it puts back."""

    __slots__ = ("previous",)

    def __init__(self, previous: str | None) -> None:
        self.previous = previous


class _Scopes:
    """The open `scoped_env` blocks of each variable, oldest first, and their lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[str, list[_Scope]] = {}

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork


_scopes = _Scopes()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_scopes.after_fork)


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextmanager
def scoped_env(name: str, value: str | None) -> Iterator[None]:
    """Set (or, for None, unset) an environment variable inside a block; restore it after.

    Blocks may end in any order (two generators, an ``ExitStack``, two
    threads): an inner block that outlives the one it opened inside keeps
    its value until it ends too, and when the last block ends the variable
    is what it was before the first.

    Examples:
        >>> import os
        >>> os.environ.pop("DK_DOC", None)
        >>> first, second = scoped_env("DK_DOC", "1"), scoped_env("DK_DOC", "2")
        >>> first.__enter__(); second.__enter__()
        >>> _ = first.__exit__(None, None, None)  # the first ends first...
        >>> os.environ["DK_DOC"]  # ...and the second, still open, keeps its value
        '2'
        >>> _ = second.__exit__(None, None, None)
        >>> "DK_DOC" in os.environ
        False
    """
    with _scopes.lock:
        scope = _Scope(os.environ.get(name))
        _scopes.open.setdefault(name, []).append(scope)
        _put(name, value)
    try:
        yield
    finally:
        with _scopes.lock:
            stack = _scopes.open[name]
            position = next(i for i, open_scope in enumerate(stack) if open_scope is scope)
            del stack[position]
            if position == len(stack):  # the innermost block: put back what it replaced
                _put(name, scope.previous)
            else:  # a block opened inside it is still open: that one now puts this value back
                stack[position].previous = scope.previous
            if not stack:
                del _scopes.open[name]


@suggest_keywords
def visible_devices(
    devices: int | str | Iterable[int | str] | None,
    *,
    subprocesses_only: bool = False,
) -> EnterOnce[list[int | str] | None]:
    """Set ``CUDA_VISIBLE_DEVICES`` inside a ``with`` block, and restore it afterwards.

    The previous value, or its absence, comes back when the block ends,
    whether it ends normally, by an exception, or inside another
    ``visible_devices`` block. The whole argument is checked before anything
    changes; unlike CUDA, which silently drops everything after a bad entry,
    this raises an error naming it.

    The variable only takes effect where CUDA has not started yet: in this
    process before its first CUDA call, and in processes started inside the
    block (``subprocess``, ``multiprocessing`` with ``spawn``). If CUDA
    starts in this process inside the block, the process keeps the block's
    GPUs until it exits; the variable is restored all the same, for the
    processes it starts later.

    Indices are physical GPUs, as CUDA numbers all of them, not this
    process's ``cuda:N``: under ``CUDA_VISIBLE_DEVICES=2,3`` (a scheduler's
    share, say), ``visible_devices(0)`` shows a child physical GPU 0, which
    is not one of this process's. Pass ``2``, or the GPU's UUID. Indices
    outside the share get a ``UserWarning`` that names the share and, where
    the indices fit it, the value meant (``visible_devices(1)`` there warns
    that this process's ``cuda:1`` is ``'3'``).

    The environment is process-wide: blocks in several threads (or blocks
    that end in another order than they began) each restore what they
    replaced, and the variable is as before once all have ended, but while
    they overlap every thread sees the value of the block that began last.

    Args:
        devices: Which GPUs to show: an index (``1``), a comma-separated
            string (``"0,2"``), a sequence of indices or of ``GPU-``/``MIG-``
            UUIDs (unique prefixes are fine); ``""`` or ``[]`` to hide every
            GPU; ``None`` to unset the variable, so that every GPU is visible.
            Each value round-trips with
            [`parse_visible_devices()`][devicekit.parse_visible_devices]:
            ``visible_devices(dk.parse_visible_devices())`` changes nothing.
        subprocesses_only: Set the variable even though CUDA has already
            started in this process, because it is meant only for processes
            started inside the block. If CUDA was not started yet and starts
            inside the block, this process reads the value too: a
            ``RuntimeWarning`` says so when the block ends.

    Yields:
        The parsed entries, for example ``[0, 2]``; ``[]`` when every GPU is
        hidden; None when the variable is unset.

    Raises:
        TypeError: ``devices`` or one of its entries has the wrong type (a
            tensor too: its value is never read as an index), or
            ``subprocesses_only`` is not a bool.
        ValueError: An entry is negative, duplicated, malformed, or indices
            and UUIDs are mixed; or, where NVML lists the machine's GPUs, an
            index is past them, or a ``GPU-`` UUID matches none of them (case
            counts, as in torch), several (an ambiguous prefix), or the same
            GPU as another entry.
        CUDAInitializedError: CUDA has already started in this process and
            ``subprocesses_only`` is False.
        RuntimeError: The object a call returned is entered a second time:
            each ``with`` statement takes a call of its own.

    Examples:
        >>> import os, devicekit as dk
        >>> with dk.visible_devices("1,0") as devices:
        ...     print(devices, os.environ["CUDA_VISIBLE_DEVICES"])
        [1, 0] 1,0
    """
    call = f"dk.visible_devices({short_repr(devices, limit=40)})"
    return EnterOnce(
        lambda: _visible_devices(devices, subprocesses_only),
        again=(
            f"this {call} block was entered already, and each block is entered once: call "
            "dk.visible_devices(...) again for each with statement"
        ),
        name=call,
        gives="devices",
    )


@contextmanager
def _visible_devices(
    devices: int | str | Iterable[int | str] | None, subprocesses_only: bool
) -> Iterator[list[int | str] | None]:
    """`visible_devices`' block: everything is checked when it is entered."""
    check_flag(subprocesses_only, name="subprocesses_only")  # "no" must not skip the check
    parsed = None if devices is None else normalize_devices(devices)
    value = None if parsed is None else ",".join(str(entry) for entry in parsed)
    reason = cuda_started()
    if not subprocesses_only and reason is not None:
        change = f"unset {ENV_VAR}" if value is None else f"set {ENV_VAR}={value!r}"
        shell = f"env -u {ENV_VAR}" if value is None else f"{ENV_VAR}={value}"
        raise CUDAInitializedError(
            f"cannot {change} for this process: {reason}, and CUDA reads the variable only "
            "when it starts. Do it before the first CUDA call (at the top of the script, or "
            f"in the shell: {shell} python train.py), or pass subprocesses_only=True to do "
            "it only for processes started in the block."
        )
    if parsed:
        _warn_if_outside_share(parsed)
    with scoped_env(ENV_VAR, value):
        try:
            yield parsed
        finally:
            if subprocesses_only and reason is None:
                _warn_if_started_inside(value)


def _warn_if_outside_share(parsed: list[int | str]) -> None:
    """Say so when indices name GPUs outside the share this process was given.

    The usual cause: this process's ``cuda:N`` (what ``pick_gpu()`` and
    ``torch.cuda`` count) taken for the machine's index N.
    """
    with _scopes.lock:
        # The share from outside (a scheduler, the shell), not another open block's value:
        # threads each showing their children one GPU are not leaving anything.
        opened = _scopes.open.get(ENV_VAR)
        given = opened[0].previous if opened else os.environ.get(ENV_VAR)
    share = None if given is None else parse_visible_devices(given)
    if not share or not all(isinstance(entry, int) for entry in share):
        return  # every GPU, none, or UUIDs: nothing to compare indices with
    outside = [entry for entry in parsed if isinstance(entry, int) and entry not in share]
    if not outside:
        return
    within = all(isinstance(e, int) and e < len(share) for e in parsed)
    meant = ",".join(str(share[e]) for e in parsed if isinstance(e, int)) if within else None
    fix = (
        f"if you meant this process's cuda:{', cuda:'.join(map(str, parsed))}, pass "
        f"visible_devices({meant!r})"
        if meant is not None
        else f"pass GPUs among {','.join(map(str, share))}"
    )
    named = (
        f"GPUs {','.join(map(str, outside))} are" if len(outside) > 1 else f"GPU {outside[0]} is"
    )
    warnings.warn(
        f"visible_devices(): {ENV_VAR}={given!r} gave this process GPUs "
        f"{','.join(map(str, share))}, and {named} not among them. Entries are the machine's "
        f"GPU indices, not this process's cuda:N: {fix}. Where leaving the share is meant, "
        "filter this warning.",
        UserWarning,
        stacklevel=caller_stacklevel(),  # the with block's line, or the decorated call's
    )


def _warn_if_started_inside(value: str | None) -> None:
    """Say so when CUDA started in this process inside a ``subprocesses_only`` block."""
    reason = cuda_started()
    if reason is None:
        return
    setting = f"unset {ENV_VAR}" if value is None else f"{ENV_VAR}={value}"
    warnings.warn(
        f"visible_devices(..., subprocesses_only=True) was meant for the processes started in "
        f"it, but {reason} inside the block, so this process read {setting} too and keeps "
        "that view of the GPUs until it exits. Start CUDA before the block (or after it), or "
        "pass the setting to the child alone (subprocess.run(..., env=...)).",
        RuntimeWarning,
        stacklevel=caller_stacklevel(),  # the with block's line, or the decorated call's
    )
