"""Every public function that takes a device reads it the same way, and refuses it the same way.

One table of inputs goes to each function. Each call reports the device it
ended up using, so the test sees the normalization (``cpu:0`` is ``cpu``), and
every error must be of the same class and name the parameter.
"""

from __future__ import annotations

import io
import math
import re
import sys
import types
from collections.abc import Callable

import pytest
import torch

import devicekit as dk

from .conftest import GPU_COUNT, FakeAccelerator

Call = Callable[[object], list[torch.device]]


def _to_device(value: object) -> list[torch.device]:
    return [dk.to_device(torch.ones(1), value).device]  # type: ignore[arg-type]


def _load(value: object) -> list[torch.device]:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(1)}, buffer)
    buffer.seek(0)
    return [dk.load(buffer, value)["w"].device]  # type: ignore[arg-type]


def _assert_same_device(value: object) -> list[torch.device]:
    return [dk.assert_same_device(torch.ones(1), device=value)]  # type: ignore[arg-type]


def _timer(value: object) -> list[torch.device]:
    with dk.Timer(device=value) as timer:  # type: ignore[arg-type]
        pass
    return [timer._device or torch.device("cpu")]


def _benchmark_context(value: object) -> list[torch.device]:
    bench = dk.Benchmark("quiet", device=value)  # type: ignore[arg-type]
    return [bench._timer._device or torch.device("cpu")]


def _benchmark(value: object) -> list[torch.device]:
    m = dk.benchmark(math.sqrt, 2.0, device=value, warmup=0.001, min_time=0.001, max_time=0.01)  # type: ignore[arg-type]
    return [torch.device(m.conditions.device)]


def _compare(value: object) -> list[torch.device]:
    table = dk.compare({"sqrt": lambda: math.sqrt(2)}, device=value, max_time=0.01, min_time=0.001)
    return [torch.device(table.rows[0].measurement.conditions.device)]


def _memory_scope(value: object) -> list[torch.device]:
    with dk.memory_scope(value) as scope:  # type: ignore[arg-type]
        pass
    assert scope.report is not None
    return [torch.device(scope.report.device)]


def _data_parallel(value: object) -> list[torch.device]:
    model = dk.data_parallel(torch.nn.Linear(1, 1), value)  # type: ignore[arg-type]
    return [model.weight.device]


def _gpu_map(value: object) -> list[torch.device]:
    dk.gpu_map(math.sqrt, [1.0], devices=value)  # type: ignore[arg-type]
    from devicekit import _workerslots

    return [
        torch.device("cpu") if s == "cpu" else torch.device("cuda", s)
        for s in _workerslots.worker_slots(value, 1)
    ]


def _free_memory(value: object) -> list[torch.device]:
    dk.free_memory(devices=value)  # type: ignore[arg-type]
    return []


def _bench(value: object) -> list[torch.device]:
    from devicekit._devices import resolve_cuda_devices

    resolve_cuda_devices(
        value, name="devices", why="", fix=""
    )  # bench() itself would run for seconds
    return []


SINGLE: dict[str, tuple[Call, str]] = {
    "to_device": (_to_device, "device"),
    "load": (_load, "device"),
    "assert_same_device": (_assert_same_device, "device"),
    "Timer": (_timer, "device"),
    "Benchmark": (_benchmark_context, "device"),
    "benchmark": (_benchmark, "device"),
    "compare": (_compare, "device"),
    "memory_scope": (_memory_scope, "device"),
}
LISTS: dict[str, tuple[Call, str]] = {
    "data_parallel": (_data_parallel, "devices"),
    "gpu_map": (_gpu_map, "devices"),
}
CUDA_ONLY_LISTS: dict[str, tuple[Call, str]] = {
    "free_memory": (_free_memory, "devices"),
    "bench": (_bench, "devices"),
}
CPU = torch.device("cpu")

