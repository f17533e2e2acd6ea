"""``explain_oom``: when a device runs out of memory, say where the memory is and what to do.

A context manager and a decorator. When an out-of-memory error leaves the
block, ``__exit__`` builds the report (`_oomread`) while the failed block's
frames are still alive (the traceback holds them), so the numbers are those of
the moment of failure, and raises a ``DeviceOutOfMemoryError`` that carries it
from torch's error (the host's ``MemoryError`` gets it as a note instead).

The error raised is a ``DeviceOutOfMemoryError`` whose one argument is the
report, ending with torch's first line: the retry loops that look for torch's
words in ``args[0]`` (accelerate's ``find_executable_batch_size``, Lightning's
batch-size finder) go on retrying. An error of a class of its own (the user's
``class MyOOM(torch.OutOfMemoryError)``, torch's ``AcceleratorError``) becomes
an instance of that class too (`_with_class`), with its attributes: every
``except`` that caught it still does.

A plain function comes back decorated as an `_Explained`, not as a function:
``with dk.explain_oom(step):`` then fails with the fix (`_misuse`), where a
function would fail with Python's bare "does not support the context manager
protocol". It binds as a method and pickles by name as the function it
replaces does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any, Literal, NoReturn, TypeVar, overload

import torch

from ._accelerators import accelerator_count, accelerator_type
from ._devices import DeviceLike, resolve_device
from ._errors import DeviceOutOfMemoryError, add_note
from ._keywords import suggest_keywords
from ._oomread import build_report
from ._oomreport import OOMReport
from ._oomtext import is_oom
from ._options import check_count, check_flag
from ._shortrepr import short_repr

__all__ = ["explain_oom"]

F = TypeVar("F", bound=Callable[..., Any])
_record_history: Any = torch.cuda.memory._record_memory_history  # unannotated in torch


def _history_enabled() -> bool:
    """Whether CUDA's memory-history recorder is on (a private torch call, there since 2.1)."""
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(probe()) if probe is not None else False


def _misuse(func: object) -> TypeError:
    """The error for ``func`` given where it cannot serve: what was received, and the fix.

    A module is refused as soon as it is given (decorated, it would become a
    function without parameters); a function is decorated, and refused when the
    result is entered as a block instead of called.
    """
    if isinstance(func, torch.nn.Module):
        # Callable, so it would be decorated: the result is a function, not a module (no
        # parameters(), no train()), and `with dk.explain_oom(model):` fails in Python.
        return TypeError(
            f"explain_oom() takes a function to decorate as its first argument, got the module "
            f"{type(func).__name__}; a module goes in model= (it names the report's tensors): "
            "`with dk.explain_oom(model=model):`, or `@dk.explain_oom(model=model)` on the "
            "step. To explain each forward pass, decorate a function that calls the model"
        )
    name = getattr(func, "__name__", None)
    what = f"the function {name}" if isinstance(name, str) else f"a {type(func).__name__}"
    return TypeError(
        f"`with dk.explain_oom(fn):` got {what}, but explain_oom(fn) is a decorator: it "
        "returns fn wrapped, to be called, not a block to enter. For a block, write "
        "`with dk.explain_oom():` around the code (options by keyword: "
        "`with dk.explain_oom(model=model):`); for the function, put `@dk.explain_oom` above "
        "its def (or `fn = dk.explain_oom(fn)`) and call it"
    )


def _lookup(module: object, qualname: str) -> object:
    """What ``module.qualname`` names (``Trainer.step``: an attribute of an attribute); None."""
    found = sys.modules.get(module) if isinstance(module, str) else None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


# One class per class of error, so that two such errors are of one type.
_CLASSES: dict[type[BaseException], type[DeviceOutOfMemoryError] | None] = {}


def _with_class(base: type[BaseException]) -> type[DeviceOutOfMemoryError] | None:
    """A ``DeviceOutOfMemoryError`` that is a ``base`` too; None where Python cannot make one.

    ``base.__init__`` is never called (its parameters are the user's): the error
    gets the original's attributes copied instead (`explained_error`).
    """
    if base in _CLASSES:
        return _CLASSES[base]
    return _CLASSES.setdefault(base, _make_class(base))  # a racing thread's, if it was first


