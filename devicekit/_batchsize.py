"""``find_batch_size``: the largest batch that fits, leaving the allocator as it found it.

Batch-size finders are known to leave memory behind (2 to 3 GB in Lightning's
issue 6570) or to cause an out-of-memory error right after they return (issue
20231): a failed trial's tensors stay alive in the exception's traceback, and
the allocator keeps what they used in its cache. Here, after every trial the
failed trial's frames are cleared (their locals dropped), the garbage
collector runs, and the cache goes back to the driver; with ``isolate=True``
each trial runs in a child process of its own, so this process's allocator
never sees an out-of-memory error at all.

The search doubles from ``start`` until a size fails, then bisects between the
last size that ran and the first that failed. An out-of-memory error is
recognized by its type (``torch.OutOfMemoryError``, and Python's
``MemoryError``: the host's memory), or for older torch and the CPU by the
message of a ``RuntimeError``; any other error is the caller's and propagates.

A size that fails is tried once more, after the clean-up, before it counts as
too big: memory another process held for a moment, or a cache not yet given
back, would otherwise end the doubling early and halve the answer. A size
that fails and then runs is reported with a ``RuntimeWarning``.
"""

from __future__ import annotations

import gc
import itertools
import math
import multiprocessing
import pickle
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from fractions import Fraction
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from ._census import census, only_new_objects
from ._devices import DeviceLike, resolve_device
from ._dist import DEFAULT_TIMEOUT, gather_objects, initialized
from ._errors import DeviceOutOfMemoryError, add_note
from ._format import format_bytes
from ._memory import used_cuda_indices
from ._oomreport import build_report
from ._oomtext import is_oom
from ._options import check_count, check_flag, check_number, check_seconds, refuse_lazy
from ._visible import torch_cuda_initialized

__all__ = ["find_batch_size"]

_POLL = 0.1  # seconds between checks that a trial's child process is still alive
# A child's start (a new interpreter importing torch and fn's module) is not the trial's
# time: trial_timeout counts from when fn is loaded and about to run, which the child
# says with this message. Starting is bounded too, generously, so nothing hangs.
_STARTED = b""
_START_LIMIT = 300.0
# A child whose end of the pipe closed is exiting; this bounds the wait for its exit code
# (one that closed the pipe and lives on is killed after it).
_EXIT_WAIT = 10.0
_CEILING = 2**31  # no batch is this many starts large: a function that still fits ignores it
_LAZY_FIX = (
    "pass a function that does the work: lambda n: list(gen(n)) for a generator, "
    "lambda n: asyncio.run(step(n)) for async def"
)


def _too_big(error: BaseException) -> bool:
    """Whether ``error`` says a size did not fit: torch's out-of-memory errors, or the host's."""
    return is_oom(error) or isinstance(error, MemoryError)


def _explained(error: BaseException, device: torch.device | None) -> DeviceOutOfMemoryError:
    """``error`` as a `DeviceOutOfMemoryError` with its report, built while its frames live."""
    if isinstance(error, DeviceOutOfMemoryError):  # fn explains its own (@dk.explain_oom)
        return error
    try:
        report = build_report(error, device=device)
    except Exception as failure:  # noqa: BLE001 - a failed report must not hide the failure
        add_note(error, f"devicekit.find_batch_size could not build a report: {failure!r}")
        return DeviceOutOfMemoryError(f"{type(error).__name__}: {error}")
    return DeviceOutOfMemoryError(str(report), report)


def _run(fn: Callable[[int], Any], size: int) -> None:
    """``fn(size)``, refusing a result that means its body never ran (so every size fits).

    An error of fn's own (not out of memory) leaves with a note of the size that
    raised it: a step that fails only at 64 looks, without it, like one that
    always fails.
    """
    try:
        result = fn(size)
    except Exception as error:
        if not _too_big(error):
            add_note(error, f"devicekit.find_batch_size: fn({size}) raised this")
        raise
    refuse_lazy(fn, call=f"fn({size})", fix=_LAZY_FIX, result=result)


def _give_back(*, collect: bool = True) -> None:
    """Free what nothing refers to any more, and return the allocator's cache to the driver."""
    if collect:
        gc.collect()
    if torch_cuda_initialized():
        torch.cuda.empty_cache()


