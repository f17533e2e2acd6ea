"""The files GPU claims are made of: where they live, what each is named, who holds one.

`_claims` locks and releases them; this module only finds them. Every job of
one user must find the same files, whatever its environment, so the
directory is fixed: ``/tmp/devicekit-<uid>``, mode 0700, or
``$DEVICEKIT_CLAIMS_DIR`` where the user names one. Not ``$XDG_RUNTIME_DIR``
or ``$TMPDIR``: a job started from cron, Slurm, ``sudo -u`` or a service has
neither, or its own, and would claim GPUs other jobs hold; and logind deletes
``/run/user/<uid>`` at logout, under the claims of jobs left running. The
files are never deleted: deleting a lock file while another process has it
open but not yet locked would let two processes lock two different files for
one GPU. There is one small file per GPU ever claimed, named after its UUID.
While it holds a claim, a process also holds a shared ``flock`` on the
directory (`share_lock`), which ``systemd-tmpfiles`` honours: it does not age
a locked directory, so the files of a claim held for weeks stay where the
next job looks for them.

Who holds a claim: the kernel's lock table says (`holder`); the pid a
holder writes into its file is only a fallback, and may be stale.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import time
from pathlib import Path
from types import ModuleType

from ._procfs import read_stat

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows has no flock
    fcntl = None

__all__ = [
    "DIR_VAR",
    "PID_WIDTH",
    "PROC_LOCKS",
    "cannot",
    "check_chosen_directory",
    "claims_directory",
    "claims_path",
    "fcntl",
    "holder",
    "lock_file",
    "lock_name",
    "locked_by",
    "open_lock_file",
    "refusal",
    "share_lock",
]

DIR_VAR = "DEVICEKIT_CLAIMS_DIR"
# Fixed, not tempfile.gettempdir(): TMPDIR differs between jobs of one user (Slurm sets
# one per job), and jobs that look in different directories do not see each other.
_SHARED_TMP = "/tmp"
# systemd-tmpfiles holds a directory it ages exclusively for milliseconds; wait that out,
# but never hang on a process that keeps it locked (then the claim goes on without it).
_DIRECTORY_LOCK_TRIES = 100
_DIRECTORY_LOCK_PAUSE = 0.01  # seconds
PID_WIDTH = 10  # the holder's pid, written fixed-width: Linux pids have at most 7 digits
_FIX = (
    f"set {DIR_VAR} to a directory of your own on a local disk with free space (every job "
    "that shares these GPUs must see the same value), or pass claim=False"
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
        >>> from devicekit._claimfiles import claims_directory
        >>> oct(claims_directory().stat().st_mode & 0o777)
        '0o700'
    """
    chosen = os.environ.get(DIR_VAR)
    path = claims_path()
    try:
        if chosen and not os.path.lexists(path.parent):
            path.parent.mkdir(parents=True, exist_ok=True)  # "devicekit creates it"
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise cannot("create the directory of GPU claims", path, error) from None
    info = os.lstat(path)
    _refuse(path, info, chosen)
    mode = stat.S_IMODE(info.st_mode)
    if not chosen and mode & 0o077:
        try:  # its own directory, made by an older umask or by hand: make it private again
            os.chmod(path, 0o700)
        except OSError as error:
            raise cannot("make private (mode 0700)", path, error) from None
    return path


def claims_path() -> Path:
    """Where `claims_directory` is, without creating or checking it.

    Raises:
        ValueError: ``$DEVICEKIT_CLAIMS_DIR`` is a relative path.
    """
    chosen = os.environ.get(DIR_VAR)
    if chosen:
        return _chosen_path(chosen)
    base = _SHARED_TMP if os.path.isdir(_SHARED_TMP) else tempfile.gettempdir()
    return Path(base) / f"devicekit-{os.getuid()}"


def check_chosen_directory() -> None:
    """Refuse a ``$DEVICEKIT_CLAIMS_DIR`` that `claims_directory` would refuse; creates nothing.

    Every ``claim=True`` call checks the setting, GPU or not: a machine with no
    GPU to claim never reached `claims_directory`, so a relative path,
    ``/dev/null``, a file, a link or a directory others can write to passed on
    a laptop or in CI, and was refused only on the GPU node. What does not exist
    yet is not checked (`claims_directory` creates it): a path that exists only
    on the GPU nodes (``/scratch/...``) is not an error elsewhere. Unset or empty:
    the default directory, devicekit's own, which it makes private itself.

    Raises:
        ValueError: It is a relative path.
        PermissionError: It exists but is not a directory of this user's, or
            others can write to it (as `claims_directory` says).
        NotADirectoryError: It lies under a file (``/etc/passwd/claims``),
            where no directory can be made.
    """
    chosen = os.environ.get(DIR_VAR)
    if not chosen:
        return
    path = _chosen_path(chosen)
    try:
        info = os.lstat(path)
    except NotADirectoryError as error:  # under a file (/etc/passwd/sub): never made anywhere
        raise cannot("create the directory of GPU claims", path, error) from None
    except OSError:  # not there (to be created), or not to be looked at: claims_directory says
        return
    _refuse(path, info, chosen)


