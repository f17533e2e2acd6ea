"""``LogBuffer``: log scalars every step without a host/device sync; copy them in bulk.

``loss.item()`` or ``print(loss)`` each step makes the host wait for the GPU,
so the two stop overlapping. A ``LogBuffer`` keeps references to the detached
0-d tensors (no kernel, no sync) and, every ``flush_every`` steps, stacks them
and copies them to the host in one copy per device and dtype.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from ._timing import CudaEvent

__all__ = ["LogBuffer", "Record", "Sink"]

Record = dict[str, Any]
"""One logged step on the host: ``{"step": 12, "loss": 0.25, ...}``."""
Sink = Callable[[list[Record]], Any]
"""Anything that takes the new records of a flush."""

_REDUCE_OPS = ("mean", "sum", "max", "min")
_Tensor = torch.Tensor


@dataclass
class _InFlight:
    """A flush whose copies to the host were started but not yet waited on."""

    steps: list[Any]  # only the steps: the logged tensors are freed once stacked
    slots: list[tuple[int, str, int, int]]  # record index, key, group, position in group
    hosts: list[torch.Tensor]  # one host tensor per (device, dtype) group
    done: list[Any] = field(default_factory=list)  # events that mark each copy complete


class LogBuffer:
    """Collect scalars on the device and bring them to the host in bulk, never per step.

    ``log(step, loss=loss, lr=0.1)`` takes 0-d tensors on any device and
    Python numbers. It never synchronizes and launches no kernel: it keeps a
    reference to each value (detached, so no autograd graph stays alive).
    A flush stacks the pending values per device and dtype and copies them to
    the host in one non-blocking copy per group (into pinned memory on CUDA),
    then waits for that copy only; the records land in :attr:`history` and
    are handed to each sink. :meth:`flush` and the end of a ``with`` block
    flush at once. The automatic flush every ``flush_every`` calls only
    *starts* the copy: waiting for it would also wait for every kernel queued
    before it, so its records arrive at the next flush (or when ``history``
    is read), by which time the copy has long landed.

    Nothing is lost: a sink that raises does not lose records (they are in
    ``history`` before any sink runs; the other sinks still run; the first
    error is raised once), NaN and inf are kept (and counted in
    :attr:`nonfinite`), and device memory holds at most ``flush_every``
    pending values plus one stacked copy in flight.

    With ``reduce`` set and ``torch.distributed`` initialized, each flush
    combines the pending values of all ranks in a single ``all_reduce`` (NCCL
    or gloo), so every rank records the same numbers; every rank must then log
    the same keys in the same order. Without an initialized process group,
    nothing is reduced.

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
    """

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
        self._pending: list[tuple[Any, dict[str, Any]]] = []
        self._history: list[Record] = []
        self._in_flight: _InFlight | None = None
        self._calls = 0
        self.nonfinite = 0
        """How many NaN or infinite values have been recorded (they are kept)."""

    def log(self, step: int | None = None, **scalars: torch.Tensor | float | int) -> None:
        """Record scalars for one step; ``step`` defaults to the number of earlier ``log`` calls."""
        # Runs every training step: one pass, no new dict (kwargs is already fresh).
        for key, value in scalars.items():
            if isinstance(value, _Tensor):
                if value.dim() != 0 and value.numel() != 1:
                    raise ValueError(
                        f"LogBuffer.log({key}=...) expects a scalar: a 0-d tensor or a number, got "
                        f"a tensor of shape {tuple(value.shape)}; log value.mean() or one element"
                    )
                if value.requires_grad:
                    scalars[key] = value.detach()  # a view: no kernel, no graph kept alive
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(
                    f"LogBuffer.log({key}=...) expects a 0-d tensor or a number, "
                    f"got {type(value).__name__}"
                )
        self._pending.append((self._calls if step is None else step, scalars))
        self._calls += 1
        if len(self._pending) >= self.flush_every:
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
        """
        finished = self._complete()
        if self._pending:
            self._in_flight = self._start(self._pending)
            self._pending = []
            if wait:
                finished += self._complete()
        return finished

    @property
    def history(self) -> list[Record]:
        """Every record on the host so far, oldest first (completes an in-flight flush)."""
        self._complete()
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
        self.flush()

    # --- the copy ------------------------------------------------------------------------

    def _start(self, pending: list[tuple[Any, dict[str, Any]]]) -> _InFlight:
        # One stack (and so one copy) per device and dtype; Python numbers make one
        # float64 tensor together (a tensor each would cost more than the rest of
        # the flush). Dicts keep first-seen order.
        groups: dict[tuple[torch.device, torch.dtype] | None, list[Any]] = {}
        position: dict[tuple[torch.device, torch.dtype] | None, int] = {}
        slots: list[tuple[int, str, int, int]] = []
        for index, (_, values) in enumerate(pending):
            for key, value in values.items():
                group = (value.device, value.dtype) if isinstance(value, _Tensor) else None
                members = groups.get(group)
                if members is None:
                    members = groups[group] = []
                    position[group] = len(position)
                slots.append((index, key, position[group], len(members)))
                members.append(value)
        stacked = [
            torch.tensor(members, dtype=torch.float64)
            if group is None
            # reshape only the rare one-element tensors that are not 0-d
            else torch.stack([v.reshape(()) if v.dim() else v for v in members])
            for group, members in groups.items()
        ]
        if self.reduce is not None:
            stacked = _all_reduce(stacked, self.reduce)
        in_flight = _InFlight(steps=[step for step, _ in pending], slots=slots, hosts=[])
        for tensor in stacked:
            if tensor.device.type == "cuda":
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                event = CudaEvent()
                event.record(torch.cuda.current_stream(tensor.device))
                in_flight.done.append(event)
            else:
                host = tensor.to("cpu")  # CPU: no copy; other devices: their safe copy
            in_flight.hosts.append(host)
        return in_flight

    def _complete(self) -> list[Record]:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        for event in in_flight.done:
            event.synchronize()  # this copy only, not the whole device
        host_values = [host.tolist() for host in in_flight.hosts]
        records: list[Record] = [{"step": step} for step in in_flight.steps]
        for index, key, group, position in in_flight.slots:
            value = float(host_values[group][position])
            if not math.isfinite(value):
                self.nonfinite += 1
            records[index][key] = value
        self._history.extend(records)
        self._deliver(records)
        return records

    def _deliver(self, records: list[Record]) -> None:
        first_error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink(records)
            except Exception as error:  # noqa: BLE001 - every sink runs; the first error is raised
                first_error = first_error or error
        if first_error is not None:
            raise first_error


def _all_reduce(stacked: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    """Combine the values of every rank in one collective; unchanged without a process group."""
    import torch.distributed as dist  # noqa: PLC0415 - only when reducing

    if not (dist.is_available() and dist.is_initialized()):
        return list(stacked)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    sizes = [t.numel() for t in stacked]
    flat = torch.cat([t.to(device=device, dtype=torch.float64) for t in stacked])
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM}
    ops |= {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    references = sys.getrefcount(flat)
    dist.all_reduce(flat, op=ops[op])  # mean: a sum, divided below
    if backend != "nccl":
        # torch >= 2.10 counts each C++ owner of a Python tensor as one Python
        # reference, and gives it back with the GIL. gloo's worker thread lets go of
        # `flat` just after the collective completes; if the interpreter is already
        # shutting down by then (the flush at the end of a script), taking the GIL
        # aborts the process. So wait, briefly, for that to happen here. (NCCL's
        # watchdog lets go much later; torch shuts it down in destroy_process_group.)
        deadline = time.monotonic() + 1.0
        while sys.getrefcount(flat) > references and time.monotonic() < deadline:
            time.sleep(0)  # hands the GIL to the worker thread
    if op == "mean":
        flat /= dist.get_world_size()
    return list(torch.split(flat, sizes))
