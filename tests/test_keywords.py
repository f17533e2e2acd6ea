"""suggest_keywords: a call that cannot bind names the keyword meant, on every Python."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._keywords import suggest_keywords


@suggest_keywords
def scale(x: float, *, factor: float = 2.0, offset: float = 0.0) -> float:
    if x < 0:
        raise TypeError("raised inside scale")
    return x * factor + offset


class Buffer:
    @suggest_keywords
    def __init__(self, *, flush_every: int = 1) -> None:
        self.flush_every = flush_every


def test_a_mistyped_keyword_names_the_one_meant() -> None:
    with pytest.raises(TypeError, match=r"'factr'; did you mean 'factor'\?$"):
        scale(1.0, factr=3.0)  # type: ignore[call-arg]


def test_the_start_of_a_long_keyword_names_it() -> None:
    # Before, nothing: difflib scores "min_free" against "min_free_memory" at 0.70.
    with pytest.raises(TypeError, match=r"'min_free'; did you mean 'min_free_memory'\?$"):
        dk.pick_gpu(min_free=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'mi'$"):  # too short to say which
        dk.pick_gpu(mi=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'m'$"):
        dk.pick_gpu(m=1)  # type: ignore[call-arg]


def test_another_pool_s_name_for_its_process_count_names_workers_per_device() -> None:
    # Before: processes=2, what a multiprocessing.Pool user writes, got "did you mean
    # 'progress'?", by its letters.
    for key in ("processes", "n_jobs", "max_workers"):
        with pytest.raises(
            TypeError, match=rf"'{key}'; did you mean 'workers_per_device'\? \(the workers"
        ):
            dk.gpu_map(abs, [1], **{key: 2})


def test_a_class_is_named_as_it_is_called() -> None:
    with pytest.raises(TypeError, match=r"'flushevery'; did you mean 'flush_every'\?$"):
        Buffer(flushevery=3)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match=r"flush_every is keyword-only: Buffer\(\.\.\., flush_every"
    ):
        Buffer(3)  # type: ignore[misc]


def test_options_given_by_position_are_told_they_are_keyword_only() -> None:
    with pytest.raises(
        TypeError,
        match=r"but 2 were given; factor, offset are keyword-only: "
        r"scale\(\.\.\., factor=\.\.\., offset=\.\.\.\)$",
    ):
        scale(1.0, 3.0)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # Nothing close: Python's own message, untouched.
        (lambda: scale(1.0, zzzzzz=1), r"^scale\(\) got an unexpected keyword argument 'zzzzzz'$"),
        (scale, r"^scale\(\) missing 1 required positional argument: 'x'$"),
        # A TypeError from inside the function is the function's own.
        (lambda: scale(-1.0), r"^raised inside scale$"),
    ],
)
def test_other_type_errors_pass_through_as_they_are(call: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message) as caught:
        call()
    assert "did you mean" not in str(caught.value)


def test_the_wrapped_function_keeps_its_name_signature_and_result() -> None:
    assert scale(2.0, factor=3.0, offset=1.0) == 7.0
    assert scale.__name__ == "scale"
    assert list(inspect.signature(scale).parameters) == ["x", "factor", "offset"]


def test_a_function_that_takes_any_keyword_is_told_only_of_options_by_position() -> None:
    @suggest_keywords
    def anything(path: str, *, verify: bool = False, **kwargs: object) -> None:
        pass

    anything("p", verfy=True)  # every keyword binds: fn's own business
    with pytest.raises(TypeError, match=r"; verify is keyword-only: \S*anything\(\.\.\., verify="):
        anything("p", True)  # type: ignore[misc]


def test_compare_and_load_tell_an_option_passed_by_position() -> None:
    # T50: the bare "compare() takes 1 positional argument but 2 were given".
    m = dk.Measurement.from_times([1.0] * 10)
    with pytest.raises(TypeError, match=r"; baseline is keyword-only: compare\(\.\.\., baseline="):
        dk.compare({"a": m}, "a")  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"; verify is keyword-only: load\(\.\.\., verify="):
        dk.load("model.pt", "cpu", True)  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"unknown options basline \(did you mean baseline\?\)"):
        dk.compare({"a": m}, basline="a")


def test_a_context_manager_function_is_told_too() -> None:
    @suggest_keywords
    @contextlib.contextmanager
    def scope(*, devices: int = 0) -> Iterator[int]:
        yield devices

    with pytest.raises(TypeError, match=r"'device'; did you mean 'devices'\?$"), scope(device=1):  # type: ignore[call-arg]
        pass


# Per-step paths skip the wrapper's frame; functions that take any keyword check their own.
_NOT_WRAPPED = {"to_device"}


def _named_options(target: Any) -> list[str]:
    """The parameters of ``target`` a call can name (keyword-only, or positional or keyword)."""
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return []  # takes any keyword: checks its own
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in named and p.name not in ("self", "cls")]


def _public_with_options() -> list[tuple[str, str]]:
    """(public call, its longest named parameter) for every public callable that has one.

    Classes count with their constructor and their public class methods
    (``Measurement.from_times``): a user calls those too.
    """
    found = []
    for name in dk.__all__:
        obj = getattr(dk, name)
        if name in _NOT_WRAPPED or not callable(obj):
            continue
        if isinstance(obj, type) and issubclass(obj, BaseException):
            continue  # devicekit raises them; users do not build them
        calls = []
        if not isinstance(obj, type):
            calls.append((name, obj, _named_options(obj)))
        elif not dataclasses.is_dataclass(obj):  # a result's fields are devicekit's to fill
            calls.append((name, obj, _keyword_only(obj.__init__)))
        if isinstance(obj, type):
            for attr, raw in vars(obj).items():
                if isinstance(raw, classmethod) and not attr.startswith("_"):
                    options = _named_options(getattr(obj, attr))
                    if len(options) > 1:  # from_dict(data): one argument, never named
                        calls.append((f"{name}.{attr}", getattr(obj, attr), options))
        for call_name, _, named in calls:
            options = [option for option in named if len(option) > 2]  # "i": no typo to make
            if options:
                found.append((call_name, max(options, key=len)))
    return found


def _keyword_only(target: Any) -> list[str]:
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return []
    return [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _resolve(name: str) -> Any:
    obj: Any = dk
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("name", "option"), _public_with_options())
def test_every_public_call_with_options_names_a_mistyped_one(name: str, option: str) -> None:
    typo = option[:-1]  # the last letter forgotten: "max_siz"
    with pytest.raises(TypeError, match=rf"'{typo}'; did you mean '{option}'\?$"):
        _resolve(name)(**{typo: 1})


def test_a_singular_for_a_plural_is_named_too() -> None:
    with pytest.raises(TypeError, match=r"'device'; did you mean 'devices'\?$"):
        dk.data_parallel(torch.nn.Linear(1, 1), device=[0])  # type: ignore[call-arg]


def _instances() -> dict[str, Any]:
    """An instance of each public class with public methods that take options."""
    m = dk.Measurement.from_times([1.0] * 10)
    return {"LogBuffer": dk.LogBuffer(), "Measurement": m, "Comparison": dk.compare({"a": m})}


# log() runs every step: it takes any key, and refuses what it cannot record itself.
_HOT_METHODS = {"LogBuffer.log"}


def _public_methods_with_options() -> list[tuple[str, str]]:
    """(Class.method, its longest keyword-only option) for every public method that has one."""
    found = []
    for name in dk.__all__:
        obj = getattr(dk, name)
        if not isinstance(obj, type) or issubclass(obj, BaseException):
            continue
        for attr, raw in vars(obj).items():
            if attr.startswith("_") or not inspect.isfunction(raw):
                continue
            options = [o for o in _keyword_only(raw) if len(o) > 2]
            if options and f"{name}.{attr}" not in _HOT_METHODS:
                found.append((f"{name}.{attr}", max(options, key=len)))
    return found


def test_every_public_method_with_options_is_wrapped() -> None:
    unwrapped = [
        name
        for name, _ in _public_methods_with_options()
        if not hasattr(_resolve(name), "__wrapped__")
    ]
    assert unwrapped == []


_TRIED = [(name, option) for name, option in _public_methods_with_options() if "Pool" not in name]


@pytest.mark.parametrize(("name", "option"), _TRIED)
def test_every_public_method_with_options_names_a_mistyped_one(name: str, option: str) -> None:
    # T50: LogBuffer.flush(wiat=False) was Python's bare "unexpected keyword argument". (A
    # pool's map is wrapped too, above; making a pool here would start workers.)
    cls, method = name.split(".")
    typo = option[:-1]
    with pytest.raises(TypeError, match=rf"'{typo}'; did you mean '{option}'\?$"):
        getattr(_instances()[cls], method)(**{typo: 1})
