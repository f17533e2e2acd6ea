from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _timing
from devicekit._format import format_bytes, format_joules, format_seconds, safe_text
from devicekit._options import check_index, check_number, check_seconds
from devicekit._shortrepr import got, short_repr


def test_format_bytes_goes_on_past_pib_to_yib() -> None:
    assert format_bytes(2**50) == "1.0 PiB"
    assert format_bytes(4 * 2**60) == "4.0 EiB"  # torch.empty(2**62) asked for "4096.0 PiB"
    assert format_bytes(4 * 2**60, digits=2) == "4.00 EiB"
    assert format_bytes(2**70) == "1.0 ZiB"
    assert format_bytes(3 * 2**80) == "3.0 YiB"
    assert format_bytes(2**90) == "1024.0 YiB"  # past the last unit, the count of YiB grows
    assert format_bytes(2**100) == "1.0e+06 YiB"  # and a million of them reads as one


def test_format_bytes_chooses_the_unit_after_rounding() -> None:
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1023.6) == "1.0 KiB"  # not "1024 B"
    assert format_bytes(2**20 - 1) == "1.0 MiB"  # not "1024.0 KiB"
    assert format_bytes(2**20 - 52, digits=2) == "1023.95 KiB"  # two digits still tell
    assert format_bytes(-(2**30 - 1)) == "-1.0 GiB"


def test_format_bytes_zero_negative_and_unknown() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(-0.0) == "0 B"
    assert format_bytes(-0.4) == "0 B"  # rounds to nothing: no "-0 B"
    assert format_bytes(-3 * 2**20) == "-3.0 MiB"
    for unknown in (None, float("nan"), float("inf"), float("-inf")):
        assert format_bytes(unknown) == "?"


def test_format_bytes_huge_ints_and_floats() -> None:
    assert format_bytes(1e300) == "8.3e+275 YiB"
    # An int no float can hold: counted exactly, never an OverflowError.
    assert format_bytes(10**400) == "8.3e+375 YiB"
    assert format_bytes(-(10**400), digits=2) == "-8.27e+375 YiB"


def test_safe_text_escapes_bidirectional_overrides_as_well_as_control_characters() -> None:
    name = "evil\u202e\u2066\u200fname\x1b[2J"
    assert safe_text(name) == "evil\\u202e\\u2066\\u200fname\\x1b[2J"
    assert safe_text("résumé 日本") == "résumé 日本"  # printable text is left alone


# --- how an error shows a value: _options.short_repr and got ---------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "cuda:0",
        {"b": 1, "a": 2},  # in its own order: reprlib alone sorts the keys
        (1,),
        [[[1]], ()],
        {3, 1},
        3.5,
        None,
        b"w.pt",
        bytearray(b"\x00" * 16),  # its repr: 78 characters
        torch.device("cuda", 1),
        collections.OrderedDict(a=1),
        "x" * 78,  # its repr: 80 characters
    ],
    ids=repr,
)
def test_short_repr_of_a_short_value_is_its_repr(value: object) -> None:
    assert short_repr(value) == repr(value)


class _Counted:
    """An item whose repr counts how often it was read."""

    reads = 0

    def __repr__(self) -> str:
        _Counted.reads += 1
        return "item"


@pytest.mark.parametrize(
    "container",
    [list, tuple, set, lambda items: dict(enumerate(items)), collections.OrderedDict.fromkeys],
    ids=["list", "tuple", "set", "dict", "OrderedDict"],
)
def test_short_repr_reads_only_the_start_of_a_huge_value(container: Any) -> None:
    # A full repr reads every item (a state_dict's OrderedDict: every tensor's repr).
    value = container([_Counted() for _ in range(10**5)])
    _Counted.reads = 0
    shown = short_repr(value)
    assert len(shown) <= 80
    assert shown.endswith("...")
    assert _Counted.reads <= 80 // 3 + 1


def test_short_repr_of_values_that_have_no_plain_repr() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert re.fullmatch(
        r"<tests\.test_format\.[\w.<>]*Broken object at 0x[0-9a-f]+>", short_repr(Broken(), 200)
    )
    # repr() itself refuses an int past 4300 digits (ValueError): say its size instead.
    assert short_repr(10**5000) == "<an int of 16610 bits>"
    assert short_repr(-(10**5000)) == "<a negative int of 16610 bits>"
    assert short_repr("x" * 10**6, limit=20) == "'xxxxxxx...xxxxxxxx'"
    assert short_repr(b"\x00" * 10**6, limit=20) == "b'\\x00\\x00\\x00'..."


def test_got_names_the_type_and_says_a_bool_is_one() -> None:
    assert got(True) == "the bool True"
    assert got("0") == "'0' of type str"
    assert got(list(range(10**6))) == (
        "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21... "
        "of type list"
    )


def test_log_buffer_names_a_huge_bad_option_in_a_short_message() -> None:
    # LogBuffer's options go through _options.check_count. Before: the 7.9 MB repr.
    with pytest.raises(TypeError) as caught:
        dk.LogBuffer(flush_every=list(range(10**6)))  # type: ignore[arg-type]
    message = str(caught.value)
    assert len(message) < 1000
    assert message.startswith("flush_every must be an int >= 1, got [0, 1, 2, ")
    assert message.endswith("... of type list")


