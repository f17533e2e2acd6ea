"""A [`LogBuffer`][devicekit.LogBuffer]'s reprs: one readable line, a table in a notebook.

However many keys the buffer holds, the reprs show the first few, then how
many more; a key that would blur with the next (``'a, b'``) or break the line
is shown as its repr.
"""

from __future__ import annotations

from typing import Any

from ._format import html_table, plural, shorten
from ._logdeliver import Record

__all__ = ["key_shown", "some", "state_line", "state_table"]


def state_line(state: dict[str, Any]) -> str:
    r"""The buffer's repr, from its ``_state()``: one line, however many keys it holds.

    A key is shown as written where that reads unmistakably (``loss``,
    ``train/loss``), else as its repr (``'a, b'``, ``'multi\nline'``), so that a
    key holding a comma or a line break neither blurs with the next nor breaks
    the line; a long one is shortened.
    """
    keys = [key_shown(key) for key in state["keys"]]
    records = plural(state["records"], "record")
    parts = [f"{records} of {some(keys)}" if keys else f"{records}, no keys yet"]
    parts.append(f"{plural(state['pending'], 'value')} pending")
    if state["nonfinite"]:  # as the table shows them
        parts.append(f"{plural(state['nonfinite'], 'value')} NaN or inf")
    if state["last"] is not None:
        parts.append(f"last {_some_items(state['last'], limit=_KEY_LIMIT)}")
    if state["sinks"]:
        parts.append(f"sinks {', '.join(state['sinks'])}")
    if state["unwritten"]:
        parts.append(_unwritten(state["unwritten"]))
    return f"{state['name']}: {', '.join(parts)}"


def _unwritten(count: int) -> str:
    """What the reprs say of records a sink has yet to write (interrupted, or a write failed)."""
    return f"{plural(count, 'record')} a sink has yet to write (flush() writes them)"


def state_table(state: dict[str, Any]) -> str:
    r"""The buffer's table in a notebook, from its ``_state()``: keys as the repr shows them.

    A key with a line break (``'a\nb'``) is its repr: written as it is, the table
    showed it as two lines, as if two keys.
    """
    last = state["last"] or {}
    keys = [key_shown(key) for key in state["keys"]]
    shown_last = {key_shown(key) if key != "step" else key: value for key, value in last.items()}
    rows = [
        ("records", plural(state["records"], "record")),
        ("keys", some(keys, shown=50) or "none yet"),
        ("pending", f"{plural(state['pending'], 'value')} not yet on the host"),
        ("last record", _some_items(shown_last, shown=50, braces=False) or "none"),
        ("sinks", ", ".join(state["sinks"]) or "none"),
    ]
    if state["unwritten"]:
        rows.append(("not yet written", _unwritten(state["unwritten"])))
    if state["nonfinite"]:
        rows.append(("NaN or inf", plural(state["nonfinite"], "value")))
    return html_table(rows, caption=state["name"])


def some(keys: list[str], *, shown: int = 10) -> str:
    """The first keys, then how many more: a repr with 2,000 keys stays one readable line."""
    if len(keys) <= shown:
        return ", ".join(keys)
    return f"{', '.join(keys[:shown])} and {len(keys) - shown} more"


def _some_items(
    record: Record, *, shown: int = 10, braces: bool = True, limit: int | None = None
) -> str:
    """The first items of a record (as its repr writes them), then how many more.

    ``limit``: the most characters a key is shown with (its repr then quoted in full).
    """
    items = [
        f"{_quoted(key, limit)}: {value!r}" if braces else f"{key}={value}"
        for key, value in record.items()
    ]
    text = some(items, shown=shown)
    return f"{{{text}}}" if braces else text


_KEY_LIMIT = 40  # the most characters of one key in the one-line repr


def key_shown(key: str) -> str:
    """A key in the one-line repr: as written if that is unmistakable, else its repr; short."""
    if key and key.isprintable() and key.strip() == key and not any(c in key for c in ",'\""):
        return shorten(key, _KEY_LIMIT)
    return _quoted(key, _KEY_LIMIT)


def _quoted(key: str, limit: int | None) -> str:
    """``repr(key)``, its text cut to ``limit`` characters (the quotes kept)."""
    return repr(key if limit is None else shorten(key, limit))
