"""The CSV file sink of [`LogBuffer`][devicekit.LogBuffer]: `CSVSink`.

Called once per flush with the new records, so it costs no sync per step. It
appends whole rows only, and widens its header by writing a new file beside
the old one and replacing it (the sinks for TensorBoard and a progress bar are
in `_sinkadapters`).

One file, one writer. Two sinks on one file would each append under whatever
header is on disk (values under another's columns) and replace the file for
their own header (another's rows lost). So a sink remembers the file as it
left it (device, inode and size, from one ``stat``): before each write it
checks that the file is still that one, grown by no one else, and refuses to
write otherwise; this catches another process too (every DDP rank writing
``metrics.csv``). In this process it refuses even earlier: a second live sink
that would replace the file (``append=False``) is refused when it is made.

One sink object may be shared (a train and an eval buffer given one sink, each
flushed by its own thread): each call holds the sink's own lock throughout, so
two calls never interleave their rows or race to widen the header.
"""

from __future__ import annotations

import codecs
import csv
import io
import os
import stat
import uuid
from pathlib import Path
from typing import Any

from ._callbacks import new_sink_lock, restore_sink, sink_state
from ._csvclaims import by_token, claim, reclaim, unclaim
from ._csvpath import file_path, keep_mode, write_fix
from ._csvtext import csv_text, existing, render, utf8
from ._errors import add_note, retold
from ._format import plural
from ._keywords import suggest_keywords
from ._logdeliver import KEPT_FOR_NEXT_FLUSH, KeepsRecords, Record
from ._options import check_flag

__all__ = ["CSVSink"]


_Identity = tuple[int, int, int]
"""A file as a sink left it: its device, inode and size (None: no file there)."""
_UNKNOWN: _Identity = (-1, -1, -1)  # not known (a stat failed): not checked


