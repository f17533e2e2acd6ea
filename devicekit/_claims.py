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

Every job of one user must find the same files, whatever its environment, so
the directory is fixed: ``/tmp/devicekit-<uid>``, mode 0700, or
``$DEVICEKIT_CLAIMS_DIR`` where the user names one. Not ``$XDG_RUNTIME_DIR``
or ``$TMPDIR``: a job started from cron, Slurm, ``sudo -u`` or a service has
neither, or its own, and would claim GPUs other jobs hold; and logind deletes
``/run/user/<uid>`` at logout, under the claims of jobs left running. The
files are never deleted: deleting a lock file while another process has it
open but not yet locked would let two processes lock two different files for
one GPU. There is one small file per GPU ever claimed. While it holds a
claim, a process also holds a shared ``flock`` on the directory, which
``systemd-tmpfiles`` honours: it does not age a locked directory, so the
files of a claim held for weeks stay where the next job looks for them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ._blocks import EnterOnce
from ._devices import DeviceLike, parse_cuda_index, resolve_device
from ._keywords import suggest_keywords
from ._visible import ENV_VAR

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows has no flock
    fcntl = None

__all__ = [
    "DIR_VAR",
    "check_claims_supported",
    "claim",
    "claim_gpu",
    "claims_directory",
    "holder",
    "is_held",
    "release",
    "release_gpu",
]

DIR_VAR = "DEVICEKIT_CLAIMS_DIR"
# Fixed, not tempfile.gettempdir(): TMPDIR differs between jobs of one user (Slurm sets
# one per job), and jobs that look in different directories do not see each other.
_SHARED_TMP = "/tmp"
# systemd-tmpfiles holds a directory it ages exclusively for milliseconds; wait that out,
# but never hang on a process that keeps it locked (then the claim goes on without it).
_DIRECTORY_LOCK_TRIES = 100
_DIRECTORY_LOCK_PAUSE = 0.01  # seconds
_FIX = (
    f"set {DIR_VAR} to a directory of your own on a local disk with free space (every job "
    "that shares these GPUs must see the same value), or pass claim=False"
)


@dataclass(frozen=True)
class _Claim:
    fd: int  # the open, locked lock file; closing it releases the claim
    directory_fd: int  # the directory, share-locked so that tmp cleaners leave it alone
    index: int  # cuda:<index> as pick_gpu returned it
    visible: str | None  # CUDA_VISIBLE_DEVICES then, which gave the index its meaning


_PID_WIDTH = 10  # Linux process ids have at most 7 digits (pid_max <= 2**22)


