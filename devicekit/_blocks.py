"""``with`` blocks made by a function call: entered once each, and usable as decorators.

``dk.claim_gpu()`` and ``dk.detect_syncs()`` return one block each. A bare
``@contextlib.contextmanager`` object entered a second time fails inside
``contextlib`` (``AttributeError: ... 'args'``), which tells the user nothing;
`EnterOnce` says what to do instead, and, used as a decorator, makes a fresh
block for each call, as ``contextlib``'s own objects do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["EnterOnce"]

T = TypeVar("T")


class EnterOnce(contextlib.ContextDecorator, Generic[T]):
    """One ``with`` block, made by ``make()`` when it is entered; a second entry is refused.

    Examples:
        >>> block = EnterOnce(lambda: contextlib.nullcontext(1), again="call it again")
        >>> with block as value:
        ...     value
        1
        >>> with block:
        ...     pass
        Traceback (most recent call last):
        ...
        RuntimeError: call it again
        >>> block = EnterOnce(lambda: contextlib.nullcontext(1), again="", name="f()", gives="x")
        >>> block.real  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AttributeError: f() has no .real: it has not run yet; enter it and read .real ...
    """

    def __init__(
        self,
        make: Callable[[], contextlib.AbstractContextManager[T]],
        *,
        again: str,
        name: str = "a devicekit",
        gives: str = "value",
        reads: Mapping[str, str] | None = None,
    ):
        self._make = make
        self._again = again  # the message for a second entry: what to call instead
        self._name = name  # what made it, for the repr: "dk.claim_gpu()"
        self._gives = gives  # a name for what it gives, for messages: "syncs"
        # Where what it gives keeps a name, when not on itself: "scope.report.peak_allocated".
        self._reads = reads or {}
        self._block: contextlib.AbstractContextManager[T] | None = None

    def _recreate_cm(self) -> EnterOnce[T]:
        # As a decorator, each call of the function gets a block of its own.
        return EnterOnce(
            self._make, again=self._again, name=self._name, gives=self._gives, reads=self._reads
        )

    def __repr__(self) -> str:
        state = "not entered yet" if self._block is None else "entered"
        return f"<{self._name} block, {state}>"

    def __getattr__(self, name: str) -> Any:
        # Only names the block lacks get here, most often one of what its with gives
        # (dk.detect_syncs().count): say where it is, not "'EnterOnce' object has no ...".
        if name.startswith("_"):  # copy's and pickle's probes, and ours before __init__
            raise AttributeError(name, name=name, obj=self)
        state = (
            "it has not run yet; enter it and read"
            if self._block is None
            else "it is the block; read"
        )
        raise AttributeError(
            f"{self._name} has no .{name}: {state} .{name} off what its `with` gives: "
            f"with {self._name} as {self._gives}: ..., then "
            f"{self._reads.get(name, f'{self._gives}.{name}')}",
            name=name,
            obj=self,
        )

    def __enter__(self) -> T:
        if self._block is not None:
            raise RuntimeError(self._again)
        self._block = self._make()
        return self._block.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        assert self._block is not None  # __exit__ follows a successful __enter__
        return self._block.__exit__(*exc_info)
