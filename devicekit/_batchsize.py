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
last size that ran and the first that failed, until the one that failed is at
most a tenth of ``margin`` above the one that ran (`_PRECISION`): more trials
would move the answer, ``margin`` below the size that ran, by less than a
tenth of ``margin``, and the trials near the limit are the costly ones (on the
CPU they write gigabytes: the README's step took 146 s to bisect to the exact
11.5 million, 55 s to a tenth of its 10% margin). With ``margin=0`` nothing
hides a difference, so it bisects to the exact size. An out-of-memory error is
recognized by its type (``torch.OutOfMemoryError``, and Python's
``MemoryError``: the host's memory), or for older torch and the CPU by the
message of a ``RuntimeError``; any other error is the caller's and propagates.

A size that fails is tried once more, after the clean-up, before it counts as
too big: memory another process held for a moment, or a cache not yet given
back, would otherwise end the doubling early and halve the answer. A size
that fails and then runs is reported with a ``RuntimeWarning``.

On the CPU no out-of-memory error comes before the kernel's out-of-memory
killer, so trials there run under a bound of the host's free memory
(`._hostmemory.bounded`, on Linux): past it an allocation fails, as out of
memory. The trials run on the CPU when ``device`` says so, or when torch
here has no accelerator; where CUDA exists but has not started, a first trial
that ran without starting it ran on the CPU (in this process; a child of
``isolate=True`` cannot tell, and runs unbounded). Where no bound can be set,
the search on the CPU needs ``max_size``.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

import torch

from ._accelerators import accelerator_count, accelerator_type
from ._batchrestore import saved_states
from ._census import only_new_objects
from ._devices import DeviceLike, resolve_device
from ._dist import DEFAULT_TIMEOUT, gather_objects
from ._errors import add_note
from ._format import format_bytes
from ._frames import caller_stacklevel
from ._hostmemory import can_bound
from ._isolated import Isolated
from ._keywords import suggest_keywords
from ._options import check_count, check_flag, check_number, check_seconds, refuse_lazy
from ._trial import LAZY_FIX, InProcess, give_back
from ._visible import torch_cuda_initialized
from ._world import initialized

__all__ = ["find_batch_size"]

_CEILING = 2**31  # no batch is this many starts large: a function that still fits ignores it
# The bisection stops once the first size that failed is within this share of margin above the
# last that ran: the answer then keeps between margin and 1.1 * margin of what fits free.
_PRECISION = Fraction(1, 10)


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


def _search(
    trial: Callable[..., bool],
    start: int,
    max_size: int | None,
    flaky: list[int],
    precision: Fraction = Fraction(0),
) -> int:
    """A size that ran: doubling from ``start``, then bisecting until within ``precision``.

    The bisection stops once the first size that failed is at most ``precision``
    times the last that ran above it (next to it, with ``precision`` 0: the
    largest that ran), and returns the one that ran.
    """
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
    while failed - fits > 1 and failed - fits > fits * precision:
        middle = (fits + failed) // 2
        if _fits(trial, middle, flaky):
            fits = middle
        else:
            failed = middle
    return fits


def _search_and_clean(
    trial: Callable[..., bool],
    start: int,
    max_size: int | None,
    flaky: list[int],
    precision: Fraction,
) -> int:
    """`_search()`, with a cheap collection after each trial and a full one at the end.

    A trial's garbage is new objects, so collecting only what is new finds it
    (0.01 s instead of 0.27 s per trial with torch imported); the full
    collection at the end catches anything the cheap ones could not see.
    """
    try:
        with only_new_objects():  # which collects everything first
            give_back(collect=False)  # the baseline: nothing cached
            return _search(trial, start, max_size, flaky, precision)
    finally:
        give_back()


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
        stacklevel=caller_stacklevel(),
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
        stacklevel=caller_stacklevel(),
    )


def _trial_device(device: DeviceLike) -> torch.device:
    """``device`` resolved; meta refused, where nothing can run out of memory."""
    target = resolve_device(device, name="device")
    if target.type == "meta":
        # Nothing is allocated on meta, so no size can fail there: an answer would be a
        # size nothing measured (max_size, or wherever fn raised for reasons of its own).
        raise ValueError(
            "find_batch_size() got device='meta', where tensors have shapes but no memory: no "
            "batch size can run out of memory there, so none can be found; pass the device "
            "fn's step runs on ('cuda', 'cpu'), or leave device out"
        )
    return target


