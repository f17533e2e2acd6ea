"""Where a `CSVSink` may write: its path checked and its folder made, or refused now.

A path no CSV file can take is refused when the sink is made, with the fix,
not at its first flush inside a ``log()`` call far away: a folder, a special
file, a folder that cannot be made, one on the kernel's own file systems, a
read-only one; and a write that fails later is explained (`write_fix`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from ._errors import retold
from ._options import check_path
from ._procfs import file_system_type
from ._shortrepr import short_repr

__all__ = ["file_path", "keep_mode", "write_fix"]

# Where no regular file can be created, whatever the folder's permissions say.
_KERNEL_FILE_SYSTEMS = frozenset(
    [
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "configfs",
        "devpts",
        "bpf",
        "pstore",
        "efivarfs",
        "fusectl",
        "binfmt_misc",
        "mqueue",
    ]
)


def file_path(path: object) -> Path:
    """The file a `CSVSink` writes, its folder made: refused now if no CSV file can go there.

    Each refusal names the path as given, what was expected, and the fix:
    otherwise it would surface at the first flush, as a raw error from
    ``os.replace`` at a ``log()`` call far away (and ``"logs/"`` would have
    become a file named ``logs``, ``"/tmp"`` a temporary file in ``/``).
    """
    given = os.fspath(path) if isinstance(path, os.PathLike) else path  # as written, for messages
    if isinstance(given, bytes):  # open() takes bytes; Path, and so this sink, does not
        raise TypeError(
            f"CSVSink(path={short_repr(path)}): expected a str or os.PathLike path, got bytes. "
            "Pass "
            "os.fsdecode(path)"
        )
    if not isinstance(given, str):
        check_path(path, name="path", fix="pass where the CSV file goes, such as 'log.csv'")
        raise TypeError(f"path must be a str, got {given!r}")  # never: check_path refused it
    expected = f"CSVSink(path={given!r}): expected the path of a CSV file, got"
    if not given:
        raise ValueError(f"{expected} an empty string. Pass one such as 'logs/train.csv'")
    if "\0" in given:
        raise ValueError(f"{expected} one with a NUL character, which no file name can hold")
    expanded = os.path.expanduser(given)  # "~/runs/a.csv", not a folder named "~" here
    variables = _variables_named(expanded)
    if variables:
        name = variables[0]
        here = os.path.expandvars(expanded)
        where = f"it is {here!r} here" if name in os.environ else f"${name} is not set here"
        raise ValueError(
            f"{expected} one that names an environment variable (${name}), which CSVSink "
            f"does not expand, as open() does not: it would name a folder or file after it. "
            f"Pass os.path.expandvars(path) ({where})"
        )
    in_it = f"Pass a file in it, such as {os.path.join(os.path.normpath(given), 'train.csv')!r}"
    file = Path(expanded)
    try:
        mode: int | None = file.stat().st_mode
    except (OSError, ValueError):  # not there yet (nearly always), or its folder unreadable
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        error = IsADirectoryError(f"{expected} a folder that exists. {in_it}")
        error.errno = errno.EISDIR  # its message stays as written
        raise error
    if os.path.basename(expanded) in ("", ".", ".."):  # Path("logs/") would be a file "logs"
        ending = "/" if given.endswith(("/", os.sep)) else os.path.basename(given)
        raise ValueError(f"{expected} a folder (it ends with {ending!r}). {in_it}")
    if _through_proc(expanded):  # /dev/stdout: checked before the mode, which is the target's
        raise ValueError(
            f"{expected} a stream of this process (a file descriptor, through /proc): a flush "
            "replaces its file, so with stdout sent to a file (python train.py > out.log) "
            "everything printed before and after would be cut off. Pass the path of a regular "
            "file; to see the records on the terminal, pass print as a sink (sinks=[print])"
        )
    if mode is not None and not stat.S_ISREG(mode):  # os.replace would replace /dev/null itself
        raise ValueError(
            f"{expected} a special file (a device or a pipe), which a flush would "
            "replace. Pass the path of a regular file; to write no CSV, leave the sink out"
        )
    _make_folder(file.parent, given)
    return file


_FILE_DESCRIPTORS = re.compile(r"/proc/[^/]+(/task/[^/]+)?/fd$")  # /dev/fd is /proc/self/fd
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?|%([A-Za-z_][A-Za-z0-9_]*)%")


def _variables_named(path: str) -> list[str]:
    """The environment variables ``path`` names as a shell would expand them (``$SCRATCH``).

    None where a ``$`` is more likely part of a name: no such variable is set,
    and the folder the path names is already there.
    """
    names = [dollar or percent for dollar, percent in _VARIABLE.findall(path)]
    if not names:
        return []
    if not any(name in os.environ for name in names) and os.path.isdir(
        os.path.dirname(os.path.abspath(path))
    ):
        return []
    return names


def _through_proc(path: str) -> bool:
    """Whether ``path`` names a file descriptor, in ``/proc`` (``/dev/stdout``, ``/dev/fd/1``).

    Such a link names a file descriptor of this process: stdout sent to a file
    resolves to that file, a regular one, so its mode does not tell.
    """
    here = os.path.abspath(path)
    for _ in range(40):  # as many links as the kernel follows
        if _FILE_DESCRIPTORS.match(os.path.realpath(os.path.dirname(here))):
            return True
        try:
            target = os.readlink(here)
        except (OSError, ValueError):  # not a link (nearly always): the path is the file
            return False
        here = os.path.normpath(os.path.join(os.path.dirname(here), target))
    return False


def write_fix(number: int | None, folder: Path) -> str:
    """What to do about a write that failed with ``errno`` ``number``, the file in ``folder``."""
    where = str(folder)
    if number in (errno.ENOSPC, errno.EDQUOT):
        return "Free space on that disk, or pass a path on another one"
    if number == errno.ENOENT:  # os.open(O_CREAT) fails so only where no file can be made
        return (
            f"Its folder {where!r} was removed, or holds no files of its own (as /proc and "
            "/sys do): create the folder again, or pass a path in a folder you can write to"
        )
    if number == errno.EROFS:
        return f"Its folder {where!r} is read-only: pass a path in a folder you can write to"
    if number in (errno.EACCES, errno.EPERM):
        return f"Make {where!r} writable, or pass a path in a folder you can write to"
    return "Pass a path in a folder you can write to, on a disk with room"


def _make_folder(folder: Path, given: str) -> None:
    """Create ``folder`` now, so a folder that cannot be made is refused here, not at a log()."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        # The folder, or one above it, may be a file: name the one in the way.
        blocker = next((p for p in (folder, *folder.parents) if p.is_file()), None)
        if blocker == folder:
            why = "is a file, not a folder"
        elif blocker is not None:
            why = f"cannot be created: {str(blocker)!r} is a file, not a folder"
        else:
            why = f"does not exist and cannot be created ({error.strerror or error})"
        raise retold(
            error,
            f"CSVSink(path={given!r}): its folder {str(folder)!r} {why}. Pass a path in a folder "
            "you can write to, or create the folder first",
        ) from None
    # The kernel's own file systems look writable to root, yet no file can be made there:
    # the first flush, in a log() call, would fail (ENOENT).
    kind = file_system_type(str(folder))
    if kind in _KERNEL_FILE_SYSTEMS:
        raised = OSError(
            f"CSVSink(path={given!r}): its folder {str(folder)!r} is on the kernel's {kind} "
            "file system, which holds no files of its own. Pass a path in a folder you can "
            "write to"
        )
        raised.errno = errno.ENOENT
        raise raised
    # Then: os.access says a read-only file system is not writable (to root too), and
    # the folder's permissions are not what to fix there (a container's /sys).
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows): unknown, so not refused
        read_only = False
    if read_only:
        raised = OSError(
            f"CSVSink(path={given!r}): its folder {str(folder)!r} is on a file system mounted "
            "read-only, where no file can be written. Pass a path in a folder you can write to"
        )
        raised.errno = errno.EROFS
        raise raised
    # The file, and a wider one beside it at each new key, are created in the folder.
    if not os.access(folder, os.W_OK | os.X_OK):
        raised = PermissionError(
            f"CSVSink(path={given!r}): its folder {str(folder)!r} is not writable, and the file "
            "is written there (a new one beside it, each time the header widens). Pass a path "
            "in a folder you can write to"
        )
        raised.errno = errno.EACCES
        raise raised