# (input, expected): a list of devices, or (error class, what the message must say).
CPU_BUILD_CASES: list[tuple[object, object]] = [
    (True, (TypeError, "got the bool True")),
    (-1, (ValueError, "must be a non-negative int, got -1")),
    (99, (dk.DeviceNotFoundError, "means accelerator 99, but")),
    ("cuda", (dk.DeviceNotFoundError, "names a CUDA device, but this torch build")),
    ("cuda:99", (dk.DeviceNotFoundError, "names a CUDA device, but this torch build")),
    ("npu", (ValueError, "is not a device torch knows")),
    ("privateuseone", (dk.DeviceNotFoundError, "no such backend is registered")),
    (1.5, (TypeError, "got 1.5 of type float")),
    ("cpu:0", [CPU]),
    (torch.device("cpu", 0), [CPU]),
    ("cpu", [CPU]),
]


def _check(call: Call, name: str, value: object, expected: object) -> None:
    if isinstance(expected, list):
        assert call(value) == expected
        return
    error, text = expected  # type: ignore[misc]
    with pytest.raises(error) as info:
        call(value)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert re.search(rf"\b{name}(\[\d+\])?\b", message), message  # the parameter is named
    assert text in message, message


@pytest.fixture
def no_accelerator(fake_accelerator: FakeAccelerator) -> None:
    fake_accelerator(None, 0)  # a CPU-only build, wherever the suite runs


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize(("value", "expected"), CPU_BUILD_CASES, ids=repr)
@pytest.mark.parametrize("function", [*SINGLE, *LISTS])
def test_every_function_reads_a_device_the_same_way(
    function: str, value: object, expected: object
) -> None:
    call, name = {**SINGLE, **LISTS}[function]
    _check(call, name, value, expected)


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([-1], (ValueError, "must be a non-negative int, got -1")),
        (["cpu", "cuda:99"], (dk.DeviceNotFoundError, "names a CUDA device")),
        (["npu"], (ValueError, "is not a device torch knows")),
        ([True], (TypeError, "got the bool True")),
        ({"cpu": 1}, (TypeError, "must be a device or a list of devices")),
        (b"cpu", (TypeError, "must be a device or a list of devices")),
        ("cpu", [CPU]),  # a string is one device, never a sequence of letters
        (["cpu", torch.device("cpu", 0)], [CPU, CPU]),
        ((CPU,), [CPU]),
    ],
    ids=repr,
)
@pytest.mark.parametrize("function", list(LISTS))
def test_every_list_parameter_reads_devices_the_same_way(
    function: str, value: object, expected: object
) -> None:
    call, name = LISTS[function]
    if function == "data_parallel" and isinstance(expected, list) and len(expected) > 1:
        expected = [CPU]  # one module, on the first device
    _check(call, name, value, expected)


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cpu", (ValueError, "{name}='cpu' is not a CUDA device")),  # one device: no [0]
        (["cpu"], (ValueError, "{name}[0]='cpu' is not a CUDA device")),
        ([99], (dk.DeviceNotFoundError, "means accelerator 99")),
        (True, (TypeError, "must be a device or a list of devices")),
        ([], []),
    ],
    ids=repr,
)
@pytest.mark.parametrize("function", list(CUDA_ONLY_LISTS))
def test_cuda_only_lists_refuse_the_cpu(function: str, value: object, expected: object) -> None:
    call, name = CUDA_ONLY_LISTS[function]
    if function == "free_memory" and value == []:  # it would empty every GPU's cache
        expected = (ValueError, "devices=[], an empty list")
    if function == "free_memory" and value in ("cpu", ["cpu"]):
        # The CPU is taken: gc, and a note of what its live tensors hold (the advice for
        # devices=0 on a CPU build says "Pass 'cpu'").
        expected = []
    if isinstance(expected, tuple):  # the message names the argument as it was given
        expected = (expected[0], expected[1].format(name=name))
    _check(call, name, value, expected)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cuda:2", (dk.DeviceNotFoundError, "2 GPUs are visible: cuda:0, cuda:1")),
        (5, (dk.DeviceNotFoundError, "2 GPUs are visible: cuda:0, cuda:1")),
        ("xpu", (dk.DeviceNotFoundError, "names an XPU device")),
        ("mps:0", (dk.DeviceNotFoundError, "names an MPS device")),
    ],
    ids=repr,
)
@pytest.mark.parametrize("function", [*SINGLE, *LISTS, *CUDA_ONLY_LISTS])
def test_with_two_fake_gpus_a_third_is_refused_everywhere(
    fake_accelerator: FakeAccelerator, function: str, value: object, expected: object
) -> None:
    fake_accelerator("cuda", 2)
    call, name = {**SINGLE, **LISTS, **CUDA_ONLY_LISTS}[function]
    _check(call, name, value, expected)


