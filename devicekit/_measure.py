"""``benchmark``: time a function until the result is precise, and say whether to trust it."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ._accelerators import current_cuda_device
from ._conditions import Sampler
from ._devices import DeviceLike, resolve_device
from ._energy import EnergyCounter, energy_counter, energy_use
from ._format import close_match
from ._measurecheck import MODES
from ._measurejudge import MIN_CALLS
from ._measurement import Measurement
from ._measurerun import CpuRunner, CudaRunner, Mode, noted_call, warm_up
from ._options import check_choice, check_number, check_seconds, refuse_lazy
from ._shortrepr import got, short_repr
from ._stats import relative_noise
from ._tree import iter_tensors

__all__ = ["DEFAULT_MIN_TIME", "benchmark", "callable_name", "check_options", "time_budget"]

_BATCH_SECONDS = 0.01  # measure in batches this long, then check whether to stop


def callable_name(fn: object) -> str:
    """A short label for a function, module or other callable: never a multi-line repr.

    Examples:
        >>> import functools, torch
        >>> callable_name(sorted), callable_name(torch.nn.Sequential(torch.nn.ReLU()))
        ('sorted', 'Sequential')
        >>> callable_name(functools.partial(max, 1)), callable_name(lambda: 0)
        ('max', '<lambda>')
    """
    if isinstance(fn, functools.partial):
        return callable_name(fn.func)
    if isinstance(fn, torch.nn.Module):
        inner = getattr(fn, "_orig_mod", None)  # torch.compile's wrapper names the model inside
        return type(inner if isinstance(inner, torch.nn.Module) else fn).__name__
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) and name else type(fn).__name__


def _infer_device(device: DeviceLike | None, args: Any, kwargs: Any) -> torch.device:
    if device is not None:
        return resolve_device(device)
    for _, tensor in iter_tensors((args, kwargs), "args"):
        return tensor.device
    return current_cuda_device() or torch.device("cpu")


# benchmark()'s own keyword options: every other keyword goes to fn.
OPTIONS = ("device", "warmup", "min_time", "max_time", "rel_noise", "mode")


def misspelled_options(names: Iterable[str]) -> list[str]:
    """``"min_tme (did you mean min_time?)"`` for each name that looks like a mistyped option."""
    found = []
    for name in names:
        close = close_match(name, OPTIONS, cutoff=0.75)
        if close is not None:
            found.append(f"{name} (did you mean {close}?)")
    return found


def _refuse_misspelled(kwargs: dict[str, Any]) -> None:
    """Refuse a keyword for fn that looks like a mistyped option, before any call.

    Passed on, ``maxtime=0.1`` would fail inside fn as fn's own error, or, to
    an fn taking ``**kwargs``, be ignored while the default ``max_time`` ran.
    """
    guesses = misspelled_options(kwargs)
    if guesses:
        name = next(name for name in kwargs if misspelled_options([name]))  # the first
        raise TypeError(
            f"benchmark() got {', '.join(guesses)}: it passes keywords it does not know to "
            "fn, but not one this close to its own, which fn would take for its own; if fn "
            f"does take {name}, bind it first: benchmark(functools.partial(fn, {name}=...)) "
            f"or benchmark(lambda: fn({name}=...))"
        )


DEFAULT_MIN_TIME = 0.1  # min_time left out, unless max_time is shorter: max_time wins


def _refuse_shadowed(fn: object, **options: Any) -> None:
    """Refuse an option given (not its default) that fn takes as a keyword too.

    ``benchmark(make, 1000, device="cpu")`` keeps ``device`` for itself and
    calls ``make(1000)``. A function whose signature cannot be read (a builtin
    such as ``torch.randn``) cannot be told; a ``partial`` that binds the
    keyword already has its own. Given is told by identity with the default:
    ``==`` would run a value's own comparison before its check (a numpy array's
    raises).
    """
    try:
        parameters = inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # not callable (told next), or no signature to read
        return
    bound = fn.keywords if isinstance(fn, functools.partial) else {}
    for name, value in options.items():
        parameter = parameters.get(name)
        if parameter is None or name in bound or value is _DEFAULTS[name]:
            continue
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise TypeError(
                f"benchmark() got {name}={short_repr(value)}, which is its own option, and "
                f"{callable_name(fn)} takes a {name} too: benchmark() keeps it, so fn would "
                f"run without it. Bind fn's with functools.partial: "
                f"benchmark(functools.partial(fn, {name}={short_repr(value)}), ...), and "
                f"pass benchmark()'s own {name}= besides where you mean that too"
            )


def _check_options(
    fn: object,
    *,
    warmup: float,
    min_time: float | None,
    max_time: float,
    rel_noise: float,
    mode: str,
) -> float:
    """Refuse a bad option before any call; the ``min_time`` to use (left out: its default)."""
    if not callable(fn):
        raise TypeError(
            f"benchmark() needs a function to time, got {got(fn)}. To time model(x), pass "
            "the function and its arguments, benchmark(model, x), or wrap the call, "
            "benchmark(lambda: model(x)): benchmark(model(x)) passes what the call returned"
        )
    refuse_lazy(fn, call="benchmark(fn): fn()")
    check_seconds(warmup, name="warmup", zero_ok=True, fix="0 warms up with a single call")
    if min_time is not None:
        check_seconds(
            min_time, name="min_time", zero_ok=True, fix="0 stops as soon as it is precise"
        )
    check_seconds(
        max_time, name="max_time", zero_ok=False, fix="it bounds the whole call: say max_time=10"
    )
    if min_time is not None and max_time < min_time:  # both given, and they disagree
        raise ValueError(
            f"max_time must be at least min_time ({short_repr(min_time)}), got "
            f"{short_repr(max_time)}; raise max_time or lower min_time (left out, it is "
            f"{DEFAULT_MIN_TIME:g} s, or max_time where that is shorter)"
        )
    check_number(rel_noise, name="rel_noise", above=0, meaning="0.01 means ±1%")
    if rel_noise >= 1:  # a fraction: 2 is ±200%, which any two calls meet
        raise ValueError(
            f"rel_noise must be below 1, a fraction of the median (0.01 means ±1%), got "
            f"{short_repr(rel_noise)}; for ±{rel_noise:g}% pass rel_noise={rel_noise / 100:g}"
        )
    check_choice(mode, name="mode", choices=MODES)
    return time_budget({"min_time": min_time, "max_time": max_time})[1]


_CHECKED = ("warmup", "min_time", "max_time", "rel_noise", "mode")  # OPTIONS but device


def time_budget(options: Mapping[str, Any]) -> tuple[float, float, float]:
    """``(warm-up, min_time, max_time)`` as `benchmark()` spends them for these ``options``.

    What is left out is `benchmark()`'s default; the warm-up stops at half of
    ``max_time``, and ``min_time`` left out is `DEFAULT_MIN_TIME`, or
    ``max_time`` where that is shorter.

    Examples:
        >>> time_budget({"max_time": 0.05})
        (0.025, 0.05, 0.05)
    """
    defaults = inspect.signature(benchmark).parameters
    max_time = float(options.get("max_time", defaults["max_time"].default))
    warmup = float(options.get("warmup", defaults["warmup"].default))
    min_time = options.get("min_time")
    return (
        min(warmup, max_time / 2),
        min(DEFAULT_MIN_TIME, max_time) if min_time is None else float(min_time),
        max_time,
    )


def check_options(options: dict[str, Any]) -> None:
    """Check `benchmark()`'s keyword ``options`` (names already known) before any call.

    For `compare()`, whose functions would otherwise meet a bad option only
    once the first of them was about to be measured.
    """
    given = {name: value for name, value in options.items() if name != "device"}
    values = {name: _DEFAULTS[name] for name in _CHECKED} | given
    _check_options(lambda: None, **{name: values[name] for name in _CHECKED})
    if options.get("device") is not None:
        resolve_device(options["device"])


def _energy_counter(target: torch.device, mode: str) -> EnergyCounter | None:
    # In cold mode the L2 flushes between calls would count as the function's energy.
    return None if mode == "cold" else energy_counter(target)


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    device: DeviceLike | None = None,
    warmup: float = 0.05,
    min_time: float | None = None,
    max_time: float = 2.0,
    rel_noise: float = 0.01,
    mode: Mode = "warm",
    **kwargs: Any,
) -> Measurement:
    """Time ``fn(*args, **kwargs)`` until the median is known to ``rel_noise``, and judge it.

    Warms up for ``warmup`` seconds (compilation, caches and first-call costs
    stay out), then times calls in batches until the median's 95% confidence
    interval is within ±``rel_noise`` (after at least ``min_time`` and 10
    calls) or the whole call has taken ``max_time``; ``stop_reason`` says
    which. A run that stops at ``max_time`` is judged by the precision it
    reached, and its note says what it fell short of: the ``rel_noise``
    target, or only ``min_time`` (or 10 calls) with the target met. On a
    GPU every call is timed with CUDA events, and the host time to issue it
    is kept too, so launch-bound code shows itself. Around the run it
    gathers evidence (other processes on the GPU and on this process's CPU
    cores, the GPU's utilization, clocks and throttling) into ``conditions``,
    and ``Measurement.trustworthy`` and ``Measurement.notes`` say what it
    means. It also times a call that does nothing (on a GPU: takes the
    events' 0.5 µs resolution): a median under ten times that floor may be
    a tenth or more the clock's own cost, and is not trustworthy. On a GPU
    with an energy counter, timed calls lasting a second or more also give
    joules per call and watts.

    Args:
        fn: The function (or module) to time; its result is discarded.
        *args: Passed to ``fn``.
        device: Where ``fn`` runs. Default: the device of the first tensor
            in the arguments, else the current CUDA device if CUDA is
            initialized, else the CPU.
        warmup: Seconds of untimed calls first (at least one call). Warm-up
            counts against ``max_time``, and stops at half of it at most
            (but a first call longer than that still runs to its end: when
            it leaves too little time, the note says how long it took and
            how much ``max_time`` would do).
        min_time: Seconds of timed calls at least, unless ``max_time`` comes
            first. Default: 0.1, or ``max_time`` where that is shorter
            (``max_time`` bounds the call); one given above ``max_time`` is a
            ``ValueError``. The warm-up counts against ``max_time``, so reaching
            ``min_time`` takes ``max_time`` of about ``min_time`` plus the
            warm-up plus 10 ms (0.16 s with the defaults); a shorter
            ``max_time`` is allowed (it bounds the call), and a run it cuts
            short of ``min_time`` is still trustworthy when precise.
        max_time: Seconds the whole call may take, warm-up included (it
            overshoots by one call at most, as the clock is read after
            each, plus on a GPU the calls still queued: at least one call
            is timed).
        rel_noise: The precision target for the median: 0.01 is ±1%.
        mode: ``"warm"`` (caches warm, the default), ``"cold"`` (the L2 cache
            is flushed before every call, untimed) or ``"graph"`` (the calls
            are captured in a CUDA graph and its replays timed: no launch
            overhead). ``cold`` and ``graph`` need a CUDA device.
        **kwargs: Passed to ``fn`` (so ``fn`` cannot take the option names
            above). A keyword one typo away from an option (``maxtime``,
            ``min_tme``) is refused instead: bind it with `functools.partial`
            or a lambda if ``fn`` really takes it. So is an option given
            that ``fn``'s signature takes too (``device=``, ``mode=``), which
            ``fn`` would never see; a builtin's signature cannot be read
            (``torch.randn``): bind its ``device=`` yourself.

    Returns:
        The [`Measurement`][devicekit.Measurement].

    Raises:
        TypeError: ``fn`` is not callable, or is a generator or ``async``
            function (a call would only create the generator or coroutine),
            or an option is not a number, ``mode`` is not a string, or a
            keyword looks like a misspelled option.
        ValueError: An option is out of range or not finite, ``mode`` is not
            one of the three (the likely one is named), or ``mode`` needs CUDA.

    Examples:
        >>> import devicekit as dk
        >>> m = dk.benchmark(sorted, list(range(1000, 0, -1)), max_time=0.5)
        >>> m.name, m.median > 0, m.stop_reason in ("converged", "max_time")
        ('sorted', True, True)
    """
    _refuse_shadowed(
        fn,
        device=device,
        warmup=warmup,
        min_time=min_time,
        max_time=max_time,
        rel_noise=rel_noise,
        mode=mode,
    )
    min_time = _check_options(
        fn, warmup=warmup, min_time=min_time, max_time=max_time, rel_noise=rel_noise, mode=mode
    )
    _refuse_misspelled(kwargs)
    target = _infer_device(device, args, kwargs)
    if mode != "warm" and target.type != "cuda":
        raise ValueError(f"mode={mode!r} needs a CUDA device, but fn runs on {target}")
    began = time.perf_counter()
    deadline = began + max_time
    sampler = Sampler(target)
    sampler.before()
    counter = _energy_counter(target, mode)
    call = functools.partial(fn, *args, **kwargs)
    runner: CpuRunner | CudaRunner = (
        CudaRunner(call, target, mode) if target.type == "cuda" else CpuRunner(call)
    )
    # Warm-up counts against max_time and leaves at least half of it for the timed calls.
    warm_until = began + time_budget({"warmup": warmup, "max_time": max_time})[0]
    warmup_time = warm_up(runner, warm_until, fn)
    per_call = max(warmup_time / runner.warmed, 1e-9)  # a coarse clock can read 0
    if isinstance(runner, CudaRunner) and mode == "graph":
        noted_call(runner, functools.partial(runner.capture, per_call), "capture")
        per_call /= 2  # replays are cheaper than eager calls; batches stay short anyway
    clock_floor = runner.floor()

    times = runner.times
    ordered: list[float] = []  # sorted times, merged in only when checked
    sampler.start_timing()
    energy_before = None if counter is None else counter.read()
    measure_began = time.perf_counter()
    while True:
        left = deadline - time.perf_counter()
        # min() before int(): with a max_time near float's largest (1e308) left / per_call
        # is inf, which int() refuses; the batch's own bound is always finite.
        batch = max(1, int(min(_BATCH_SECONDS / max(per_call, 1e-7), left / per_call)))
        batch_began = time.perf_counter()
        before = len(runner.host)
        # The deadline goes in: calls that turn slower than the last batch's would run the
        # whole batch past max_time (39x, seen), where one clock reading ends it.
        noted_call(runner, functools.partial(runner.run, batch, deadline), "timed")
        # The warm-up's estimate can be far off (a first call that compiles takes
        # seconds): without this, a fast function would be timed one call per batch.
        ran = max(len(runner.host) - before, 1)  # fewer than batch where the deadline came
        per_call = max((time.perf_counter() - batch_began) / ran, 1e-9)
        sampler.during()
        now = time.perf_counter()
        # The deadline first: a run past max_time stopped because time ran out, even where
        # its last batch also made it precise ("converged" would hide the overrun).
        if now >= deadline:
            stop_reason = "max_time"
            break
        if len(times) >= MIN_CALLS and now - measure_began >= min_time:
            # A sorted run plus the new tail: Timsort merges them in linear time.
            ordered = sorted(ordered + times[len(ordered) :])
            noise = relative_noise(ordered)
            if noise is not None and noise <= rel_noise:
                stop_reason = "converged"
                break
    measured = time.perf_counter() - measure_began
    energy_after = None if counter is None else counter.read()
    calls = len(times) * (runner.calls_per_replay if isinstance(runner, CudaRunner) else 1)
    energy, power = energy_use(energy_before, energy_after, measured, calls)
    return Measurement.from_times(
        times,
        runner.host,
        name=callable_name(fn),
        mode=mode,
        stop_reason=stop_reason,
        conditions=sampler.after(),
        energy_per_call=energy,
        power=power,
        warmup=warmup,
        warmup_time=warmup_time,
        clock_floor=clock_floor,
        min_time=min_time,
        rel_noise_target=rel_noise,
    )


# Its options' defaults, read once: an option is "given" where it is not the default itself.
_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(benchmark).parameters.items()
    if name in OPTIONS
}
