"""``detect_syncs``: find the lines that make the host wait for the GPU."""

from __future__ import annotations

import collections
import contextlib
import html
import logging
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from ._accelerators import accelerator_count, accelerator_type
from ._blocks import EnterOnce
from ._errors import SyncError
from ._format import html_table, plural
from ._frames import UNKNOWN_LOCATION, is_user, user_location
from ._keywords import suggest_keywords
from ._shortrepr import got, short_repr

__all__ = ["SyncReport", "detect_syncs"]

_SYNC_MESSAGE = "synchronizing CUDA operation"
logger = logging.getLogger("devicekit")


def _traceback_location(traceback: types.TracebackType | None) -> str:
    location = UNKNOWN_LOCATION
    while traceback is not None:  # the deepest user frame is the line that synced
        code = traceback.tb_frame.f_code
        if is_user(code.co_filename):
            location = f"{code.co_filename}:{traceback.tb_lineno}"
        traceback = traceback.tb_next
    return location


@dataclass(frozen=True)
class SyncReport:
    """What `detect_syncs()` saw: each synchronizing call and the user line it came from.

    Filled in while its block runs; read it after.

    Attributes:
        mode: ``"record"`` or ``"error"``.
        supported: False where nothing can be detected (no CUDA device).
        reason: Why not, when ``supported`` is False.
    """

    mode: str
    supported: bool = True
    reason: str | None = None
    # (location, what) per sync, appended by the block while it runs.
    _events: list[tuple[str, str]] = field(default_factory=list, compare=False, repr=False)

    @property
    def events(self) -> list[tuple[str, str]] | None:
        """``(location, what)`` per sync, in order (location is ``file:line``).

        None where nothing could be seen (``supported`` False), as for ``count``:
        an empty list would claim the block was checked and found free of syncs.
        """
        return list(self._events) if self.supported else None

    @property
    def count(self) -> int | None:
        """How many synchronizing calls were seen; None where none could be (``supported`` False).

        Not 0 there: 0 would claim the block was checked and found free of syncs.
        """
        return len(self._events) if self.supported else None

    @property
    def locations(self) -> dict[str, int] | None:
        """``file:line`` of each user line that synchronized, with how often, most first.

        None where nothing could be seen (``supported`` False), as for ``count``.
        """
        return self._counted() if self.supported else None

    def _counted(self) -> dict[str, int]:
        return dict(collections.Counter(location for location, _ in self._events).most_common())

    def summary(self) -> str:
        """A readable account: the count, then each line with its count."""
        if not self.supported:
            return f"sync detection unavailable: {self.reason}"
        if not self._events:
            return "no synchronizing CUDA operation seen"
        lines = [f"{plural(len(self._events), 'synchronizing CUDA operation')}:"]
        lines += [f"  {count:6d}x  {where}" for where, count in self._counted().items()]
        return "\n".join(lines)

    __str__ = summary

    def __repr__(self) -> str:
        if not self.supported:
            return f"SyncReport(unavailable: {self.reason})"
        lines = self._counted()
        if not lines:
            return f"SyncReport({self.mode}: no sync)"
        where = ", ".join(f"{line} ({count}x)" for line, count in lines.items())
        return (
            f"SyncReport({self.mode}: {plural(len(self._events), 'sync')} from "
            f"{plural(len(lines), 'line')}: {where})"
        )

    def _repr_html_(self) -> str:
        if not self.supported:
            return f"<p>{html.escape(f'sync detection unavailable: {self.reason}')}</p>"
        caption = f"detect_syncs: {plural(len(self._events), 'synchronizing CUDA operation')}"
        rows = [(where, f"{count}x") for where, count in self._counted().items()]
        if not rows:
            return f"<p>{html.escape(caption)}</p>"
        return html_table(rows, header=("line", "syncs"), caption=caption)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: mode, support, count (null where unsupported) and locations."""
        return {
            "mode": self.mode,
            "supported": self.supported,
            "reason": self.reason,
            "count": self.count,
            "locations": self.locations,
        }


def _unsupported(kind: str | None, count: int) -> str | None:
    """Why syncs cannot be detected with this build and device count, or None when they can.

    Examples:
        >>> print(_unsupported("mps", 1))
        no CUDA device: this torch build drives MPS, whose work is asynchronous and makes the \