def test_a_private_use_backend_is_a_device_once_its_package_registers_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit._devices import resolve_device

    backend = torch._C._get_privateuse1_backend_name()
    if hasattr(torch, backend):
        pytest.skip(f"this torch has the {backend!r} backend registered")
    with pytest.raises(
        dk.DeviceNotFoundError,
        match=rf"device='{backend}' names the out-of-tree \(PrivateUse1\) backend '{backend}', "
        rf"but no such backend is registered .*there is no torch\.{backend} module.*"
        r"Import the backend's package \(such as torch_npu\) first",
    ):
        resolve_device(backend)
    # What the backend's package does when imported (torch._register_device_module).
    monkeypatch.setattr(torch, backend, types.ModuleType(f"torch.{backend}"), raising=False)
    assert resolve_device(f"{backend}:1") == torch.device(backend, 1)


def test_the_device_model_normalizes_fake_gpus(
    fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devicekit._devices import resolve_device, resolve_devices

    fake_accelerator("cuda", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert resolve_device("cuda") == torch.device("cuda", 0)  # before CUDA starts: cuda:0
    assert resolve_device(1) == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert resolve_devices(["cuda:0", 1]) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(dk.DeviceNotFoundError, match=r"CUDA_VISIBLE_DEVICES='3,1'"):
        resolve_device("cuda:2")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cuda:0", 0),
        (torch.device("cuda", 1), 1),
        (1, 1),
        ("cuda", 0),  # the current device; cuda:0 before CUDA starts
    ],
    ids=repr,
)
def test_pick_gpu_exclude_reads_cuda_devices(value: object, expected: int) -> None:
    from devicekit._devices import parse_cuda_indices

    assert parse_cuda_indices(value, name="exclude") == [expected]


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        ("cpu", ValueError, "exclude='cpu' is not a CUDA device"),
        (True, TypeError, "exclude must be a device or a list of devices"),
        ([True], TypeError, "exclude[0] must be a torch.device"),
        ([-1], ValueError, "exclude[0] must be a non-negative int"),
        ("npu", ValueError, "exclude='npu' is not a device torch knows"),
    ],
    ids=repr,
)
def test_pick_gpu_exclude_refuses_like_the_rest(
    nvml_session: Callable[[object], None], value: object, error: type[Exception], text: str
) -> None:
    nvml_session(None)
    with pytest.raises(error) as info:
        dk.pick_gpu(exclude=value)  # type: ignore[arg-type]
    assert text in str(info.value)


def test_pick_gpu_exclude_walks_no_string_letter_by_letter(
    nvml_session: Callable[[object], None],
) -> None:
    nvml_session(None)
    assert dk.pick_gpu(exclude="cuda:0") == CPU  # before: "device string: c" from torch


@pytest.mark.gpu
@pytest.mark.parametrize("function", [*SINGLE, *LISTS, *CUDA_ONLY_LISTS])
def test_on_a_real_gpu_a_missing_one_is_refused_everywhere(function: str) -> None:
    call, name = {**SINGLE, **LISTS, **CUDA_ONLY_LISTS}[function]
    count = torch.cuda.device_count()
    visible = f"{count} GPU{'s are' if count > 1 else ' is'} visible"
    _check(call, name, f"cuda:{count}", (dk.DeviceNotFoundError, visible))
    if function in SINGLE:
        assert call("cuda") == [torch.device("cuda", torch.cuda.current_device())]
        assert call(torch.device("cuda", 0)) == [torch.device("cuda", 0)]