class _Held:
    """This process's claims, by GPU UUID, and the lock that guards them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.claims: dict[str, _Claim] = {}

    def forget_after_fork(self) -> None:
        # The child shares the parent's open lock files. Closing its copies leaves
        # the parent's claims in place and makes them end when the parent ends,
        # not when the last child made by fork (a DataLoader worker, say) does.
        self.lock = threading.Lock()  # another thread may have held it at the fork
        for held in self.claims.values():
            for fd in (held.fd, held.directory_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.claims.clear()


_held = _Held()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_held.forget_after_fork)


def check_claims_supported() -> None:
    """Raise unless this system has the file locks claims are made of."""
    if fcntl is None:
        raise NotImplementedError(
            f"claim=True needs OS file locks (fcntl.flock), which this system ({sys.platform}) "
            "does not have; pass claim=False, and give each job its GPU explicitly"
        )


def claims_directory() -> Path:
    """The directory of this user's lock files, created with mode 0700 if needed.

    ``$DEVICEKIT_CLAIMS_DIR`` when set (an absolute path; ``~`` is expanded,
    missing parents are made), else ``/tmp/devicekit-<uid>``, whatever
    ``TMPDIR`` or ``XDG_RUNTIME_DIR`` say: jobs see each other's claims only
    where they look in the same directory. The default directory is made
    private again if its mode let others in; a chosen one is never changed,
    and refused if others can write to it.

    Raises:
        PermissionError: The directory exists but is not a directory owned
            by this user (someone else created it, or it is a link), a chosen
            one is writable by others, or it cannot be created here.
        OSError: It cannot be created for another reason (a full or
            read-only disk); the message names the directory and the fix.
        ValueError: ``$DEVICEKIT_CLAIMS_DIR`` is a relative path.

    Examples:
        >>> from devicekit._claims import claims_directory
        >>> oct(claims_directory().stat().st_mode & 0o777)
        '0o700'
    """
    chosen = os.environ.get(DIR_VAR)
    if chosen:
        expanded = os.path.expanduser(chosen)  # as a shell would have: "~/claims"
        if not os.path.isabs(expanded):
            raise ValueError(
                f"{DIR_VAR}={chosen!r} is a relative path, which names a different directory "
                "for each job's working directory; give an absolute path"
            )
        path = Path(expanded)
    else:
        base = _SHARED_TMP if os.path.isdir(_SHARED_TMP) else tempfile.gettempdir()
        path = Path(base) / f"devicekit-{os.getuid()}"
    try:
        if chosen and not os.path.lexists(path.parent):
            path.parent.mkdir(parents=True, exist_ok=True)  # "devicekit creates it"
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise _cannot("create the directory of GPU claims", path, error) from None
    info = os.lstat(path)
    # In a shared temp directory another user could have made this name first:
    # then their files would decide our claims, so refuse instead.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        # A device, pipe or socket the user named (DEVICEKIT_CLAIMS_DIR=/dev/null) is not
        # theirs to remove: only a file, a link or a directory is.
        plain = any(test(info.st_mode) for test in (stat.S_ISREG, stat.S_ISLNK, stat.S_ISDIR))
        fix = "remove it, or set" if plain or not chosen else "set"
        raise PermissionError(
            errno.EACCES,
            f"{path} should be a directory of GPU claims owned by this user (uid "
            f"{os.getuid()}), but it is {_describe(info)}; {fix} {DIR_VAR} "
            "to a directory of your own",
        )
    mode = stat.S_IMODE(info.st_mode)
    if chosen and mode & 0o022:
        # Not changed: it is the user's (their home, a project folder). Others could plant
        # links there where the lock files go, so it is refused instead.
        raise PermissionError(
            errno.EACCES,
            f"{DIR_VAR}={chosen!r} is writable by other users (mode {mode:o}), who could "
            "plant files or links where the lock files go; devicekit does not change a "
            f"directory you chose. Set {DIR_VAR} to a directory only you can write, such as "
            f"{os.path.join(expanded, 'devicekit-claims')!r} (devicekit creates it, private)",
        )
    if not chosen and mode & 0o077:
        try:  # its own directory, made by an older umask or by hand: make it private again
            os.chmod(path, 0o700)
        except OSError as error:
            raise _cannot("make private (mode 0700)", path, error) from None
    return path


def _describe(info: os.stat_result) -> str:
    """What a path is and who owns it: ``"a character device owned by uid 0"``.

    Named by kind: "not a directory owned by uid 0" read as "not owned by uid 0" to the
    owner of a file (or of ``/dev/null``), and a link to a directory is not "not a
    directory" to its maker.
    """
    note = ""
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        kind, note = "a symbolic link", ", which claims do not follow (its target could change)"
    else:
        kinds = [
            (stat.S_ISDIR, "a directory"),
            (stat.S_ISREG, "a regular file"),
            (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"),
            (stat.S_ISFIFO, "a named pipe (FIFO)"),
            (stat.S_ISSOCK, "a socket"),
        ]
        kind = next((name for test, name in kinds if test(mode)), "a special file")
    return f"{kind} owned by uid {info.st_uid}{note}"


def _cannot(action: str, path: Path, error: OSError) -> OSError:
    """``error`` retold: what claim=True was doing, where, and what to do (same errno, so class)."""
    return OSError(
        error.errno,
        f"claim=True cannot {action} {path}: {error.strerror or error}; {_FIX}",
    )


def _lock_file(uuid: str) -> Path:
    # Old drivers name MIG instances "MIG-GPU-<uuid>/<gi>/<ci>": no slashes in a file name.
    return claims_directory() / (re.sub(r"[^A-Za-z0-9._-]", "_", uuid) + ".lock")


def _share_lock(directory_fd: int) -> None:
    """Share-lock the directory, so that ``systemd-tmpfiles`` does not age it (best effort)."""
    assert fcntl is not None
    for _ in range(_DIRECTORY_LOCK_TRIES):
        try:
            fcntl.flock(directory_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a cleaner is looking at it right now
            time.sleep(_DIRECTORY_LOCK_PAUSE)
        except OSError:  # a file system without directory locks: nothing to protect it with
            return
        else:
            return


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
        path = _lock_file(uuid)
        opened: list[int] = []
        made: _Claim | None = None
        try:
            try:
                opened.append(os.open(path.parent, os.O_RDONLY))
                # The directory's lock first: a cleaner already at work in it could delete
                # the lock file between our open and our lock, and the next job make another.
                _share_lock(opened[0])
                opened.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # closed by exec
            except OSError as error:
                raise _cannot("open the lock file", path, error) from None
            directory_fd, fd = opened
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError as error:  # a file system without flock (some FUSE mounts)
                raise _cannot("lock", path, error) from None
            # Who holds it, for the messages of processes turned away (best effort). Fixed
            # width, written over the last holder's: truncating first would make ext4 flush
            # the file to disk at close (its auto_da_alloc rule), 4.5 ms instead of 20 us.
            # Best effort: a full disk must not fail the claim (holder() asks the kernel).
            with contextlib.suppress(OSError):
                os.pwrite(fd, f"{os.getpid():>{_PID_WIDTH}}\n".encode(), 0)
            made = _Claim(fd, directory_fd, index, os.environ.get(ENV_VAR))
            _held.claims[uuid] = made
            return True
        finally:
            # Whatever stopped it before the claim was recorded (a Ctrl-C included), the
            # lock must not outlive it: an unrecorded lock could never be released.
            if made is None or _held.claims.get(uuid) is not made:
                for descriptor in opened:
                    os.close(descriptor)


def release(uuid: str) -> bool:
    """Release this process's claim on the GPU with this UUID; False if it held none."""
    with _held.lock:  # closed under the lock: a claim racing in sees the GPU free or held, not both
        held = _held.claims.pop(uuid, None)
        if held is None:
            return False
        os.close(held.fd)  # closing the only descriptor of the file drops its lock
        os.close(held.directory_fd)
    return True


