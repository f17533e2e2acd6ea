"""The look inside pandas objects (`_lookpandas`), and arguments it cannot look inside at all.

pandas is not installed where CI runs, so most tests use a fake: three small
classes named and placed (``__module__``) as pandas's DataFrame, Series and
Index are, with only the API the look calls (``dtypes``, ``dtype``,
``columns``, ``index``, ``iloc``, slicing, ``is_unique``, ``to_numpy()``,
``tolist()``).
Like pandas, which keeps its values in C block managers, each keeps its values
out of the look's reach (in `_STORE`, not in its instance ``__dict__``), so a
look that does not go through that API sees nothing. The tests at the end use
real pandas, and are skipped where it is absent.
"""

from __future__ import annotations

import contextvars
import decimal
import re
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _checks, _checkwalk, _look, _mover

CPU = torch.device("cpu")


class _Dtype:
    """A numpy dtype as the look asks it: ``hasobject`` and ``kind``."""

    def __init__(self, hasobject: bool) -> None:
        self.hasobject = hasobject
        self.kind = "O" if hasobject else "f"


OBJECT, FLOAT = _Dtype(True), _Dtype(False)


class CategoricalDtype:
    """A pandas extension dtype of kind "O" that may hold objects: no ``hasobject``."""

    __module__ = "pandas.core.dtypes.dtypes"
    kind = "O"


class StringDtype(CategoricalDtype):
    """pandas's strings: kind "O" too, but never an object of the user's."""

    __module__ = "pandas.core.arrays.string_"


class _Array(list[Any]):
    """What ``to_numpy(dtype=object)`` returns, as far as the look uses it: ``tolist()``."""

    def tolist(self) -> list[Any]:
        return list(self)


# Each fake's data, out of the look's reach, as pandas keeps it in its block managers.
_STORE: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_read: list[tuple[str, int]] = []  # (what was read, how many values), in order