def test_a_real_cpu_build_refuses_cuda_without_a_torch_assertion() -> None:
    if torch.version.cuda or GPU_COUNT:
        pytest.skip("this torch build has CUDA")
    for call, name in [*SINGLE.values(), *LISTS.values()]:
        _check(call, name, "cuda", (dk.DeviceNotFoundError, "names a CUDA device"))


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("CUDA:0", "write 'cuda:0' (device types are lower case, without spaces)"),
        (" cuda", "write 'cuda' (device types are lower case, without spaces)"),
        ("cpu ", "write 'cpu' (device types are lower case, without spaces)"),
        ("Meta", "write 'meta' (device types are lower case, without spaces)"),
        ("gpu", "write 'cuda', or dk.try_gpu() to use whichever accelerator this machine has"),
        ("GPU:1", "write 'cuda:1', or dk.try_gpu() to use whichever accelerator"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("function", [*SINGLE, *LISTS])
def test_a_string_torch_misses_by_case_or_spaces_gets_the_string_it_means(
    function: str, value: str, fix: str
) -> None:
    call, name = {**SINGLE, **LISTS}[function]
    _check(call, name, value, (ValueError, f"{value!r} is not a device torch knows; {fix}"))


@pytest.mark.parametrize(
    "value", ["cuda:", "cuda:-1", "cuda:1.5", "cuda:+1", "cuda:\u0663", "cpu:-1"]
)
def test_a_string_with_a_bad_index_says_how_to_write_one(value: str) -> None:
    from devicekit._devices import resolve_device

    kind = value.partition(":")[0]
    fix = (
        "the index after ':' must be a non-negative integer written with the digits 0-9, "
        f"such as '{kind}:1', or leave it out ('{kind}')"
    )
    start = re.escape(f"device={value!r} is not a device torch knows (")
    with pytest.raises(ValueError, match=rf"^{start}.*\): {re.escape(fix)}$"):
        resolve_device(value)


@pytest.mark.parametrize(("value", "fixed"), [("cuda:00", "cuda:0"), ("cpu:01", "cpu:1")])
def test_a_leading_zero_in_the_index_gets_the_string_without_it(value: str, fixed: str) -> None:
    # Before: "must be ... written with the digits 0-9", which "00" is.
    from devicekit._devices import resolve_device

    start = re.escape(f"device={value!r} is not a device torch knows (")
    fix = re.escape(f"torch reads no leading zero in the index; write {fixed!r}")
    with pytest.raises(ValueError, match=rf"^{start}.*\): {fix}$"):
        resolve_device(value)


def test_a_tensor_is_never_read_as_a_device_index(fake_accelerator: FakeAccelerator) -> None:
    from devicekit._devices import parse_cuda_index, resolve_device, resolve_devices

    fake_accelerator("cuda", 2)
    message = r"got a tensor \(shape \[\], on cpu\); pass tensor.device to use the device"
    with pytest.raises(TypeError, match=rf"^device must be a torch.device.*{message}"):
        resolve_device(torch.tensor(1))  # its value, 1, is not where anything should go
    with pytest.raises(TypeError, match=rf"^exclude must be a torch.device.*{message}"):
        parse_cuda_index(torch.tensor(1), name="exclude")
    with pytest.raises(TypeError, match=r"^devices must be .*got a tensor \(shape \[2\], on cpu\)"):
        resolve_devices(torch.tensor([0, 1]))
    with pytest.raises(TypeError, match=r"^device must be .*got a tensor"):
        dk.to_device(torch.ones(1), torch.ones(1, dtype=torch.long))  # type: ignore[arg-type]


def test_a_numpy_array_of_indices_is_a_list_of_devices(fake_accelerator: FakeAccelerator) -> None:
    np = pytest.importorskip("numpy")
    from devicekit._devices import parse_cuda_indices, resolve_device, resolve_devices

    fake_accelerator("cuda", 2)
    assert resolve_devices(np.arange(2)) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert parse_cuda_indices(np.array([1]), name="exclude") == [1]
    assert resolve_devices(np.int64(1)) == [torch.device("cuda", 1)]  # one integer: one device
    assert resolve_device(np.array(1)) == torch.device("cuda", 1)  # a 0-d array is an integer


@pytest.mark.parametrize(("value", "package"), [("npu:0", "torch_npu"), ("NPU", "torch_npu")])
def test_a_backend_whose_package_names_the_device_says_to_import_it(
    value: str, package: str
) -> None:
    from devicekit._devices import resolve_device

    if package in sys.modules:
        pytest.skip(f"{package} is imported here")
    # Until torch_npu renames torch's spare device type, torch cannot parse "npu" at all.
    with pytest.raises(
        ValueError,
        match=rf"^device='{value}' is not a device torch knows \(.*\); {package} registers "
        rf"'npu' when imported: import {package} first, or use dk.try_gpu\(\)",
    ):
        resolve_device(value)


def test_an_out_of_tree_backend_is_a_device_once_its_package_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit._devices import resolve_device

    if hasattr(torch, "hpu") or "torch_xla" in sys.modules:
        pytest.skip("an out-of-tree backend is installed here")
    for kind, package in [("hpu", "habana_frameworks.torch"), ("xla", "torch_xla")]:
        with pytest.raises(
            dk.DeviceNotFoundError,
            match=rf"^device='{kind}:0' names an {kind.upper()} device, which torch \(.*\) "
            rf"supports only once {package} is imported, and it is not; devices here: .*"
            rf"Import {package} first",
        ):
            resolve_device(f"{kind}:0")
    # What habana_frameworks.torch does when imported (torch._register_device_module).
    monkeypatch.setattr(torch, "hpu", types.ModuleType("torch.hpu"), raising=False)
    assert resolve_device("hpu:1") == torch.device("hpu", 1)
    monkeypatch.setitem(sys.modules, "torch_xla", types.ModuleType("torch_xla"))
    assert resolve_device("xla") == torch.device("xla")


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("hip:1", "names a HIP device, but torch calls AMD GPUs 'cuda', on ROCm builds too; "),
        ("lazy", "names a lazy device, but this torch build"),
        ("mtia", "names an MTIA device, but this torch build"),
        ("vulkan", "names a Vulkan device, but this torch build"),
    ],
    ids=repr,
)
def test_devices_this_build_lacks_are_named_in_plain_words(value: str, text: str) -> None:
    from devicekit._devices import resolve_device

    with pytest.raises(dk.DeviceNotFoundError, match=re.escape(text)):
        resolve_device(value)