def _chosen_path(chosen: str) -> Path:
    """``$DEVICEKIT_CLAIMS_DIR``'s path, ``~`` expanded; a `ValueError` if it is relative."""
    expanded = os.path.expanduser(chosen)  # as a shell would have: "~/claims"
    if not os.path.isabs(expanded):
        raise ValueError(
            f"{DIR_VAR}={chosen!r} is a relative path, which names a different directory "
            "for each job's working directory; give an absolute path"
        )
    return Path(expanded)


def _refuse(path: Path, info: os.stat_result, chosen: str | None) -> None:
    """Raise `PermissionError` unless ``path`` (``info``, its ``lstat``) may hold claims.

    ``chosen``: ``$DEVICEKIT_CLAIMS_DIR`` as set, or None for the default directory.
    """
    why = refusal(path, info, chosen)
    if why is not None:
        raise PermissionError(errno.EACCES, why)


def refusal(path: Path, info: os.stat_result, chosen: str | None) -> str | None:
    """Why ``path`` (``info``, its ``lstat``) may not hold claims, with the fix; None if it may.

    What `claims_directory` refuses, told without raising (``devicekit claims``
    says it). ``chosen``: ``$DEVICEKIT_CLAIMS_DIR`` as set, or None for the default.
    """
    # In a shared temp directory another user could have made this name first:
    # then their files would decide our claims, so refuse instead.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        # A device, pipe or socket the user named (DEVICEKIT_CLAIMS_DIR=/dev/null) is not
        # theirs to remove: only a file, a link or a directory is.
        plain = any(test(info.st_mode) for test in (stat.S_ISREG, stat.S_ISLNK, stat.S_ISDIR))
        own = f"set {DIR_VAR} to a directory of your own"
        if not plain and chosen:
            fix = own
        elif _removable(path, info):
            fix = f"remove it, or {own}"
        else:  # another user's, in a sticky /tmp: only they or root may remove it
            fix = f"{own} (or ask its owner or root to remove it)"
        return (
            f"{path} should be a directory of GPU claims owned by this user (uid "
            f"{os.getuid()}), but it is {_describe(info)}; {fix}"
        )
    mode = stat.S_IMODE(info.st_mode)
    if chosen and mode & 0o022:
        # Not changed: it is the user's (their home, a project folder). Others could plant
        # links there where the lock files go, so it is refused instead.
        return (
            f"{DIR_VAR}={chosen!r} is writable by other users (mode {mode:o}), who could "
            "plant files or links where the lock files go; devicekit does not change a "
            f"directory you chose. Set {DIR_VAR} to a directory only you can write, such as "
            f"{os.path.join(path, 'devicekit-claims')!r} (devicekit creates it, private)"
        )
    return None


def _removable(path: Path, info: os.stat_result) -> bool:
    """Whether this user may remove ``path`` (``info``, its ``lstat``) from its directory."""
    if os.geteuid() == 0:
        return True
    try:
        parent = os.stat(path.parent)
    except OSError:
        return False
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return False
    # In a sticky directory (/tmp) only the owner of an entry, or of the directory, may remove it.
    uid = os.geteuid()
    return not parent.st_mode & stat.S_ISVTX or uid in (info.st_uid, parent.st_uid)


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


def cannot(action: str, path: Path, error: OSError) -> OSError:
    """``error`` retold: what claim=True was doing, where, and what to do (same errno, so class)."""
    why = error.strerror or str(error)
    fix = _FIX
    if error.errno in (errno.EACCES, errno.EPERM):
        # A directory of the user's own that they made read-only: "a directory of your own"
        # alone read as if it were someone else's.
        directory = path if action.startswith("make private") else path.parent
        mode = _read_only_own(directory)
        if mode is not None:
            why = f"{why}: {directory}, this user's own, is not writable (mode {mode:o})"
            fix = f"make it writable (chmod u+w {directory}), or {_FIX}"
    return OSError(error.errno, f"claim=True cannot {action} {path}: {why}; {fix}")