def _make_class(base: type[BaseException]) -> type[DeviceOutOfMemoryError] | None:
    name = f"DeviceOutOfMemoryError[{base.__qualname__}]"
    namespace = {
        "__module__": "devicekit",
        "__qualname__": name,
        "__doc__": f"A DeviceOutOfMemoryError that is a {base.__qualname__} too.",
        "__str__": BaseException.__str__,  # the report, whatever base's own __str__ shows
        "__reduce__": _reduce,
        "_devicekit_base": base,
    }
    try:
        return type(name, (DeviceOutOfMemoryError, base), namespace)
    except Exception:  # noqa: BLE001 - a layout, metaclass or __init_subclass__ refusal
        return None


def _reduce(self: BaseException) -> tuple[Any, ...]:
    # Pickled as the user's class and the arguments; the state carries the attributes.
    state = {**vars(self), **_slot_values(self)}  # BaseException's setstate sets each
    return _rebuild, (type(self)._devicekit_base, self.args), state  # type: ignore[attr-defined]


def _rebuild(base: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """Unpickle an error of `_with_class` (``base`` made one when it was raised)."""
    cls = _with_class(base)
    return BaseException.__new__(base if cls is None else cls, *args)


def explained_error(
    error: BaseException, report: OOMReport | None, *, message: str | None = None
) -> BaseException | None:
    """The ``DeviceOutOfMemoryError`` to raise from ``error``; None: keep ``error`` itself.

    torch's own classes become a plain one. Any other class (a subclass of
    theirs) becomes one that is that class too, with ``error``'s attributes;
    where no such class can be made, ``error`` is kept, with the report as a
    note and as ``report``. ``message`` (default: the report) is the new
    error's; ``error`` may be one this made (find_batch_size rewords it), whose
    class is reused, not wrapped again.
    """
    message = str(report) if message is None else message
    if type(error) in (torch.OutOfMemoryError, RuntimeError, DeviceOutOfMemoryError):
        return DeviceOutOfMemoryError(message, report)
    cls = _with_class(getattr(type(error), "_devicekit_base", type(error)))
    if cls is not None:
        try:
            explained = BaseException.__new__(cls, message)
        except TypeError:  # a __new__ of base's own that BaseException's cannot stand in for
            pass
        else:
            # Its notes stay on error, shown as the cause's, as for torch's own class.
            explained.__dict__.update((k, v) for k, v in vars(error).items() if k != "__notes__")
            _copy_slots(error, explained)
            explained.__dict__["report"] = report
            return explained
    add_note(error, f"devicekit.explain_oom:\n{message}")
    with contextlib.suppress(AttributeError, TypeError):  # a class that refuses attributes
        error.report = report  # type: ignore[attr-defined]
    return None


def _slot_values(error: BaseException) -> dict[str, Any]:
    """What ``error`` keeps in ``__slots__`` (no ``__dict__`` holds it), by attribute name."""
    values: dict[str, Any] = {}
    for klass in type(error).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            name = f"_{klass.__name__.lstrip('_')}{slot}" if slot.startswith("__") else slot
            with contextlib.suppress(AttributeError):  # a slot never set
                values[name] = getattr(error, name)
    return values


def _copy_slots(source: BaseException, target: BaseException) -> None:
    """Copy what ``source`` keeps in ``__slots__`` to ``target`` (a class of its slots)."""
    for name, value in _slot_values(source).items():
        with contextlib.suppress(AttributeError, TypeError):  # read-only
            setattr(target, name, value)


class _Explained:
    """A function that `explain_oom` decorated: each call runs in a block of its own.

    Not a function, so that entering it (``with dk.explain_oom(step):``) can
    say what to write instead; bound as a method, copied as itself and pickled
    by name, as a function is.
    """

    def __init__(self, func: Callable[..., Any], options: tuple[Any, ...]) -> None:
        functools.update_wrapper(self, func)  # __name__, __doc__, ..., and __wrapped__
        self._explained = (func, options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        func, options = self._explained
        with _ExplainOOM(*options):  # a fresh one per call: calls may nest or overlap
            return func(*args, **kwargs)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __enter__(self) -> NoReturn:
        raise _misuse(self._explained[0])

    def __exit__(self, *exc_info: object) -> Literal[False]:
        return False

    def __copy__(self) -> _Explained:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Explained:
        return self  # as a function is: a copy of model= would label nothing

    def __reduce__(self) -> str | tuple[Any, ...]:
        # By name where the name leads here (`@dk.explain_oom` on a module's function), as
        # a function is pickled; else the function and options, to decorate again.
        name = self.__dict__.get("__qualname__")
        if isinstance(name, str) and _lookup(self.__dict__.get("__module__"), name) is self:
            return name
        return (_Explained, self._explained)

    def __repr__(self) -> str:
        return f"<{self._explained[0]!r} explained by devicekit.explain_oom>"


class _ExplainOOM:
    """What [`explain_oom()`][devicekit.explain_oom] returns: a context manager, and a decorator."""

    def __init__(
        self,
        device: torch.device | None,
        model: torch.nn.Module | None,
        record_history: bool,
        top: int,
        history_entries: int,
    ) -> None:
        self._options = (device, model, record_history, top, history_entries)
        self._recording = False  # the recorder is on: the report can name allocation sites
        self._started = False  # this block turned it on, so it turns it off

    def __enter__(self) -> None:
        _, _, record_history, _, entries = self._options
        if record_history and accelerator_type() == "cuda" and accelerator_count() > 0:
            # Starts CUDA if it has not started: the recorder lives in CUDA's allocator.
            # A recorder someone else started keeps running, with their settings.
            if not _history_enabled():
                _record_history(
                    enabled="all", context="alloc", stacks="python", max_entries=entries
                )
                self._started = True
            self._recording = True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> Literal[False]:
        device, model, _, top, _ = self._options
        try:
            if error is None or isinstance(error, DeviceOutOfMemoryError):
                return False
            host = isinstance(error, MemoryError)
            if not (host or is_oom(error)):
                return False
            try:
                report = build_report(
                    error, device=device, model=model, top=top, sites=self._recording
                )
            except Exception as failure:  # noqa: BLE001 - a failed report must never hide the OOM
                add_note(error, f"devicekit.explain_oom could not build a report: {failure!r}")
                return False
            if host:
                # Still a MemoryError, so `except MemoryError` catches it: the report is a note.
                add_note(
                    error,
                    f"devicekit.explain_oom: a host allocation failed (MemoryError).\n{report}",
                )
                return False
            explained = explained_error(error, report)
            if explained is None:
                return False
            raise explained from error
        finally:
            if self._started:
                _record_history(enabled=None)
            self._recording = self._started = False

    def __call__(self, func: F) -> F:
        options = self._options
        # Above @staticmethod or @classmethod: the function inside is what runs, and the
        # descriptor must stay outermost, or a call on an instance passes it as an argument.
        if isinstance(func, (staticmethod, classmethod)):
            return type(func)(self(func.__func__))
        # A generator's or coroutine's body runs after the call returns, so wrapping the
        # call alone would leave every out-of-memory error in it unexplained.
        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def explained_generator(*args: Any, **kwargs: Any) -> Any:
                with _ExplainOOM(*options):
                    return (yield from func(*args, **kwargs))

            return explained_generator  # type: ignore[return-value]
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def explained_coroutine(*args: Any, **kwargs: Any) -> Any:
                with _ExplainOOM(*options):
                    return await func(*args, **kwargs)

            return explained_coroutine  # type: ignore[return-value]
        if inspect.isasyncgenfunction(func):
            raise TypeError(
                f"explain_oom cannot decorate the async generator {func.__qualname__}: its "
                "body runs between the awaits of whoever iterates it; use "
                "`with dk.explain_oom():` inside it instead"
            )
        return _Explained(func, options)  # type: ignore[return-value]


@overload
def explain_oom(
    func: F,
    /,
    *,
    device: DeviceLike | None = None,
    model: torch.nn.Module | None = None,
    record_history: bool = False,
    top: int = 10,
    history_entries: int = 100_000,
) -> F: ...


@overload
def explain_oom(
    *,
    device: DeviceLike | None = None,
    model: torch.nn.Module | None = None,
    record_history: bool = False,
    top: int = 10,
    history_entries: int = 100_000,
) -> _ExplainOOM: ...


@suggest_keywords
def explain_oom(
    func: Callable[..., Any] | None = None,
    /,
    *,
    device: DeviceLike | None = None,
    model: torch.nn.Module | None = None,
    record_history: bool = False,
    top: int = 10,
    history_entries: int = 100_000,
) -> Any:
    """Turn an out-of-memory error into a report: where the memory is, and what to do.

    A context manager (``with dk.explain_oom():``) and a decorator
    (``@dk.explain_oom`` or ``@dk.explain_oom(model=model)``). When
    ``torch.OutOfMemoryError``, or an older out-of-memory ``RuntimeError`` (the
    CPU's "can't allocate memory" included), leaves the block, it raises
    [`DeviceOutOfMemoryError`][devicekit.DeviceOutOfMemoryError] from it: a subclass of
    ``torch.OutOfMemoryError``, so existing handlers still catch it, whose
    message is the report and whose ``report`` is an [`OOMReport`][devicekit.OOMReport].
    torch's error and its traceback stay attached as ``__cause__``, and its
    first line ends the message (``original message: CUDA out of memory.
    ...``), so the retry loops of accelerate, Lightning and transformers,
    which look for torch's words, still retry. An error of another class
    than torch's own (a subclass of it) becomes an instance of that class
    too, with its attributes, so ``except`` on that class still catches it. Python's
    ``MemoryError`` (the host's memory: NumPy, ``bytearray``, a list) stays a
    ``MemoryError``, so ``except MemoryError`` still catches it, and gets the
    report of the CPU's memory as a note (Python 3.11 and later; logged on
    3.10). Any other exception passes through untouched.

    The report has the device's total, free, allocated and reserved bytes;
    the reserved-but-unallocated bytes and the largest free block (the
    fragmentation); the other processes on that GPU and this process's share
    (NVML); the largest live tensors, named when ``model`` is given; and fixes
    ranked by what those numbers show. Building it allocates nothing on the
    device and never starts CUDA.

    Args:
        func: The function to decorate, when used as ``@dk.explain_oom``.
        device: The device to report on. Default: the one torch's message
            names, else the current CUDA device, else the CPU. The host's
            memory running out (``MemoryError``, the CPU allocator's message)
            is reported on the CPU, whatever ``device`` says. The numbers of a
            message about another device are not reported as ``device``'s.
        model: A module whose parameter, gradient and buffer names label the
            tensors in the report.
        record_history: Record where each block is allocated while the block
            runs (torch's memory-history recorder, at most ``history_entries``
            events, switched off again on exit unless it was already on), and
            list the lines that allocated the largest blocks. CUDA only;
            starts CUDA if needed.
        top: How many tensors and blocks to list.
        history_entries: The recorder's ring size, when recording.

    Returns:
        A context manager that is also a decorator; with ``func``, the
        decorated function, to be called: ``with dk.explain_oom(func):``
        raises a ``TypeError`` that says to write ``with dk.explain_oom():``
        or ``@dk.explain_oom``.

    Raises:
        DeviceOutOfMemoryError: From the block, in place of an out-of-memory error.
        TypeError: ``model`` is not a ``torch.nn.Module``, ``device`` not a
            device, ``record_history`` not True or False, ``func`` an async
            generator function (use the context manager inside it), or
            ``func`` a ``torch.nn.Module`` (a module is meant as ``model=``:
            decorated, it would become a function without its parameters);
            or, on entering it, the decorated ``func`` used as a block.
        ValueError: ``top`` or ``history_entries`` is below 1, or
            ``history_entries`` past ``sys.maxsize``.
        DeviceNotFoundError: ``device`` does not exist here.

    Examples:
        >>> import torch, devicekit as dk
        >>> try:
        ...     with dk.explain_oom():
        ...         torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: no machine has that
        ... except torch.OutOfMemoryError as error:
        ...     print(error.report.device, error.report.requested == 2**62)
        cpu True
    """
    if isinstance(func, torch.nn.Module):
        raise _misuse(func)
    if func is not None and not callable(func):
        raise TypeError(
            f"explain_oom() takes a function to decorate or keyword options only, got "
            f"{func!r}; write dk.explain_oom(device=...) for options"
        )
    target = None if device is None else resolve_device(device, name="device")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, whose parameter names label the report, got "
            f"{type(model).__name__}"
        )
    # Strictly a bool: record_history="no" would be truthy, and recording starts CUDA.
    record_history = check_flag(record_history, name="record_history")
    # Plain ints on: np.int64 would reach the report and torch's recorder.
    top = check_count(top, name="top", minimum=1)
    entries = check_count(history_entries, name="history_entries", minimum=1)
    if entries > sys.maxsize:
        # torch's recorder takes a C++ size_t: past it, pybind's bare "incompatible
        # function arguments" would surface at the first out-of-memory error, on CUDA only.
        raise ValueError(
            f"history_entries must be at most sys.maxsize ({sys.maxsize:,}), got "
            f"{short_repr(history_entries)}; for no practical bound pass sys.maxsize (torch's "
            "own default), else fewer"
        )
    options = _ExplainOOM(target, model, record_history, top, entries)
    # explain_oom(fn, model=m) applies its options to fn, as @explain_oom(model=m) does.
    return options if func is None else options(func)