# Every public parameter that takes an index or a device, called with ``value``: the
# parameter's name as its errors give it. try_gpu and visible_devices are not device
# arguments, but take indices, so a tensor is refused there too.
def _claim_gpu(value: object) -> None:
    with dk.claim_gpu(exclude=value):  # type: ignore[arg-type]
        pass


def _visible_devices(value: object) -> None:
    with dk.visible_devices(value):  # type: ignore[arg-type]
        pass


def _explain_oom(value: object) -> None:
    with dk.explain_oom(device=value):  # type: ignore[arg-type]
        pass


INDEX_TAKERS: dict[str, tuple[Callable[[object], object], str]] = {
    "try_gpu": (dk.try_gpu, r"try_gpu\(i\)"),  # type: ignore[dict-item]
    "gpu": (dk.gpu, "index"),  # type: ignore[dict-item]
    "Status.gpu": (lambda value: dk.status().gpu(value), "index"),  # type: ignore[arg-type]
    "pick_gpu": (lambda value: dk.pick_gpu(exclude=value), "exclude"),  # type: ignore[arg-type]
    "pick_gpus": (lambda value: dk.pick_gpus(1, exclude=value), "exclude"),  # type: ignore[arg-type]
    "claim_gpu": (_claim_gpu, "exclude"),
    "release_gpu": (dk.release_gpu, "device"),  # type: ignore[dict-item]
    "explain_oom": (_explain_oom, "device"),
    "find_batch_size": (
        lambda value: dk.find_batch_size(lambda size: None, device=value),  # type: ignore[arg-type]
        "device",
    ),
    "gpu_pool": (lambda value: dk.gpu_pool(devices=value), "devices"),  # type: ignore[arg-type]
    "visible_devices": (_visible_devices, r"visible_devices\(\)|entry"),
    **SINGLE,
    **LISTS,
    **CUDA_ONLY_LISTS,
}