host wait too, but PyTorch's sync debug mode watches CUDA only
    """
    if kind == "cuda" and count:
        return None
    # Only where work runs on the CPU is "synchronous, nothing to find" true; an MPS
    # or XPU build queues work and syncs as CUDA does, unseen by torch's debug mode.
    if kind is None:
        where = "this torch build has no accelerator"
    elif not count:
        where = (
            f"torch is built for {'CUDA' if kind == 'cuda' else kind.upper()} but sees no device"
        )
    else:
        return (
            f"no CUDA device: this torch build drives {kind.upper()}, whose work is "
            "asynchronous and makes the host wait too, but PyTorch's sync debug mode "
            "watches CUDA only"
        )
    return f"no CUDA device: {where}, so work runs on the CPU, which is synchronous"


# The device-wide waits torch's debug mode does not flag, by the names a program calls.
_SYNCHRONIZING: tuple[tuple[str, Any], ...] = (
    ("torch.cuda.synchronize", torch.cuda),
    ("torch.accelerator.synchronize", getattr(torch, "accelerator", None)),
)


def _filters_changed() -> None:
    """Tell ``warnings`` its filter list changed in place, as its own functions do."""
    mutated = getattr(warnings, "_filters_mutated", None)  # absent on some versions
    if mutated is not None:
        mutated()


class _Watch:
    """What every ``detect_syncs`` block open now shares: they nest, and may end in any order.

    The sync debug mode, the synchronize functions and the warnings hook are
    process-wide, so they are set up when the first block opens and put back
    when the last one closes, not by each block: a block that saved and
    restored them itself would, closing before one opened after it (another
    thread, a generator), leave the debug mode on and the hooks installed for
    good. A sync is counted by every open block, and the debug mode is
    ``"error"`` while any open block is in error mode.

    Only what the first block put in is taken out: a warnings filter or
    ``showwarning`` the program set meanwhile stays (``catch_warnings`` would
    put back the whole list, dropping them), and ``show`` passes a warning on
    even after the last block closed, for whoever kept a reference to it
    (``logging.captureWarnings`` does).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: list[SyncReport] = []
        self.previous: int | str = 0
        # (module, its synchronize before the first block, the one put in its place)
        self.replaced: list[tuple[Any, Any, Any]] = []
        self.shown: Any = None  # the showwarning this one passes other warnings on to
        self.filters: list[Any] = []  # the filters the first block put in

    def open(self, report: SyncReport) -> None:
        with self.lock:
            if not self.reports:
                self.previous = torch.cuda.get_sync_debug_mode()
                # torch's own caveat; the docstring of detect_syncs says what is not detected.
                warnings.filterwarnings(
                    "ignore", message="Synchronization debug mode is a prototype"
                )
                warnings.filterwarnings("always", message=f".*{_SYNC_MESSAGE}")
                self.filters = list(warnings.filters[:2])
                if warnings.showwarning != self.show:  # not ours, put back by another
                    self.shown = warnings.showwarning
                warnings.showwarning = self.show
                for name, module in _SYNCHRONIZING:
                    original = getattr(module, "synchronize", None)
                    if original is not None:
                        watched = self.watched(name, original)
                        self.replaced.append((module, original, watched))
                        module.synchronize = watched
            self.reports.append(report)
            self.set_mode()

    def close(self, report: SyncReport) -> None:
        with self.lock:
            self.reports = [open_ for open_ in self.reports if open_ is not report]
            if self.reports:
                self.set_mode()
                return
            torch.cuda.set_sync_debug_mode(self.previous)
            for module, original, watched in self.replaced:
                if module.synchronize is watched:  # not if someone replaced it since
                    module.synchronize = original
            if warnings.showwarning == self.show:
                warnings.showwarning = self.shown
            kept = [item for item in warnings.filters if item not in self.filters]
            if len(kept) != len(warnings.filters):
                cast("list[Any]", warnings.filters)[:] = kept  # typeshed: a Sequence
                _filters_changed()
            self.replaced, self.filters = [], []

    def set_mode(self) -> None:
        strict = any(report.mode == "error" for report in self.reports)
        torch.cuda.set_sync_debug_mode("error" if strict else "warn")

    def record(self, location: str, what: str) -> None:
        for report in list(self.reports):
            report._events.append((location, what))

    def watched(self, name: str, original: Callable[..., None]) -> Callable[..., None]:
        """``original`` (``torch.cuda.synchronize``), counted or refused as a sync first.

        torch's sync debug mode flags implicit syncs only, not these calls.
        """

        def synchronize(device: Any = None) -> None:
            location = user_location()
            if any(report.mode == "error" for report in self.reports):
                raise SyncError(f"{name}() at {location} makes the host wait")
            self.record(location, f"{name}()")
            original(device)

        return synchronize

    def show(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if _SYNC_MESSAGE in str(message) and self.reports:
            self.record(user_location(), str(message).splitlines()[0])
        else:
            shown = self.shown or warnings._showwarning_orig  # type: ignore[attr-defined]
            shown(message, category, *args, **kwargs)


_watch = _Watch()
_told: set[str] = set()  # why no block could watch, each said once (mode="error")


@suggest_keywords
def detect_syncs(
    *, mode: Literal["record", "error"] = "record"
) -> contextlib.AbstractContextManager[SyncReport]:
    """Record (or refuse) every operation that makes the host wait for the GPU.

    Inside the block, PyTorch's sync debug mode reports each synchronizing
    CUDA operation it knows (``.item()``, ``.cpu()``, ``print(tensor)``,
    blocking copies, ``nonzero``, boolean masking...), and devicekit notes the
    first line outside torch and devicekit that caused it. Calls of
    ``torch.cuda.synchronize()`` and ``torch.accelerator.synchronize()`` are
    caught too. The previous debug mode is restored when the last block
    open ends.

    Blocks nest: a sync counts in every block open around it, and inside an
    ``"error"`` block every sync raises, even within a ``"record"`` block
    nested in it. It applies to the whole process: a sync in another thread
    is counted too, and blocks opened from several threads may end in any
    order. Entering it initializes CUDA, as the GPU code inside would.

    It cannot see: ``Event.synchronize()``, ``Stream.synchronize()`` and other
    event waits, collectives, a ``synchronize`` imported by name before the
    block, syncs in C++ extensions that bypass PyTorch's check, or syncs
    under code that hides warnings from it (``catch_warnings`` with
    ``simplefilter("ignore")``, ``logging.captureWarnings(True)`` inside the
    block). In another thread, an ``"error"`` block's refusal is torch's own
    ``RuntimeError``, not in the report.

    ``@dk.detect_syncs(mode="error")`` decorates a function: each call runs
    in a block of its own. A ``"record"`` block is no decorator (each call's
    report would be lost), and no block decorates a generator or ``async``
    function, whose body runs outside it.

    Args:
        mode: ``"record"`` counts syncs and their lines; ``"error"`` raises
            [`SyncError`][devicekit.SyncError] at the first one, naming the line.

    Returns:
        A context manager, entered once, whose ``with ... as`` gives a
        [`SyncReport`][devicekit.SyncReport], filled in as the block runs. Without a CUDA
        device it records nothing: ``report.count`` is None (unknown, not 0), and
        ``report.reason`` says why; in ``"error"`` mode, where no report is read, the
        ``devicekit`` logger warns of it too.

    Raises:
        ValueError: ``mode`` is neither ``"record"`` nor ``"error"``.
        TypeError: It decorates a function in ``"record"`` mode, or decorates
            a generator or ``async`` function.
        RuntimeError: The same ``detect_syncs(...)`` object is entered a second time.
        SyncError: In ``"error"`` mode, at the first sync.

    Examples:
        >>> import devicekit as dk
        >>> with dk.detect_syncs() as syncs:
        ...     pass
        >>> syncs.count == (0 if syncs.supported else None)  # None: no CUDA device to watch
        True
    """
    if not isinstance(mode, str):
        raise TypeError(
            f"mode must be 'record' or 'error', got {got(mode)}; 'record' counts syncs and "
            "their lines, 'error' raises SyncError at the first"
        )
    if mode not in ("record", "error"):
        raise ValueError(
            f"mode must be 'record' or 'error' (lower case), got {short_repr(mode)}; 'record' "
            "counts syncs and their lines, 'error' raises SyncError at the first"
        )
    return EnterOnce(
        lambda: _sync_block(mode),
        again=(
            "this detect_syncs() was already entered once; each block gets its own report, "
            "so call dk.detect_syncs(...) again for each: with dk.detect_syncs() as syncs: ..."
        ),
        name="dk.detect_syncs()",
        gives="syncs",
        # An "error" block raises at the first sync: a decorator keeps that. A "record"
        # block's report would be lost, as a decorated function returns only its value.
        undecorating=None
        if mode == "error"
        else "in mode='record', each call's report would be lost, as a decorated function "
        "returns only its own value (decorate with dk.detect_syncs(mode='error') to raise at "
        "the first sync)",
    )


@contextlib.contextmanager
def _sync_block(mode: str) -> Iterator[SyncReport]:
    reason = _unsupported(accelerator_type(), accelerator_count())
    report = SyncReport(mode, supported=reason is None, reason=reason)
    if reason is not None:
        if mode == "error" and reason not in _told:
            # Nobody reads the report of an "error" block: the silence that follows would
            # read as "no sync here", so say that nothing was watched; once a process,
            # not once a block: a block around each step would say it every step.
            _told.add(reason)
            logger.warning("detect_syncs(mode='error') cannot detect syncs here: %s", reason)
        yield report
        return
    _watch.open(report)
    try:
        yield report
    except RuntimeError as error:
        if mode == "error" and _SYNC_MESSAGE in str(error) and not isinstance(error, SyncError):
            where = _traceback_location(error.__traceback__)
            raise SyncError(
                f"{where} makes the host wait for the GPU ({str(error).strip()}); keep the "
                "value on the device (dk.LogBuffer for logging) or sync outside the loop"
            ) from error
        raise
    finally:
        _watch.close(report)
