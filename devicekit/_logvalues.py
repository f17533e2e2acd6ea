"""What `LogBuffer.log()` accepts, checked when it is logged, never at the flush.

A value that could not be stacked or read later (a complex, sparse or meta
tensor, an int too large for a float64) is refused at its own ``log()`` call,
naming its key, so that nothing else logged before or after is affected.
``log()`` itself takes the common case (a 0-d floating tensor) inline and
hands everything else to `checked()`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import sys
from collections.abc import Mapping
from typing import Any, SupportsIndex, cast

import torch

from ._format import plural, shorten
from ._shortrepr import short_repr

__all__ = [
    "FLOATING",
    "LOGGABLE",
    "OWN_BYTES",
    "checked",
    "checked_step",
    "on_device",
    "own_value",
    "plain_values",
    "refuse",
    "refuse_keys",
]

_Tensor = torch.Tensor
_STRIDED = torch.strided
# Real numbers that stack and convert to a Python float exactly (as float64): every
# float8 too. Complex, quantized and bit-packed dtypes are refused when logged.
LOGGABLE = frozenset(
    getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        # A power of two (or NaN), unsigned: the scale of an MX block, exact as a float64.
        "float8_e8m0fnu",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)  # uints, float8s: newer torch only
)
# Those whose Tensor.item() is already a Python float: log()'s fast path takes these.
FLOATING = frozenset(dtype for dtype in LOGGABLE if dtype.is_floating_point)


def _not_dense(key: str, value: torch.Tensor) -> TypeError:
    """The error for a sparse, nested or other non-dense tensor, with a fix that works on it."""
    if value.is_nested:  # to_dense() refuses it: one number from all its elements
        return TypeError(
            f"LogBuffer.log({key}=...) expects a dense tensor of one element, got a nested "
            f"tensor (layout {value.layout}); log one number from it, such as "
            "value.values().mean() (over every element of every component)"
        )
    return TypeError(
        f"LogBuffer.log({key}=...) expects a dense tensor, got layout {value.layout}; "
        "log value.to_dense()"
    )


def checked(key: str, value: Any) -> Any:
    """What to keep for a value the fast path of log() did not accept, or an error."""
    if isinstance(value, _Tensor):
        return _checked_tensor(key, value)
    if isinstance(value, (int, float)) or (_is_real(value) and not _is_time(value)):
        try:  # bool and int subclasses included
            number = float(value)  # now: a numpy scalar is exact as a float64
            # A finite value beyond float64 whose float() is inf, not an error (a numpy
            # longdouble): refused as an int of that size is, never recorded as inf.
            if math.isinf(number) and value != number:
                raise OverflowError  # noqa: TRY301 - told below, as float()'s own is
        except OverflowError:
            what = (
                f"an int of {int(value).bit_length()} bits, too large for a float64 (1024 bits "
                "at most)"
                if isinstance(value, int)
                else f"a {type(value).__name__} too large for a float64 ({short_repr(value, 40)})"
            )
            raise ValueError(f"LogBuffer.log({key}=...) got {what}; log it scaled") from None
        except (TypeError, ValueError) as error:  # a numbers.Real whose float() fails
            raise TypeError(
                f"LogBuffer.log({key}=...) expects a number that converts to a float, got "
                f"{short_repr(value, 60)} of type {type(value).__name__}, whose float() raised "
                f"{type(error).__name__}: {shorten(str(error), 80)}; log a float computed from it"
            ) from None
        return number
    raise TypeError(
        f"LogBuffer.log({key}=...) expects a 0-d tensor or a number, got "
        f"{type(value).__name__}{_fix(value)}"
    )


def _checked_tensor(key: str, value: torch.Tensor) -> torch.Tensor:
    """`checked()` of a tensor: a 0-d one of a loggable dtype, detached, or an error."""
    if _MASKED is not None and isinstance(value, _MASKED):
        value = _unmasked(value)
    if value.dtype not in LOGGABLE:
        if value.dtype.is_complex:
            expected, fix = "a real number", "; log value.real or value.abs()"
        else:
            expected, fix = "a dtype that converts to a float", _dtype_fix(value)
        raise TypeError(
            f"LogBuffer.log({key}=...) expects {expected}, got a tensor of dtype {value.dtype}{fix}"
        )
    if value.layout is not _STRIDED or value.is_nested:
        raise _not_dense(key, value)
    if value.numel() != 1:
        raise ValueError(
            f"LogBuffer.log({key}=...) expects a scalar: a 0-d tensor or a number, got "
            f"a tensor of shape {tuple(value.shape)}; log value.mean() or one element"
        )
    if value.is_meta or _is_fake(value):
        raise refuse(key, value)
    if isinstance(value, torch.nn.Parameter):
        # An optimizer's step changes it in place after log(): a reference would read
        # the last value at every step it was logged. One kernel (a learned temperature
        # is logged now and then, never every element of a model).
        return value.detach().clone().reshape(())
    if shares_storage(value):  # a view of a larger tensor: kept, it would keep it alive
        return own_value(value).reshape(())
    if value.requires_grad:
        value = value.detach()
    return value.reshape(()) if value.ndim else value  # a view: no kernel


# A value whose storage holds more bytes than this is copied by log(): a few values
# kept beside it cost nothing, a base of megabytes does.
OWN_BYTES = 64


def shares_storage(value: torch.Tensor) -> bool:
    """Whether ``value`` shares a storage larger than `OWN_BYTES` (a view, its ``.detach()``)."""
    try:
        return value.untyped_storage().nbytes() > OWN_BYTES
    except NotImplementedError:  # no storage to read (inside torch.vmap)
        return False


def own_value(view: torch.Tensor) -> torch.Tensor:
    """A copy of the one value of ``view``, which holds none of its base's memory.

    ``logits[0, -1, 0]`` shares the storage of ``logits``, and so does its
    ``.detach()`` (which is no view): kept until the flush, it would keep every
    logits tensor of ``flush_every`` steps alive (on a GPU, out of memory). The
    copy is one element, one small kernel, only where the storage is larger
    than `OWN_BYTES`.
    """
    return view.detach().clone()


def plain_values(values: dict[str, Any]) -> dict[str, Any]:
    """A step's pending ``values``, a tensor subclass's as a plain tensor (for pickle).

    ``torch.load(weights_only=True)`` refuses any class it was not told of, so
    a buffer saved with a subclass's value pending (a ``MaskedTensor``, a
    library's own) could not be loaded as the docs say. ``as_subclass`` shares
    the storage: nothing is copied.
    """
    return {
        key: value.as_subclass(torch.Tensor)
        if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor
        else value
        for key, value in values.items()
    }


def _is_fake(value: torch.Tensor) -> bool:
    """Whether ``value`` is a ``FakeTensor`` (torch.compile's, made under ``FakeTensorMode``).

    It says it is on a real device (``cpu``, ``cuda``) but, as a meta tensor,
    holds no values; its module is only read where something imported it.
    """
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(value, fake.FakeTensor)


_MASKED: type | None = getattr(getattr(torch, "masked", None), "MaskedTensor", None)


def _unmasked(value: torch.Tensor) -> torch.Tensor:
    """A ``MaskedTensor`` as a plain tensor: its value, NaN where it is masked out.

    Kept as it was, its flush read it as a tensor that changed after ``log()``.
    Asking whether the mask is set would wait for the device, at every call;
    NaN is what the history and the sinks hold for a value that is not there
    (counted in ``nonfinite``), with no wait. An integer one becomes a float64
    (float32 on MPS, which has no float64), so that NaN fits. The one kernel
    this takes (``where``) makes a new tensor: its value is the one at
    ``log()``, where a plain tensor's is the one at the flush.
    """
    masked = cast("Any", value)  # torch.masked is untyped
    data: torch.Tensor = masked.get_data().detach()
    if data.layout is not _STRIDED:
        return value  # refused as a sparse tensor is, with the same fix (to_dense())
    if not data.is_floating_point() and not data.is_complex():
        data = data.to(torch.float32 if data.device.type == "mps" else torch.float64)
    return torch.where(masked.get_mask(), data, math.nan)


def _is_time(value: object) -> bool:
    """A numpy datetime64 or timedelta64 (a timedelta64 is a ``numbers.Real``, with no float())."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.datetime64, numpy.timedelta64))


def _fix(value: object) -> str:
    """What to log instead of ``value``, which is no number: advice that works, or none.

    ``float(value)`` is offered only where it gives the number meant: not for a
    complex (it drops the imaginary part, or raises), nor for numpy's dates and
    durations (it raises), nor for a numpy array of several elements.
    """
    numpy = sys.modules.get("numpy")
    complexes = (complex,) if numpy is None else (complex, numpy.complexfloating)
    if isinstance(value, complexes):
        return "; log value.real or abs(value)"
    told = None if numpy is None else _numpy_fix(value, numpy)
    if told is not None:
        return told
    if value is None:
        return "; leave the key out of this call where there is no value, or log math.nan"
    if isinstance(value, (list, tuple)):
        return "; log one element, or their mean"
    if hasattr(value, "__float__"):
        return "; log float(value)"
    if isinstance(value, (str, bytes)):
        return "; log numbers only (a count, a score): keep text in your own logger"
    if isinstance(value, dict):
        return "; log each number under its own key: log(step, **values)"
    # Anything else (an object of the user's): the number it stands for is theirs to pick.
    return "; log a number taken from it, as a float or a 0-d tensor"


def _numpy_fix(value: Any, numpy: Any) -> str | None:
    """`_fix` for numpy's own values that are no number, or None for any other value."""
    if isinstance(value, numpy.timedelta64):
        return " (a duration); log it in seconds, value / np.timedelta64(1, 's')"
    if isinstance(value, numpy.datetime64):
        return (
            " (a date); log it in seconds since 1970, "
            "(value - np.datetime64(0, 's')) / np.timedelta64(1, 's')"
        )
    records = (numpy.void, numpy.ndarray)
    if isinstance(value, records) and value.dtype.names and value.size == 1:  # by field
        fields = ", ".join(f"{name}=value[{name!r}]" for name in value.dtype.names[:3])
        return f" (a record of fields); log each field, log(step, {fields})"
    if isinstance(value, numpy.void):  # raw bytes: no number in it to offer
        return " (raw bytes); log a number"
    if isinstance(value, numpy.ndarray):
        if value.size == 1:
            return "; log value.item()"
        return f" of shape {value.shape}; log value.mean().item() or one element"
    return None


def _dtype_fix(value: torch.Tensor) -> str:
    """What to log instead of a tensor of a dtype that is not `LOGGABLE` (nor complex)."""
    if value.is_quantized:
        return "; log value.dequantize()"
    try:  # bit-packed dtypes (float4_e2m1fn_x2, uint4, bits8) have no conversion at all
        torch.empty(1, dtype=value.dtype).float()
    except (RuntimeError, NotImplementedError, TypeError):
        return (
            " (bit-packed: several values per byte, which torch cannot convert to a float); "
            "unpack it with the code that packed it, and log a float"
        )
    return "; log value.float()"


def _is_real(value: object) -> bool:
    """A real number that is not a Python one: numpy's scalars (bool_ too), a Fraction.

    ``numbers.Real`` is what they register as; numpy's ``bool_`` registers as
    nothing. A Decimal is not a ``numbers.Real`` (nor is ``float()`` of one
    checked: a huge one becomes inf), and stays refused.
    """
    if isinstance(value, numbers.Real):
        return True
    numpy = sys.modules.get("numpy")  # a numpy value exists: numpy is imported
    return numpy is not None and isinstance(value, numpy.bool_)


def on_device(value: Any) -> bool:
    return isinstance(value, _Tensor) and not value.is_cpu


def refuse(key: str, value: torch.Tensor) -> ValueError:
    """The error for a tensor that holds no values: on the meta device, or a fake tensor."""
    where = (
        f"a fake tensor (torch's FakeTensor, on {value.device.type} in name only)"
        if _is_fake(value)
        else f"a tensor on the {value.device.type} device"
    )
    return ValueError(
        f"LogBuffer.log({key}=...) got {where}, which holds no values; log a tensor on a "
        "real device"
    )


def refuse_keys(scalars: dict[str, Any], unnamed: tuple[object, ...] = ()) -> Exception:
    """The error for a ``log()`` call with no value, a value with no key, or the key ``""``.

    A key names a column of the history and of each sink (a CSV header, a
    TensorBoard tag): a value passed by position, or under ``""``, would be a
    column with no name. Refused before anything is kept, so nothing else
    logged is affected.
    """
    if unnamed:  # log(step, loss): Python's own message said nothing of keys
        values = ", ".join(short_repr(value, 40) for value in unnamed[:3])
        more = ", ..." if len(unnamed) > 3 else ""
        return TypeError(
            f"LogBuffer.log() takes the step by position and each value by keyword, got "
            f"{plural(len(unnamed), 'value')} with no key ({values}{more}); "
            "name each one, as in log(step, loss=value), or log(step, **values) for a dict"
        )
    if not scalars:
        return ValueError("log() needs at least one value to record, such as log(step, loss=loss)")
    # As the call would be written: a key that is no identifier ("a,b", "l\nb") inside the
    # dict, quoted, so that neither a comma nor a line break in it blurs the message.
    plain = [f"{key}=..." for key in scalars if key and key.isidentifier()]
    quoted = [f"{key!r}: ..." for key in scalars if key and not key.isidentifier()]
    written = shorten(", ".join(["'': ...", *quoted]), 60)
    return ValueError(
        f"LogBuffer.log() got a value under the empty key '' (log(**{{{written}}}"
        f"{', ' + shorten(', '.join(plain), 60) if plain else ''})), which names no column in "
        "the history or in a sink (a CSV header, a TensorBoard tag); give it a name, such as "
        "log(step, loss=value)"
    )


def checked_step(step: object) -> int:
    """A step that is not a plain int: an integer-like one (numpy's) is taken as an int."""
    if isinstance(step, Mapping):  # wandb.log({"loss": x}) style: the values in a dict
        raise TypeError(
            f"LogBuffer.log() takes each value by keyword, not in a dict, got the dict "
            f"{short_repr(step, 60)} as the step; log(**values), or log(step, **values)"
        )
    usable = not isinstance(step, bool) and hasattr(step, "__index__")
    if isinstance(step, _Tensor) and (not step.is_cpu or step.dtype is torch.bool):
        usable = False  # reading one on a device would wait for it at every log()
    if usable:
        with contextlib.suppress(TypeError):  # a float tensor: its __index__ refuses
            return operator.index(cast("SupportsIndex", step))
    raise TypeError(
        f"step must be an int (or None for the number of earlier log() calls), got "
        f"{short_repr(step, 60)} of type {type(step).__name__}; pass int(step) once it is "
        "on the host, or leave step out"
    )
