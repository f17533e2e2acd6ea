"""The CSV file sink of [`LogBuffer`][devicekit.LogBuffer]: `CSVSink`.

Called once per flush with the new records, so it costs no sync per step. It
appends whole rows only, and widens its header by writing a new file beside
the old one and replacing it (the sinks for TensorBoard and a progress bar are
in `_sinkadapters`).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import os
import stat
import uuid
from pathlib import Path
from typing import TypeVar

from ._errors import add_note
from ._format import shorten
from ._keywords import suggest_keywords
from ._logdeliver import Record
from ._options import check_flag, check_path, short_repr
from ._procfs import file_system_type

__all__ = ["CSVSink"]

_S = TypeVar("_S")

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


class CSVSink:
    """Append records to a CSV file, one row per record, one column per key.

    A record is one ``log()`` call, so two calls at one step give two rows,
    each with the other's cells empty: log a step's values in one call to get
    one row. The header is the keys in order of first appearance. When a later
    flush brings a new key, the file is written again with the wider header
    (earlier rows get an empty cell), so no value is dropped. Keys are written
    as given (quoted where they hold a comma, a quote or a line break), the
    file is UTF-8, and NaN and inf are written as ``nan``, ``inf`` and ``-inf``.

    A failed write never destroys rows already on disk. A wider header is
    written to a new file beside the old one, which then replaces it in one
    step (``os.replace``); an append that fails (a full disk) is cut back to
    where it began. The records it could not write are kept and written first
    at the next flush. A file that disappears while the run goes on (a log
    rotation) is started again with the header. An error writing the file
    may surface at a ``log()`` call far from where the sink was made, so its
    message names the sink, the file (not the temporary file written beside
    it) and the fix; it keeps its type and ``errno`` (``except OSError``
    still catches it).

    Args:
        path: The file (a ``str`` or ``os.PathLike``), created on the first
            flush; a leading ``~`` is your home folder, as in a shell. Its
            folder is created when the sink is made, so a path no file can be
            written to (a folder, a typo, no permission) is refused at once,
            not at the first flush.
        append: What to do with a file already at ``path``: False (the
            default, as ``open(path, "w")``) replaces it at the first flush;
            True keeps its rows and goes on after them (to resume a run), its
            header widened if the new records bring new keys. A file whose
            first line is no header (blank, a column with no name or one
            named twice, numbers only: a row of data) is refused with a
            ``ValueError`` at the first flush, never replaced.

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (a ``bytes``
            path included: pass ``os.fsdecode(path)``).
        ValueError: ``path`` is empty, holds a NUL character, ends with a
            separator or ``.`` (a folder), or names something that is not a
            regular file (``/dev/null``).
        IsADirectoryError: ``path`` is a folder that exists.
        OSError: The folder of ``path`` cannot be created (the error
            ``mkdir`` raised, such as ``FileNotFoundError`` or
            ``FileExistsError``, with a message naming ``path``), is not
            writable (``PermissionError``), or is on a file system mounted
            read-only (``errno.EROFS``).

    Examples:
        >>> import pathlib, tempfile, devicekit as dk
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "log.csv"
        >>> with dk.LogBuffer(sinks=[dk.CSVSink(path)]) as logs:
        ...     logs.log(0, loss=0.5)
        >>> path.read_text().splitlines()
        ['step,loss', '0,0.5']
        >>> dk.CSVSink("logs/")
        Traceback (most recent call last):
        ...
        ValueError: CSVSink(path='logs/'): expected the path of a CSV file, got a folder (it \
ends with '/'). Pass a file in it, such as 'logs/train.csv'
    """

    @suggest_keywords
    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        check_flag(append, name="append")  # first: a refused sink makes no folder
        self.path = _file_path(path)
        # Where it was when the sink was made (as logging.FileHandler does): a chdir()
        # later must not move the file, away from the folder made here.
        self._file = self.path.absolute()
        self.append = append
        self.columns: list[str] = []
        self._started = False  # the file at path is this sink's, with self.columns as header
        self._newline_first = False  # appending to a file whose last line has no line end
        self._line_end = "\r\n"  # the csv module's; a file appended to keeps its own
        self._unwritten: list[Record] = []  # what a failed write left out, written first next time

    def __repr__(self) -> str:
        append = ", append=True" if self.append else ""
        return f"CSVSink({str(self.path)!r}{append})"

    def __call__(self, records: list[Record]) -> None:
        """Write ``records`` (called by the buffer at each flush)."""
        rows = [*self._unwritten, *records]
        if not self._started and self.append:
            try:
                self.columns, self._newline_first, self._line_end = _existing(self._file)
            except OSError as error:
                self._unwritten = rows
                raise self._write_error(error, rows, doing="read") from None
            except BaseException:
                self._unwritten = rows
                raise
            self._started = bool(self.columns)
        new = [
            key for key in dict.fromkeys(k for row in rows for k in row) if key not in self.columns
        ]
        columns = [*self.columns, *new]
        closing = None
        try:
            if self._started and not new:
                closing = self._append(columns, rows)
            else:
                self._replace(columns, rows)
        except OSError as error:
            self._unwritten = rows
            raise self._write_error(error, rows) from None
        except BaseException:
            self._unwritten = rows
            raise
        self._unwritten = []
        self._newline_first = False
        self.columns = columns
        self._started = True
        if closing is not None:
            raise self._close_error(closing, rows)

    def _close_error(self, error: OSError, rows: list[Record]) -> OSError:
        """A close that failed once ``rows`` were written: said so, and not written again."""
        why = error.strerror or str(error)
        raised = type(error)(
            f"{self!r} wrote {len(rows)} records to {str(self._file)!r}, but closing it "
            f"failed: {why}. Some may not have reached the disk (a network file system "
            "reports late write errors so); they are not written again, which would put "
            f"them there twice (they are in the buffer's history). "
            f"{_write_fix(error.errno, self._file.parent)}"
        )
        raised.errno = error.errno
        return raised

    def _write_error(self, error: OSError, rows: list[Record], doing: str = "write") -> OSError:
        """``error`` told as this sink's: the user's path, what went wrong and the fix.

        It may surface at a ``log()`` far from where the sink was made, and the
        file ``os.open`` names is often the temporary one written beside the
        CSV (``.train.csv.42b0d82b0920.tmp``), which the user never named. The
        same type and ``errno``, so ``except FileNotFoundError`` still catches
        it; and the same message at each failure (no temporary name in it), so
        a flush that fails on several batches tells it once, with a count.
        """
        kept = f"its {len(rows)} unwritten records are kept and written first at its next call"
        if type(error).__module__ != "builtins":  # a subclass of unknown signature: as it is
            add_note(error, f"raised by {self!r} writing {str(self._file)!r}; {kept}")
            return error
        why = error.strerror or str(error)  # OSError("disk full") has no strerror
        raised = type(error)(
            f"{self!r} could not {doing} {str(self._file)!r}: {why}. "
            f"{_write_fix(error.errno, self._file.parent)}"
        )
        raised.errno = error.errno  # its message stays as written
        add_note(raised, f"{self!r}: {kept}")
        return raised

    def _append(self, columns: list[str], rows: list[Record]) -> OSError | None:
        """Append ``rows``; the error closing the file raised once they were written, if any.

        A network file system may report a late write error at ``close``: the
        rows are in the file by then, as far as this process can tell, so they
        are not kept to be written again (they would be there twice).
        """
        descriptor = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(descriptor).st_size
            # A file rotated away (empty now) gets a new header.
            data = _render(columns, rows, header=not size, line_end=self._line_end)
            if self._newline_first and size:
                data = self._line_end.encode() + data
            try:
                _write_all(descriptor, data)
            except BaseException:
                os.ftruncate(descriptor, size)  # no half-written row is left behind
                raise
        except BaseException:
            with contextlib.suppress(OSError):  # the write's own error is the one to tell
                os.close(descriptor)
            raise
        try:
            os.close(descriptor)
        except OSError as error:
            return error
        return None

    def _replace(self, columns: list[str], rows: list[Record]) -> None:
        """Write the whole file (old rows widened, then ``rows``) beside it, then swap it in."""
        text = io.StringIO()
        writer = csv.writer(text, lineterminator=self._line_end)
        writer.writerow(columns)
        if self._started:  # the rows on disk, each with an empty cell per new column
            padding = [""] * (len(columns) - len(self.columns))
            try:
                with self._file.open(newline="", encoding="utf-8") as old:
                    writer.writerows([*row, *padding] for row in list(csv.reader(old))[1:])
            except FileNotFoundError:  # rotated away: nothing of it to keep here
                pass
        data = _utf8(text.getvalue()) + _render(
            columns, rows, header=False, line_end=self._line_end
        )
        # A link is kept, and the file it points to replaced: os.replace would swap the link.
        target = Path(os.path.realpath(self._file))
        target.parent.mkdir(parents=True, exist_ok=True)
        # Beside it, on the same file system; the name cut short so that a long one still fits.
        temporary = target.with_name(f".{target.name[:40]}.{uuid.uuid4().hex[:12]}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            try:
                _write_all(descriptor, data)
                os.fsync(descriptor)  # on disk before it takes the old file's name
            finally:
                os.close(descriptor)
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def _file_path(path: object) -> Path:
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
    if mode is not None and not stat.S_ISREG(mode):  # os.replace would replace /dev/null itself
        raise ValueError(
            f"{expected} a special file (a device or a pipe), which a flush would "
            "replace. Pass the path of a regular file; to write no CSV, leave the sink out"
        )
    _make_folder(file.parent, given)
    return file


def _write_fix(number: int | None, folder: Path) -> str:
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
        raised = type(error)(
            f"CSVSink(path={given!r}): its folder {str(folder)!r} {why}. Pass a path in a folder "
            "you can write to, or create the folder first"
        )
        raised.errno = error.errno
        raise raised from None
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


def _existing(path: Path) -> tuple[list[str], bool, str]:
    """The header of the CSV file at ``path`` (none without one), and how to go on after it.

    Also whether its last line lacks a line end (the first appended row then
    starts with one), and the line end it uses: a bare line feed, or the csv
    module's carriage return and line feed.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False, "\r\n"
    try:  # utf-8-sig: a file saved by Excel starts with a byte-order mark, not part of the header
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"CSVSink(append=True) cannot go on after {str(path)!r}: it is not UTF-8 text "
            f"({error.reason} at byte {error.start}), and the sink writes UTF-8. Save it as "
            "UTF-8 or move it, or pass append=False to replace it"
        ) from None
    header = next(csv.reader(io.StringIO(text, newline="")), [])
    problem = _not_a_header(header) if data else None
    if problem is not None:
        first = text.splitlines()[0] if text else ""
        raise ValueError(
            f"CSVSink(append=True) cannot go on after {str(path)!r}: its first line is not a "
            f"CSV header ({problem}): {shorten(first, 60)!r}. Expected the names of its "
            "columns, such as 'step,loss'. Pass another path, fix the file, or pass "
            "append=False to start it over"
        )
    end = data.find(b"\n")
    line_end = "\n" if end >= 0 and data[end - 1 : end] != b"\r" else "\r\n"
    return header, bool(data) and not data.endswith((b"\n", b"\r")), line_end


def _not_a_header(header: list[str]) -> str | None:
    """Why a first line cannot be a header (a row of data, a blank line), or None.

    Only what no header is: an empty name, a name given twice, or numbers
    alone, as a row of data is. A row of text (``train,0.5``) cannot be told
    from a header, and is taken as one.
    """
    if not any(header):
        return "it is empty"
    empty = next((index for index, name in enumerate(header, 1) if not name), None)
    if empty is not None:  # log() refuses the key "": no file of this sink's has one
        return f"column {empty} has no name"
    seen: set[str] = set()
    for name in header:
        if name in seen:
            return f"it names {shorten(repr(name), 40)} twice"
        seen.add(name)
    if all(_is_number(name) for name in header):
        return "it holds numbers only, as a row of data does"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _render(columns: list[str], rows: list[Record], *, header: bool, line_end: str) -> bytes:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, restval="", lineterminator=line_end)
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return _utf8(text.getvalue())


def _utf8(text: str) -> bytes:
    # A key with a lone surrogate ("\ud800") cannot be UTF-8: written escaped, so that
    # it cannot make every later flush fail on the same records.
    return text.encode("utf-8", "backslashreplace")


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]
