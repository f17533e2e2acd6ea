"""A mistyped keyword answered with the one meant: ``did you mean 'flush_every'?``.

Python 3.13 suggests the keyword meant by itself; 3.10 to 3.12 say only
"unexpected keyword argument 'flushevery'". `suggest_keywords` wraps a public
function (or a class's ``__init__``) so that every version says it, and so
that options passed by position are told they are keyword-only.

Only a call that could not bind is touched (the signature says so, once the
call has failed): a ``TypeError`` raised inside the function passes through as
it is. The wrapper costs one frame a call (about
0.1 µs), so it stays off the per-step paths (``to_device``, ``LogBuffer.log``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TypeVar

from typing_extensions import ParamSpec

from ._format import close_match

__all__ = ["suggest_keywords"]

P = ParamSpec("P")
R = TypeVar("R")

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def suggest_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, whose calls with a mistyped keyword name the keyword meant.

    Examples:
        >>> @suggest_keywords
        ... def scale(x, *, factor=2):
        ...     return x * factor
        >>> scale(3, factr=4)
        Traceback (most recent call last):
        ...
        TypeError: scale() got an unexpected keyword argument 'factr'; did you mean 'factor'?
        >>> scale(3, 4)
        Traceback (most recent call last):
        ...
        TypeError: scale() takes 1 positional argument but 2 were given; factor is keyword-only: \
scale(..., factor=...)
    """
    signature = inspect.signature(fn)
    parameters = signature.parameters.values()
    # With **kwargs every keyword binds: only an option passed by position is told
    # (dk.load(path, "cpu", True): verify is keyword-only).
    named = [p.name for p in parameters if p.kind in _NAMED]
    keyword_only = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    takes_more = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    call_name = _call_name(fn)

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except TypeError as error:
            if _binds(signature, args, kwargs):
                raise  # raised by fn itself: its own
            message = str(error)
            hint = _hint(message, kwargs, named, [] if takes_more else keyword_only, call_name)
            if hint is None:
                raise
            raise TypeError(f"{error}; {hint}") from None

    return call


def _binds(
    signature: inspect.Signature, args: tuple[object, ...], kwargs: dict[str, object]
) -> bool:
    """Whether the call binds: if not, the function never ran, and the error is the call's."""
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _hint(
    message: str,
    kwargs: dict[str, object],
    named: list[str],
    keyword_only: list[str],
    call_name: str,
) -> str | None:
    """The suggestion for a call that could not bind, or None where there is none to make."""
    if "did you mean" in message.lower():
        return None  # Python 3.13 and newer made it already
    for key in kwargs:
        if key not in named:
            alias = _ALIASES.get(key)
            if alias is not None and alias[0] in named and repr(key) in message:
                return f"did you mean {alias[0]!r}? ({alias[1]})"
            match = close_match(key, named, cutoff=0.7) or _prefix_of(key, named)
            if match is None or repr(key) not in message:
                return None  # nothing close, or Python complained of something else first
            return f"did you mean {match!r}?"
    if keyword_only and message.endswith(("were given", "was given")):  # too many positional
        shown = ", ".join(f"{name}=..." for name in keyword_only[:3])
        verb = "is" if len(keyword_only) == 1 else "are"
        options = ", ".join(keyword_only[:3]) + (", ..." if len(keyword_only) > 3 else "")
        return f"{options} {verb} keyword-only: {call_name}(..., {shown})"
    return None


# What other pools call the number of processes: no spelling of it (processes= read as
# progress= by its letters), but the option meant, and how it differs.
_PER_DEVICE = "the workers started on each of devices; devices= says which, and how many"
_ALIASES = dict.fromkeys(
    ("processes", "n_jobs", "max_workers", "num_workers", "nprocs"),
    ("workers_per_device", _PER_DEVICE),
)


def _prefix_of(key: str, named: list[str]) -> str | None:
    """The one keyword that ``key`` starts (``min_free`` for ``min_free_memory``), if one.

    difflib scores a short start of a long name low (0.70 for those two).
    """
    starts = [name for name in named if len(key) >= 3 and name.startswith(key)]
    return starts[0] if len(starts) == 1 else None


def _call_name(fn: Callable[..., object]) -> str:
    """How the call reads: ``LogBuffer`` for ``LogBuffer.__init__``, else the function's name."""
    qualified = getattr(fn, "__qualname__", getattr(fn, "__name__", "fn"))
    owner, _, name = qualified.rpartition(".")
    return owner.rpartition(".")[2] if name == "__init__" and owner else qualified
