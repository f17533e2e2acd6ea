"""``with`` blocks made by a function call: entered once each, and usable as decorators.

``dk.claim_gpu()`` and ``dk.detect_syncs()`` return one block each. A bare
``@contextlib.contextmanager`` object entered a second time fails inside
``contextlib`` (``AttributeError: ... 'args'``), which tells the user nothing;
`EnterOnce` says what to do instead, and, used as a decorator, makes a fresh
block for each call, as ``contextlib``'s own objects do. It refuses to
decorate where the block would not cover the body (a generator or ``async``
function) or where what the block gives would be lost (a report nobody could
read): a decorated function returns only its own value.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from ._options import deferred_kind
from ._shortrepr import short_repr

__all__ = ["EnterOnce"]

T = TypeVar("T")

# Guards each block's "entered" mark, so that two threads entering one block cannot both get
# in. One for all blocks, held for a test and a set only; a fork's child gets its own.
_entering = threading.Lock()


def _new_lock_in_child() -> None:
    global _entering  # noqa: PLW0603 - the module's lock, replaced once per fork
    _entering = threading.Lock()  # a parent's thread may have held it at the fork


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_new_lock_in_child)
F = TypeVar("F", bound=Callable[..., Any])


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
        undecorating: str | None = None,
    ):
        self._make = make
        self._again = again  # the message for a second entry: what to call instead
        self._name = name  # what made it, for the repr: "dk.claim_gpu()"
        self._gives = gives  # a name for what it gives, for messages: "syncs"
        # Where what it gives keeps a name, when not on itself: "scope.report.peak_allocated".
        self._reads = reads or {}
        # Why it is no decorator, where what it gives would be lost (a report nobody can
        # read, a GPU the function never learns of): None where decorating makes sense.
        self._undecorating = undecorating
        self._block: contextlib.AbstractContextManager[T] | None = None
        # Set, under `_entering`, before the block is made: entering can take a while (a
        # claim that waits for a GPU), and a second thread must be refused meanwhile, not
        # let in to make a block of its own over the first one's.
        self._entered = False

    def __call__(self, func: F) -> F:
        """Decorate ``func``: each call runs in a block of its own.

        Refused where the block would not cover what the function does: a
        generator or ``async`` function runs its body after the call returns,
        outside the block, so nothing in it would be watched or held.
        """
        name = getattr(func, "__qualname__", None) or short_repr(func)
        if self._undecorating is not None:
            raise TypeError(
                f"{self._name} cannot decorate {name}: {self._undecorating}; open the block "
                f"in its body instead: with {self._name} as {self._gives}: ..."
            )
        kind = deferred_kind(func)
        if kind is not None:
            raise TypeError(
                f"{self._name} cannot decorate {name}, {kind}: its body runs after the call "
                f"returns, outside the block, so the block would cover none of it; open "
                f"the block in its body instead: with {self._name} as {self._gives}: ..."
            )
        return super().__call__(func)

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
        given = f"with {self._name} as {self._gives}: ..."
        if name == self._gives:  # dk.visible_devices(...).devices: what it gives is that
            state = "it has not run yet" if self._block is None else "it is the block"
            how = f"{state}; its `with` gives the {name} itself: {given}"
        else:
            state = (
                "it has not run yet; enter it and" if self._block is None else "it is the block;"
            )
            read = self._reads.get(name, f"{self._gives}.{name}")
            how = f"{state} read .{name} off what its `with` gives: {given}, then {read}"
        raise AttributeError(
            f"{self._name} has no .{name}: {how}",
            name=name,
            obj=self,
        )

    def __enter__(self) -> T:
        with _entering:
            if self._entered:
                raise RuntimeError(self._again)
            self._entered = True
        try:
            block = self._make()
            value = block.__enter__()
        except BaseException:
            self._entered = False  # one that refused its arguments was never entered
            raise
        self._block = block
        return value

    def __exit__(self, *exc_info: Any) -> bool | None:
        if self._block is None:  # an ExitStack or a hand-written __exit__ gone wrong
            raise RuntimeError(
                f"{self._name} was left without being entered: call __enter__ first, or "
                f"write with {self._name} as {self._gives}: ..."
            )
        return self._block.__exit__(*exc_info)