# A file's owner or group this process may not give (not root), or a file system with
# no such thing: the new file keeps what it has, as a file written in place would.
_NOT_KEPT = frozenset([errno.EPERM, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP])


def keep_mode(descriptor: int, target: Path) -> None:
    """Give the file open at ``descriptor`` the permissions of ``target``, which it replaces.

    A wider header is a new file swapped in for the old one, which would get the
    umask's mode (``0o644``): a log made private (``chmod 600``) would become
    readable by all, a group-writable one not writable. The owner and group,
    and the extended attributes (an ACL), are kept where this process may set
    them; a new file (no ``target``) keeps the umask's mode, as
    ``open(path, "w")`` gives it.
    """
    try:
        info = os.stat(target)
    except (OSError, ValueError):  # no file yet (a new one), or unreadable: the umask's mode
        return
    fchown = getattr(os, "fchown", None)  # not on Windows
    if fchown is not None:
        # First: a change of owner may clear the set-id bits. Another user's file: its
        # group alone, which a member of it may give.
        for uid in dict.fromkeys((info.st_uid, -1)):
            try:
                fchown(descriptor, uid, info.st_gid)
                break
            except OSError as error:
                if error.errno not in _NOT_KEPT:
                    raise
    fchmod = getattr(os, "fchmod", None)  # on Windows from 3.13
    if fchmod is not None:
        try:
            fchmod(descriptor, stat.S_IMODE(info.st_mode))
        except OSError as error:
            if error.errno not in _NOT_KEPT:
                raise
    _keep_attributes(descriptor, target)


def _keep_attributes(descriptor: int, target: Path) -> None:
    """Copy ``target``'s extended attributes: its ACL (``system.posix_acl_access``) among them.

    After the mode, which an ACL's mask refines. Linux only (``os.listxattr``);
    each attribute this process may not set (another namespace's, a file
    system without them) is left, as the owner is.
    """
    listxattr = getattr(os, "listxattr", None)
    if listxattr is None:
        return
    try:
        names = listxattr(target)
    except OSError:  # none on this file system, or unreadable: nothing to keep
        return
    for name in names:
        try:
            os.setxattr(descriptor, name, os.getxattr(target, name))
        except OSError as error:
            if error.errno not in _NOT_KEPT and error.errno != errno.EACCES:
                raise