def _drop_frames(error: BaseException | None) -> None:
    """Clear the locals of every finished frame an exception chain holds: the trial's tensors."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # a frame still running is left alone
        error = error.__cause__ or error.__context__


def _held() -> int:
    """Bytes held now: live tensors off CUDA (the census), and CUDA's allocated bytes.

    On CUDA the allocator's count also sees what no Python tensor holds (a kept
    loss's autograd graph); elsewhere the census is all there is to read.
    """
    groups = census(lambda tensor: None)
    held = sum(size for (device, *_), (_, size) in groups.items() if not device.startswith("cuda"))
    if torch_cuda_initialized():
        held += sum(torch.cuda.memory_allocated(index) for index in used_cuda_indices())
    return held


def _start_failed(start: int, error: DeviceOutOfMemoryError) -> DeviceOutOfMemoryError:
    report = error.report
    return DeviceOutOfMemoryError(
        f"find_batch_size: fn({start}) ran out of memory, so even start={start} does not fit. "
        + ("Pass a smaller start, or free memory" if start > 1 else "Free memory")
        + " first (the fixes below), or make one step smaller (a smaller model, shorter "
        f"inputs, mixed precision); what the memory held when it failed:\n"
        f"{report if report is not None else error}",
        report,
    )


class _InProcess:
    """Runs trials in this process; cleans up after each.

    A trial returns whether ``fn(size)`` ran; with ``first``, one that ran out
    of memory raises `DeviceOutOfMemoryError` with the report instead.
    """

    def __init__(self, fn: Callable[[int], Any], device: torch.device | None) -> None:
        self.fn, self.device = fn, device
        self.held: list[int] = []  # bytes held after each trial that ran, cleaned up

    def __call__(self, size: int, *, first: bool) -> bool:
        try:
            _run(self.fn, size)  # the result is dropped at once
        except Exception as error:
            if not _too_big(error):
                raise
            # Read while the failed frames are alive: the report counts their tensors.
            explained = _explained(error, self.device) if first else None
            _drop_frames(error)
            if explained is not None:
                raise _start_failed(size, explained) from error
            return False
        finally:
            _give_back()
        self.held.append(_held())
        return True


def _child(fn_bytes: bytes, size: int, first: bool, device: str | None, result: Any) -> None:
    """A trial in a child process: send back None (it ran) or the exception it raised."""
    try:
        fn = pickle.loads(fn_bytes)
        result.send_bytes(_STARTED)
        _run(fn, size)
    except Exception as error:  # noqa: BLE001 - every failure goes back to the parent
        text = traceback.format_exc()
        if first and _too_big(error):  # the report is of this process's memory: built here
            error = _explained(error, None if device is None else torch.device(device))
        try:
            payload = pickle.dumps((error, text))
        except (pickle.PicklingError, AttributeError, TypeError):
            # Keep what matters: whether it was an out-of-memory error, and the text.
            kind = torch.OutOfMemoryError if _too_big(error) else RuntimeError
            payload = pickle.dumps((kind(f"{type(error).__name__}: {error}"), text))
        result.send_bytes(payload)
    else:
        result.send_bytes(pickle.dumps(None))


def _died(process: BaseProcess, size: int) -> RuntimeError:
    """The error for a child that ended without an answer: its exit code, or the signal."""
    # Its end of the pipe is closed: it is on its way out. Polled, not join(timeout): a
    # child that closed its file descriptors closed join's sentinel too, and join would
    # then wait for its exit with no bound.
    deadline = time.monotonic() + _EXIT_WAIT
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(_POLL / 10)
    start = f"find_batch_size: the child process running fn({size})"
    if code is None:
        process.kill()
        process.join()
        return RuntimeError(
            f"{start} closed its end of the pipe without sending a result, and was still "
            f"running {_EXIT_WAIT:g} s later, so it was killed: fn, or something it called, "
            "closes file descriptors it did not open"
        )
    if code >= 0:
        return RuntimeError(
            f"{start} exited with code {code} before it sent a result: fn, or something "
            "it called, ended the process (sys.exit(), os._exit()), or the child failed "
            "to start; its stderr may say why"
        )
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = (
        "a host out of memory ends a process with SIGKILL (the kernel's log, dmesg, says "
        "whether its out-of-memory killer did), or another process killed it"
        if name == "SIGKILL"
        else "a crash in native code (in fn or a library it calls), or another process "
        "sent the signal"
    )
    return RuntimeError(
        f"{start} was killed by {name} (exit code {code}) before it sent a result: {why}"
    )


class _Isolated:
    """Runs each trial in a spawned child process and reads back how it ended."""

    def __init__(
        self, fn: Callable[[int], Any], device: torch.device | None, timeout: float | None
    ) -> None:
        self.timeout = timeout
        try:
            self.fn_bytes = pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise TypeError(
                f"find_batch_size(isolate=True) runs fn in a child process, so fn must be "
                f"picklable, and {fn!r} is not ({error}). Define it with def at the top level "
                "of a module (not a lambda, not inside a function), or use isolate=False."
            ) from None
        self.device = None if device is None else str(device)

    def _wait(self, process: BaseProcess, receive: Connection, size: int) -> bytes:
        """The child's outcome; a child that hangs (starting, or in fn) is killed."""
        started = False
        deadline = None if self.timeout is None else time.monotonic() + _START_LIMIT
        while True:
            if receive.poll(_POLL):  # data, or the end of the pipe: the child has died
                try:
                    message = receive.recv_bytes()
                except (EOFError, OSError):  # OSError: it died halfway through a message
                    raise _died(process, size) from None
                if message != _STARTED:
                    return message
                started = True
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
            elif deadline is not None and time.monotonic() > deadline:
                process.kill()  # a hung trial: its child goes, and so does its memory
                if not started:
                    raise TimeoutError(
                        f"find_batch_size: the child process for fn({size}) did not start "
                        f"within {_START_LIMIT:g} s (importing torch and fn's module), and was "
                        "killed; check that importing fn's module does not hang"
                    )
                raise TimeoutError(
                    f"find_batch_size: fn({size}) ran longer than trial_timeout="
                    f"{self.timeout:g} s in its child process, which was killed; raise "
                    "trial_timeout if one step really takes that long"
                )
            elif not process.is_alive() and not receive.poll():
                # Dead with the pipe still open: a process it forked holds the other end.
                raise _died(process, size)

    def __call__(self, size: int, *, first: bool) -> bool:
        context = multiprocessing.get_context("spawn")  # a forked CUDA process cannot use CUDA
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_child, args=(self.fn_bytes, size, first, self.device, send), daemon=True
        )
        process.start()
        send.close()
        try:
            received = self._wait(process, receive, size)
        except BaseException:
            # Ctrl-C, or a trial that failed: its child is of no more use. Killed now, not
            # after the 10 s wait below (Ctrl-C from a terminal reaches the child too, but
            # a signal to this process alone, or an IDE's stop button, does not).
            process.kill()
            raise
        finally:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
            receive.close()
        try:
            outcome = pickle.loads(received)
        except (pickle.UnpicklingError, AttributeError, ImportError) as error:
            raise RuntimeError(
                f"find_batch_size: fn({size}) failed in its child process, and its error cannot "
                f"be read here ({error!r})"
            ) from None
        if outcome is None:
            return True
        raised, text = outcome
        if first and _too_big(raised):
            # The child sends its report; a stand-in for an error that would not pickle has none.
            if not isinstance(raised, DeviceOutOfMemoryError):
                raised = DeviceOutOfMemoryError(str(raised))
            raise _start_failed(size, raised) from None
        if _too_big(raised):
            return False
        raise RuntimeError(
            f"find_batch_size: fn({size}) raised in its child process:\n{text}"
        ) from raised


