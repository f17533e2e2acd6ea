from __future__ import annotations

import inspect
import re

import pytest
import torch

import devicekit as dk
from devicekit import _accelerators

from .conftest import GPU_COUNT, FakeAccelerator, run_python


def test_accelerator_type_reads_the_build_without_the_torch_2_6_runtime_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch 2.6's current_accelerator() takes no arguments, asks the CUDA runtime
    # (starting the driver) and raises without a device; devicekit must not call it.
    query = torch.accelerator.current_accelerator
    if "check_available" not in inspect.signature(query).parameters:
        pytest.skip("this torch has no build-only query to compare with")
    build = query()

    def like_torch_2_6() -> torch.device:
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", like_torch_2_6)
    _accelerators.accelerator_type.cache_clear()
    try:
        assert _accelerators.accelerator_type() == (None if build is None else build.type)
    finally:
        _accelerators.accelerator_type.cache_clear()


def test_try_gpu_is_cpu_without_an_accelerator(fake_accelerator: FakeAccelerator) -> None:
    fake_accelerator(None, 0)
    assert dk.try_gpu() == torch.device("cpu")
    assert dk.try_gpu(3) == torch.device("cpu")


def test_try_gpu_is_cpu_when_the_build_has_cuda_but_no_device(
    fake_accelerator: FakeAccelerator,
) -> None:
    fake_accelerator("cuda", 0)
    assert dk.try_gpu() == torch.device("cpu")
    assert dk.try_all_gpus() == [torch.device("cpu")]


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_try_gpu_indexes_the_visible_devices(fake_accelerator: FakeAccelerator, kind: str) -> None:
    fake_accelerator(kind, 2)
    assert dk.try_gpu() == torch.device(kind, 0)
    assert dk.try_gpu(1) == torch.device(kind, 1)
    assert dk.try_gpu(2) == torch.device("cpu")
    assert dk.try_all_gpus() == [torch.device(kind, 0), torch.device(kind, 1)]


class _Index:
    """An integer-like object, as numpy integers are."""

    def __index__(self) -> int:
        return 1