@pytest.mark.parametrize(
    ("check", "message"),
    [
        (lambda: check_number(10**400, name="x"), r"^x must be a finite number, got 10000"),
        (
            lambda: check_seconds(10**400, name="t"),
            r"^t must be a finite number of seconds > 0, got 10000",
        ),
        (
            lambda: dk.benchmark(lambda: None, max_time=-(10**400)),
            r"^max_time must be a finite number of seconds > 0, got -10000.*; it bounds",
        ),
        (
            lambda: check_index(-(10**5000), name="i"),
            r"^i must be a non-negative int, got <a negative int of 16610 bits>; the first",
        ),
    ],
)
def test_a_number_past_a_float_s_range_is_refused_by_name(
    check: Callable[[], object], message: str
) -> None:
    # Before: a bare "OverflowError: int too large to convert to float", or for the index,
    # "Exceeds the limit (4300 digits) for integer string conversion".
    with pytest.raises(ValueError, match=message) as caught:
        check()
    assert len(str(caught.value)) < 1000


_HUGE = list(range(10**6))  # its full repr is 6.9 MB


class _Bar:
    def set_postfix(self, values: dict[str, str]) -> None:
        pass


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: dk.LogBuffer(reduce=_HUGE), "reduce"),
        (lambda: dk.CSVSink(bytes(10**6)), "CSVSink(path="),
        (lambda: dk.ProgressBarSink(_Bar(), keys=_HUGE), "keys"),  # type: ignore[arg-type]
        (lambda: dk.ProgressBarSink(_Bar(), fmt="x" * 10**6), "fmt="),
        (lambda: dk.Timer(_HUGE), "Timer"),
        (lambda: dk.Benchmark(_HUGE), "description"),
        (
            lambda: dk.Conditions.from_dict({"device": "cpu", "throttle_reasons": [_HUGE]}),
            "throttle_reasons",
        ),
    ],
)
def test_every_option_names_a_huge_bad_value_in_a_short_message(
    call: Callable[[], object], names: str
) -> None:
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    message = str(caught.value)
    assert len(message) < 1000
    assert names in message


class _LengthRaises(list[Any]):
    def __len__(self) -> int:
        raise RuntimeError("no len")


class _ItemsRaise(dict[str, Any]):
    def items(self) -> Any:
        raise RuntimeError("no items")


class _IterRaises(list[Any]):
    def __iter__(self) -> Any:
        raise RuntimeError("no iter")


_UNPRINTABLE = r"<tests\.test_format\.[\w.<>]+ object at 0x[0-9a-f]+>"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (_LengthRaises(range(100)), r"_LengthRaises\(\[0, 1, 2, .*\.\.\."),  # raised
        (_LengthRaises([1]), r"\[1\]"),
        (_ItemsRaise(enumerate("x" * 100)), r"_ItemsRaise\(\{0: 'x', 1: 'x', .*\.\.\."),  # raised
        (_IterRaises(range(100)), r"_IterRaises\(\[0, 1, 2, .*\.\.\."),  # raised
        (type("dict", (), {})(), _UNPRINTABLE),  # raised: reprlib took it for a dict by its name
        (type("list", (), {"__module__": __name__})(), _UNPRINTABLE),  # raised too
        ([type("set", (), {"__module__": __name__})(), 1], rf"\[{_UNPRINTABLE}, 1\]"),
    ],
    ids=["len", "short len", "items", "iter", "named dict", "named list", "inside a list"],
)
def test_short_repr_never_raises(value: object, shown: str) -> None:
    # A value whose repr raises is shown by type and address; so is one whose len(), items()
    # or iteration raises, read as its builtin base stores it where it is long.
    assert re.fullmatch(shown, short_repr(value))


def test_short_repr_of_a_value_whose_repr_raises_names_its_type_and_address() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    broken = Broken()
    assert short_repr(broken, 200) == (
        f"<tests.test_format.{Broken.__qualname__} object at {id(broken):#x}>"
    )
    assert short_repr({"a": broken}, 200) == f"{{'a': {short_repr(broken, 200)}}}"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (999.0, "999 s"),
        (1500.0, "25 min"),  # was "1.5e+03 s"
        (5999.0, "100 min"),
        (18090.0, "5.03 h"),  # was "1.81e+04 s"
        (3e6, "34.7 d"),
        (1e9, "11,574 d"),  # the largest unit: never in e-notation
        (-1500.0, "-25 min"),
        (2.5e-3, "2.5 ms"),
        (999.6, "16.7 min"),  # rounds to 1,000 s: was "1e+03 s"
        (0.9996, "1 s"),  # was "1e+03 ms"
        (9.996e-7, "1 µs"),
    ],
)
def test_long_durations_read_in_minutes_hours_and_days(seconds: float, shown: str) -> None:
    # A Timer around a training epoch showed "last 1.5e+03 s".
    assert format_seconds(seconds) == shown


def test_a_timer_of_a_long_lap_shows_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    class Clock:  # _timing's time module, but a lap of 25 minutes
        now = 0.0

        def perf_counter(self) -> float:
            Clock.now += 1500.0  # each reading 25 minutes after the last
            return Clock.now

        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

    monkeypatch.setattr(_timing, "time", Clock())
    with dk.Timer(sync=False) as timer:
        pass
    assert repr(timer) == "Timer(1 lap: last 25 min)"
    assert "25 min" in timer._repr_html_()


def test_energy_reads_in_si_steps() -> None:
    # 1,500 J read "1.5e+03 J"; a run's energy is megajoules.
    assert [format_joules(v) for v in (1500.0, 2.52e6, 3e9, 0.5)] == [
        "1.5 kJ",
        "2.52 MJ",
        "3 GJ",
        "500 mJ",
    ]