def _fits(trial: Callable[..., bool], size: int, flaky: list[int], *, first: bool = False) -> bool:
    """Whether ``fn(size)`` runs: a size that fails is tried once more before it counts.

    The trial has cleaned up after itself (frames, garbage, cache), so the second
    try sees all the memory there is; a size that runs then goes into ``flaky``.
    With ``first``, a second failure raises the report instead of returning False.
    """
    if trial(size, first=False):
        return True
    if not trial(size, first=first):
        return False
    flaky.append(size)
    return True


def _search(trial: Callable[..., bool], start: int, max_size: int | None, flaky: list[int]) -> int:
    """The largest size that ran: doubling from ``start``, then bisecting."""
    _fits(trial, start, flaky, first=True)  # raises when even start does not fit, twice
    fits = start
    # The ceiling counts from start: with a fixed one, a start past it was refused as
    # "still fit" without a larger size ever tried.
    limit = start * _CEILING if max_size is None else max_size
    failed = None
    while fits < limit:
        size = min(fits * 2, limit)
        if _fits(trial, size, flaky):
            fits = size
        else:
            failed = size
            break
    if failed is None:
        if max_size is None:
            raise RuntimeError(
                f"find_batch_size: fn({fits}) still fit: fn does not seem to use memory in "
                "proportion to its argument. Pass max_size to bound the search."
            )
        return fits
    while failed - fits > 1:
        middle = (fits + failed) // 2
        if _fits(trial, middle, flaky):
            fits = middle
        else:
            failed = middle
    return fits