def test_try_gpu_accepts_integer_like_objects(fake_accelerator: FakeAccelerator) -> None:
    fake_accelerator("cuda", 2)
    assert dk.try_gpu(_Index()) == torch.device("cuda", 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (-1, ValueError, r"try_gpu\(i\) must be a non-negative int, got -1; the first device is 0"),
        (True, TypeError, r"try_gpu\(i\) must be a non-negative int, got the bool True"),
        (1.0, TypeError, r"got 1\.0 of type float"),
        ("0", TypeError, r"got '0' of type str"),
        (None, TypeError, r"got None of type NoneType"),
    ],
)
def test_try_gpu_rejects_bad_indices(bad: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dk.try_gpu(bad)  # type: ignore[arg-type]


def test_try_gpu_names_a_huge_bad_index_in_a_short_message() -> None:
    # Before: the repr of all 10**6 items, 7.9 MB.
    with pytest.raises(TypeError) as caught:
        dk.try_gpu(list(range(10**6)))  # type: ignore[arg-type]
    message = str(caught.value)
    assert len(message) < 1000
    assert message.startswith("try_gpu(i) must be a non-negative int, got [0, 1, 2, ")
    assert "... of type list; pass an int index such as dk.try_gpu(0)" in message


@pytest.mark.parametrize(
    ("bad", "fix"),
    [
        (
            "cuda:0",
            "try_gpu takes an index, not a device: use 'cuda:0' as it is, or dk.try_gpu(0) for "
            "accelerator 0 (the CPU when there is none)",
        ),
        (
            torch.device("cuda", 1),
            "use 'cuda:1' as it is, or dk.try_gpu(1) for accelerator 1 (the CPU when there is "
            "none)",
        ),
        ("cpu", "try_gpu takes an index, not a device: use 'cpu' as it is"),
        (1.0, "pass the int: dk.try_gpu(1)"),
        ("2", "pass the int: dk.try_gpu(2)"),
        ("gpu", "pass an int index such as dk.try_gpu(0), or nothing for the first accelerator"),
        (None, "pass an int index such as dk.try_gpu(0), or nothing for the first accelerator"),
    ],
    ids=repr,
)
def test_try_gpu_says_what_to_pass_instead(bad: object, fix: str) -> None:
    # Before: only "try_gpu(i) must be a non-negative int, got 'cuda:0' of type str".
    with pytest.raises(TypeError) as caught:
        dk.try_gpu(bad)  # type: ignore[arg-type]
    assert str(caught.value).endswith(fix), str(caught.value)


@pytest.mark.parametrize("tensor", [torch.tensor(1), torch.tensor([1])], ids=repr)
def test_try_gpu_never_reads_a_tensor_as_an_index(
    fake_accelerator: FakeAccelerator, tensor: torch.Tensor
) -> None:
    fake_accelerator("cuda", 2)  # before: cuda:1, the tensor's value
    shape = re.escape(str(list(tensor.shape)))
    with pytest.raises(
        TypeError,
        match=rf"^try_gpu\(i\) must be a non-negative int, got a tensor \(shape {shape}, on cpu\); "
        r"a tensor's value is never read as an index; use tensor\.device as it is",
    ):
        dk.try_gpu(tensor)  # type: ignore[arg-type]


def test_try_gpu_names_a_numpy_bool_as_a_bool() -> None:
    np = pytest.importorskip("numpy")
    # Before: "got np.True_ of type bool", as if it were a Python bool refused for no reason.
    with pytest.raises(
        TypeError, match=r"must be a non-negative int, got the NumPy bool np\.True_;"
    ):
        dk.try_gpu(np.True_)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "shown"),
    [
        (
            list(range(10**6)),
            r"got \[0, 1, 2, .*\.\.\. of type list; pass one device, not a list of them "
            r"\(device=0\)$",
        ),
        ("q" * 10**6, r"^device='qqq.*\.\.\.q+' is not a device torch knows \(it knows cpu"),
        ("cuda:" + "1" * 10**6, r"^device='cuda:111.*' is not a device torch knows \(Could not"),
    ],
)
def test_to_device_names_a_huge_bad_device_in_a_short_message(device: object, shown: str) -> None:
    # Before: the whole repr (7.9 MB for the list, 1 MB for the string), or for an index of a
    # million digits Python's bare "Exceeds the limit (4300 digits) for integer string conversion".
    with pytest.raises((TypeError, ValueError)) as caught:
        dk.to_device(torch.ones(1), device)  # type: ignore[arg-type]
    assert len(str(caught.value)) < 1000
    assert re.search(shown, str(caught.value))


def test_try_all_gpus_on_this_machine_is_never_empty() -> None:
    devices = dk.try_all_gpus()
    assert devices
    assert devices[0] == dk.try_gpu()
    if GPU_COUNT == 0:
        assert devices == [torch.device("cpu")]


@pytest.mark.gpu
def test_try_gpu_agrees_with_torch_on_a_real_gpu() -> None:
    # A fresh interpreter, so the answer is not coloured by this process's state.
    result = run_python(
        """
        import json, torch, devicekit as dk
        print(json.dumps({
            "count": torch.cuda.device_count(),
            "all": [str(d) for d in dk.try_all_gpus()],
            "first": str(dk.try_gpu()),
            "beyond": str(dk.try_gpu(torch.cuda.device_count())),
            "initialized": torch.cuda.is_initialized(),
        }))
        """
    )
    assert result["count"] >= 1
    assert result["all"] == [f"cuda:{i}" for i in range(result["count"])]
    assert result["first"] == "cuda:0"
    assert result["beyond"] == "cpu"
    assert result["initialized"] is False


def test_synchronize_calls_each_backend_as_it_wants(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple[object, ...]]] = []

    class Module:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def synchronize(self, *args: object) -> None:
            calls.append((self.kind, args))

    monkeypatch.setattr(torch, "get_device_module", Module)
    _accelerators.synchronize(torch.device("mps", 0))  # torch.mps.synchronize() takes no device
    _accelerators.synchronize(torch.device("cuda", 1))
    _accelerators.synchronize(torch.device("cpu"))  # nothing to wait for
    _accelerators.synchronize(torch.device("meta"))
    assert calls == [("mps", ()), ("cuda", (torch.device("cuda", 1),))]
