"""What the ``devicekit`` command writes, and what happens when it cannot be written.

Every line goes through ``print_line`` (flushed at once), so a closed pipe, a
full disk or a stdout that Python closed (``devicekit >&-``) surfaces as one
``StdoutError``, raised only for stdout, which ``_cli.main()`` turns into an
exit code. ``escaping_unencodable`` writes what an ASCII stdout or stderr
cannot encode as backslash escapes; ``silence_stdout`` points a stdout that
failed at the null device, so that Python's flush at exit fails no more.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = [
    "StdoutError",
    "complain",
    "escaping_unencodable",
    "flush_stdout",
    "print_json",
    "print_line",
    "show",
    "silence_stdout",
    "stdout",
]


class StdoutError(Exception):
    """Writing to stdout failed (a closed pipe, a full disk); ``main`` tells the user.

    Raised only where we write to stdout (``print_line``, ``flush_stdout`` and argparse's
    ``_print_message``), so an ``OSError`` from anywhere else is never reported as a
    failure of stdout.
    """

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


def stdout() -> TextIO:
    """``sys.stdout``; ``StdoutError`` when it is closed.

    Started with stdout closed (``devicekit >&-``), Python sets ``sys.stdout`` to
    None: ``print()`` then drops every line without a word (the command printed
    nothing and exited 0) and a flush raised AttributeError, a traceback.
    """
    if sys.stdout is None:
        raise StdoutError(OSError(errno.EBADF, "stdout is closed"))
    return sys.stdout


def print_line(text: str = "") -> None:
    """Print ``text`` and a line end to stdout now; a failed write raises ``StdoutError``."""
    try:
        # Flushed here, so a failure surfaces here, not at exit.
        print(text, file=stdout(), flush=True)
    except OSError as error:
        raise StdoutError(error) from error


def print_json(document: Any, *, lines: bool = False) -> None:
    print_line(json.dumps(document, indent=None if lines else 2))


@contextlib.contextmanager
def escaping_unencodable(stream: TextIO | None) -> Iterator[None]:
    """Write what ``stream``'s encoding cannot hold as backslash escapes, during the block.

    Our output holds µ and ± (and whatever a GPU or a process is named): on an ASCII
    stream (``LC_ALL=C``, ``PYTHONIOENCODING=ascii``) it raised UnicodeEncodeError. A
    UTF encoding holds every character, and a stream without ``reconfigure`` (a
    caller's StringIO) cannot be changed: both are left as they are. The stream's own
    error handler is put back on return, for callers of main() in their own process.
    """
    if not isinstance(stream, io.TextIOWrapper) or _is_unicode(stream.encoding):
        yield
        return
    errors = stream.errors
    stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        # reconfigure() flushes first: a stream that failed is left as it is.
        with contextlib.suppress(OSError, ValueError):
            stream.reconfigure(errors=errors)


def _is_unicode(encoding: str) -> bool:
    try:
        return codecs.lookup(encoding).name.startswith("utf")
    except LookupError:  # pragma: no cover - a stream cannot be opened with one
        return False


def flush_stdout() -> None:
    if sys.stdout is None:
        # Closed: what was to be written there already failed in stdout(); a usage
        # error, written to stderr, keeps its 2.
        return
    try:
        sys.stdout.flush()
    except OSError as error:
        raise StdoutError(error) from error


def silence_stdout() -> None:
    """Point stdout's file descriptor at the null device, as Python's documentation does.

    The bytes that failed are still in the buffer: when Python flushes it at exit it
    would print "Exception ignored ... BrokenPipeError" and exit 120 instead of ours.
    """
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def complain(message: str) -> None:
    """``devicekit: message`` on stderr; a stderr that fails as well is let be."""
    with contextlib.suppress(OSError):
        print(f"devicekit: {message}", file=sys.stderr, flush=True)


def show(result: Any, *, json_form: bool) -> None:
    if json_form:
        print_json(result.to_dict())
    else:
        print_line(str(result))