@pytest.mark.parametrize(
    "tensor",
    [torch.tensor(1), torch.tensor([1]), torch.tensor([0, 1])],
    ids=lambda tensor: f"shape{list(tensor.shape)}",
)
@pytest.mark.parametrize("function", list(INDEX_TAKERS))
def test_no_function_reads_a_tensor_as_an_index(
    fake_accelerator: FakeAccelerator,
    nvml_session: Callable[[object], None],
    function: str,
    tensor: torch.Tensor,
) -> None:
    # Before: try_gpu(torch.tensor(1)) was cuda:1, visible_devices(torch.tensor(1)) set
    # CUDA_VISIBLE_DEVICES=1, and visible_devices(torch.tensor([0, 1])) raised torch's own
    # "only integer tensors of a single element can be converted to an index".
    nvml_session(None)
    fake_accelerator("cuda", 2)
    call, name = INDEX_TAKERS[function]
    with pytest.raises(TypeError) as info:
        call(tensor)
    message = str(info.value)
    assert re.search(rf"^(entry )?({name})(?!\w)", message), message  # the parameter is named
    shape = list(tensor.shape)
    assert f"a tensor (shape {shape}, on cpu)" in message, message  # never its values
    assert "tensor.device" in message or "tensor.tolist()" in message, message  # the fix


def test_a_numpy_array_of_several_is_no_single_device(fake_accelerator: FakeAccelerator) -> None:
    np = pytest.importorskip("numpy")
    from devicekit._devices import resolve_device

    fake_accelerator("cuda", 2)
    # Before: "device must be a non-negative int, got array([0, 1])", as if only ints were meant.
    with pytest.raises(
        TypeError,
        match=r"^device must be a torch\.device, a device string such as 'cuda:0', or an "
        r"accelerator index, got array\(\[0, 1\]\) of type ndarray$",
    ):
        resolve_device(np.arange(2))
    with pytest.raises(TypeError, match=r"^device must be .*, got the NumPy bool np\.True_$"):
        resolve_device(np.True_)


def test_a_string_read_before_is_checked_against_the_machine_at_each_call(
    fake_accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Strings are kept once parsed (to_device(batch, "cuda") runs every step); what
    # exists, and which GPU "cuda" means, is still read at each call.
    from devicekit import _devices

    fake_accelerator("cuda", 2)
    assert _devices.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert "cuda:1" in _devices._strings_read
    fake_accelerator("cuda", 1)  # a visible_devices scope of one GPU
    with pytest.raises(dk.DeviceNotFoundError, match=r"device='cuda:1' does not exist"):
        _devices.resolve_device("cuda:1")
    fake_accelerator("cuda", 2)
    assert _devices.resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(_devices, "default_cuda_device", lambda: torch.device("cuda", 1))
    assert _devices.resolve_device("cuda") == torch.device("cuda", 1)  # torch.cuda.set_device(1)


def test_cpu_and_meta_strings_read_once_are_the_one_device_and_bad_ones_are_not_kept() -> None:
    from devicekit import _devices

    for _ in range(2):
        assert _devices.resolve_device("cpu:0") is _devices.resolve_device(torch.device("cpu"))
        assert _devices.resolve_device("meta") is _devices.resolve_device(torch.device("meta"))
        with pytest.raises(ValueError, match="write 'cpu'"):
            _devices.resolve_device(" CPU")
    assert " CPU" not in _devices._strings_read
    for index in range(200):  # a program that builds a new string each time
        assert _devices.resolve_device(f"cpu:{index}") == torch.device("cpu")
    assert len(_devices._strings_read) <= _devices._STRINGS_KEPT


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize(
    ("value", "fix"),
    [
        (torch.cuda.device(0), "context manager); pass torch.device('cuda', 0) or 'cuda:0'"),
        ([CPU], "; pass one device, not a list of them (device=device(type='cpu'))"),
        (torch.nn.Linear(1, 1), "; pass next(model.parameters()).device to use the device"),
        (torch.cuda.device(-1), "context manager); pass 'cuda'"),  # not 'cuda:-1'
        ([0, 1], "; pass one device, not a list of them (device=0)"),
    ],
    ids=["torch.cuda.device", "a list", "a module", "torch.cuda.device(-1)", "indices"],
)
def test_objects_that_stand_near_a_device_are_refused_with_the_fix(value: object, fix: str) -> None:
    # Before: "got <torch.cuda.device object ...> of type device", which reads as a
    # torch.device, and no word on passing one device of a list, or a model's device.
    with pytest.raises(TypeError) as info:
        dk.to_device(torch.ones(1), value)  # type: ignore[arg-type]
    assert fix in str(info.value)
