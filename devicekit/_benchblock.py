"""``Benchmark``: d2l's timing block, synchronized, and a decorator too."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import ParamSpec, TypeVar

from ._devices import DeviceLike
from ._format import format_seconds
from ._keywords import suggest_keywords
from ._options import LAZY_RESULTS, refuse_lazy, refuse_lazy_result, wraps_a_call
from ._shortrepr import short_repr
from ._timing import Timer

__all__ = ["Benchmark"]

P = ParamSpec("P")
R = TypeVar("R")


class Benchmark:
    """d2l's ``Benchmark`` context manager, but synchronized, so its numbers are right.

    Prints ``"{description}: {seconds:.4f} sec"`` when the block ends, and keeps
    the time in ``elapsed``. A block under a millisecond, which that format
    shows as ``0.0000`` or with one digit, is printed in human units instead
    (``sum: 12.3 µs``). Also a decorator (``@dk.Benchmark("step")``): each
    call is a block of its own (recursive calls and threads included), printed,
    and ``elapsed`` holds the last one to end.

    Args:
        description: What the printed line starts with.
        device: As for [`Timer`][devicekit.Timer].

    Examples:
        >>> import devicekit as dk
        >>> with dk.Benchmark("sum") as bench:
        ...     _ = sum(range(10))  # doctest: +ELLIPSIS
        sum: ... µs
        >>> bench.elapsed >= 0
        True
    """

    @suggest_keywords
    def __init__(self, description: str = "Done", *, device: DeviceLike | None = None) -> None:
        if not isinstance(description, str):
            raise TypeError(
                f"description must be a string, the label printed with the time, got "
                f"{short_repr(description)} of type {type(description).__name__}; Benchmark takes "
                "it "
                "first, and the device as device="
            )
        self.description = description
        self.elapsed: float | None = None
        self._timer = Timer(device=device, sync=True)
        self._quiet = False  # a refused call prints no time

    def __enter__(self) -> Benchmark:
        # A second block (nested, or in another thread) is refused as Timer refuses it.
        timer = self._timer
        timer._claim_block(f"this Benchmark ({self.description!r})", "Benchmark")
        try:
            timer._running = timer._begin()  # the block's lap, in place of any before
        except BaseException:
            timer._release_block()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._timer.__exit__(exc_type, exc, traceback)
        self.elapsed = self._timer.elapsed
        if self._quiet:
            return
        # d2l's format, where it has digits to show; "0.0000 sec" is what made people ask.
        took = f"{self.elapsed:.4f} sec" if self.elapsed >= 1e-3 else format_seconds(self.elapsed)
        print(f"{self.description}: {took}")

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Time and print each call of ``fn``, as the block does (``@dk.Benchmark("step")``).

        Raises:
            TypeError: ``fn`` is not callable, or is a generator or ``async``
                function (a call only creates it: nothing of the work is timed).
                A call that returns one, where ``fn`` is a lambda or
                ``partial`` around such a function, raises it too, and prints
                no time.
        """
        if not callable(fn):
            raise TypeError(
                f"@dk.Benchmark({self.description!r}) decorates a function, got "
                f"{short_repr(fn)}; to time a block, write `with dk.Benchmark(...):` around it"
            )
        refuse_lazy(
            fn,
            call=f"@dk.Benchmark({self.description!r}): fn()",
            fix="time the loop that does the work `with dk.Benchmark(...):`",
        )

        wrapping = wraps_a_call(fn)

        @functools.wraps(fn)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            # A block per call, as Timer's laps: a recursive call, or calls from two
            # threads at once, are blocks of their own, not a second entry into one.
            block = Benchmark(self.description, device=self._timer._device)
            try:
                with block:
                    result = fn(*args, **kwargs)
                    if wrapping and isinstance(result, LAZY_RESULTS):  # a lambda around one
                        block._quiet = True  # no time printed for a call that did no work
                        refuse_lazy_result(
                            fn,
                            result,
                            decorator=f"@dk.Benchmark({self.description!r})",
                            block="dk.Benchmark(...)",
                        )
                return result
            finally:
                if block.elapsed is not None and not block._quiet:
                    self.elapsed = block.elapsed  # the last call to end that did work

        return timed

    def __repr__(self) -> str:
        took = "not run yet" if self.elapsed is None else format_seconds(self.elapsed)
        return f"Benchmark({self.description!r}: {took})"
