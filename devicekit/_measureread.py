"""A [`Measurement`][devicekit.Measurement] read back from its document, which may have been edited.

The times are the measurement: it is rebuilt from them, with every other
field checked as `from_times()` checks it (``_measurecheck``), and each
statistic the document holds must be what its times give, so that no
hand-edited document loads as a measurement whose numbers contradict each
other. ``trustworthy`` and ``notes`` are not read: they are judged anew.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, TypeVar

from ._conditions import Conditions
from ._format import plural
from ._measurecheck import same_interval
from ._options import check_count, check_number
from ._shortrepr import got, short_repr

__all__ = ["read_document"]

T = TypeVar("T")

_WHERE = "Measurement.from_dict()"
# What the times determine: recomputed from them, and a document's checked against them.
_STATISTICS = ("median", "mean", "min", "iqr", "rel_noise", "ci", "n", "host_median")
_VERDICTS = ("trustworthy", "notes")  # judged anew: a later devicekit may judge differently
_REQUIRED = ("name", "mode", "stop_reason", "conditions", "host_times")
# Fields that documents from before them lack: None (unknown) then.
_OPTIONAL = (
    "energy_per_call",
    "power",
    "warmup",
    "warmup_time",
    "clock_floor",
    "min_time",
    "rel_noise_target",
)


def read_document(data: object, *, build: Callable[..., T], fields: Iterable[str]) -> T:
    """``Measurement.from_dict()``: ``build`` (``from_times``) from a document's times, checked.

    Args:
        data: What ``to_dict(times=True)`` wrote, or anything else given.
        build: ``Measurement.from_times``, which checks every option it takes.
        fields: The measurement's fields: the names a document may hold, with
            the statistics and the verdict.
    """
    if not isinstance(data, Mapping):
        raise TypeError(
            f"{_WHERE} needs a mapping, a measurement's to_dict(times=True) (or that read "
            f"back from JSON), got {got(data)}"
        )
    if "times" not in data:
        raise ValueError(
            "this document has only the statistics, not the raw times a Measurement "
            "holds; write it with to_dict(times=True) to rebuild it"
        )
    known = {*fields, *_STATISTICS, *_VERDICTS}
    unknown = [key for key in data if key not in known]
    if unknown:
        raise ValueError(
            f"{_WHERE}: the document has {plural(len(unknown), 'unknown field')}, "
            f"{', '.join(map(repr, unknown))}: a measurement's to_dict(times=True) has none; "
            "was it written by a later devicekit, or edited?"
        )
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ValueError(
            f"{_WHERE}: the document has no {', '.join(map(repr, missing))}; "
            "a measurement's to_dict(times=True) writes every one"
        )
    try:
        return _rebuild(data, build)
    except (TypeError, ValueError) as error:
        # The field's own message, with where it came from: not a from_times() call.
        raise type(error)(f"{_WHERE}: {error}") from None


def _rebuild(data: Mapping[str, Any], build: Callable[..., T]) -> T:
    """`read_document()`'s work once the document's keys are known to be right."""
    times = data["times"]
    if isinstance(times, Sized) and len(times) == 0:
        # from_times() would name itself; here the rest of the document is what matters.
        raise ValueError(
            "times is empty, yet a measurement holds at least one timed call; "
            "the document's statistics describe times that are gone"
        )
    conditions = data["conditions"]
    if not isinstance(conditions, Mapping):
        raise TypeError(
            f"conditions must be a mapping, a Conditions' to_dict(), got {got(conditions)}"
        )
    try:
        rebuilt = Conditions.from_dict(dict(conditions))
    except (TypeError, ValueError) as error:
        raise type(error)(f"conditions: {error}") from None
    measurement = build(
        times,
        data["host_times"],
        name=data["name"],
        mode=data["mode"],
        stop_reason=data["stop_reason"],
        conditions=rebuilt,
        **{key: data.get(key) for key in _OPTIONAL},
    )
    _check_statistics(measurement, data)
    return measurement


def _check_statistics(measurement: object, data: Mapping[str, Any]) -> None:
    """Refuse a statistic in ``data`` that the ``measurement`` its times give does not have."""
    for key in _STATISTICS:
        if key not in data:
            continue
        given = data[key]
        computed = getattr(measurement, key)
        if key == "n":
            check_count(given, name="n", minimum=1)
            agree = given == computed
        elif key == "ci":
            agree = same_interval(given, computed)
        elif given is None:  # unknown: right only where the times give none either
            agree = computed is None
        else:
            number = check_number(given, name=key, at_least=0)
            agree = computed is not None and math.isclose(number, computed, rel_tol=1e-9)
        if not agree:
            shown = list(computed) if isinstance(computed, tuple) else computed
            source = "host_times" if key == "host_median" else "times"
            raise ValueError(
                f"{key} is {short_repr(given)}, but the document's {source} give "
                f"{short_repr(shown)}: its statistics disagree with its times (was it edited?); "
                f"the times are the measurement: restore {key}, or leave it out to have it "
                "recomputed"
            )