def _search_and_clean(
    trial: Callable[..., bool], start: int, max_size: int | None, flaky: list[int]
) -> int:
    """`_search()`, with a cheap collection after each trial and a full one at the end.

    A trial's garbage is new objects, so collecting only what is new finds it
    (0.01 s instead of 0.27 s per trial with torch imported); the full
    collection at the end catches anything the cheap ones could not see.
    """
    try:
        with only_new_objects():  # which collects everything first
            _give_back(collect=False)  # the baseline: nothing cached
            return _search(trial, start, max_size, flaky)
    finally:
        _give_back()


def _warn_leak(held: list[int]) -> None:
    """Warn when what fn holds grew trial after trial: each trial had less room than the last.

    The first trial may make state that lasts (optimizer state, workspaces),
    so growth counts from it on, and only when it happened after two trials
    or more.
    """
    rises = sum(later > earlier for earlier, later in itertools.pairwise(held))
    if rises < 2 or held[-1] <= held[0]:
        return
    warnings.warn(
        f"find_batch_size: fn keeps memory from one call to the next: what stayed alive "
        f"grew after {rises} of its {len(held)} trials that ran, by "
        f"{format_bytes(held[-1] - held[0], digits=2)} in all, so each trial had less room "
        "than the last and the answer is lower than what fits. Keep nothing across calls "
        "(a list of losses keeps every step's graph; a cache keyed by batch size), or pass "
        "isolate=True to run each trial in a fresh process",
        RuntimeWarning,
        stacklevel=3,
    )


def _warn_flaky(flaky: list[int], found: int) -> None:
    sizes = ", ".join(f"fn({size})" for size in flaky)
    warnings.warn(
        f"find_batch_size: {sizes} ran out of memory and then ran on a second try, so "
        f"memory near the limit is not steady here (another process, fragmentation, a "
        f"cache); the search counts such a size as fitting (the largest that ran: {found}), "
        "and a step near it may still fail now and then: pass margin= (0.1 keeps 10% free) "
        "for headroom",
        RuntimeWarning,
        stacklevel=3,
    )