def _on_cpu(target: torch.device | None) -> bool | None:
    """Whether the trials run on the CPU; None: to be seen (CUDA exists and has not started)."""
    if target is not None:
        return target.type == "cpu"
    if accelerator_count() == 0:
        return True
    return None if accelerator_type() == "cuda" and not torch_cuda_initialized() else False


def _refuse_unbounded(max_size: int | None) -> None:
    """Refuse a search on the CPU with no bound at all: it would end in the kernel's SIGKILL."""
    if max_size is None and not can_bound():
        raise ValueError(
            "find_batch_size() on the CPU needs max_size here, got max_size=None: the CPU raises "
            "no out-of-memory error before the operating system ends a process (or swaps), and "
            "devicekit bounds the search by the free memory only on Linux, from /proc (this "
            f"is {sys.platform}); pass max_size=, the largest batch to try"
        )


@suggest_keywords
def find_batch_size(
    fn: Callable[[int], Any],
    *,
    start: int = 1,
    max_size: int | None = None,
    margin: float = 0.0,
    device: DeviceLike | None = None,
    isolate: bool = False,
    trial_timeout: float | None = None,
    restore: Iterable[object] = (),
) -> int:
    """Find the largest batch size ``fn(batch_size)`` runs with, without leaving memory behind.

    Calls ``fn(batch_size)``, doubling from ``start`` until an out-of-memory
    error (or ``max_size``), then bisects between the last size that ran and
    the first that failed, until that one is at most a tenth of ``margin``
    above the one that ran (the exact size with ``margin=0``): the answer is
    the size that ran, less ``margin``, so it keeps between ``margin`` and
    1.1 times ``margin`` of what fits free, and each trial near the limit is
    the costly one. Out of memory means ``torch.OutOfMemoryError``,
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

    On the CPU no out-of-memory error comes before the kernel kills the
    process (or a neighbour), so on Linux each trial there runs with this
    process's ``ulimit -v`` (soft ``RLIMIT_AS``) lowered to its address space
    plus the free memory of the machine and of its container's cgroup, less
    5% (at least 256 MiB), and the old limit restored after it, however it
    ended: a size past that fails as out of memory. The trials run on the
    CPU when ``device`` is the CPU or torch here has no accelerator; where
    CUDA exists and has not started, a first trial that ran without starting
    it tells (not with ``isolate=True``, whose children cannot). Elsewhere
    (macOS, Windows) the CPU needs ``max_size``.

    Args:
        fn: Runs one step (forward, backward, optimizer) at a batch size. It
            should allocate what a real step allocates; its return value is
            dropped.
        start: The first size tried; the answer is never below it.
        max_size: The largest size tried. Default: no bound but an
            out-of-memory error (on the CPU, the host's free memory;
            required on the CPU where that cannot be bounded).
        margin: A fraction to keep free: the answer is
            ``floor(found * (1 - margin))``, at least ``start``, where
            ``found`` ran and the first size that failed is at most
            ``found * (1 + margin / 10)`` (``found + 1`` with 0, the default:
            the exact size, at the cost of every bisection step).
        device: The device the trials run on: its memory is reported when
            even ``start`` fails, and the CPU's bounds the search (above).
            Default: the one the error names; the CPU where torch has no
            accelerator.
        isolate: Run each trial in a child process (``spawn``), so this
            process's allocator never sees an out-of-memory error; ``fn``
            must then be picklable. Each trial then pays a process start.
            The child ends with this process, and a trial cut short (a
            timeout, Ctrl-C, ``SIGTERM``) stops it and, on Linux, what
            ``fn`` started in it, as [`gpu_map()`][devicekit.gpu_map] does.
        trial_timeout: With ``isolate=True``, the seconds one trial may run
            before its child process is killed and ``TimeoutError`` is
            raised (a trial that hangs cannot hang the search). It counts
            from when ``fn`` is loaded in the child, so the child's start
            (importing torch and ``fn``'s module) is not part of it; the
            start has its own bound of 300 s. Default: no bound. Without
            ``isolate`` a running ``fn`` cannot be stopped, so this is
            refused there.
        restore: Objects whose state the trials change, put back when the
            search ends, however it ends: each trial runs a real step, so
            one with ``optimizer.step()`` trains the model on the search's
            batches, fills the optimizer's state and leaves gradients.
            Anything with ``state_dict()`` and ``load_state_dict()``:
            ``restore=[model, optimizer]`` (a scheduler, a ``GradScaler``).
            Their states are kept in host memory meanwhile (serialized, one
            copy); a module's gradients and torch's random number generators
            are put back too. Default: nothing is put back. Not with
            ``isolate=True``, where nothing in this process changes.

    Returns:
        A size that ran, reduced by ``margin``: the largest that ran, which
        is the largest that fits to within a tenth of ``margin``.

    Warns:
        RuntimeWarning: A size ran out of memory and then ran on its second
            try: memory near the limit is not steady, and the warning names
            the sizes and suggests a ``margin``. Or what stays alive after a
            trial grew after two trials or more: ``fn`` keeps memory from one
            call to the next, so the answer is lower than what fits.

    Raises:
        DeviceOutOfMemoryError: Even ``start`` does not fit, on two tries; the
            message has the out-of-memory report
            ([`explain_oom()`][devicekit.explain_oom]). It is of the class
            ``fn`` raised too (``except MyOOM``, ``except MemoryError`` still
            catch it), with that error's attributes.
        TypeError: ``fn`` is not callable, a generator or ``async def`` function
            (its body would never run), or not picklable with ``isolate=True``;
            ``isolate`` is not True or False.
        ValueError: ``device`` is ``meta`` (nothing runs out of memory there),
            ``start`` below 1, ``max_size`` below ``start``,
            ``margin`` outside [0, 1), or ``trial_timeout`` not a positive
            number of seconds or given without ``isolate=True``; or the
            trials run on the CPU where no bound can be set (not Linux) and
            ``max_size`` is None.
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
    refuse_lazy(fn, call="fn(batch_size)", fix=LAZY_FIX)
    isolate = check_flag(isolate, name="isolate")
    # The plain values on: start=torch.tensor(3) failed in Fraction arithmetic, and
    # margin=np.float32(0.1) in Fraction().
    start = check_count(start, name="start", minimum=1)
    if max_size is not None:
        max_size = check_count(
            max_size, name="max_size", minimum=start, fix="pass max_size >= start"
        )
    given_margin = margin
    margin = check_number(margin, name="margin", at_least=0, below=1, meaning="0.1 is 10% headroom")
    if trial_timeout is not None:
        trial_timeout = check_seconds(trial_timeout, name="trial_timeout")
        if not isolate:
            raise ValueError(
                f"trial_timeout={trial_timeout:g} needs isolate=True: a trial in this process "
                "cannot be stopped; pass isolate=True, or drop trial_timeout"
            )
    if isolate and not (isinstance(restore, (list, tuple)) and not restore):
        raise ValueError(
            "restore= with isolate=True: the trials run in child processes, so nothing in this "
            "process changes; drop restore, or isolate"
        )
    target = None if device is None else _trial_device(device)
    cpu = _on_cpu(target)
    if cpu:
        _refuse_unbounded(max_size)
    trial = (
        Isolated(fn, target, trial_timeout, cpu=cpu is True)
        if isolate
        else InProcess(fn, target, cpu)
    )
    # In fractions, not floats: 50 * (1 - 0.02) is 48.99999999999999 in floats. Read from
    # the text (np.float32(0.1) is '0.1', and 0.10000000149 as a float: 44 for 45).
    share = _fraction(given_margin, margin)
    precision = share * _PRECISION
    flaky: list[int] = []
    put_back = saved_states(restore)
    found: int | None = None
    try:
        found = _search_everywhere(trial, start, max_size, flaky, precision)
    finally:
        try:
            put_back()
        except Exception as error:
            if found is not None:  # the search's answer is not lost with it
                add_note(error, f"find_batch_size found {found}; putting back restore failed")
            raise
    if flaky:
        _warn_flaky(flaky, found)
    if isinstance(trial, InProcess):
        _warn_leak(trial.held)
    return max(start, math.floor(found * (1 - share)))


def _fraction(given: object, value: float) -> Fraction:
    """``margin`` as a fraction: read from its text where that is a number, else ``value``'s.

    Examples:
        >>> _fraction("unused", 0.1), _fraction(1e-3, 1e-3)
        (Fraction(1, 10), Fraction(1, 1000))
    """
    try:
        exact = Fraction(str(given))
    except (ValueError, ZeroDivisionError):
        return Fraction(value).limit_denominator(10**9)
    return exact if abs(float(exact) - value) <= 1e-6 else Fraction(value).limit_denominator(10**9)


def _search_everywhere(
    trial: InProcess | Isolated,
    start: int,
    max_size: int | None,
    flaky: list[int],
    precision: Fraction,
) -> int:
    """The search on this rank, or under ``torch.distributed`` the minimum over every rank."""
    if not initialized():
        found = _search_and_clean(trial, start, max_size, flaky, precision)
    else:
        found, failure = 0, None
        try:
            found = _search_and_clean(trial, start, max_size, flaky, precision)
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
    return found