class CSVSink(KeepsRecords):
    """Append records to a CSV file, one row per record, one column per key.

    A record is one ``log()`` call, so two calls at one step give two rows,
    each with the other's cells empty: log a step's values in one call to get
    one row. The header is the keys in order of first appearance. When a later
    flush brings a new key, the file is written again with the wider header
    (earlier rows get an empty cell), so no value is dropped. Keys are written
    as given (quoted where they hold a comma, a quote or a line break), the
    file is UTF-8, and NaN and inf are written as ``nan``, ``inf`` and ``-inf``.

    One file has one writer. A second sink on a file that a sink alive in
    this process writes is refused when it is made (``ValueError``), unless
    it is made with ``append=True``, which keeps the first one's rows. Before
    each write a sink checks that the file is still the one it last wrote
    (or found when it was made): one that another writer has grown or
    replaced since (another sink, another process: every DDP rank writing
    the same file) is not written to, and the flush raises a
    ``RuntimeError`` naming the file, what changed and the fix; the records
    are in the buffer's history. One sink object, by contrast, may be given to
    several buffers flushed in several threads: its calls take turns. A copy
    (``copy.deepcopy`` of a trainer that holds it, a pickle loaded in this
    process) is the sink itself, so it is one writer too.

    A failed write never destroys rows already on disk. A wider header is
    written to a new file beside the old one, which then replaces it in one
    step (``os.replace``), with the old file's permissions (a file made private
    with ``chmod 600`` stays so) and, where allowed, its owner and group; an
    append that fails (a full disk) is cut back to where it began. The records
    it could not write are kept and written first at the next flush, even one
    with no new records (``logs.flush()`` once the disk has room, the end of a
    ``with`` block, the flush at exit). Ctrl-C
    during a write writes no row twice and leaves the file the sink's: a write
    that reached the file counts as done (found so at the next flush if Ctrl-C
    landed before the sink could note it). A file that disappears while the run goes on (a log
    rotation) is started again with the header. An error writing the file
    may surface at a ``log()`` call far from where the sink was made, so its
    message names the sink, the file (not the temporary file written beside
    it) and the fix; it keeps its type and ``errno`` (``except OSError``
    still catches it).

    Args:
        path: The file (a ``str`` or ``os.PathLike``), created on the first
            flush; a leading ``~`` is your home folder, as in a shell (an
            environment variable, ``$SCRATCH``, is not expanded, as
            ``open()`` does not: refused, with ``os.path.expandvars``). Its
            folder is created when the sink is made, so a path no file can be
            written to (a folder, a typo, no permission, ``/dev/stdout``) is
            refused at once, not at the first flush.
        append: What to do with a file already at ``path``: False (the
            default, as ``open(path, "w")``) replaces it at the first flush;
            True keeps its rows and goes on after them (to resume a run), its
            header widened if the new records bring new keys. A file whose
            first line is no header (blank, a column with no name or one
            named twice, numbers only: a row of data; another delimiter)
            is refused with a ``ValueError`` at the first flush, never
            replaced.

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (a ``bytes``
            path included: pass ``os.fsdecode(path)``).
        ValueError: ``path`` is empty, holds a NUL character, ends with a
            separator or ``.`` (a folder), or names something that is not a
            regular file (``/dev/null``); or, with ``append=False``, another
            `CSVSink` alive in this process writes that file.
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

    _released = False  # let go by a failed block, claimed again at its next write

    @suggest_keywords
    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        check_flag(append, name="append")  # first: a refused sink makes no folder
        self.path = file_path(path)
        # Where it was when the sink was made (as logging.FileHandler does): a chdir()
        # later must not move the file, away from the folder made here.
        self._file = self.path.absolute()
        self.append = append
        self.columns: list[str] = []
        self._started = False  # the file at path is this sink's, with self.columns as header
        self._newline_first = False  # appending to a file whose last line has no line end
        self._line_end = "\r\n"  # the csv module's; a file appended to keeps its own
        self._unwritten: list[Record] = []  # what a failed write left out, written first next time
        self._took: dict[int, list[Record]] = {}  # see KeepsRecords._take
        self._real = os.path.realpath(self._file)  # one file, however it is named (a link)
        self._known = _identity(self._file)  # the file as this sink expects to find it
        # A write under way: the file as it will be once it is done, and its header.
        self._pending: tuple[_Identity, list[str]] | None = None
        self._wrote = False
        # A lock per sink, not per file: _claim already refuses a second sink that would
        # replace a live one's file, and the check at each write stops two on one file, so
        # what is left to serialize is one sink's calls from several threads (two buffers
        # given one sink).
        self._lock = new_sink_lock()
        self._token = uuid.uuid4().hex  # this sink, wherever a pickle of it goes
        claim(self)

    def __repr__(self) -> str:
        append = ", append=True" if self.append else ""
        return f"CSVSink({str(self.path)!r}{append})"

    def __copy__(self) -> CSVSink:
        """The sink itself: one file, one writer (see `__reduce__`)."""
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> CSVSink:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its state, and unpickled as itself where it is still alive.

        A copy (of a trainer or a config that holds the sink) was a second
        writer of the file: whichever of the two wrote second was refused at
        every later flush, the original's rows lost to its file. In the process
        it came from, the copy is the sink; in another process it is a sink
        of its own, which the check at each write tells from this one.
        """
        return (_unpickled, (self._token, self.__getstate__()))

    def __getstate__(self) -> dict[str, Any]:
        return sink_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """An unpickled sink: the same state, with a lock of its own."""
        restore_sink(self, state)
        self.__dict__.setdefault("_pending", None)  # pickled before it had one
        self.__dict__.setdefault("_token", uuid.uuid4().hex)  # pickled before it had one

    def _kept(self) -> int:
        return len(self._unwritten)

    def _let_go(self) -> None:
        # Until it writes again: a buffer whose block failed may go on (the error
        # caught) or share the sink. If a new sink took the file meanwhile, that write
        # is refused; if not, it claims the file again. Under the lock: not between a
        # write's claim and its mark.
        with self._lock:
            unclaim(self)
            self._released = True

    def _handed_over_error(self, taken: object, rows: list[Record]) -> RuntimeError:
        """The error of a sink let go whose file another sink took meanwhile: it writes no more."""
        return RuntimeError(
            f"{self!r} did not write {str(self._file)!r}: its LogBuffer's with block failed, "
            f"which let go of the file, and {taken!r} was made for it since (a retry), so this "
            f"sink writes it no more: two writers on one file put values under each other's "
            f"columns and lose rows. Its {plural(len(rows), 'record')} "
            f"{'is' if len(rows) == 1 else 'are'} in its LogBuffer's history. Give this "
            "buffer a sink of its own (logs.sinks = [dk.CSVSink('other.csv')]), or let it go "
            "(logs.sinks = [])"
        )

    def __call__(self, records: list[Record]) -> None:
        """Write ``records`` (called by the buffer at each flush)."""
        # Held for the whole call, once per flush (never per log()): the rows kept from
        # a failed write, the header and the file as this sink left it are read and
        # changed together, so two threads never interleave rows or widen it twice.
        with self._lock:
            self._write(records)

    def _write(self, records: list[Record]) -> None:
        # Ctrl-C may land at any line here: the rows are kept until the file holds them,
        # and a write that reached the file is recorded as done (at once, or by _settle
        # at the next call), so no row is written twice and the file is never refused.
        self._settle()
        rows = self._take(records)
        changed = self._changed()
        if changed is not None:  # another writer: writing now would mix or lose rows
            raise self._conflict_error(changed, rows)
        if self._released:  # let go when a block failed, and written to again: claimed
            taken = reclaim(self)
            if taken is not None:
                raise self._handed_over_error(taken, rows)
            self._released = False
        keys = dict.fromkeys(key for row in rows for key in row)  # in order of first use
        if not self._started and self.append:
            try:
                self.columns, self._newline_first, self._line_end = existing(self._file, keys)
            except OSError as error:
                self._known = _UNKNOWN  # to be fixed: read it again
                raise self._write_error(error, rows, doing="read") from None
            except BaseException:
                self._known = _UNKNOWN
                raise
            self._started = bool(self.columns)
        new = [key for key in keys if key not in self.columns]
        columns = [*self.columns, *new]
        closing = None
        try:
            if self._started and not new:
                closing = self._append(columns, rows)
            else:
                self._replace(columns, rows)
        except _NameTaken:  # another writer made the file as this one wrote it
            changed = "since this sink last wrote it" if self._wrote else "as this sink wrote it"
            raise self._conflict_error(f"{changed} (another writer made it)", rows) from None
        except OSError as error:
            raise self._write_error(error, rows) from None
        if closing is not None:  # the rows are written (and not kept): only the close failed
            raise self._close_error(closing, rows)

    def _settle(self) -> None:
        """Record a write that Ctrl-C cut short once it had reached the file, or drop it.

        `_pending` is set just before the file changes (an append, a replace), with
        the file as it will be after: found so, the write happened and its rows are
        not written again; found otherwise, it did not, and they are still kept.
        """
        pending = self._pending
        if pending is not None:
            if _identity(self._file) == pending[0]:
                self._commit(*pending)
            self._pending = None

    def _commit(self, written: _Identity, columns: list[str]) -> None:
        """The rows kept are in the file, which is now ``written``, with ``columns`` as header.

        Called as soon as the write (or the replace) returns. Ctrl-C between two of
        these lines leaves `_pending` set, and `_settle` runs this again: every line
        sets a value, so running it twice changes nothing.
        """
        self._known = written  # what the next write expects
        self.columns = columns
        self._unwritten = []
        self._newline_first = False
        self._started = self._wrote = True
        self._pending = None

    def _changed(self) -> str | None:
        """How another writer changed the file since this sink last wrote it (or was made).

        None while it is this sink's: as it left it, gone, or emptied (a log
        rotation: the sink starts it again with its header). One ``stat``.
        """
        now = _identity(self._file)
        known = self._known
        # Unreadable now (its folder replaced by a file, no permission): no other writer
        # known, so the write goes on and fails with the real error, not a rival's.
        if now is None or now[2] == 0 or _UNKNOWN in (now, known) or known == now:
            return None
        since = "since this sink last wrote it" if self._wrote else "since this sink was made"
        if known is None:
            what = f"there was no file, and now one holds {now[2]} bytes"
        elif now[:2] != known[:2]:
            what = f"it was replaced by another file, of {now[2]} bytes"
            if self._wrote:
                what += ", which may not hold the rows this sink wrote before"
        else:
            what = f"it went from {known[2]} to {now[2]} bytes"
        return f"{since} ({what})"

    def _conflict_error(self, changed: str, rows: list[Record]) -> RuntimeError:
        """The error for a file another writer changed: what changed, and one file per writer."""
        name = Path(self._file.name)
        per_rank = f"{name.stem}.rank{{rank}}{name.suffix or '.csv'}"
        return RuntimeError(
            f"{self!r} did not write {str(self._file)!r}: the file changed {changed}, so "
            "something else writes it too: another CSVSink, in this process or another (every "
            "DDP rank writing the same file is a common slip), or another program. Two writers "
            "on one file put values under the wrong columns and lose rows, so this sink wrote "
            f"none of its {plural(len(rows), 'record')} (they are in its LogBuffer's history). "
            "Give each writer its own file: one per rank "
            f"(dk.CSVSink(f{per_rank!r}) with rank = torch.distributed.get_rank()), or a "
            "CSVSink on rank 0 only (with reduce='mean' every rank records the same values); "
            "one per LogBuffer ('train.csv', 'eval.csv'), or one CSVSink object given to both"
        )

    def _close_error(self, error: OSError, rows: list[Record]) -> OSError:
        """A close that failed once ``rows`` were written: said so, and not written again."""
        why = error.strerror or str(error)
        return retold(
            error,
            f"{self!r} wrote {plural(len(rows), 'record')} to {str(self._file)!r}, but closing it "
            f"failed: {why}. Some may not have reached the disk (a network file system "
            "reports late write errors so); they are not written again, which would put "
            f"them there twice (they are in the buffer's history). "
            f"{write_fix(error.errno, self._file.parent)}",
        )

    def _write_error(self, error: OSError, rows: list[Record], doing: str = "write") -> OSError:
        """``error`` told as this sink's: the user's path, what went wrong and the fix.

        It may surface at a ``log()`` far from where the sink was made, and the
        file ``os.open`` names is often the temporary one written beside the
        CSV (``.train.csv.42b0d82b0920.tmp``), which the user never named. The
        same type and ``errno``, so ``except FileNotFoundError`` still catches
        it; and the same message at each failure (no temporary name in it), so
        a flush that fails on several batches tells it once, with a count.
        """
        kept = (
            f"its {plural(len(rows), 'unwritten record')} {'is' if len(rows) == 1 else 'are'} "
            f"{KEPT_FOR_NEXT_FLUSH}"
        )
        if type(error).__module__ != "builtins":  # a subclass of unknown signature: as it is
            add_note(error, f"raised by {self!r} writing {str(self._file)!r}; {kept}")
            return error
        why = error.strerror or str(error)  # OSError("disk full") has no strerror
        raised = retold(
            error,
            f"{self!r} could not {doing} {str(self._file)!r}: {why}. "
            f"{write_fix(error.errno, self._file.parent)}",
        )
        add_note(raised, f"{self!r}: {kept}")
        return raised

    def _append(self, columns: list[str], rows: list[Record]) -> OSError | None:
        """Append ``rows``; the error closing the file raised once they were written, if any.

        A network file system may report a late write error at ``close``: the
        rows are in the file by then, as far as this process can tell, so they
        are not kept to be written again (they would be there twice).
        """
        closing = None
        descriptor = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            info = os.fstat(descriptor)
            size = info.st_size
            # A file rotated away (empty now) gets a new header.
            data = render(columns, rows, header=not size, line_end=self._line_end)
            if self._newline_first and size:
                data = self._line_end.encode() + data
            written = (info.st_dev, info.st_ino, size + len(data))
            self._pending = (written, columns)  # before the file changes: see _settle
            try:
                _write_all(descriptor, data)
            except BaseException:
                os.ftruncate(descriptor, size)  # no half-written row is left behind
                raise
            self._commit(written, columns)
        finally:
            try:
                os.close(descriptor)
            except OSError as error:  # the write's own error, if any, is the one to tell
                closing = error
        return closing

    def _replace(self, columns: list[str], rows: list[Record]) -> None:
        """Write the whole file (old rows widened, then ``rows``) beside it, then swap it in."""
        table = [columns]
        mark = b""  # a byte-order mark (Excel's) stays: Excel reads the file by it
        if self._started:  # the rows on disk, each with an empty cell per new column
            padding = [""] * (len(columns) - len(self.columns))
            try:
                old = self._file.read_bytes()
            except FileNotFoundError:  # rotated away: nothing of it to keep here
                old = b""
            if old.startswith(codecs.BOM_UTF8):
                mark = codecs.BOM_UTF8
            text = io.StringIO(old.decode("utf-8-sig"), newline="")
            table += ([*row, *padding] for row in list(csv.reader(text))[1:])
        data = mark + utf8(csv_text(table, self._line_end))
        data += render(columns, rows, header=False, line_end=self._line_end)
        # A link is kept, and the file it points to replaced: os.replace would swap the link.
        target = Path(os.path.realpath(self._file))
        absent = _identity(target) is None  # then made by a link, which fails if taken since
        target.parent.mkdir(parents=True, exist_ok=True)
        # Beside it, on the same file system; the name cut short so that a long one still fits.
        temporary = target.with_name(f".{target.name[:40]}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            # Inside the try: Ctrl-C as os.open returns (before the name is bound) must
            # still take the new file away; its descriptor closes with the process.
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                # Before any row is in it: a file made private stays so (a new one: umask).
                keep_mode(descriptor, target)
                _write_all(descriptor, data)
                os.fsync(descriptor)  # on disk before it takes the old file's name
                info = os.fstat(descriptor)  # a rename keeps inode and size
            finally:
                os.close(descriptor)
            written = (info.st_dev, info.st_ino, info.st_size)
            self._pending = (written, columns)  # before the file changes: see _settle
            if not (absent and _made_new(temporary, target)):
                os.replace(temporary, target)
            self._commit(written, columns)
        except BaseException:
            temporary.unlink(missing_ok=True)  # gone already once it was swapped in
            raise


class _NameTaken(Exception):
    """Raised by `_made_new`: another writer made the file since this one found none."""


def _made_new(temporary: Path, target: Path) -> bool:
    """Give ``temporary`` the name ``target``, which had no file: whether it did.

    A link, not a rename: ``os.link`` fails where the name was taken since, so of
    two writers that found no file (two ranks' first flush) the second is told,
    where ``os.replace`` replaced the first's rows. Without hard links (FAT): not.
    """
    try:
        os.link(temporary, target)
    except FileExistsError:  # told apart from a folder replaced by a file (mkdir's)
        raise _NameTaken from None
    except OSError:  # no hard links here (EPERM, ENOTSUP...): renamed over, unchecked
        return False
    temporary.unlink()
    return True


def _identity(path: Path) -> _Identity | None:
    """The file at ``path`` as `_Identity`, None if there is none, `_UNKNOWN` if unreadable."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # its folder unreadable now: not known, so not checked
        return _UNKNOWN
    if not stat.S_ISREG(info.st_mode):  # a folder made there: the write names it
        return _UNKNOWN
    return info.st_dev, info.st_ino, info.st_size


def _unpickled(token: str, state: dict[str, Any]) -> CSVSink:
    """The sink ``token`` names, in the process it was pickled in; else a new one."""
    found = by_token(token)
    if isinstance(found, CSVSink):
        return found
    sink = CSVSink.__new__(CSVSink)
    sink.__setstate__(state)
    return sink


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]
