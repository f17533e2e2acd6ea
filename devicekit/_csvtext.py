"""CSV text for `CSVSink`: the header of a file to go on after, and rows rendered.

A key may hold a comma, a quote or a line break: the header is read as
``csv.reader`` reads a record (its line end is the one that ends it), and a
cell that holds a line end of either kind is quoted, so any reader reads it back.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

from ._format import shorten
from ._logdeliver import Record

__all__ = ["csv_text", "existing", "render", "utf8"]


def existing(path: Path, keys: Collection[str] = ()) -> tuple[list[str], bool, str]:
    """The header of the CSV file at ``path`` (none without one), and how to go on after it.

    ``keys``: those of the records to write after it, which tell a file of another
    format (``step;loss``, ``step, loss``) from one this sink wrote with such keys.

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
    # The lines of the header record, as csv.reader takes them (a quoted key may hold
    # line breaks): the line end of the file is the one that ends the record.
    lines: list[str] = []
    header = next(csv.reader(_kept(io.StringIO(text, newline=""), lines)), [])
    problem = _not_a_header(header, keys) if data else None
    if problem is not None:
        first = text.splitlines()[0] if text else ""
        raise ValueError(
            f"CSVSink(append=True) cannot go on after {str(path)!r}: its first line is not a "
            f"CSV header ({problem}): {shorten(first, 60)!r}. Expected the names of its "
            "columns, such as 'step,loss'. Pass another path, fix the file, or pass "
            "append=False to start it over"
        )
    last = lines[-1] if lines else ""
    line_end = "\n" if last.endswith("\n") and not last.endswith("\r\n") else "\r\n"
    return header, bool(data) and not data.endswith((b"\n", b"\r")), line_end


def _kept(lines: Iterable[str], into: list[str]) -> Iterator[str]:
    """``lines``, each also put ``into`` the list as it is taken."""
    for line in lines:
        into.append(line)
        yield line


def _not_a_header(header: list[str], keys: Collection[str]) -> str | None:
    """Why a first line cannot be a header (a row of data, a blank line), or None.

    Only what no header is: an empty name, a name given twice, or numbers
    alone, as a row of data is; one column that holds the record ``keys``
    joined by another delimiter (``step;loss``); names the record ``keys`` are
    with a space before them (``step, loss``), which would give a key a second
    column. A file this sink wrote with such keys (``' loss'``, ``'a;b'``) is
    a header all the same. A row of text (``train,0.5``) cannot be told from
    a header, and is taken as one.
    """
    if not any(header):
        return "it is empty"
    empty = next((index for index, name in enumerate(header, 1) if not name), None)
    if empty is not None:  # log() refuses the key "": no file of this sink's has one
        pandas = " (pandas writes its index there: to_csv(path, index=False))" if empty == 1 else ""
        return f"column {empty} has no name{pandas}"
    seen: set[str] = set()
    for name in header:
        if name in seen:
            return f"it names {shorten(repr(name), 40)} twice"
        seen.add(name)
    if all(_is_number(name) for name in header):
        return "it holds numbers only, as a row of data does"
    mark = next((mark for mark in _OTHER_DELIMITERS if mark in header[0]), None)
    if len(header) == 1 and mark and any(key in header[0].split(mark) for key in keys):
        return (
            f"it is one column holding {mark!r}, as a file with another delimiter is: this "
            "sink writes commas, so each old row would sit in one cell"
        )
    spaced = [name for name in header if name[:1].isspace() and name not in keys]
    twice = next((name for name in spaced if name.strip() in keys), None)
    if twice is not None:
        return (
            f"its names start with a space, as ', ' between names makes them "
            f"({shorten(repr(twice), 20)}): the key {shorten(repr(twice.strip()), 20)} would "
            "get a second column"
        )
    return None


_OTHER_DELIMITERS = (";", "\t", "|")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def render(columns: list[str], rows: list[Record], *, header: bool, line_end: str) -> bytes:
    table: list[Any] = [dict(zip(columns, columns, strict=True))] if header else []
    table += rows
    return utf8(csv_text(table, line_end, columns=columns))


def csv_text(rows: Iterable[Any], line_end: str, *, columns: list[str] | None = None) -> str:
    r"""``rows`` (lists, or records with ``columns``) as CSV text, each ended with ``line_end``.

    The csv module quotes a cell only for the characters of its own line end:
    with ``"\n"`` it writes a lone ``"\r"`` unquoted, which no reader can read
    back. So every cell is quoted as for ``"\r\n"``, which quotes both, and
    only the line end of each row is then written as the file has it.
    """
    text = io.StringIO()
    writer: Any = (
        csv.writer(text, lineterminator="\r\n")
        if columns is None
        else csv.DictWriter(text, fieldnames=columns, restval="", lineterminator="\r\n")
    )
    if line_end == "\r\n":
        writer.writerows(rows)
        return text.getvalue()
    lines = []
    for row in rows:  # one at a time, so that each row's own end is known
        text.seek(0)
        text.truncate()
        writer.writerow(row)
        lines.append(text.getvalue()[:-2])
    return "".join(line + line_end for line in lines)


def utf8(text: str) -> bytes:
    # A key with a lone surrogate ("\ud800") cannot be UTF-8: written escaped, so that
    # it cannot make every later flush fail on the same records.
    return text.encode("utf-8", "backslashreplace")