def _read_only_own(directory: Path) -> int | None:
    """The mode of ``directory`` where it is this user's own and they cannot write it; else None."""
    try:
        info = os.stat(directory)
    except OSError:
        return None
    own = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    if own and not os.access(directory, os.W_OK | os.X_OK):
        return stat.S_IMODE(info.st_mode)
    return None


def open_lock_file(path: Path) -> int:
    """Open (creating if needed) the lock file at ``path``: a regular file of this user's.

    Never through a link, nor a FIFO, device or directory in its place: claims write the
    holder's pid into the file, which must not land in a file that a link points to.

    Raises:
        PermissionError: Something else is at ``path``; the message names it: remove it.
        OSError: It cannot be made (a full or read-only disk), as `cannot` tells.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK  # no wait on a FIFO
    try:
        fd = os.open(path, flags, 0o600)  # closed by exec (Python's default)
    except OSError as error:
        try:
            info = os.lstat(path)
        except OSError:
            info = None
        if info is None or stat.S_ISREG(info.st_mode):
            raise cannot("open the lock file", path, error) from None
        raise _not_a_lock_file(path, info) from None
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise _not_a_lock_file(path, info)
    return fd


def _not_a_lock_file(path: Path, info: os.stat_result) -> PermissionError:
    return PermissionError(
        errno.EACCES,
        f"claim=True cannot use {path} as a GPU's lock file: it should be a regular file "
        f"owned by this user (uid {os.getuid()}), but it is {_describe(info)}; remove it "
        "(claim=True makes it again)",
    )


def lock_file(uuid: str) -> Path:
    return claims_directory() / (lock_name(uuid) + ".lock")


def lock_name(uuid: str) -> str:
    """A GPU's UUID as its lock file is named, without ``.lock``."""
    # Old drivers name MIG instances "MIG-GPU-<uuid>/<gi>/<ci>": no slashes in a file name.
    return re.sub(r"[^A-Za-z0-9._-]", "_", uuid)


def share_lock(directory_fd: int) -> None:
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


PROC_LOCKS = "/proc/locks"


def holder(uuid: str) -> int | None:
    """The process id that holds the claim on this GPU; None if unknown.

    The kernel's lock table says, where there is one (Linux): the pid the
    lock file holds is only what the holder wrote, and a holder that could
    not write it (a full disk) leaves the pid of an earlier holder there,
    which may since belong to an unrelated process. Without the table
    (macOS; btrfs, whose device numbers there differ from ``stat``'s) that
    pid is all there is: named only while a process of that pid exists.
    """
    path = lock_file(uuid)
    listed, pid = locked_by(path)
    if listed:
        return pid
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    pid = int(text) if text.isascii() and text.isdigit() else 0
    # 0 would ask os.kill about this process group; this process holds no claim here
    # (is_held() said so before holder() was asked); one that has exited held nothing since.
    return pid if 0 < pid < _PID_LIMIT and pid != os.getpid() and _exists(pid) else None


# No system gives out pids this large (Linux's pid_max is at most 2**22): a number past
# it is no pid, and os.kill would raise OverflowError on it, not an OSError.
_PID_LIMIT = 2**31


def _exists(pid: int) -> bool:
    """Whether a live process ``pid`` exists (perhaps another user's), as far as we can tell.

    Signals tell whether the pid is in use; where ``/proc`` shows it, a zombie
    (exited, not yet reaped by its parent) holds no lock any more.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, and is another user's
        pass
    stat = read_stat(pid)
    return stat is None or not stat[1] or stat[1][0] != b"Z"


def locked_by(path: Path) -> tuple[bool, int | None]:
    """Whether the kernel's lock table lists ``path`` as claimed, and by which pid (`holder`)."""
    try:
        return _kernel_holder(os.stat(path))
    except OSError:  # gone, or not ours to look at
        return False, None


def _kernel_holder(info: os.stat_result) -> tuple[bool, int | None]:
    """Whether ``/proc/locks`` lists an exclusive ``flock`` on this file, and by which pid.

    The pid is None where the holder lives in another pid namespace (the
    kernel writes 0 or less for it then). Not listed: no lock table, or a
    file system whose device number there differs from ``stat``'s (btrfs).
    """
    try:
        with open(PROC_LOCKS, encoding="ascii") as table:
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
