"""``with`` blocks made by a function call: entered once each, and usable as decorators.

``dk.claim_gpu()`` and ``dk.detect_syncs()`` return one block each. A bare
``@contextlib.contextmanager`` object entered a second time fails inside
``contextlib`` (``AttributeError: ... 'args'``), which tells the user nothing;
`EnterOnce` says what to do instead, and, used as a decorator, makes a fresh
block for each call, as ``contextlib``'s own objects do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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
    """

    def __init__(
        self,
        make: Callable[[], contextlib.AbstractContextManager[T]],
        *,
        again: str,
        name: str = "a devicekit",
    ):
        self._make = make
        self._again = again  # the message for a second entry: what to call instead
        self._name = name  # what made it, for the repr: "dk.claim_gpu()"
        self._block: contextlib.AbstractContextManager[T] | None = None

    def _recreate_cm(self) -> EnterOnce[T]:
        # As a decorator, each call of the function gets a block of its own.
        return EnterOnce(self._make, again=self._again, name=self._name)

    def __repr__(self) -> str:
        state = "not entered yet" if self._block is None else "entered"
        return f"<{self._name} block, {state}>"

    def __enter__(self) -> T:
        if self._block is not None:
            raise RuntimeError(self._again)
        self._block = self._make()
        return self._block.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        assert self._block is not None  # __exit__ follows a successful __enter__
        return self._block.__exit__(*exc_info)
