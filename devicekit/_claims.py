"""GPU claims: devicekit processes started together take different GPUs.

NVML says how busy a GPU is *now*, so two jobs launched at the same moment
both see GPU 1 free and both take it. A claim closes that window:
``pick_gpu(claim=True)`` takes an exclusive lock on a file named after the
chosen GPU's UUID, and another process asking with ``claim=True`` skips any
GPU whose file it cannot lock. Claims are advisory: only devicekit calls with
``claim=True`` look at them.

The locks are the operating system's (``flock``), so they vanish with the
process that holds them: a job that crashes or is killed leaves no stale
claim, and there is no daemon and nothing to clean up. ``flock`` rather than
``lockf``/``fcntl`` record locks because record locks belong to the whole
process: a second claim from the same process would succeed on a GPU it
already holds, and closing *any* descriptor of the file would drop them.
``flock`` locks belong to one open file, so two opens conflict even in one
process, and a child made by ``fork`` closes its inherited copy (below)
without releasing the parent's claim.

Where the lock files live, what each is named, and who holds one: `_claimfiles`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ._blocks import EnterOnce
from ._claimfiles import (
    DIR_VAR,
    PID_WIDTH,
    cannot,
    check_chosen_directory,
    claims_directory,
    fcntl,  # None where the OS has no flock (Windows)
    holder,
    lock_file,
    open_lock_file,
    share_lock,
)
from ._devices import DeviceLike, parse_cuda_index, resolve_device
from ._errors import DeviceNotFoundError
from ._keywords import suggest_keywords
from ._visible import ENV_VAR

__all__ = [
    "DIR_VAR",
    "check_chosen_directory",
    "check_claims_supported",
    "claim",
    "claim_gpu",
    "claims_directory",
    "holder",
    "is_held",
    "release",
    "release_gpu",
]


@dataclass(frozen=True)
class _Claim:
    fd: int  # the open, locked lock file; closing it releases the claim
    directory_fd: int  # the directory, share-locked so that tmp cleaners leave it alone
    index: int  # cuda:<index> as pick_gpu returned it
    visible: str | None  # CUDA_VISIBLE_DEVICES then, which gave the index its meaning


class _Held:
    """This process's claims, by GPU UUID, and the lock that guards them."""

    def __init__(self) -> None:
        # Reentrant: a fork waits for it (below), and must not hang in the thread that has it.
        self.lock = threading.RLock()
        self.claims: dict[str, _Claim] = {}
        # Per thread: where `claim` lists the claims it makes while `recording` is on.
        self.recorders = threading.local()

    # Around a fork, not bound to one lock object: the child replaces it (below), and its own
    # forks must take the new one, not the copy of the parent's that it inherited, held.
    def lock_before_fork(self) -> None:
        self.lock.acquire()

    def unlock_after_fork(self) -> None:
        self.lock.release()

    def forget_after_fork(self) -> None:
        # The child shares the parent's open lock files. Closing its copies leaves
        # the parent's claims in place and makes them end when the parent ends,
        # not when the last child made by fork (a DataLoader worker, say) does.
        self.lock = threading.RLock()  # the parent's is held across the fork (below)
        for held in self.claims.values():
            for fd in (held.fd, held.directory_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.claims.clear()


_held = _Held()
if hasattr(os, "register_at_fork"):
    # A fork waits for a claim being made in another thread: forked between its lock and
    # its record, the child would keep a lock that it does not know of, and the GPU would
    # stay claimed until that child (a DataLoader worker, say) ended, after the parent.
    os.register_at_fork(
        before=_held.lock_before_fork,
        after_in_parent=_held.unlock_after_fork,
        after_in_child=_held.forget_after_fork,
    )


def check_claims_supported() -> None:
    """Raise unless this system has the file locks claims are made of."""
    if fcntl is None:
        raise NotImplementedError(
            f"claim=True needs OS file locks (fcntl.flock), which this system ({sys.platform}) "
            "does not have; pass claim=False, and give each job its GPU explicitly"
        )


def claim(uuid: str, index: int) -> bool:
    """Claim the GPU with this UUID for this process; False if anyone holds it, this process too.

    ``index`` is the torch index the caller knows it by, for
    [`release_gpu()`][devicekit.release_gpu].

    Raises:
        OSError: The lock file cannot be made (a full or read-only disk, or
            a file of another user); the message names it and the fix.
    """
    check_claims_supported()
    assert fcntl is not None
    with _held.lock:
        if uuid in _held.claims:
            return False
        path = lock_file(uuid)
        opened: list[int] = []
        made: _Claim | None = None
        try:
            try:
                opened.append(os.open(path.parent, os.O_RDONLY))
                # The directory's lock first: a cleaner already at work in it could delete
                # the lock file between our open and our lock, and the next job make another.
                share_lock(opened[0])
            except OSError as error:
                raise cannot("open the lock file", path, error) from None
            opened.append(open_lock_file(path))  # never through a link: it is written to
            directory_fd, fd = opened
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError as error:  # a file system without flock (some FUSE mounts)
                raise cannot("lock", path, error) from None
            # Who holds it, for the messages of processes turned away (best effort). Fixed
            # width, written over the last holder's: truncating first would make ext4 flush
            # the file to disk at close (its auto_da_alloc rule), 4.5 ms instead of 20 us.
            # Best effort: a full disk must not fail the claim (holder() asks the kernel).
            with contextlib.suppress(OSError):
                os.pwrite(fd, f"{os.getpid():>{PID_WIDTH}}\n".encode(), 0)
            made = _Claim(fd, directory_fd, index, os.environ.get(ENV_VAR))
            _held.claims[uuid] = made
            recorded = getattr(_held.recorders, "made", None)
            if recorded is not None:
                recorded.append((uuid, made))
            return True
        finally:
            # Whatever stopped it before the claim was recorded (a Ctrl-C included), the
            # lock must not outlive it: an unrecorded lock could never be released.
            if made is None or _held.claims.get(uuid) is not made:
                for descriptor in opened:
                    os.close(descriptor)


def release(uuid: str, *, only: _Claim | None = None) -> bool:
    """Release this process's claim on the GPU with this UUID; False if it held none.

    ``only``: release it only if it is still that claim (one a block made), not
    one made since, after the block's own was released.
    """
    with _held.lock:  # closed under the lock: a claim racing in sees the GPU free or held, not both
        held = _held.claims.get(uuid)
        if held is None or (only is not None and held is not only):
            return False
        del _held.claims[uuid]
        os.close(held.fd)  # closing the only descriptor of the file drops its lock
        os.close(held.directory_fd)
    return True


@contextlib.contextmanager
def _recording() -> Iterator[list[tuple[str, _Claim]]]:
    """Collect the claims this thread makes in the block, by UUID: exactly these, no others."""
    made: list[tuple[str, _Claim]] = []
    outer = getattr(_held.recorders, "made", None)
    _held.recorders.made = made
    try:
        yield made
    finally:
        _held.recorders.made = outer


def is_held(uuid: str) -> bool:
    """Whether this process holds a claim on the GPU with this UUID."""
    return uuid in _held.claims


def _held_at(index: int) -> list[str]:
    """UUIDs of this process's claims on ``cuda:<index>``, under the current visibility first."""
    claims = _held.claims
    matches = [uuid for uuid, held in claims.items() if held.index == index]
    if len(matches) > 1:  # claimed under several CUDA_VISIBLE_DEVICES: the current one decides
        visible = os.environ.get(ENV_VAR)
        matches = [uuid for uuid in matches if claims[uuid].visible == visible]
    return matches


@suggest_keywords
def release_gpu(device: DeviceLike) -> bool:
    """Release this process's claim on a GPU that ``pick_gpu(claim=True)`` returned.

    Claims also end when the process exits, however it exits, and when it
    calls exec (``os.execv``): claim in the program that uses the GPU.
    Releasing the CPU (what ``pick_gpu`` returns when no GPU qualifies) does nothing, so
    ``release_gpu(pick_gpu(claim=True))`` is always valid.

    Args:
        device: The device ``pick_gpu``, ``pick_gpus`` or ``claim_gpu`` gave:
            ``torch.device("cuda", 1)``, ``"cuda:1"`` or ``1``; or the CPU.

    Returns:
        True when a claim was released; False when this process held none on it.

    Raises:
        TypeError: ``device`` is not a device.
        ValueError: ``device`` is neither a CUDA device nor the CPU.

    Examples:
        >>> import devicekit as dk
        >>> dk.release_gpu("cpu")
        False
    """
    try:
        index = parse_cuda_index(device, name="device")
    except ValueError as not_cuda:
        try:
            cpu = resolve_device(device, name="device") == torch.device("cpu")
        except DeviceNotFoundError:  # 'mps' on a machine without: not CUDA is the point
            cpu = False
        if cpu:
            return False
        raise not_cuda from None
    with _held.lock:
        matches = _held_at(index)
    released = [release(uuid) for uuid in matches]
    return any(released)


@suggest_keywords
def claim_gpu(
    *,
    min_free_memory: int | None = None,
    max_utilization: float | None = None,
    exclude: Iterable[DeviceLike] | DeviceLike = (),
    wait: float | None = None,
) -> contextlib.AbstractContextManager[torch.device]:
    """Claim the best GPU for the length of a ``with`` block; the CPU when none qualifies.

    ``pick_gpu(..., claim=True)`` that releases the claim when the block ends,
    however it ends. Other devicekit processes asking with ``claim=True`` skip
    the GPU meanwhile.

    Args:
        min_free_memory: As for [`pick_gpu()`][devicekit.pick_gpu].
        max_utilization: As for [`pick_gpu()`][devicekit.pick_gpu].
        exclude: As for [`pick_gpu()`][devicekit.pick_gpu].
        wait: As for [`pick_gpu()`][devicekit.pick_gpu]: seconds to keep looking for a GPU
            that qualifies and that nobody has claimed.

    Returns:
        A context manager, entered once, whose ``with ... as`` gives the claimed
        ``torch.device("cuda", i)``, or ``torch.device("cpu")``.

    Raises:
        NotImplementedError: This system has no file locks (Windows).
        ValueError, PermissionError: ``$DEVICEKIT_CLAIMS_DIR`` cannot hold claims,
            as for [`pick_gpu()`][devicekit.pick_gpu] (when the block is entered, GPU or not).
        RuntimeError: The same ``claim_gpu(...)`` object is entered a second time.
        TypeError: It is used as a decorator: the function would not learn which
            device was claimed.

    Examples:
        >>> import devicekit as dk
        >>> with dk.claim_gpu(min_free_memory=2**60) as device:  # nobody has an exbibyte free
        ...     device
        device(type='cpu')
    """
    return EnterOnce(
        lambda: _claim_block(
            min_free_memory=min_free_memory,
            max_utilization=max_utilization,
            exclude=exclude,
            wait=wait,
        ),
        again=(
            "this claim_gpu() was already entered once; a claim is one with block, so call "
            "dk.claim_gpu(...) again for each: with dk.claim_gpu() as device: ..."
        ),
        name="dk.claim_gpu()",
        gives="device",
        undecorating="the function would never learn which device was claimed for it",
    )


@contextlib.contextmanager
def _claim_block(
    *,
    min_free_memory: int | None,
    max_utilization: float | None,
    exclude: Iterable[DeviceLike] | DeviceLike,
    wait: float | None,
) -> Iterator[torch.device]:
    from ._pick import pick_gpu  # noqa: PLC0415 - _pick builds on the claims made here

    # The claims this pick made, recorded as it made them: comparing the claims held before
    # and after would miss one that another thread released meanwhile and this one took.
    with _recording() as made:
        device = pick_gpu(
            min_free_memory=min_free_memory,
            max_utilization=max_utilization,
            exclude=exclude,
            wait=wait,
            claim=True,
        )
    # Released by UUID, not by index: the block may change CUDA_VISIBLE_DEVICES, and then
    # cuda:<index> can name another GPU, even one this process claimed elsewhere. And only
    # while it is still this block's claim: one released in the block and made again
    # (dk.release_gpu(device), then dk.pick_gpu(claim=True)) is no longer the block's.
    with _held.lock:
        ours = [(uuid, held) for uuid, held in made if _held.claims.get(uuid) is held]
    try:
        yield device
    finally:
        for uuid, held in ours:
            release(uuid, only=held)
