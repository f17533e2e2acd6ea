"""gpu_map's executor argument, and executor="ray" where Ray is not installed.

What needs Ray itself is in tests/compat/test_ray.py.
"""

from __future__ import annotations

import importlib.util
import io
import math
import pickle
import re
import sys
import threading
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

import devicekit as dk

from .conftest import FakeAccelerator, free_port


def test_an_unknown_executor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"executor='dask': expected 'local' .* or 'ray'"):
        dk.gpu_map(math.sqrt, [1], executor="dask")  # type: ignore[arg-type]


def test_without_ray_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an absent package looks like to import
    with pytest.raises(ImportError, match=r"needs Ray, .*; pip install 'devicekit\[ray\]'"):
        dk.gpu_map(math.sqrt, [1, 4], executor="ray")


def test_bad_arguments_are_refused_before_ray_is_needed(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    fake_accelerator("cuda", 2)
    with pytest.raises(ValueError, match=r"workers_per_device must be an int >= 1, got 0"):
        dk.gpu_map(math.sqrt, [1], executor="ray", workers_per_device=0)
    with pytest.raises(ValueError, match=r"got devices=\[\]; pass devices=None"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices=[])
    with pytest.raises(ValueError, match=r"names meta devices, but Ray schedules GPU \(CUDA\)"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices=["meta"])
    with pytest.raises(ValueError, match=r"as a GPU task or as a CPU task"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices=["cpu", 1])
    with pytest.raises(TypeError, match=r"devices must be a device or a list of devices"):
        dk.gpu_map(math.sqrt, [1], executor="ray", devices={"cpu": 1})


class _Unserializable:
    """An item Ray's serializer refuses (as it refuses a lock)."""

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle '_Unserializable' object")


class _RefusesToPickle:
    """An item whose pickling raises ValueError, which Ray raises as it is."""

    def __reduce__(self) -> Any:
        raise ValueError("no pickles here")


class _FakeRay(types.ModuleType):
    """Just enough of ``ray`` for ray_map's bookkeeping; it never runs a task."""

    def __init__(self, *, initialized: bool, resources: dict[str, float] | None = None) -> None:
        super().__init__("ray")
        self.initialized = initialized
        self.resources = {"CPU": 2.0} if resources is None else resources
        self.options: list[dict[str, Any]] = []
        self.exceptions = types.SimpleNamespace(RayError=RuntimeError)
        self.submitted: list[str] = []
        self.cancelled: list[str] = []
        self.named: list[str] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init() retries an address that does not answer for minutes")

    def shutdown(self) -> None:
        self.initialized = False

    def cluster_resources(self) -> dict[str, float]:
        return self.resources

    def put(self, value: object) -> object:
        return value

    def remote(self, **options: Any) -> Any:
        ray = self
        self.options.append(options)

        class Task:
            def options(self, *, name: str) -> Task:
                ray.named.append(name)
                return self

            def remote(self, fn: object, item: object, hide_gpus: bool, packed: bool) -> str:
                if isinstance(item, _Unserializable):
                    raise TypeError(f"Could not serialize the argument {item!r} for a task")
                if isinstance(item, _RefusesToPickle):
                    item.__reduce__()  # Ray raises what the item's pickling raised, as it is
                ray.submitted.append(f"ref-{item}")
                return ray.submitted[-1]

        return lambda fn: Task()

    def cancel(self, ref: str, *, force: bool = False) -> None:
        self.cancelled.append(ref)


def test_an_item_ray_cannot_serialize_is_named_and_the_tasks_before_it_are_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, Ray's TypeError named no index, and the tasks already submitted ran on (on a
    # cluster that outlives the call, to the end).
    ray = _FakeRay(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(
        TypeError,
        match=r"sends each item to a Ray task, so Ray must be able to serialize it, and item 2 "
        r"\(<tests.test_r.*>, a _Unserializable\) cannot be: Could not serialize",
    ):
        dk.gpu_map(math.sqrt, [1, 4, _Unserializable(), 9], devices="cpu", executor="ray")
    assert ray.submitted == ["ref-1", "ref-4"]
    assert ray.cancelled == ray.submitted


def _submitted_as(ray: _FakeRay, devices: object, monkeypatch: pytest.MonkeyPatch) -> str:
    """Whether gpu_map on ``ray`` submitted GPU or CPU tasks (it stops at the second item)."""
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(TypeError, match=r"Could not serialize"):  # the fake runs no task
        dk.gpu_map(math.sqrt, [1, _Unserializable()], devices=devices, executor="ray")
    (options,) = ray.options
    return "GPU" if options.get("num_gpus") else "CPU"


def test_on_a_cluster_devices_cuda_asks_for_gpu_tasks_even_from_a_cpu_only_driver(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before: "this torch build has no CUDA support ... install a torch build with CUDA",
    # though the driver only submits tasks; the cluster's GPUs are not this machine's.
    fake_accelerator(None, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            _submitted_as(_FakeRay(initialized=True, resources={"GPU": 8}), "cuda", monkeypatch)
            == "GPU"
        )
    # A cluster with no GPU now (an autoscaler's GPU nodes at zero): the tasks wait for one.
    with pytest.warns(RuntimeWarning, match=r"has no GPU now .* so the tasks wait until one joins"):
        assert _submitted_as(_FakeRay(initialized=True), "cuda", monkeypatch) == "GPU"
    with pytest.raises(ValueError, match=r"devices=\['cuda:1'\] names GPUs of this machine"):
        dk.gpu_map(math.sqrt, [1], devices=["cuda:1"], executor="ray")
    # An index, from a driver without an accelerator: before, "means accelerator 0, but
    # this torch build has no accelerator", as if the cluster's GPUs were this machine's.
    with pytest.raises(ValueError, match=r"^devices=0 names GPUs of this machine, but gpu_map"):
        dk.gpu_map(math.sqrt, [1], devices=0, executor="ray")
    # A device kind Ray has no task for: before, "as a GPU task or as a CPU task", which
    # named neither the kind nor why (R19).
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(initialized=True))
    with pytest.raises(
        ValueError, match=r"^devices=\['mps'\] names mps devices, but Ray schedules GPU \(CUDA\) "
    ):
        dk.gpu_map(math.sqrt, [1], devices="mps", executor="ray")


def test_on_a_cluster_without_gpus_devices_none_warns_that_items_run_on_cpus(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before, an autoscaling cluster whose GPU nodes were at zero ran every item as a CPU
    # task without a word.
    fake_accelerator(None, 0)
    with pytest.warns(
        RuntimeWarning, match=r"so every item runs as a CPU task; pass devices='cuda'"
    ) as told:
        assert _submitted_as(_FakeRay(initialized=True), None, monkeypatch) == "CPU"
    assert told[0].filename == __file__  # pointed at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said outright, or GPUs there: nothing to warn of
        assert _submitted_as(_FakeRay(initialized=True), "cpu", monkeypatch) == "CPU"
        assert (
            _submitted_as(_FakeRay(initialized=True, resources={"GPU": 1}), None, monkeypatch)
            == "GPU"
        )

    class Local(_FakeRay):  # a cluster gpu_map starts on this CPU machine: as the local executor
        def init(self, *args: Any, **kwargs: Any) -> None:
            self.initialized = True

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _submitted_as(Local(initialized=False), None, monkeypatch) == "CPU"


def test_a_ray_address_nothing_answers_at_is_an_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, ray.init() retried it for 14 minutes (Ray 2.60), printing warnings.
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(initialized=False))
    port = free_port()  # nothing listens there
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(
            ConnectionError,
            match=rf"RAY_ADDRESS='{re.escape(address)}' names a Ray cluster that does not "
            rf"answer: connecting to 127.0.0.1:{port} failed",
        ):
            dk.gpu_map(math.sqrt, [1], devices="cpu", executor="ray")


@pytest.mark.parametrize("address", ["http://127.0.0.1:1", "https://head-node:8265/"])
def test_an_http_ray_address_is_named_as_such_not_as_a_dns_failure(
    monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    # Before, the scheme was taken for the host: "connecting to http://127.0.0.1:1 failed
    # ([Errno -2] Name or service not known)". ray.init() refuses these addresses too.
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(initialized=False))
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(
        ValueError,
        match=rf"RAY_ADDRESS='{re.escape(address)}' is an HTTP address \(a Ray dashboard's, "
        r"which `ray job submit` uses\), and ray.init\(\) cannot connect to a cluster there. "
        r"Set RAY_ADDRESS to the cluster's GCS address \(head-node:6379\) or its Ray Client "
        r"address \(ray://head-node:10001\), or unset it",
    ):
        dk.gpu_map(math.sqrt, [1], devices="cpu", executor="ray")


@pytest.mark.parametrize("address", ["localhost", "head-node/"])
def test_a_ray_address_without_a_port_names_the_variable_and_the_form(
    monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    # Before: Ray's "ValueError: Invalid address format: localhost", naming neither
    # RAY_ADDRESS nor the host:port it wants.
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(initialized=False))
    monkeypatch.setenv("RAY_ADDRESS", address)
    host = address.rstrip("/")
    with pytest.raises(
        ValueError,
        match=rf"RAY_ADDRESS='{address}' has no port: ray.init\(\) reads it as host:port, the "
        rf"cluster's GCS address. Set RAY_ADDRESS={host}:6379 ",
    ):
        dk.gpu_map(math.sqrt, [1], devices="cpu", executor="ray")


def test_an_ipv6_ray_address_is_checked_by_its_host_and_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(initialized=False))
    tried: list[tuple[str, int]] = []

    def refuse(address: tuple[str, int], timeout: float) -> None:
        tried.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr("socket.create_connection", refuse)
    for address in ("[::1]:6379", "ray://[::1]:10001/"):
        monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(ConnectionError, match=r"connecting to ::1:\d+ failed"):
            dk.gpu_map(math.sqrt, [1], devices="cpu", executor="ray")
    assert tried == [("::1", 6379), ("::1", 10001)]


def test_ray_error_text_loses_its_terminal_codes() -> None:
    from devicekit._rayfaults import plain_text

    text = (
        "\x1b[36mray::_run()\x1b[39m (pid=7, ip=10.0.0.3)\n           ^^^^^^^^^\n"
        '  File "x.py", line 1, in f\n\nTypeError: \x1b[1mno\x1b[0m'
    )
    assert plain_text(text) == (
        'ray::_run() (pid=7, ip=10.0.0.3)\n  File "x.py", line 1, in f\n\nTypeError: no'
    )


def test_the_ray_example_scores_without_autograd_warnings() -> None:
    # Before, float(loss) of a tensor that requires grad warned in every task: "Converting
    # a tensor with requires_grad=True to a scalar may lead to unexpected behavior".
    path = Path(__file__).parent.parent / "examples" / "gpu_map_on_ray.py"
    spec = importlib.util.spec_from_file_location("gpu_map_on_ray", path)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # its __name__ is not "__main__": nothing runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seed, device, _, loss = example.evaluate(3)
    assert (seed, device) == (3, str(dk.try_gpu()))
    assert isinstance(loss, float)


# --- what a failed task is blamed on -----------------------------------------------------------


def _interrupt(item: object) -> object:
    raise KeyboardInterrupt


class _RuntimeContext:
    def __init__(self, cancelled: bool | None) -> None:
        if cancelled is not None:  # None: a Ray without is_canceled()
            self.is_canceled = lambda: cancelled


def _ray_in_a_task(
    monkeypatch: pytest.MonkeyPatch, cancelled: bool | None, *, pickler: bool = False
) -> None:
    """``ray`` as a task sees it: whether Ray is cancelling it (None: this Ray cannot say).

    With ``pickler``, Ray's own ``ray.cloudpickle`` too (the result's dry run pickles with it).
    """
    if pickler:
        real = pytest.importorskip("ray.cloudpickle")
        monkeypatch.setitem(sys.modules, "ray.cloudpickle", real)
    ray = types.ModuleType("ray")
    ray.__version__ = "2.53.0"  # type: ignore[attr-defined]
    ray.get_runtime_context = lambda: _RuntimeContext(cancelled)  # type: ignore[attr-defined]
    ray.get = lambda ref: ref  # type: ignore[attr-defined]  # fn comes as [ObjectRef]
    monkeypatch.setitem(sys.modules, "ray", ray)


def test_a_cancellation_by_ray_leaves_the_task_as_a_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, the KeyboardInterrupt by which ray.cancel() (without force) stops a task came
    # back as fn's own: "fn raised KeyboardInterrupt". Now Ray reports its cancellation.
    from devicekit._raytask import run as _run

    _ray_in_a_task(monkeypatch, cancelled=True)
    with pytest.raises(KeyboardInterrupt):
        _run([_interrupt], 5, False)


def test_fn_s_own_keyboard_interrupt_is_fn_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit._rayfaults import answer_failed
    from devicekit._raytask import run as _run

    _ray_in_a_task(monkeypatch, cancelled=False)
    answer = _run([_interrupt], 5, False)
    assert answer[:1] == ("exited",)
    assert answer_failed(0, 5, answer).startswith(
        "gpu_map: fn raised KeyboardInterrupt on item 0 (5)"
    )


def test_where_ray_cannot_tell_a_cancellation_the_message_names_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ray before late 2025 has no is_canceled(): its cancellation and fn's KeyboardInterrupt
    # are the same exception in the task.
    from devicekit._rayfaults import answer_failed
    from devicekit._raytask import run as _run

    _ray_in_a_task(monkeypatch, cancelled=None)
    message = answer_failed(0, 5, _run([_interrupt], 5, False))
    assert re.match(
        r"gpu_map: item 0 \(5\) stopped on KeyboardInterrupt in a Ray task on .+ \(the CPU\): "
        r"fn raised it, or Ray cancelled the task \(ray.cancel\(\) without force, or a cancel "
        r"of the task that called gpu_map, raises KeyboardInterrupt in it\), and Ray 2.53.0 "
        r"cannot tell which \(Ray 2.54 and later can\). If fn raised it: fn must return a "
        r"result, or raise an Exception to fail its item",
        message,
    ), message
    # Before: "fn raised KeyboardInterrupt, or Ray cancelled the task (this Ray cannot tell
    # which) on item 0 (5) ...; fn must return a result", a fix for fn's case alone.
    assert "fn raised KeyboardInterrupt, or" not in message


def test_outside_a_ray_worker_a_keyboard_interrupt_is_fn_s(monkeypatch: pytest.MonkeyPatch) -> None:
    # is_canceled() raises RuntimeError outside a Ray worker's task: nothing there is Ray's
    # cancellation. Before, it read as a Ray that cannot tell ("or Ray cancelled the task").
    from devicekit._raytask import run as _run

    _ray_in_a_task(monkeypatch, cancelled=False)
    context = _RuntimeContext(None)

    def not_a_worker() -> bool:
        raise RuntimeError("This method is only available when the process is a worker.")

    context.is_canceled = not_a_worker  # type: ignore[attr-defined]
    monkeypatch.setattr(sys.modules["ray"], "get_runtime_context", lambda: context)
    assert _run([_interrupt], 5, False)[:1] == ("exited",)


class _ExitsWhenPickled:
    def __reduce__(self) -> Any:
        sys.exit(5)


def _exits_when_pickled(item: object) -> object:
    import torch

    return [torch.zeros(3), {"bad": _ExitsWhenPickled()}]


def test_a_result_whose_pickling_exits_is_answered_not_left_to_end_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, "ok" went back and Ray's pickling of the result raised SystemExit after the
    # task returned: the worker ended, and Ray ran the task again, three times.
    from devicekit._rayfaults import answer_failed
    from devicekit._raytask import run as _run

    _ray_in_a_task(monkeypatch, cancelled=False, pickler=True)
    answer = _run([_exits_when_pickled], 5, False)
    assert answer[:1] == ("unsendable",), answer
    message = answer_failed(0, 5, answer)
    assert re.match(
        r"gpu_map: the result of item 0 \(5\) cannot be sent back from a Ray task on .+ \(the "
        r"CPU\): pickling it called sys.exit\(5\) \(SystemExit and KeyboardInterrupt are not "
        r"Exceptions\); it was not retried",
        message,
    ), message
    assert "in __reduce__" in message  # the worker's traceback


class _RayObject:
    """As one of Ray's objects: Ray's own pickling of an ObjectRef has side effects."""

    def __reduce__(self) -> Any:
        raise AssertionError("pickled")


@pytest.mark.parametrize("module", ["ray._raylet", "ray"])
def test_the_dry_run_of_a_result_leaves_tensors_and_ray_s_objects_out(
    monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    # Before, an ObjectRef (of class ray.ObjectRef, whose module is "ray") was pickled in the
    # dry run, by Ray's own reducer, which pins its object for the life of the worker.
    import torch

    pytest.importorskip("ray.cloudpickle")
    from devicekit._raytask import dry_run as _dry_run

    monkeypatch.setattr(_RayObject, "__module__", module)
    written = io.BytesIO()
    _dry_run()(written, protocol=5).dump([torch.zeros(1000), _RayObject()])
    assert len(written.getvalue()) < 100  # neither the tensor's bytes nor the object's


def _lambda_then_exits(item: object) -> object:
    return [lambda: 1, _ExitsWhenPickled()]


def _local_class_then_exits(item: object) -> object:
    class Local:  # pickled by value by Ray's pickler; the standard one refuses it
        pass

    return [Local(), _ExitsWhenPickled()]


@pytest.mark.parametrize("fn", [_lambda_then_exits, _local_class_then_exits])
def test_the_dry_run_pickles_lambdas_and_local_classes_as_ray_does(
    monkeypatch: pytest.MonkeyPatch, fn: Any
) -> None:
    # Before, the dry run used the standard pickler: it gave up (PicklingError) at the lambda
    # or the class, before the object whose __reduce__ exits, and answered "ok". Ray's own
    # pickling then ended the worker, and Ray ran fn four times.
    from devicekit._raytask import run as _run

    _ray_in_a_task(monkeypatch, cancelled=False, pickler=True)
    answer = _run([fn], 5, False)
    assert answer[:1] == ("unsendable",), answer
    assert answer[2] == "sys.exit(5)"


class _Written:
    """``_Discard`` that counts what the dry run writes, and how often it runs."""

    runs = 0
    size = 0

    def __init__(self) -> None:
        _Written.runs += 1

    def write(self, data: bytes) -> int:
        _Written.size += len(data)
        return len(data)


def test_the_dry_run_leaves_numpy_arrays_out_and_plain_results_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a non-contiguous array was copied whole by the dry run (+391 MB of peak memory
    # for a 400 MB view), and a result that is itself a tensor or a number was pickled too.
    np = pytest.importorskip("numpy")
    pytest.importorskip("ray.cloudpickle")
    import torch

    from devicekit import _raytask

    monkeypatch.setattr(_raytask, "_Discard", _Written)
    monkeypatch.setattr(_Written, "runs", 0)
    monkeypatch.setattr(_Written, "size", 0)
    view = np.ones((200, 200))[:, ::2]  # 160 kB, not contiguous
    assert _raytask.unsendable({"scores": view, "best": view[0]}) is None
    assert _Written.runs == 1
    assert _Written.size < 1000  # the dict and its keys, not the arrays' bytes
    for plain in (view, torch.ones(100), 3, 2.5, "text", b"bytes", None, True):
        assert _raytask.unsendable(plain) is None
    assert _Written.runs == 1  # not pickled at all


def test_an_array_of_objects_is_still_pickled_in_the_dry_run() -> None:
    # numpy pickles the objects of an object array: their __reduce__ runs.
    np = pytest.importorskip("numpy")
    pytest.importorskip("ray.cloudpickle")
    from devicekit._raytask import unsendable as _unsendable

    objects = np.empty(2, dtype=object)
    objects[1] = _ExitsWhenPickled()
    for result in (objects, [objects]):
        answer = _unsendable(result)
        assert answer is not None
        assert answer[:1] == ("unsendable",)


class _Store:
    """``ray.put`` and ``ray.get``: what is put is pickled, and rebuilt when got."""

    def put(self, value: object) -> bytes:
        return pickle.dumps(value)

    def get(self, ref: bytes) -> Any:
        return pickle.loads(ref)


def _exit_here() -> None:
    sys.exit(3)


class _ExitsWhenUnpickled:
    def __reduce__(self) -> Any:
        return _exit_here, ()


@pytest.mark.parametrize("holds", ["nothing else", "a tensor"])
def test_an_item_whose_unpickling_exits_is_answered_not_left_to_end_the_worker(
    monkeypatch: pytest.MonkeyPatch, holds: str
) -> None:
    # Before, Ray rebuilt the item before the task ran, where nothing caught SystemExit: it
    # ended the worker, Ray ran the task again three times, then "The worker died
    # unexpectedly". Now the item travels packed, and the task unpacks it itself.
    import torch

    pytest.importorskip("ray.cloudpickle")
    from devicekit._ray import _parcel
    from devicekit._rayfaults import answer_failed
    from devicekit._raytask import run as _run

    store = _Store()
    item = [_ExitsWhenUnpickled()] + ([torch.zeros(2)] if holds == "a tensor" else [])
    parcel, packed = _parcel(store, item)
    assert packed
    assert isinstance(parcel, bytes) == (holds == "nothing else")  # else Ray's to carry: put
    _ray_in_a_task(monkeypatch, cancelled=False)
    monkeypatch.setattr(sys.modules["ray"], "get", store.get)
    answer = _run([store.put(len)], parcel, False, packed)
    assert answer[:1] == ("item_failed",), answer
    message = answer_failed(1, item, answer)
    assert re.match(
        r"gpu_map: item 1 \(\[.*\]\) could not be unpickled in a Ray task on .+ \(the CPU\): "
        r"rebuilding it called sys.exit\(3\). Each item is rebuilt in its worker from its "
        r"pickle: pass data .* The worker's traceback:\nTraceback",
        message,
        re.DOTALL,
    ), message
    assert "in _exit_here" in message


def test_items_whose_rebuilding_runs_no_code_of_theirs_travel_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    pytest.importorskip("ray.cloudpickle")
    from devicekit._ray import _parcel

    monkeypatch.setattr(_RayObject, "__module__", "ray")  # an ObjectRef: Ray resolves it
    store = _Store()
    for item in (3, "/data/ckpt.pt", None, torch.zeros(2), _RayObject(), _Unserializable()):
        parcel, packed = _parcel(store, item)
        assert parcel is item
        assert not packed  # Ray's own serializer, as before (and its error, for the last)
    parcel, packed = _parcel(store, ("/data/ckpt.pt", 3))
    assert packed
    assert pickle.loads(parcel) == ("/data/ckpt.pt", 3)


def test_a_failure_of_the_task_s_own_code_is_not_blamed_on_fn_nor_on_the_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, it left the task, and Ray's RayTaskError(KeyError) was worded as a result
    # that "cannot be sent back ... Return picklable data".
    import contextlib

    from devicekit import _raytask
    from devicekit._rayfaults import answer_failed

    _ray_in_a_task(monkeypatch, cancelled=False)

    @contextlib.contextmanager
    def fails_at_exit(name: str, value: str | None) -> Any:
        yield
        raise KeyError(name)

    monkeypatch.setattr(_raytask, "scoped_env", fails_at_exit)
    answer = _raytask.run([math.sqrt], 4, True)
    assert answer[:1] == ("task_failed",)
    message = answer_failed(0, 4, answer)
    assert message.startswith("gpu_map: the Ray task for item 0 (4) failed in a Ray task on "), (
        message
    )
    assert "outside fn (in devicekit's code around it): KeyError: 'CUDA_VISIBLE_DEVICES'. The " in (
        message
    )
    assert "in fails_at_exit" in message  # the task's traceback


class _RayError(Exception):
    pass


class _RaySystemError(_RayError):
    """Ray's RaySystemError: what could not be rebuilt in the worker, and its traceback."""

    def __init__(self, client_exc: BaseException, traceback_str: str) -> None:
        super().__init__(f"System error: {client_exc}\ntraceback: {traceback_str}")
        self.client_exc = client_exc
        self.traceback_str = traceback_str


class _RayTaskError(_RayError):
    """Ray's RayTaskError as ray.get raises it: Ray's text, and the cause."""

    def __init__(self, text: str, cause: BaseException) -> None:
        super().__init__(text)
        self.cause = cause


_FAKE_RAY = types.SimpleNamespace(
    exceptions=types.SimpleNamespace(
        RayError=_RayError, RayTaskError=_RayTaskError, RaySystemError=_RaySystemError
    )
)
_TASK = "\x1b[36mray::devicekit.gpu_map()\x1b[39m (pid=7, ip=10.0.0.3)\n"


def test_a_task_error_from_outside_the_serializer_is_quoted_not_blamed_on_the_result() -> None:
    # Before, any cause that was not a Ray error read "the result of item 2 (7) cannot be
    # sent back ... Return picklable data", whatever had raised it.
    from devicekit._rayfaults import ray_failed

    text = _TASK + '  File "x.py", line 3, in setup\nValueError: no'
    message = ray_failed(_FAKE_RAY, _RayTaskError(text, ValueError("no")), 2, 7)
    assert message == (
        "gpu_map: the Ray task for item 2 (7) failed: ray::devicekit.gpu_map() (pid=7, "
        'ip=10.0.0.3)\n  File "x.py", line 3, in setup\nValueError: no'
    )


def test_a_result_ray_s_serializer_refused_is_named_as_such() -> None:
    from devicekit._rayfaults import ray_failed

    text = _TASK + (
        '  File "/site-packages/ray/cloudpickle/cloudpickle.py", line 1544, in dumps\n'
        "    cp.dump(obj)\nTypeError: cannot pickle '_thread.lock' object"
    )
    cause = TypeError("cannot pickle '_thread.lock' object")
    assert ray_failed(_FAKE_RAY, _RayTaskError(text, cause), 2, 7) == (
        "gpu_map: the result of item 2 (7) cannot be sent back from a Ray task on 10.0.0.3: "
        "TypeError: cannot pickle '_thread.lock' object. Return picklable data: numbers, "
        "strings, tensors, or containers of them."
    )


def test_an_item_ray_could_not_rebuild_in_its_worker_is_named_with_the_fix() -> None:
    # Before, Ray's words: "the Ray task for item 1 (...) failed: ray::_run() (...) At least
    # one of the input arguments for this task could not be computed: ...RaySystemError...".
    text = _TASK + (
        "  At least one of the input arguments for this task could not be computed:\n"
        "ray.exceptions.RaySystemError: System error: no module mine"
    )
    remote = (
        'Traceback (most recent call last):\n  File "x.py", line 3\nModuleNotFoundError: mine\n'
    )
    cause = _RaySystemError(ModuleNotFoundError("mine"), remote)
    message = ray_failed_of(_RayTaskError(text, cause))
    assert message == (
        "gpu_map: item 2 (7) could not be unpickled in a Ray task on 10.0.0.3: "
        "ModuleNotFoundError: mine. Each item is rebuilt in its worker from its pickle: pass "
        "data (numbers, strings, paths, CPU tensors) whose classes the worker can import, and "
        f"let fn build the rest. The worker's traceback:\n{remote}"
    )


def test_a_result_this_process_cannot_rebuild_is_named_as_such() -> None:
    # Before: "the Ray task for item 2 (7) failed: System error: ..." (RaySystemError).
    remote = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'mine'"
    message = ray_failed_of(_RaySystemError(ModuleNotFoundError("mine"), remote))
    assert message == (
        "gpu_map: the result of item 2 (7) came back from its Ray task, but cannot be rebuilt "
        "here: ModuleNotFoundError: No module named 'mine'. Return data that this process can "
        "rebuild: numbers, strings, tensors, or containers of them (of classes that this "
        "process can import too)."
    )


def ray_failed_of(error: BaseException) -> str:
    """The message for item 2 (7) whose task Ray failed with ``error``."""
    try:
        from devicekit._rayfaults import ray_failed
    except ImportError:  # before _rayfaults
        from devicekit._ray import _ray_failed as ray_failed  # type: ignore[attr-defined]
    return ray_failed(_FAKE_RAY, error, 2, 7)


@pytest.mark.parametrize("upstream", ["upstream", "_run"])
def test_an_objectref_item_whose_own_task_s_result_was_unpicklable_is_not_blamed_on_fn(
    upstream: str,
) -> None:
    # Before: "the result of item 2 (7) cannot be sent back ... Return picklable data", for
    # an item whose upstream task could not send its own result back: fn never ran. And
    # devicekit's task was Ray's "_run" (its function's name), so a user's upstream task
    # also called _run was taken for devicekit's.
    text = _TASK + (
        "  At least one of the input arguments for this task could not be computed:\n"
        f"ray.exceptions.RayTaskError: \x1b[36mray::{upstream}()\x1b[39m (pid=8, ip=10.0.0.4)\n"
        '  File "/site-packages/ray/cloudpickle/cloudpickle.py", line 1544, in dumps\n'
        "    cp.dump(obj)\nTypeError: cannot pickle '_thread.lock' object"
    )
    message = ray_failed_of(_RayTaskError(text, TypeError("cannot pickle '_thread.lock' object")))
    assert message.startswith(
        "gpu_map: the Ray task for item 2 (7) failed: ray::devicekit.gpu_map() (pid=7, "
        "ip=10.0.0.3)\n  At least one of the input arguments for this task could not be "
        f"computed:\nray.exceptions.RayTaskError: ray::{upstream}() (pid=8, ip=10.0.0.4)\n"
    ), message
    assert "cannot be sent back" not in message


def test_gpu_map_s_tasks_are_named_as_its_faults_tell_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit._rayfaults import TASK_NAME

    ray = _FakeRay(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(TypeError, match=r"Could not serialize"):  # the fake runs no task
        dk.gpu_map(math.sqrt, [1, _Unserializable()], devices="cpu", executor="ray")
    assert ray.named == [TASK_NAME] == ["devicekit.gpu_map"]


class _BatchRay:
    """A ``ray`` whose tasks have all finished: one ``wait`` returns every ref."""

    exceptions = _FAKE_RAY.exceptions

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.cancelled: list[str] = []

    def wait(
        self, refs: list[str], num_returns: int, timeout: float
    ) -> tuple[list[str], list[str]]:
        return list(refs), []

    def get(self, ref: str) -> Any:
        answer = self.answers[ref]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def cancel(self, ref: str, *, force: bool = False) -> None:
        self.cancelled.append(ref)


def test_results_that_finish_with_a_failure_are_kept() -> None:
    # Before, the first failing ref of a batch raised at once: the results after it in the
    # same batch were never fetched and were missing from WorkerError.results.
    from devicekit._progress import Progress
    from devicekit._ray import _collect

    trace = "Traceback (most recent call last):\nValueError: item 1 fails\n"
    answers: dict[str, Any] = {f"ref-{i}": ("ok", i * 10) for i in range(6)}
    answers["ref-1"] = ("raised", "a Ray task on node-3 (the CPU)", trace)
    answers["ref-3"] = _RayTaskError(_TASK + "ValueError: worker died", ValueError("died"))
    ray = _BatchRay(answers)
    with pytest.raises(dk.WorkerError, match=r"fn raised on item 1 \(1\)") as caught:
        _collect(ray, list(answers), list(range(6)), Progress(6, False))
    assert caught.value.index == 1  # the first failure
    assert caught.value.results == {0: 0, 2: 20, 4: 40, 5: 50}


def test_of_items_that_fail_together_the_first_is_reported() -> None:
    # Before, the first failure in ray.wait's order was reported: item 3, not item 1.
    from devicekit._progress import Progress
    from devicekit._ray import _collect

    def failed(index: int) -> tuple[str, str, str]:
        trace = f"Traceback (most recent call last):\nValueError: item {index} fails\n"
        return ("raised", "a Ray task on node-3 (the CPU)", trace)

    class Reversed(_BatchRay):  # ray.wait gives finished refs back in its own order
        def wait(
            self, refs: list[str], num_returns: int, timeout: float
        ) -> tuple[list[str], list[str]]:
            return list(reversed(refs)), []

    answers: dict[str, Any] = {f"ref-{i}": ("ok", i * 10) for i in range(4)}
    answers["ref-1"], answers["ref-3"] = failed(1), failed(3)
    with pytest.raises(dk.WorkerError, match=r"item 1 fails") as caught:
        _collect(Reversed(answers), list(answers), list(range(4)), Progress(4, False))
    assert caught.value.index == 1
    assert caught.value.results == {0: 0, 2: 20}


def test_ctrl_c_keeps_the_results_that_had_finished() -> None:
    # Before, Ctrl-C during a Ray map lost every finished result (the local
    # executor's KeyboardInterrupt has kept them as .results since 0.x).
    from devicekit._progress import Progress
    from devicekit._ray import _collect

    class Interrupted(_BatchRay):  # two tasks finish, then Ctrl-C while waiting
        def wait(
            self, refs: list[str], num_returns: int, timeout: float
        ) -> tuple[list[str], list[str]]:
            if len(refs) < 4:
                raise KeyboardInterrupt
            return refs[:2], refs[2:]

    answers: dict[str, Any] = {f"ref-{i}": ("ok", i * 10) for i in range(4)}
    ray = Interrupted(answers)
    with pytest.raises(KeyboardInterrupt) as caught:
        _collect(ray, list(answers), list(range(4)), Progress(4, False))
    assert caught.value.results == {0: 0, 1: 10}  # type: ignore[attr-defined]
    assert caught.value.__notes__ == [
        "devicekit: gpu_map was stopped. 2 of 4 items had finished: their results are in "
        "this error's .results (a dict by item index); the others were lost."
    ]
    assert ray.cancelled == ["ref-2", "ref-3"]


def test_a_second_ctrl_c_during_ray_s_shutdown_still_shuts_it_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, Ctrl-C cutting ray.shutdown() short left Ray's agents running, and Ray
    # then ended the script before its `except KeyboardInterrupt` could save .results.
    from devicekit import _raycluster

    class Interrupted(_FakeRay):
        def __init__(self) -> None:
            super().__init__(initialized=False)
            self.shutdowns = 0

        def init(self, *args: Any, **kwargs: Any) -> None:
            self.initialized = True

        def shutdown(self) -> None:
            self.shutdowns += 1
            if self.shutdowns == 1:
                raise KeyboardInterrupt  # the second Ctrl-C, during the first shutdown
            self.initialized = False

    ray = Interrupted()
    first = KeyboardInterrupt()
    first.results = {0: 1}  # type: ignore[attr-defined]

    def map_cut_short() -> None:
        with _raycluster.cluster(ray, None, connected=False):
            raise first

    with pytest.raises(KeyboardInterrupt) as caught:
        map_cut_short()
    assert (ray.shutdowns, ray.initialized) == (2, False)
    assert caught.value.__context__ is first  # whose .results the map gives the second


class _Counted(_FakeRay):
    """A Ray that gpu_map starts itself, counting its starts and shutdowns."""

    def __init__(self) -> None:
        super().__init__(initialized=False)
        self.calls: list[str] = []

    def init(self, *args: Any, **kwargs: Any) -> None:
        assert not self.initialized, "Perhaps you called ray.init twice by accident?"
        self.initialized = True
        self.calls.append(f"init num_gpus={kwargs.get('num_gpus')}")

    def shutdown(self) -> None:
        self.initialized = False
        self.calls.append("shutdown")


def _in_a_thread(
    ray: _Counted, targets: list[Any] | None, entered: threading.Event, leave: threading.Event
) -> threading.Thread:
    """A map in a thread: it enters the cluster, says so, and leaves when told to."""
    from devicekit import _raycluster

    def map_() -> None:
        with _raycluster.cluster(ray, targets, connected=False):
            entered.set()
            assert leave.wait(10)

    thread = threading.Thread(target=map_)
    thread.start()
    return thread


def test_maps_in_two_threads_share_the_cluster_and_the_last_shuts_it_down() -> None:
    # Before, each map's thread started Ray (Ray's "Perhaps you called ray.init twice by
    # accident?") or the first to end shut it down under the other: its results were lost.
    from devicekit import _raycluster

    ray = _Counted()
    entered, leave = threading.Event(), threading.Event()
    first = _in_a_thread(ray, None, entered, leave)
    assert entered.wait(10)
    with _raycluster.cluster(ray, None, connected=False):
        leave.set()
        first.join(10)
        assert ray.calls == ["init num_gpus=None"]  # the first map's end left it running
        assert ray.initialized
    assert ray.calls == ["init num_gpus=None", "shutdown"]
    assert (_raycluster._owned, _raycluster._users) == (None, 0)


def test_a_map_for_other_gpus_waits_for_the_cluster_started_for_others(
    fake_accelerator: FakeAccelerator,
) -> None:
    # A cluster started for GPU 0 hands out GPU 0 only: a map for GPU 1 starts its own
    # once that one has ended. CPU tasks can share any (they hide every GPU).
    import torch

    from devicekit import _raycluster

    fake_accelerator("cuda", 2)
    ray = _Counted()
    entered, leave = threading.Event(), threading.Event()
    first = _in_a_thread(ray, [torch.device("cuda", 0)], entered, leave)
    assert entered.wait(10)
    with _raycluster.cluster(ray, [torch.device("cpu")], connected=False):
        assert ray.calls == ["init num_gpus=1"]
    second_entered = threading.Event()
    second = _in_a_thread(ray, [torch.device("cuda", 1)], second_entered, leave)
    assert not second_entered.wait(0.3)  # waits, rather than using GPU 0
    leave.set()
    first.join(10)
    assert second_entered.wait(10)
    second.join(10)
    assert ray.calls == ["init num_gpus=1", "shutdown", "init num_gpus=1", "shutdown"]


def test_a_ray_half_imported_by_another_thread_is_not_an_attribute_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: "partially initialized module 'ray' has no attribute 'is_initialized'".
    from devicekit import _raycluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))  # its import under way
    assert _raycluster.connected_now() is False


class _WorkerCrashedError(_RayError):
    """Ray's WorkerCrashedError: no attributes, one sentence."""

    def __str__(self) -> str:
        return (
            "The worker died unexpectedly while executing this task. Check "
            "python-core-worker-*.log files for more information."
        )


def test_a_worker_that_died_says_how_many_times_ray_ran_fn() -> None:
    # Before, after Ray had run fn four times (7.6 s), only: "the Ray task for item 1 (1)
    # failed: The worker died unexpectedly while executing this task. ...".
    from devicekit._progress import Progress
    from devicekit._ray import _collect

    ray = _BatchRay({"ref-0": ("ok", 0), "ref-1": _WorkerCrashedError(), "ref-2": ("ok", 2)})
    ray.exceptions = types.SimpleNamespace(
        **vars(_FAKE_RAY.exceptions), WorkerCrashedError=_WorkerCrashedError
    )
    with pytest.raises(dk.WorkerError) as caught:
        _collect(ray, ["ref-0", "ref-1", "ref-2"], [0, 1, 2], Progress(3, False), retries=3)
    message = str(caught.value)
    assert message.startswith(
        "gpu_map: the Ray task for item 1 (1) failed: its worker died; Ray ran the task up to "
        "4 times (max_retries=3: Ray runs a task whose worker dies again), so fn may have run "
        "4 times on this item, and its side effects (files written, messages sent) may have "
        "repeated. Something ended the worker's process while it ran: os._exit() in fn, a "
        "signal"
    ), message
    assert "set RAY_TASK_MAX_RETRIES=0 to have Ray not run it again" in message
    assert message.endswith(
        "Ray said: The worker died unexpectedly while executing this task. "
        "Check python-core-worker-*.log files for more information."
    )
    assert (caught.value.index, caught.value.results) == (1, {0: 0, 2: 2})
    from devicekit._rayfaults import worker_died

    assert "died; Ray did not run the task again (max_retries=0)." in worker_died(1, 1, 0, "")
    assert "may have run more than once on this item" in worker_died(1, 1, None, "")


def test_the_task_s_max_retries_is_set_as_ray_would_so_the_error_can_say_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for setting, expected in [(None, 3), ("0", 0), ("5", 5)]:
        if setting is None:
            monkeypatch.delenv("RAY_TASK_MAX_RETRIES", raising=False)
        else:
            monkeypatch.setenv("RAY_TASK_MAX_RETRIES", setting)
        ray = _FakeRay(initialized=True)
        monkeypatch.setitem(sys.modules, "ray", ray)
        with pytest.raises(TypeError, match=r"Could not serialize"):  # the fake runs no task
            dk.gpu_map(str, [_Unserializable()], devices="cpu", executor="ray")
        (options,) = ray.options
        assert options["max_retries"] == expected
        assert options["retry_exceptions"] is False


class Unpicklable(_Unserializable):
    """An item whose class name starts with a vowel."""


def test_an_unserializable_item_s_type_takes_the_right_article(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: "item 0 (<...>, a Unpicklable)".
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(initialized=True))
    with pytest.raises(TypeError, match=r", an Unpicklable\) cannot be: Could not serialize"):
        dk.gpu_map(str, [Unpicklable()], devices="cpu", executor="ray")


def test_an_item_whose_pickling_raises_any_exception_is_named_with_its_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, Ray's raw "ValueError: no pickles here", naming no item: only a TypeError was
    # caught.
    ray = _FakeRay(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(
        TypeError,
        match=r"so Ray must be able to serialize it, and item 1 \(<tests.*>, a _RefusesToPickle\) "
        r"cannot be: ValueError: no pickles here. Pass data",
    ) as caught:
        dk.gpu_map(str, [1, _RefusesToPickle(), 2], devices="cpu", executor="ray")
    assert isinstance(caught.value.__cause__, ValueError)  # kept
    assert ray.cancelled == ray.submitted == ["ref-1"]


_RAY_S_TEXT = (
    "Could not serialize the put value <function f at 0x7f>:\n=====\nChecking Serializability "
    "of <function f at 0x7f>\n=====\n\x1b[31m!!! FAIL\x1b[39m serialization: cannot pickle "
    "'_thread.lock' object\n=====\nVariable: \n\n\t\x1b[1mFailTuple(lock [path=lock, obj=<unlocked "
    "_thread.lock object at 0x7f>, parent=<function f at 0x7f>])\x1b[0m\n\nwas found to be "
    "non-serializable.\n"
)


def test_what_ray_could_not_serialize_is_said_with_the_pickler_s_reason() -> None:
    # Before, only Ray's first line: "Could not serialize the put value <function f ...>".
    from devicekit._rayfaults import unserializable_reason

    error = TypeError(_RAY_S_TEXT)
    assert unserializable_reason(error) == (
        "cannot pickle '_thread.lock' object (Ray found it in the variable 'lock')"
    )
    error.__cause__ = TypeError("cannot pickle '_thread.lock' object")  # as Ray raises it
    assert unserializable_reason(error) == (
        "TypeError: cannot pickle '_thread.lock' object (Ray found it in the variable 'lock')"
    )
    unknown = TypeError(_RAY_S_TEXT.replace("FailTuple(lock [", "FailTuple(unknown ["))
    assert unserializable_reason(unknown) == "cannot pickle '_thread.lock' object"


def test_more_workers_per_device_than_ray_s_resource_unit_allows_is_refused_before_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, Ray's "The precision of the fractional quantity of resource num_cpus cannot
    # go beyond 0.0001", naming no argument of gpu_map's.
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(
        ValueError,
        match=r"^workers_per_device=10001: executor='ray' asks Ray for 1/workers_per_device .* "
        r"steps of 0.0001, so at most 10000 tasks can share one; pass workers_per_device=10000",
    ):
        dk.gpu_map(math.sqrt, [1], devices="cpu", executor="ray", workers_per_device=10001)


def test_cpu_tasks_on_a_cluster_without_cpus_are_warned_of(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before, they waited forever without a word (ray.init(num_cpus=0)), where GPU tasks
    # on a cluster without GPUs were warned of.
    fake_accelerator(None, 0)
    with pytest.warns(
        RuntimeWarning, match=r"the items run as CPU tasks, but the Ray cluster has no CPU now"
    ) as told:
        assert _submitted_as(_FakeRay(initialized=True, resources={}), "cpu", monkeypatch) == "CPU"
    assert "ray.init(num_cpus=...)" in str(told[0].message)
    assert told[0].filename == __file__  # pointed at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GPU tasks ask for no CPU: nothing to warn of
        no_cpu = _FakeRay(initialized=True, resources={"GPU": 1, "CPU": 0})
        assert _submitted_as(no_cpu, None, monkeypatch) == "GPU"


def test_an_indexed_cpu_on_a_cluster_is_refused_as_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: "devices=['cpu:3'] names GPUs of this machine".
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(initialized=True))
    with pytest.raises(
        ValueError,
        match=r"^devices=\['cpu:3'\] names the CPU 'cpu:3' by index, but Ray hands out CPUs by "
        r"count, .*; pass devices='cpu'$",
    ):
        dk.gpu_map(math.sqrt, [1], devices="cpu:3", executor="ray")


def test_gpus_this_machine_lacks_are_refused_with_gpu_map_s_fixes(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    # Before: "or dk.try_gpu() to fall back to the CPU", which devices= does not take.
    fake_accelerator(None, 0)
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for devices in ("cuda", 1):
        with pytest.raises(dk.DeviceNotFoundError, match=r"Pass devices=None .* or devices='cpu'"):
            dk.gpu_map(math.sqrt, [1], devices=devices, executor="ray")
    fake_accelerator("cuda", 1)
    with pytest.raises(
        dk.DeviceNotFoundError, match=r"does not exist: .*\. Use one of those, or pass devices=None"
    ) as caught:
        dk.gpu_map(math.sqrt, [1], devices="cuda:3", executor="ray")
    assert "try_gpu" not in str(caught.value)


def test_a_task_names_its_node_as_ray_s_errors_do_by_its_ip_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, a fault caught in the task said "on vm (the CPU)" (the host name), and one
    # Ray reported "on 192.0.2.2" (the address in Ray's text): one node, named two ways.
    from devicekit._raytask import where as _where

    ray = types.SimpleNamespace(util=types.SimpleNamespace(get_node_ip_address=lambda: "10.0.0.3"))
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _where() == "a Ray task on 10.0.0.3 (the CPU)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert _where() == "a Ray task on 10.0.0.3 (GPU 1)"


def test_ray_task_max_retries_that_is_no_count_is_refused_before_ray_is_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, Ray's own words at the first task: "invalid literal for int() with base 10:
    # 'abc'", naming no variable.
    monkeypatch.setitem(sys.modules, "ray", None)  # refused before Ray is imported
    for setting in ["abc", "", "2.5", "-2"]:
        monkeypatch.setenv("RAY_TASK_MAX_RETRIES", setting)
        with pytest.raises(
            ValueError,
            match=rf"^RAY_TASK_MAX_RETRIES={re.escape(repr(setting))}: Ray reads it as how many "
            r"times to run a task again when its worker dies, an int >= 0 \(or -1: forever\); "
            r"set it to a count, such as RAY_TASK_MAX_RETRIES=3 .* or 0 \(never again\)$",
        ):
            dk.gpu_map(str, [1], devices="cpu", executor="ray")


def test_ray_task_max_retries_of_minus_one_is_warned_of_once_at_the_map_s_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, with -1 an fn that ends its worker left gpu_map waiting forever, without a word.
    monkeypatch.setenv("RAY_TASK_MAX_RETRIES", "-1")
    ray = _FakeRay(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with (
        pytest.warns(RuntimeWarning) as told,
        pytest.raises(TypeError, match=r"Could not serialize"),  # the fake runs no task
    ):
        dk.gpu_map(str, [_Unserializable(), _Unserializable()], devices="cpu", executor="ray")
    assert [str(warning.message) for warning in told] == [
        "RAY_TASK_MAX_RETRIES=-1: a task whose worker dies is retried forever by Ray, so "
        "gpu_map never returns if fn ends its worker (os._exit(), a signal, the out-of-memory "
        "killer); set RAY_TASK_MAX_RETRIES to a count, such as 3, or 0"
    ]
    assert told[0].filename == __file__  # pointed at the caller's line
    assert ray.options[0]["max_retries"] == -1
    monkeypatch.setenv("RAY_TASK_MAX_RETRIES", "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match=r"Could not serialize"):
            dk.gpu_map(str, [_Unserializable()], devices="cpu", executor="ray")
