"""``LogBuffer``: log scalars every step without a host/device sync; copy them in bulk.

``loss.item()`` or ``print(loss)`` each step makes the host wait for the GPU,
so the two stop overlapping. A ``LogBuffer`` keeps references to the detached
0-d tensors (no kernel, no sync) and, every ``flush_every`` steps, stacks them
and copies them to the host in one copy per device and dtype.

Pending values are kept by key (one column per key). Values already on the
host (Python numbers, CPU tensors) are read directly at a flush; values on an
accelerator are stacked per device and dtype and copied in one non-blocking
copy each. With ``reduce``, every rank arranges its values in the same order,
by key name, and checks that all ranks agree on that order before combining.
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from ._format import html_table, plural
from ._timing import CudaEvent

__all__ = ["LogBuffer", "Record", "Sink"]

Record = dict[str, Any]
"""One logged step on the host: ``{"step": 12, "loss": 0.25, ...}``."""
Sink = Callable[[list[Record]], Any]
"""Anything that takes the new records of a flush."""

logger = logging.getLogger("devicekit")

_REDUCE_OPS = ("mean", "sum", "max", "min")
_Tensor = torch.Tensor
_STRIDED = torch.strided
# Real numbers that stack and convert to a Python float exactly (as float64).
# Complex, quantized and bit-packed dtypes are refused when logged.
_LOGGABLE = frozenset(
    getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)  # the uints and float8s: torch >= 2.3
)

# A column: the key, the rows (indices into the flush's steps) that have it or
# None when every row does, and one value per row.
_Column = tuple[str, list[int] | None, list[Any]]


@dataclass
class _InFlight:
    """A flush whose copies to the host were started but not yet waited on."""

    steps: list[Any]
    columns: list[_Column]  # values become floats; None where a copy has yet to land
    hosts: list[torch.Tensor] = field(default_factory=list)  # one per copied group
    done: list[Any] = field(default_factory=list)  # events that mark each copy complete
    # Where each group's values go: (host index, its offset, column floats, index, count).
    fills: list[tuple[int, int, list[Any], int, int]] = field(default_factory=list)


class LogBuffer:
    """Collect scalars on the device and bring them to the host in bulk, never per step.

    ``log(step, loss=loss, lr=0.1)`` takes 0-d (or one-element) tensors of a
    real dtype on any real device, and Python numbers. It never synchronizes
    and launches no kernel: it checks each value, keeps a reference to it
    (detached, so no autograd graph stays alive), and returns. A flush reads
    the pending values that are already on the host, stacks the others per
    device and dtype, copies each stack to the host in one non-blocking copy
    (into pinned memory on CUDA), and waits for that copy only; the records
    land in :attr:`history` and are handed to each sink. :meth:`flush` and
    the end of a ``with`` block flush at once. The automatic flush every
    ``flush_every`` calls only *starts* the copy: waiting for it would also
    wait for every kernel queued before it, so its records arrive at the next
    flush (or when ``history`` is read), by which time the copy has long
    landed.

    Nothing is lost:

    - A value that could not be recorded (a complex, sparse or meta tensor,
      a string, an int beyond float64) is refused by the ``log()`` call that
      passes it, naming the key; nothing logged before or after is affected.
    - A flush that fails (an out-of-memory error, a failed collective) keeps
      its values pending, raises, and tries again ``flush_every`` calls later.
    - A sink that raises does not lose records (they are in ``history`` before
      any sink runs; the other sinks still run; the first error is raised
      once). When the ``with`` block is already leaving on an exception, a
      failing flush or sink never replaces it: the block's exception
      propagates, with a note saying what else failed (logged on Python 3.10).
    - NaN and inf are kept (and counted in :attr:`nonfinite`).

    Device memory holds at most ``flush_every`` pending values plus one
    stacked copy in flight.

    ``log()``, ``flush()`` and the readers may be called from several threads
    at once: a lock guards the pending values, and each call's record appears
    exactly once. Steps default to the number of earlier ``log()`` calls.

    With ``reduce`` set and ``torch.distributed`` initialized, each flush
    combines the values of all ranks in one ``all_reduce``, so every rank
    records the same numbers. Values are matched by key name, never by
    position: the keyword order may differ between ranks. Every rank must log
    the same keys the same number of times between flushes; if the ranks
    disagree, every rank raises ``ValueError`` naming what each rank logged,
    and no values are mixed. (To compare, the ranks first exchange a short
    fingerprint of their keys; with NCCL, reading it makes each flush wait for
    the GPU.) When the ``with`` block leaves on an exception, its final flush
    records this rank's own values unreduced, because the other ranks may
    never reach the collective. Without an initialized process group, nothing
    is reduced.

    Args:
        flush_every: Flush after this many ``log`` calls.
        sinks: Callables that receive the list of new records at each flush.
        reduce: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` across ranks, or None.

    Examples:
        >>> import torch, devicekit as dk
        >>> with dk.LogBuffer(flush_every=2) as logs:
        ...     for step in range(3):
        ...         logs.log(step, loss=torch.tensor(1.0 / (step + 1)))
        >>> [round(record["loss"], 3) for record in logs.history]
        [1.0, 0.5, 0.333]
        >>> logs
        LogBuffer(flush_every=2): 3 records of loss, 0 values pending, last {'step': 2, 'loss': 0.3333333432674408}
    """  # noqa: E501 - the expected output is one line

    def __init__(
        self,
        *,
        flush_every: int = 100,
        sinks: Iterable[Sink] = (),
        reduce: str | None = None,
    ) -> None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every must be a positive int, got {flush_every!r}")
        if reduce is not None and reduce not in _REDUCE_OPS:
            raise ValueError(
                f"reduce must be one of {', '.join(_REDUCE_OPS)} or None, got {reduce!r}"
            )
        self.flush_every = flush_every
        self.sinks: list[Sink] = list(sinks)
        for sink in self.sinks:
            if not callable(sink):
                raise TypeError(f"each sink must be callable with a list of records, got {sink!r}")
        self.reduce = reduce
        self.nonfinite = 0
        """How many NaN or infinite values have been recorded (they are kept)."""
        # _lock guards what log() touches, held for a few list operations only;
        # _flush_lock serializes flushes and sinks, and is re-entrant so that a
        # sink may read the buffer. Always taken in that order: _flush_lock first.
        self._lock = threading.Lock()
        self._flush_lock = threading.RLock()
        self._pending: list[tuple[Any, dict[str, Any]]] = []
        self._on_device = False  # whether a pending value is on an accelerator
        self._flush_at = flush_every  # pending steps that start a flush
        self._calls = 0
        self._in_flight: _InFlight | None = None
        self._history: list[Record] = []
        self._undelivered: deque[list[Record]] = deque()
        self._keys: dict[str, None] = {}  # every key recorded, in order of first appearance

    def log(self, step: int | None = None, **scalars: torch.Tensor | float | int) -> None:
        """Record scalars for one step; ``step`` defaults to the number of earlier ``log`` calls.

        Raises:
            TypeError: A value is not a tensor of a real dtype or a Python number.
            ValueError: A tensor has more than one element, is sparse or on the
                ``meta`` device, or an int is too large for a float64.
        """
        # Runs every training step: one pass, attribute reads only, no new dict
        # (kwargs is already fresh). Anything unusual goes to _checked().
        on_device = False
        for key in scalars:  # noqa: PLC0206 - indexing is 50 ns faster than .items() here
            value = scalars[key]
            if (
                value.__class__ is _Tensor
                and value.dtype in _LOGGABLE
                and not value.ndim
                and value.layout is _STRIDED
            ):
                if value.requires_grad:
                    # .data is the same alias as .detach() (no kernel, no graph
                    # kept alive) without a trip through the dispatcher: 0.1 µs less.
                    value = scalars[key] = value.data
                if not value.is_cpu:
                    if value.is_meta:
                        raise _refuse(key, value)
                    on_device = True
            elif value.__class__ is not float:
                scalars[key] = value = _checked(key, value)
                on_device = on_device or (isinstance(value, _Tensor) and not value.is_cpu)
        with self._lock:
            if step is None:
                step = self._calls
            self._calls += 1
            pending = self._pending
            pending.append((step, scalars))
            if on_device:
                self._on_device = True
            due = len(pending) >= self._flush_at
        if due:
            # Waiting here would wait for every kernel queued before the copy: the
            # GPU's queue would drain each flush. The copy lands long before the next.
            self.flush(wait=False)

    def flush(self, *, wait: bool = True) -> list[Record]:
        """Copy the pending values to the host and hand the new records to the sinks.

        Args:
            wait: False starts the copy and returns at once, so it overlaps
                the next steps; the records arrive at the next flush (or when
                :attr:`history` is read).

        Returns:
            The records this call added to ``history`` (none with ``wait=False``).

        Raises:
            ValueError: With ``reduce``, the ranks logged different keys.
            Exception: The first error a sink raised, once all sinks have run,
                or what made the copy fail (the values are still pending).
        """
        return self._flush(wait=wait, reduce=True)

    @property
    def history(self) -> list[Record]:
        """Every record on the host so far, oldest first (completes an in-flight flush)."""
        with self._flush_lock:
            self._complete()  # sinks get these records at the next flush
            return self._history

    @property
    def latest(self) -> Record | None:
        """The newest record on the host, or None."""
        history = self.history
        return history[-1] if history else None

    def values(self, key: str) -> list[float]:
        """Every recorded value of ``key``, oldest first."""
        return [record[key] for record in self.history if key in record]

    def mean(self, key: str, *, last: int | None = None) -> float:
        """The mean of ``key`` over the history, or over its ``last`` values (NaN propagates)."""
        values = self.values(key)[-last:] if last else self.values(key)
        if not values:
            raise KeyError(f"no value of {key!r} has been recorded yet")
        return sum(values) / len(values)

    def __enter__(self) -> LogBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self.flush()
            return
        # Leaving on an exception: flush without the collective (other ranks may
        # never reach it), and never let a failing flush or sink replace `exc`.
        try:
            self._flush(wait=True, reduce=False)
        except Exception as error:  # noqa: BLE001 - reported on exc, which propagates
            _report_while_exiting(exc, error, pending=self._pending_count())

    # --- notebooks ---------------------------------------------------------------------

    def __repr__(self) -> str:
        state = self._state()
        parts = [f"{plural(state['records'], 'record')} of {', '.join(state['keys']) or '(none)'}"]
        parts.append(f"{plural(state['pending'], 'value')} pending")
        if state["last"] is not None:
            parts.append(f"last {state['last']}")
        if self.sinks:
            parts.append(f"sinks {', '.join(state['sinks'])}")
        return f"{state['name']}: {', '.join(parts)}"

    def _repr_html_(self) -> str:
        state = self._state()
        last = state["last"] or {}
        rows = [
            ("records", plural(state["records"], "record")),
            ("keys", ", ".join(state["keys"]) or "none yet"),
            ("pending", f"{plural(state['pending'], 'value')} not yet on the host"),
            ("last record", ", ".join(f"{key}={value}" for key, value in last.items()) or "none"),
            ("sinks", ", ".join(state["sinks"]) or "none"),
        ]
        if self.nonfinite:
            rows.append(("NaN or inf", plural(self.nonfinite, "value")))
        return html_table(rows, caption=state["name"])

    def _state(self) -> dict[str, Any]:
        """What the reprs show, read without waiting for any copy."""
        with self._lock:
            pending_keys = [key for _, values in self._pending for key in values]
        in_flight = self._in_flight
        flight_keys = [key for key, _, _ in in_flight.columns] if in_flight else []
        options = [f"flush_every={self.flush_every}"]
        if self.reduce is not None:
            options.append(f"reduce={self.reduce!r}")
        return {
            "name": f"LogBuffer({', '.join(options)})",
            "records": len(self._history),
            "keys": list(dict.fromkeys([*self._keys, *flight_keys, *pending_keys])),
            "pending": self._pending_count(),
            "last": self._history[-1] if self._history else None,
            "sinks": [_describe_sink(sink) for sink in self.sinks],
        }

    def _pending_count(self) -> int:
        in_flight = self._in_flight
        flying = sum(len(values) for _, _, values in in_flight.columns) if in_flight else 0
        with self._lock:
            return flying + sum(len(values) for _, values in self._pending)

    # --- the flush -----------------------------------------------------------------------

    def _flush(self, *, wait: bool, reduce: bool) -> list[Record]:
        with self._flush_lock:
            finished: list[Record] = []
            failure: BaseException | None = None
            try:
                finished += self._complete()
                with self._lock:
                    batch, self._pending = self._pending, []
                    on_device, self._on_device = self._on_device, False
                if batch:
                    try:
                        self._in_flight = self._start(batch, on_device, reduce=reduce)
                    except BaseException:
                        with self._lock:  # keep the values, in order
                            self._pending[:0] = batch
                            self._on_device = self._on_device or on_device
                        raise
                    if wait:
                        finished += self._complete()
            except BaseException as error:  # noqa: BLE001 - raised below, once the sinks ran
                # Try again flush_every calls later, never at every log() call.
                with self._lock:
                    self._flush_at = len(self._pending) + self.flush_every
                failure = error
            else:
                self._flush_at = self.flush_every
            sink_error = self._deliver()
            if failure is not None:
                if sink_error is not None:
                    logger.error("a LogBuffer sink raised", exc_info=sink_error)
                raise failure
            if sink_error is not None:
                raise sink_error
            return finished

    def _start(
        self, batch: list[tuple[Any, dict[str, Any]]], on_device: bool, *, reduce: bool
    ) -> _InFlight:
        steps = [step for step, _ in batch]
        columns = _columns([values for _, values in batch])
        if reduce and self.reduce is not None and _process_group() is not None:
            return _start_reduced(steps, columns, self.reduce)
        if not on_device:
            # Every value is a number or on the CPU: read each, nothing to copy.
            # Faster than stacking (15 µs for 100 values instead of 25).
            return _InFlight(steps, [(key, rows, list(map(float, v))) for key, rows, v in columns])
        return _start_copies(steps, columns)

    def _complete(self) -> list[Record]:
        in_flight = self._in_flight
        if in_flight is None:
            return []
        for event in in_flight.done:
            event.synchronize()  # this copy only, not the whole device
        host_values = [host.tolist() for host in in_flight.hosts]
        for host, offset, floats, index, count in in_flight.fills:
            floats[index : index + count] = map(float, host_values[host][offset : offset + count])
        records: list[Record] = [{"step": step} for step in in_flight.steps]
        nonfinite = 0
        for key, rows, floats in in_flight.columns:
            if rows is None:
                for record, value in zip(records, floats, strict=True):
                    record[key] = value
            else:
                for row, value in zip(rows, floats, strict=True):
                    records[row][key] = value
            if not math.isfinite(sum(floats)):  # one C loop; count only when needed
                nonfinite += sum(not math.isfinite(value) for value in floats)
        # Only now is the flight landed: had anything above failed, it would be retried.
        self._in_flight = None
        self.nonfinite += nonfinite
        self._keys.update(dict.fromkeys(key for key, _, _ in in_flight.columns))
        self._history.extend(records)
        self._undelivered.append(records)
        return records

    def _deliver(self) -> BaseException | None:
        """Hand each landed flush to every sink, in order; return the first error."""
        first_error: BaseException | None = None
        while self._undelivered:
            records = self._undelivered.popleft()
            for sink in self.sinks:
                try:
                    sink(records)
                except Exception as error:  # noqa: BLE001 - every sink runs; the first error is raised
                    first_error = first_error or error
        return first_error


# --- checking values when they are logged ---------------------------------------------------


def _checked(key: str, value: Any) -> Any:
    """What to keep for a value the fast path of log() did not accept, or an error."""
    if isinstance(value, _Tensor):
        if value.dtype not in _LOGGABLE:
            raise TypeError(
                f"LogBuffer.log({key}=...) expects a real number, got a tensor of dtype "
                f"{value.dtype}; log value.real, value.abs() or value.float()"
            )
        if value.layout is not _STRIDED or value.is_nested:
            raise TypeError(
                f"LogBuffer.log({key}=...) expects a dense tensor, got layout {value.layout}"
                f"{' (nested)' if value.is_nested else ''}; log value.to_dense()"
            )
        if value.numel() != 1:
            raise ValueError(
                f"LogBuffer.log({key}=...) expects a scalar: a 0-d tensor or a number, got "
                f"a tensor of shape {tuple(value.shape)}; log value.mean() or one element"
            )
        if value.is_meta:
            raise _refuse(key, value)
        if value.requires_grad:
            value = value.detach()
        return value.reshape(()) if value.ndim else value  # a view: no kernel
    if isinstance(value, (int, float)):  # bool and int subclasses included
        try:
            return float(value)
        except OverflowError:
            raise ValueError(
                f"LogBuffer.log({key}=...) got an int of {int(value).bit_length()} bits, too large "
                "for a float64 (1024 bits at most); log it scaled"
            ) from None
    raise TypeError(
        f"LogBuffer.log({key}=...) expects a 0-d tensor or a number, got {type(value).__name__}"
        + ("; log float(value)" if hasattr(value, "__float__") else "")
    )


def _refuse(key: str, value: torch.Tensor) -> ValueError:
    return ValueError(
        f"LogBuffer.log({key}=...) got a tensor on the {value.device.type} device, which "
        "holds no values; log a tensor on a real device"
    )


# --- a flush ---------------------------------------------------------------------------------


def _columns(rows: list[dict[str, Any]]) -> list[_Column]:
    """The pending values by key: one list each, in order of first appearance."""
    first = rows[0]
    if sum(map(len, rows)) == len(first) * len(rows):
        try:  # nearly always: every step logs the same keys
            return [(key, None, [values[key] for values in rows]) for key in first]
        except KeyError:
            pass
    columns: dict[str, tuple[list[int], list[Any]]] = {}
    for row, values in enumerate(rows):
        for key, value in values.items():
            column = columns.get(key)
            if column is None:
                column = columns[key] = ([], [])
            column[0].append(row)
            column[1].append(value)
    return [(key, indices, values) for key, (indices, values) in columns.items()]


def _start_copies(steps: list[Any], columns: list[_Column]) -> _InFlight:
    """Read host values now; stack the others per device and dtype and start their copies."""
    in_flight = _InFlight(steps, [])
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    places: dict[tuple[torch.device, torch.dtype], list[tuple[int, list[Any], int, int]]] = {}
    for key, rows, values in columns:
        floats: list[Any] = [None] * len(values)
        in_flight.columns.append((key, rows, floats))
        for index, value in enumerate(values):
            if value.__class__ is float or value.is_cpu:
                floats[index] = float(value)
                continue
            group = (value.device, value.dtype)
            members = groups.setdefault(group, [])
            places.setdefault(group, []).append((len(members), floats, index, 1))
            members.append(value)
    for number, (group, members) in enumerate(groups.items()):
        _copy_to_host(in_flight, torch.stack(members))
        in_flight.fills.extend((number, *place) for place in places[group])
    return in_flight


def _copy_to_host(in_flight: _InFlight, tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = CudaEvent()
        event.record(torch.cuda.current_stream(tensor.device))
        in_flight.done.append(event)
    else:
        host = tensor.to("cpu")  # CPU: no copy; other devices: their safe copy
    in_flight.hosts.append(host)


# --- across ranks ----------------------------------------------------------------------------


def _process_group() -> Any:
    """``torch.distributed``, when a default process group is initialized; else None."""
    import torch.distributed as dist  # noqa: PLC0415 - only when reducing

    return dist if dist.is_available() and dist.is_initialized() else None


def _start_reduced(steps: list[Any], columns: list[_Column], op: str) -> _InFlight:
    """Combine every rank's values, matched by key name, in one collective."""
    dist = _process_group()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    ordered = sorted(columns, key=lambda column: column[0])  # by name: the same on every rank
    layout = f"{len(steps)} steps; " + "; ".join(
        f"{key}" if rows is None else f"{key} at {rows}" for key, rows, _ in ordered
    )
    flat: torch.Tensor | None = None
    problem = ""
    try:
        flat = torch.cat([_as_float64(values, device) for _, _, values in ordered])
        digest = hashlib.blake2b(layout.encode(), digest_size=7).digest()
        fingerprint = int.from_bytes(digest, "big")
    except Exception as error:  # noqa: BLE001 - every rank must still hear of it
        problem, fingerprint = f"could not prepare its values: {error!r}", -1
    # Every rank learns whether all fingerprints agree: max == min == its own.
    check = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    _all_reduce(dist, check, dist.ReduceOp.MAX)
    if check.tolist() != [fingerprint, -fingerprint]:
        descriptions: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(descriptions, problem or f"logged {_summary(ordered, len(steps))}")
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in enumerate(descriptions))
        raise ValueError(
            f"LogBuffer(reduce={op!r}) cannot combine this flush: the ranks disagree, and values "
            f"are matched by key name, never by position:\n{lines}\nLog the same keys, the same "
            "number of times, on every rank (log a NaN where a rank has no value)."
        )
    assert flat is not None
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM}
    _all_reduce(dist, flat, ops.get(op) or getattr(dist.ReduceOp, op.upper()))
    if op == "mean":
        flat /= dist.get_world_size()
    in_flight = _InFlight(steps, [])
    offset = 0
    for key, rows, values in ordered:
        floats: list[Any] = [None] * len(values)
        in_flight.columns.append((key, rows, floats))
        in_flight.fills.append((0, offset, floats, 0, len(values)))
        offset += len(values)
    _copy_to_host(in_flight, flat)
    return in_flight


def _as_float64(values: list[Any], device: torch.device) -> torch.Tensor:
    """One column as a float64 tensor on ``device``: one stack when the values allow it."""
    if all(value.__class__ is float or value.is_cpu for value in values):
        return torch.tensor(list(map(float, values)), dtype=torch.float64).to(device)
    if all(isinstance(value, _Tensor) for value in values):
        kinds = {(value.device, value.dtype) for value in values}
        if len(kinds) == 1:
            return torch.stack(values).to(device=device, dtype=torch.float64)
    return torch.stack(
        [
            torch.as_tensor(value, dtype=torch.float64).to(device)
            if isinstance(value, float)
            else value.to(device=device, dtype=torch.float64)
            for value in values
        ]
    )


def _summary(columns: list[_Column], steps: int) -> str:
    keys = ", ".join(
        key if rows is None else f"{key} ({plural(len(rows), 'step')})" for key, rows, _ in columns
    )
    return f"{plural(steps, 'step')} of {keys or 'nothing'}"


def _all_reduce(dist: Any, tensor: torch.Tensor, op: Any) -> None:
    """``dist.all_reduce`` in place, returning once the backend has let go of ``tensor``."""
    references = sys.getrefcount(tensor)
    dist.all_reduce(tensor, op=op)
    if dist.get_backend() != "nccl":
        # torch >= 2.10 counts each C++ owner of a Python tensor as one Python
        # reference, and gives it back with the GIL. gloo's worker thread lets go of
        # the tensor just after the collective completes; if the interpreter is already
        # shutting down by then (the flush at the end of a script), taking the GIL
        # aborts the process. So wait, briefly, for that to happen here. (NCCL's
        # watchdog lets go much later; torch shuts it down in destroy_process_group.)
        deadline = time.monotonic() + 1.0
        while sys.getrefcount(tensor) > references and time.monotonic() < deadline:
            time.sleep(0)  # hands the GIL to the worker thread


# --- reporting -------------------------------------------------------------------------------


def _report_while_exiting(exc: BaseException, error: Exception, *, pending: int) -> None:
    """Attach a flush's error to the exception the ``with`` block is leaving on."""
    kept = (
        f"{plural(pending, 'value')} still pending"
        if pending
        else "every record is in LogBuffer.history"
    )
    note = (
        f"devicekit: while the LogBuffer block was exiting on this exception, its final flush "
        f"raised {type(error).__name__}: {error} ({kept})"
    )
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10 has no notes
        logger.error(note, exc_info=error)


def _describe_sink(sink: Sink) -> str:
    """A sink's own repr when it has a readable one, else its name (``show``, ``list.append``)."""
    text = repr(sink)
    if not text.startswith("<"):
        return text
    return str(getattr(sink, "__qualname__", None) or type(sink).__qualname__)
