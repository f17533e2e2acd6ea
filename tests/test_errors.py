import pickle

import pytest

import devicekit as dk
from devicekit import _errors

# Every exception devicekit exports, the base first (TensorCopyError once showed its module).
ERRORS = [
    error
    for error in (getattr(dk, name) for name in dk.__all__)
    if isinstance(error, type) and issubclass(error, dk.DevicekitError)
]


def made(error: type[Exception], message: str) -> Exception:
    """An instance of ``error``, with the keyword arguments its class requires."""
    if issubclass(error, dk.WorkerTimeoutError):
        return error(message, index=0, timeout=1.0, results={})  # type: ignore[call-arg]
    return error(message)


@pytest.mark.parametrize("error", ERRORS)
def test_public_path_shows_in_tracebacks(error: type[Exception]) -> None:
    assert error.__module__ == "devicekit"
    assert repr(made(error, "boom")) == f"{error.__name__}('boom')"


def test_errors_subclass_a_builtin_and_the_base() -> None:
    assert issubclass(dk.CUDAInitializedError, RuntimeError)
    assert issubclass(dk.DeviceNotFoundError, ValueError)
    for error in ERRORS[1:]:
        assert issubclass(error, dk.DevicekitError)
    with pytest.raises(ValueError, match="nope"):
        raise dk.DeviceNotFoundError("nope")


def test_a_missing_gpu_is_a_missing_device_and_a_key_error_that_prints_plainly() -> None:
    assert issubclass(dk.GPUNotFoundError, dk.DeviceNotFoundError)
    assert issubclass(dk.GPUNotFoundError, KeyError)
    # KeyError's own str() would print "'there is no cuda:3'", quotes and all.
    assert str(dk.GPUNotFoundError("there is no cuda:3")) == "there is no cuda:3"


@pytest.mark.parametrize("error", ERRORS)
def test_errors_pickle(error: type[Exception]) -> None:
    # Errors cross process boundaries (multiprocessing, spawn workers).
    copy = pickle.loads(pickle.dumps(made(error, "message")))
    assert type(copy) is error
    assert str(copy) == "message"


def test_every_error_is_exported() -> None:
    errors = {
        name
        for name in _errors.__all__
        if isinstance(getattr(_errors, name), type)
        and issubclass(getattr(_errors, name), BaseException)
    }
    assert errors >= {"DevicekitError", "WorkerError", "DeviceOutOfMemoryError"}
    assert errors <= set(dk.__all__)
