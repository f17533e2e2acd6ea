"""How every repr, table, message and ``to_dict()`` spells numbers, units and the unknown.

One module, so that bytes are MiB/GiB everywhere, time is s/ms/µs/ns
everywhere, a value nobody knows prints as `UNKNOWN` everywhere (never ``0``,
``-`` or ``nan``), and a value that does not apply (a CPU rank's GPU
temperature) as `NOT_APPLICABLE`. It also makes text from outside the process
(process names from ``/proc``, NVML strings) safe to print, renders the small
HTML tables notebooks show, and turns results into the plain data every
``to_dict()`` returns (`plain_data`).
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import html
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "NOT_APPLICABLE",
    "UNKNOWN",
    "article",
    "close_match",
    "first_line",
    "format_bytes",
    "format_count",
    "format_joules",
    "format_percent",
    "format_seconds",
    "format_value",
    "html_table",
    "plain_data",
    "plain_fields",
    "plural",
    "qualified_name",
    "safe_text",
    "shorten",
    "shown",
    "text_table",
]

UNKNOWN = "?"
"""How text spells a value that is ``None`` in the data because nobody knows it."""

NOT_APPLICABLE = "-"
"""How a table cell spells a value that does not exist, such as a CPU rank's GPU name."""

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
# (unit, its size, the value from which it is used), largest first: a unit is used
# where the next larger one would read below 1 (or below 100 for minutes and hours).
_TIME_UNITS = (
    ("d", 86400.0, 172800.0),  # from 48 h on
    ("h", 3600.0, 6000.0),  # from 100 min on
    ("min", 60.0, 1000.0),  # from 1,000 s on: never "1.5e+03 s"
    ("s", 1.0, 1.0),
    ("ms", 1e-3, 1e-3),
    ("µs", 1e-6, 1e-6),
    ("ns", 1e-9, 0.0),
)
_Units = tuple[tuple[str, float, float], ...]
_ENERGY_UNITS: _Units = (("GJ", 1e9, 1e9), ("MJ", 1e6, 1e6), ("kJ", 1e3, 1e3), ("J", 1.0, 1.0))
_ENERGY_UNITS += (("mJ", 1e-3, 1e-3), ("µJ", 1e-6, 1e-6), ("nJ", 1e-9, 0.0))  # SI steps
# C0 and C1 control characters and DEL: anything that could move a terminal's
# cursor, change its colours or its title, or ring its bell. And the bidirectional
# marks and overrides, which make the rest of a line read in another order.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def format_bytes(value: float | None, *, digits: int = 1) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units up to YiB; None, NaN or infinity -> ``"?"``.

    The unit is chosen after rounding, so a value just short of the next
    unit reads as one of it (``"1.0 MiB"``, never ``"1024.0 KiB"``). Past
    a million YiB, and for ints too large for a float, the count of YiB is
    written in scientific notation.

    Examples:
        >>> format_bytes(80 * 2**30), format_bytes(-3 * 2**20), format_bytes(None)
        ('80.0 GiB', '-3.0 MiB', '?')
        >>> format_bytes(0), format_bytes(2**20 - 1), format_bytes(4 * 2**60)
        ('0 B', '1.0 MiB', '4.0 EiB')
        >>> format_bytes(3 * 2**80), format_bytes(10**400), format_bytes(float("nan"))
        ('3.0 YiB', '8.3e+375 YiB', '?')
    """
    if value is None:
        return UNKNOWN
    try:
        size = float(value)
    except OverflowError:  # an int past a float's range: count YiB exactly, in Decimal
        count = decimal.Decimal(abs(int(value))) / (1024 ** (len(_BINARY_UNITS) - 1))
        return f"{'-' if value < 0 else ''}{count:.{digits}e} {_BINARY_UNITS[-1]}"
    if not math.isfinite(size):
        return UNKNOWN
    negative, size = size < 0, abs(size)
    for unit in _BINARY_UNITS:
        places = 0 if unit == "B" else digits
        if round(size, places) < 1024 or unit == _BINARY_UNITS[-1]:
            if unit == _BINARY_UNITS[-1] and size >= 1e6:
                text = f"{size:.{digits}e}"
            else:
                text = f"{size:.{places}f}"
            # -0.2 bytes is "0 B", not "-0 B".
            sign = "-" if negative and float(text) != 0 else ""
            return f"{sign}{text} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_seconds(value: float | None) -> str:
    """``0.00123`` -> ``"1.23 ms"``, three significant digits; None or NaN -> ``"?"``.

    From 1,000 s on, minutes, hours and days (``"25 min"``), never ``"1.5e+03 s"``:
    a timed epoch or a whole run reads as people say it.

    Examples:
        >>> format_seconds(2.5), format_seconds(1.234e-5), format_seconds(3e-9)
        ('2.5 s', '12.3 µs', '3 ns')
        >>> format_seconds(1500), format_seconds(18090), format_seconds(3e6)
        ('25 min', '5.03 h', '34.7 d')
    """
    if value is None or not math.isfinite(value):
        return UNKNOWN
    return _scaled(value, _TIME_UNITS)


def format_joules(value: float | None) -> str:
    """``0.0123`` -> ``"12.3 mJ"``: the same digits as seconds, in SI steps; None -> ``"?"``.

    Examples:
        >>> format_joules(2.5), format_joules(1.234e-5), format_joules(2.52e6)
        ('2.5 J', '12.3 µJ', '2.52 MJ')
    """
    if value is None or not math.isfinite(value):
        return UNKNOWN
    return _scaled(value, _ENERGY_UNITS)


def _scaled(value: float, units: _Units) -> str:
    """``value`` in the first of ``units`` it reaches (see `_TIME_UNITS`), 3 significant digits."""
    index = next(i for i, (_, _, start) in enumerate(units) if abs(value) >= start)
    if "e" in f"{value / units[index][1]:.3g}" and index:  # 999.6 s reads "1e+03 s"
        index -= 1  # the next unit up: 16.7 min
    unit, size, _ = units[index]
    text = f"{value / size:.3g}"
    # The largest unit has no next one: 11,574 d, not 1.16e+04 d.
    return f"{value / size:,.0f} {unit}" if "e" in text else f"{text} {unit}"


def format_percent(value: float | None, *, digits: int = 0) -> str:
    """``42`` -> ``"42%"`` (the value is already in percent); None -> ``"?"``."""
    return UNKNOWN if value is None else f"{value:.{digits}f}%"


def format_value(value: float | None, unit: str = "", *, digits: int = 0) -> str:
    """A number with its unit (``"300 W"``, ``"41 °C"``); None -> ``"?"``.

    Examples:
        >>> format_value(299.6, "W"), format_value(None, "W")
        ('300 W', '?')
    """
    if value is None:
        return UNKNOWN
    return f"{value:.{digits}f} {unit}" if unit else f"{value:.{digits}f}"


def format_count(value: int | None, word: str) -> str:
    """``plural`` that also knows the unknown: ``None`` -> ``"? processes"``."""
    return f"{UNKNOWN} {_plural_word(word)}" if value is None else plural(value, word)


def plural(count: int, word: str) -> str:
    """``"1 process"``, ``"2 processes"``, ``"0 GPUs"``.

    Examples:
        >>> plural(1, "process"), plural(3, "process"), plural(0, "GPU")
        ('1 process', '3 processes', '0 GPUs')
    """
    return f"1 {word}" if count == 1 else f"{count} {_plural_word(word)}"


def _plural_word(word: str) -> str:
    return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")


def first_line(error: BaseException) -> str:
    r"""An error's message, its first line only; the error's type when the message is empty.

    Examples:
        >>> first_line(RuntimeError("out of memory.\nTried to allocate")), first_line(KeyError())
        ('out of memory.', 'KeyError')
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def qualified_name(cls: type) -> str:
    """A class as messages name it: its module, then its qualified name.

    Examples:
        >>> import collections
        >>> qualified_name(collections.OrderedDict)
        'collections.OrderedDict'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def shorten(text: str, limit: int) -> str:
    """``text``, cut to at most ``limit`` characters ending in ``...`` when longer.

    Examples:
        >>> shorten("tensor([1., 2., 3.])", 12), shorten("12", 12)
        ('tensor([1...', '12')
    """
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def safe_text(text: str) -> str:
    r"""``text`` with every control character written as an escape, for a terminal.

    Process names come from ``/proc/<pid>/comm``, which any user can set for
    their own processes; printed raw, an escape sequence there would reach the
    terminal of whoever runs ``devicekit``.

    Examples:
        >>> safe_text("python\x1b]0;pwned\x07")
        'python\\x1b]0;pwned\\x07'
        >>> safe_text("report\u202etxt.exe")  # would print as "reportexe.txt"
        'report\\u202etxt.exe'
    """
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def article(word: str) -> str:
    """``"an"`` or ``"a"`` before ``word``, by how it sounds: an acronym letter by letter.

    Examples:
        >>> article("MPS"), article("CUDA"), article("MAIA"), article("Index"), article("ndarray")
        ('an', 'a', 'a', 'an', 'an')
    """
    # Read letter by letter ("en-dee-array"), but for the acronyms said as words.
    if (word.isupper() and word not in ("MAIA", "HIP")) or word.startswith("nd"):
        return "an" if word[:1].upper() in "AEFHILMNORSX" else "a"
    return "an" if word[:1].lower() in "aeiou" else "a"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, as lines; trailing blanks trimmed.

    Examples:
        >>> for line in text_table(("a", "bb"), [("xyz", "1")]):
        ...     print(line)
        a    bb
        xyz  1
    """
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]