class _Located:
    """``obj.iloc``: positions, noted in `_read` as they are asked for."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def __getitem__(self, key: Any) -> Any:
        return self.owner.located(key)


class Index:
    __module__ = "pandas.core.indexes.base"

    def __init__(self, values: list[Any], dtype: Any = OBJECT) -> None:
        _STORE[self] = {"values": list(values), "dtype": dtype}

    @property
    def dtype(self) -> Any:
        return _STORE[self]["dtype"]

    @property
    def is_unique(self) -> bool:
        values = _STORE[self]["values"]
        return len(set(values)) == len(values)

    def __len__(self) -> int:
        return len(_STORE[self]["values"])

    def __getitem__(self, key: Any) -> Any:
        values = _STORE[self]["values"][key]
        return Index(values, self.dtype) if isinstance(key, slice) else values

    def to_numpy(self, dtype: Any = None) -> _Array:
        _read.append(("Index", len(self)))
        return _Array(_STORE[self]["values"])


class Series:
    __module__ = "pandas.core.series"

    def __init__(self, values: list[Any], dtype: Any = OBJECT, index: Index | None = None) -> None:
        index = Index(list(range(len(values))), FLOAT) if index is None else index
        _STORE[self] = {"values": list(values), "dtype": dtype, "index": index}

    dtype = property(lambda self: _STORE[self]["dtype"])
    index = property(lambda self: _STORE[self]["index"])
    iloc = property(_Located)

    def located(self, key: slice) -> Series:
        return Series(_STORE[self]["values"][key], self.dtype)

    def to_numpy(self, dtype: Any = None) -> _Array:
        _read.append(("Series", len(_STORE[self]["values"])))
        return _Array(_STORE[self]["values"])

    def tolist(self) -> list[Any]:  # what a frame's dtypes are read with
        return list(_STORE[self]["values"])


class DataFrame:
    __module__ = "pandas.core.frame"

    def __init__(self, columns: list[tuple[Any, Any, list[Any]]], **given: Any) -> None:
        rows = len(columns[0][2]) if columns else 0
        _STORE[self] = {
            "labels": Index([label for label, _, _ in columns]),
            "dtypes": [dtype for _, dtype, _ in columns],
            "values": [values for _, _, values in columns],
            "index": Index(list(range(rows)), FLOAT),
        }
        self._attrs: dict[str, Any] = {}
        for name, value in given.items():  # raising=...: an API that fails
            _STORE[self][name] = value

    columns = property(lambda self: _STORE[self]["labels"])
    index = property(lambda self: _STORE[self]["index"])
    iloc = property(_Located)

    @property
    def dtypes(self) -> Series:
        raising = _STORE[self].get("raising")
        if raising is not None:
            raise raising
        return Series(_STORE[self]["dtypes"])

    def located(self, key: tuple[slice, int]) -> Series:
        rows, column = key
        return Series(_STORE[self]["values"][column][rows], _STORE[self]["dtypes"][column])


class Holder:
    """A class of its own: to_device() returns it unchanged, the check looks inside."""

    def __init__(self, x: object) -> None:
        self.x = x


def frame(*columns: tuple[Any, Any, list[Any]]) -> DataFrame:
    return DataFrame(list(columns))


def meta(*size: int) -> torch.Tensor:
    return torch.ones(*size or (1,), device="meta")


def test_a_dataframe_of_tensors_is_looked_inside() -> None:
    # Its values sat in block managers the look could not read: beside a meta tensor the
    # check returned meta, vouching for the CPU tensors it never saw, and alone it said
    # "found no tensor in df".
    df = frame(("emb", OBJECT, [torch.ones(2), torch.zeros(2)]), ("n", FLOAT, [1.0, 2.0]))
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(x=meta(), df=df)
    assert "  df['emb'].iloc[0]: cpu\n  df['emb'].iloc[1]: cpu\n" in str(info.value)
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(df=df, device="meta")
    assert "it is a DataFrame, which dk.to_device() returns unchanged" in str(info.value)
    assert dk.assert_same_device(df=df) == CPU
    # Inside another object too, and a Series and an Index alike.
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  h.x['f']['emb'].iloc[1]: cpu")):
        dk.assert_same_device(h=Holder({"f": df}), x=meta())
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  s.iloc[0]: cpu")):
        dk.assert_same_device(s=Series([torch.ones(1)]), x=meta())
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  i[1]: meta")):
        dk.assert_same_device(i=Index(["a", meta()]), x=torch.ones(1))


def test_only_columns_that_may_hold_objects_are_read() -> None:
    # A column of numbers or strings holds no tensor: its dtype alone says so.
    del _read[:]
    rows = 1_000
    df = frame(
        ("n", FLOAT, [0.0] * rows),
        ("s", StringDtype(), ["a"] * rows),
        ("c", CategoricalDtype(), [meta()] + ["a"] * (rows - 1)),
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  df['c'].iloc[0]: meta")):
        dk.assert_same_device(df=df, x=torch.ones(1))
    # The column labels (object dtype) and column c were read; n and s were not.
    assert _read == [("Series", rows), ("Index", 3)]


def test_paths_name_labels_and_repeated_columns_as_pandas_indexes_them() -> None:
    df = frame(("a", OBJECT, [torch.ones(1)]), ("a", OBJECT, [meta()]))
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(df=df)
    assert "  df.iloc[:, 0].iloc[0]: cpu\n  df.iloc[:, 1].iloc[0]: meta\n" in str(info.value)
    labelled = frame(("n", FLOAT, [1.0]))
    _STORE[labelled]["index"] = Index([meta()])
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  df.index[0]: meta")):
        dk.assert_same_device(df=labelled, x=torch.ones(1))
    # Its attrs, where anything may be kept, are read as attrs.
    labelled = frame(("n", FLOAT, [1.0]))
    labelled._attrs["w"] = meta()
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  df.attrs['w']: meta")):
        dk.assert_same_device(df=labelled, x=torch.ones(1))


def test_a_frame_pandas_cannot_read_is_refused_not_passed() -> None:
    broken = DataFrame([("emb", OBJECT, [torch.ones(1)])], raising=RuntimeError("broken"))
    said = (
        "cannot check df: df is a DataFrame, which it reads through pandas, and pandas raised "
        "RuntimeError: broken"
    )
    for others in ({}, {"x": meta()}):
        with pytest.raises(ValueError, match=re.escape(said)):
            dk.assert_same_device(df=broken, **others)


def test_a_large_frame_is_read_within_the_bounds_and_refused_past_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_checkwalk, "_BULK_BUDGET", 1_000)
    monkeypatch.setattr(_checkwalk, "_LOOK_BUDGET", 50)
    # Plain values of an object column are passed over in bulk, counted as values.
    assert dk.assert_same_device(df=frame(("s", OBJECT, ["a"] * 900)), x=torch.ones(1)) == CPU
    del _read[:]
    with pytest.raises(
        ValueError,
        match=r"values of object dtype, read through pandas, are more than 1,000",
    ) as refused:
        dk.assert_same_device(df=frame(("s", OBJECT, ["a"] * 100_000)), x=torch.ones(1))
    # Said as a pandas user reads it: strings of object dtype (pandas < 3), and the fix.
    assert "df.convert_dtypes() makes them strings" in str(refused.value)
    assert "a dataset, a logger" not in str(refused.value)
    assert max(count for _, count in _read) <= 1_001  # not the 100,000
    # Objects are looked at one by one, counted as objects.
    objects = frame(("o", OBJECT, [object() for _ in range(60)]))
    with pytest.raises(ValueError, match=r"more than 50 objects"):
        dk.assert_same_device(df=objects, x=torch.ones(1))


def test_to_device_warns_of_a_frame_it_leaves_with_tensors_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It returned the frame as it was, its tensors left on the CPU, without a word.
    monkeypatch.setattr(_mover, "looks_left", weakref.WeakKeyDictionary())
    df = frame(("n", FLOAT, [1.0]), ("emb", OBJECT, [torch.ones(1)]))
    with pytest.warns(RuntimeWarning, match=re.escape("(DataFrame['emb'].iloc[0])")) as told:
        assert dk.to_device({"df": df}, "meta")["df"] is df
    # The fix is one for a pandas user, for that column and target: not "give DataFrame
    # a .to(device)".
    said = "a column of them with df[column] = df[column].map(lambda t: t.to('meta'))"
    assert said in str(told[0].message)
    assert ".to(device) that returns" not in str(told[0].message)
    # The look is bounded: a column of 10,000 objects is read 256 at most.
    del _read[:]
    many = frame(("o", OBJECT, [object() for _ in range(10_000)]))
    assert _look.tensor_elsewhere(many, CPU) is None
    assert 0 < max(count for _, count in _read) <= 256
    assert _look.tensor_elsewhere(frame(("o", OBJECT, ["a", meta()])), CPU) == "['o'].iloc[1]"


class Guarded(Holder):
    """Its __dict__ is a property, which the look never runs."""

    @property  # type: ignore[override]
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        raise AssertionError("a property named __dict__ ran")


class Tag(str):
    """A Python class with empty slots: nothing to read, and nothing unreadable."""

    __slots__ = ()


def test_an_argument_it_cannot_look_inside_is_named_not_passed_off_as_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "found no tensor in g" read as if it had looked inside g.
    monkeypatch.setattr(_checks, "_warned_unread", set())
    with pytest.raises(
        ValueError,
        match=r"found no tensor in g, step, but it could not look inside g \(a ContextVar: it "
        r"keeps what it holds where Python cannot read it",
    ):
        dk.assert_same_device(g=contextvars.ContextVar("g", default=meta()), step=3)  # noqa: B039
    for thing, why in (
        (Guarded(meta()), "its __dict__ is a property"),
        (weakref.ref(Holder), "a weak reference, which the check does not follow"),
    ):
        said = f"could not look inside arg0 (a {type(thing).__name__}: {why}"
        with pytest.raises(ValueError, match=re.escape(said)):
            dk.assert_same_device(thing)
    # Beside other tensors it warns, once per name and class, and passes.
    # A tensor's grad_fn holds the tensors it saved, where Python cannot read them.
    saved = (torch.ones(1, device="meta", requires_grad=True) * 2).grad_fn
    with pytest.warns(RuntimeWarning, match=r"could not look inside g \(a MulBackward0"):
        assert dk.assert_same_device(torch.ones(1), g=saved) == CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dk.assert_same_device(torch.ones(1), g=saved) == CPU
        # Objects it looked inside, and plain values, are as before: no warning.
        assert dk.assert_same_device(torch.ones(1), Holder(None), step=3, df=frame()) == CPU
        # Nor Python's, torch's or numpy's own objects, which hold no tensor of the user's.
        own = {"rows": slice(0, 2), "every": ..., "lock": threading.Lock()}
        own |= {"g": torch.Generator(), "info": torch.finfo(torch.float32)}
        own |= {"price": decimal.Decimal(1), "pattern": re.compile("x"), "tag": Tag("x")}
        assert dk.assert_same_device(torch.ones(1), **own) == CPU
    with pytest.raises(ValueError, match=r"found no tensor in arg0, step; pass the tensors"):
        dk.assert_same_device(Holder(None), step=3)


# Real pandas, where it is installed.


def test_real_pandas_objects_holding_tensors_are_looked_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"emb": [torch.ones(2), torch.zeros(2)], "n": [1, 2], "s": ["a", "b"]})
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(x=meta(), df=df)
    assert "  df['emb'].iloc[0]: cpu\n  df['emb'].iloc[1]: cpu\n" in str(info.value)
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("df['emb'].iloc[0] and 1 more")):
        dk.assert_same_device(df=df, device="meta")
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  s.iloc[0]: cpu")):
        dk.assert_same_device(x=meta(), s=pd.Series([torch.ones(2)]))
    monkeypatch.setattr(_mover, "looks_left", weakref.WeakKeyDictionary())
    with pytest.warns(RuntimeWarning, match=re.escape("(DataFrame['emb'].iloc[0])")):
        dk.to_device({"df": df}, "meta")
    # Frames of numbers, strings (object dtype too) and categories hold no tensor, and pass.
    plain = pd.DataFrame(
        {
            "n": range(100_000),
            "s": pd.Series([f"s{i}" for i in range(100_000)], dtype=object),
            "c": pd.Categorical(["a", "b"] * 50_000),
        }
    )
    assert dk.assert_same_device(df=plain, x=torch.ones(1)) == CPU
