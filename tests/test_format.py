from __future__ import annotations

from devicekit._format import format_bytes, safe_text


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