def is_held(uuid: str) -> bool:
    """Whether this process holds a claim on the GPU with this UUID."""
    return uuid in _held.claims


_PROC_LOCKS = "/proc/locks"


def holder(uuid: str) -> int | None:
    """The process id that holds the claim on this GPU; None if unknown.

    The kernel's lock table says, where there is one (Linux): the pid the
    lock file holds is only what the holder wrote, and a holder that could
    not write it (a full disk) leaves the pid of an earlier holder there,
    which may since belong to an unrelated process.
    """
    path = _lock_file(uuid)
    try:
        info = os.stat(path)
    except OSError:
        return None
    listed, pid = _kernel_holder(info)
    if listed:
        return pid
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _kernel_holder(info: os.stat_result) -> tuple[bool, int | None]:
    """Whether ``/proc/locks`` lists an exclusive ``flock`` on this file, and by which pid.

    The pid is None where the holder lives in another pid namespace (the
    kernel writes 0 or less for it then). Not listed: no lock table, or a
    file system whose device number there differs from ``stat``'s (btrfs).
    """
    try:
        with open(_PROC_LOCKS, encoding="ascii") as table:
            lines = table.readlines()
    except (OSError, UnicodeDecodeError):
        return False, None
    # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2147666 0 EOF"; waiters' lines carry "->".
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in lines:
        fields = line.split()
        if (
            len(fields) >= 6
            and fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"]
            and fields[5] == key
            and fields[4].lstrip("-").isdigit()
        ):
            pid = int(fields[4])
            return True, pid if pid > 0 else None
    return False, None


def _held_at(index: int) -> list[str]:
    """UUIDs of this process's claims on ``cuda:<index>``, under the current visibility first."""
    claims = _held.claims
    matches = [uuid for uuid, held in claims.items() if held.index == index]
    if len(matches) > 1:  # claimed under several CUDA_VISIBLE_DEVICES: the current one decides
        visible = os.environ.get(ENV_VAR)
        matches = [uuid for uuid in matches if claims[uuid].visible == visible]
    return matches


def release_gpu(device: DeviceLike) -> bool:
    """Release this process's claim on a GPU that ``pick_gpu(claim=True)`` returned.

    Claims also end when the process exits, however it exits. Releasing the
    CPU (what ``pick_gpu`` returns when no GPU qualifies) does nothing, so
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
    except ValueError:
        if resolve_device(device, name="device") == torch.device("cpu"):
            return False
        raise
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
        RuntimeError: The same ``claim_gpu(...)`` object is entered a second time.

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

    with _held.lock:
        before = set(_held.claims)
    device = pick_gpu(
        min_free_memory=min_free_memory,
        max_utilization=max_utilization,
        exclude=exclude,
        wait=wait,
        claim=True,
    )
    # Released by UUID, not by index: the block may change CUDA_VISIBLE_DEVICES, and then
    # cuda:<index> can name another GPU, even one this process claimed elsewhere.
    with _held.lock:
        ours = [] if device.type == "cpu" else _held_at(device.index or 0)
        ours = [uuid for uuid in ours if uuid not in before]
    try:
        yield device
    finally:
        for uuid in ours:
            release(uuid)