def html_table(
    rows: Iterable[Sequence[object]],
    *,
    header: Sequence[str] | None = None,
    caption: str | None = None,
) -> str:
    """A small HTML table for ``_repr_html_``; every cell is escaped, None shows as ``"?"``.

    Examples:
        >>> html_table([("memory", "80.0 GiB")], caption="cuda:0")
        '<table><caption>cuda:0</caption><tr><th style="text-align:left">memory</th><td>80.0 GiB</td></tr></table>'
    """  # noqa: E501 - the expected output is one line
    parts = ["<table>"]
    if caption is not None:  # lines kept: a flag's "fix:" line under its detail
        parts.append(f"<caption>{_cell(caption)}</caption>")
    if header is not None:
        parts.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = [_cell(value) for value in row]
        if header is None and cells:  # a key-value table: the key is a row header
            first = f'<th style="text-align:left">{cells[0]}</th>'
            parts.append("<tr>" + first + "".join(f"<td>{c}</td>" for c in cells[1:]) + "</tr>")
        else:
            parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    parts.append("</table>")
    return "".join(parts)


def _cell(value: object) -> str:
    text = UNKNOWN if value is None else str(value)
    return "<br>".join(html.escape(line) for line in text.splitlines()) or ""


def close_match(word: str, known: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The known word ``word`` most likely misspells, if one is close enough; never ``word``.

    Examples:
        >>> close_match("doctr", ["watch", "doctor", "bench"])
        'doctor'
        >>> close_match("zzz", ["watch"]) is None
        True
    """
    matches = difflib.get_close_matches(word, [k for k in known if k != word], n=1, cutoff=cutoff)
    return matches[0] if matches else None


def plain_fields(result: object) -> dict[str, Any]:
    """A dataclass's fields as `plain_data`: where a result's ``to_dict()`` starts.

    Examples:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Span:
        ...     shape: tuple[int, ...]
        >>> plain_fields(Span((2, 3)))
        {'shape': [2, 3]}
    """
    if not dataclasses.is_dataclass(result) or isinstance(result, type):
        raise TypeError(f"plain_fields() needs a dataclass instance, got {type(result).__name__}")
    return {f.name: plain_data(getattr(result, f.name)) for f in dataclasses.fields(result)}


_SHOWN = "devicekit.shown"  # the field metadata key `shown` fills


@dataclasses.dataclass(frozen=True)
class _Shown:
    text: Callable[[Any], str] | None = None
    none: str = UNKNOWN
    of_row: Callable[[Any], str] | None = None


_AS_IT_IS = _Shown()


def shown(
    text: Callable[[Any], str] | None = None,
    *,
    none: str = UNKNOWN,
    of_row: Callable[[Any], str] | None = None,
) -> dict[str, Any]:
    """Field metadata that says how a `PlainResult`'s HTML writes the field.

    For ``field(metadata=shown(format_seconds))``: on the field itself, so the
    unit cannot drift from it. A field without it is written as it is:
    ``"yes"``/``"no"`` for a bool, a string with its control characters
    escaped, a nested result as its text, one line per item of a tuple.

    Args:
        text: Writes the value when it is not None (a dict's values one by
            one), such as `format_seconds` or `format_bytes`.
        none: What None means here: unknown (``"?"``) unless said otherwise.
        of_row: Writes the field from the whole row instead, where another
            field decides how (a value in its row's ``unit``).

    Returns:
        The metadata for ``dataclasses.field``.
    """
    return {_SHOWN: _Shown(text, none, of_row)}


class PlainResult:
    """A result whose ``to_dict()`` is its fields as plain data: a row inside a report.

    In a notebook a row is a table of its fields in human units (see `shown`),
    under its ``str()`` where the class has one, else under its class name
    and `_title`.

    Examples:
        >>> from dataclasses import dataclass, field
        >>> @dataclass(frozen=True)
        ... class Row(PlainResult):
        ...     shape: tuple[int, ...]
        ...     seconds: float | None = field(metadata=shown(format_seconds))
        >>> Row((2, 3), 0.0123).to_dict()
        {'shape': [2, 3], 'seconds': 0.0123}
        >>> html = Row((2, 3), 0.0123)._repr_html_()
        >>> "<td>12.3 ms</td>" in html, "<td>?</td>" in Row((2, 3), None)._repr_html_()
        (True, True)
    """

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: each field as plain data, a nested result as its own ``to_dict()``."""
        return plain_fields(self)

    def _title(self) -> str:
        """What names this row in its HTML caption when it has no ``__str__``: its first field."""
        return _field_text(self, _fields(self)[0])

    def _not_applicable(self) -> Collection[str]:
        """The fields that do not apply to this row (its HTML shows ``"-"``, not ``"?"``)."""
        return ()

    def _repr_html_(self) -> str:
        absent = self._not_applicable()
        rows = [
            (f.name.replace("_", " "), NOT_APPLICABLE if f.name in absent else _field_text(self, f))
            for f in _fields(self)
        ]
        if type(self).__str__ is object.__str__:  # no human text of its own
            caption = f"{type(self).__name__}: {self._title()}"
        else:
            caption = str(self).strip()  # a report's line, aligned there by leading blanks
        return html_table(rows, caption=caption)


def _fields(row: object) -> tuple[dataclasses.Field[Any], ...]:
    if not dataclasses.is_dataclass(row):
        raise TypeError(f"a PlainResult is a dataclass, got {type(row).__name__}")
    return dataclasses.fields(row)


def _field_text(row: object, field: dataclasses.Field[Any]) -> str:
    how: _Shown = field.metadata.get(_SHOWN, _AS_IT_IS)
    if how.of_row is not None:
        return how.of_row(row)
    return _text(getattr(row, field.name), how)


def _text(value: object, how: _Shown) -> str:
    """One field's (or one dict value's) text in a row's HTML."""
    if value is None:
        return how.none
    if isinstance(value, Mapping):  # one "key: value" line per item
        lines = [f"{_text(key, _AS_IT_IS)}: {_text(item, how)}" for key, item in value.items()]
        return "\n".join(lines) or "none"
    if how.text is not None:
        return how.text(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return "\n".join(_text(item, how) for item in value) or "none"
    return str(value)  # an int, or a nested result (a GPU snapshot) as its text


def plain_data(value: object) -> Any:
    """``value`` as JSON-ready data: dicts, lists, str, int, float, bool and None only.

    Tuples and sets become lists; a nested result becomes its own
    ``to_dict()``, any other dataclass a dict of its fields; a subclass of
    str, int or float (torch's version string) becomes the plain type; a
    float that is not finite becomes None (JSON has no ``NaN``, and
    devicekit's unknown is None). So
    ``json.loads(json.dumps(plain_data(x))) == plain_data(x)``.

    Raises:
        TypeError: Something that has no plain form (a tensor, a device), or a
            mapping key that is not a string or an int (ints become strings,
            as JSON writes them).

    Examples:
        >>> plain_data({"shape": (2, 3), "ci": (1.0, float("nan")), 4: None})
        {'shape': [2, 3], 'ci': [1.0, None], '4': None}
    """
    if value is None or type(value) in (bool, int, str):
        return value
    # Subclasses (torch's TorchVersion is a str, an IntEnum an int) as the plain type.
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):  # a result inside a result
        return to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_fields(value)
    if isinstance(value, Mapping):
        return {_plain_key(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain_data(item) for item in value]
    raise TypeError(f"{type(value).__name__} has no JSON-ready form: {value!r}")


def _plain_key(key: object) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise TypeError(f"a JSON object's keys are strings, got {key!r}")