def find_batch_size(
    fn: Callable[[int], Any],
    *,
    start: int = 1,
    max_size: int | None = None,
    margin: float = 0.0,
    device: DeviceLike | None = None,
    isolate: bool = False,
    trial_timeout: float | None = None,
) -> int:
    """Find the largest batch size ``fn(batch_size)`` runs with, without leaving memory behind.

    Calls ``fn(batch_size)``, doubling from ``start`` until an out-of-memory
    error (or ``max_size``), then bisects between the last size that ran and
    the first that failed. Out of memory means ``torch.OutOfMemoryError``,
    torch's older out-of-memory ``RuntimeError`` (the CPU allocator's "can't
    allocate memory" included), or Python's ``MemoryError`` (the host's
    memory ran out: a size too big for the machine); any other error is
    ``fn``'s own and propagates. A size that runs out of memory is tried once
    more, after freeing memory, before it counts as too big: a failure that
    does not repeat (another process held memory for a moment) would
    otherwise end the doubling early and the answer come out low. Each size
    that fails for good costs that one more trial. Before the first trial and
    after every trial it drops the trial's references and returns cached
    memory to the driver, so when it returns, the allocator's reserved memory
    is where it was before (less any cache that was idle when it began, which
    it gave back first).
    Under ``torch.distributed`` every rank gets the same answer, the minimum
    over ranks, in one collective; a rank that fails makes every rank raise,
    so none waits forever.

    Args:
        fn: Runs one step (forward, backward, optimizer) at a batch size. It
            should allocate what a real step allocates; its return value is
            dropped.
        start: The first size tried; the answer is never below it.
        max_size: The largest size tried. Default: no bound but an
            out-of-memory error.
        margin: A fraction to keep free: the answer is
            ``floor(found * (1 - margin))``, at least ``start``.
        device: The device whose memory is reported when even ``start``
            fails. Default: the one the error names.
        isolate: Run each trial in a child process (``spawn``), so this
            process's allocator never sees an out-of-memory error; ``fn``
            must then be picklable. Each trial then pays a process start.
        trial_timeout: With ``isolate=True``, the seconds one trial may run
            before its child process is killed and ``TimeoutError`` is
            raised (a trial that hangs cannot hang the search). It counts
            from when ``fn`` is loaded in the child, so the child's start
            (importing torch and ``fn``'s module) is not part of it; the
            start has its own bound of 300 s. Default: no bound. Without
            ``isolate`` a running ``fn`` cannot be stopped, so this is
            refused there.

    Returns:
        The largest size that ran, reduced by ``margin``.

    Warns:
        RuntimeWarning: A size ran out of memory and then ran on its second
            try: memory near the limit is not steady, and the warning names
            the sizes and suggests a ``margin``. Or what stays alive after a
            trial grew after two trials or more: ``fn`` keeps memory from one
            call to the next, so the answer is lower than what fits.

    Raises:
        DeviceOutOfMemoryError: Even ``start`` does not fit, on two tries; the
            message has the out-of-memory report
            ([`explain_oom()`][devicekit.explain_oom]).
        TypeError: ``fn`` is not callable, a generator or ``async def`` function
            (its body would never run), or not picklable with ``isolate=True``;
            ``isolate`` is not True or False.
        ValueError: ``start`` below 1, ``max_size`` below ``start``,
            ``margin`` outside [0, 1), or ``trial_timeout`` not a positive
            number of seconds or given without ``isolate=True``.
        TimeoutError: A trial ran longer than ``trial_timeout``.
        RuntimeError: Another rank failed, or ``fn`` fits at any size.

    Examples:
        >>> import torch, devicekit as dk
        >>> def step(batch_size):
        ...     if batch_size > 48:  # stands in for a real allocation that fails
        ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        >>> dk.find_batch_size(step), dk.find_batch_size(step, margin=0.1)
        (48, 43)
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable with a batch size, got {type(fn).__name__}")
    refuse_lazy(fn, call="fn(batch_size)", fix=_LAZY_FIX)
    isolate = check_flag(isolate, name="isolate")
    check_count(start, name="start", minimum=1)
    if max_size is not None:
        check_count(max_size, name="max_size", minimum=start, fix="pass max_size >= start")
    check_number(margin, name="margin", at_least=0, below=1, meaning="0.1 is 10% headroom")
    if trial_timeout is not None:
        trial_timeout = check_seconds(trial_timeout, name="trial_timeout")
        if not isolate:
            raise ValueError(
                f"trial_timeout={trial_timeout:g} needs isolate=True: a trial in this process "
                "cannot be stopped; pass isolate=True, or drop trial_timeout"
            )
    target = None if device is None else resolve_device(device, name="device")
    trial = _Isolated(fn, target, trial_timeout) if isolate else _InProcess(fn, target)
    flaky: list[int] = []
    if not initialized():
        found = _search_and_clean(trial, start, max_size, flaky)
    else:
        found, failure = 0, None
        try:
            found = _search_and_clean(trial, start, max_size, flaky)
        except Exception as error:  # noqa: BLE001 - raised below, once every rank has answered
            failure = error
        # Over devicekit's gloo group: no GPU buffer under NCCL, and bounded in time.
        answers = gather_objects(
            (found, failure is not None), timeout=DEFAULT_TIMEOUT, what="find_batch_size()"
        )
        if failure is not None:
            raise failure
        failed = [rank for rank, (_, error) in enumerate(answers) if error]
        if failed:
            raise RuntimeError(
                f"find_batch_size: rank {', '.join(map(str, failed))} failed (its own error "
                "says why), so no batch size is common to every rank"
            )
        found = min(size for size, _ in answers)
    if flaky:
        _warn_flaky(flaky, found)
    if isinstance(trial, _InProcess):
        _warn_leak(trial.held)
    # In fractions, not floats: 50 * (1 - 0.02) is 48.99999999999999 in floats.
    keep = 1 - Fraction(margin).limit_denominator(10**9)
    return max(start, math.floor(found * keep))
