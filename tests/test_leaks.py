from __future__ import annotations

import gc
import importlib
import json
import sys
import warnings
import weakref
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk

HERE = __file__


def line_of(marker: str) -> str:
    """``file:line`` of the line of this file that ends with ``marker``."""
    with open(HERE, encoding="utf-8") as source:
        for number, text in enumerate(source, 1):
            if text.rstrip().endswith(marker) and "line_of(" not in text:
                return f"{HERE}:{number}"
    raise AssertionError(marker)


def test_a_list_that_grows_is_caught_with_its_line() -> None:
    kept: list[torch.Tensor] = []

    def step() -> None:
        for _ in range(3):
            kept.append(torch.zeros(5, 7, dtype=torch.float64))  # leak: three per call

    report = dk.find_leaks(step, repeat=6, warmup=1)
    (leak,) = report.leaks
    assert leak.device == "cpu"
    assert leak.dtype == "float64"
    assert leak.shape == (5, 7)
    assert leak.location == line_of("# leak: three per call")
    assert leak.count_per_call == 3.0
    assert leak.bytes_per_call == 3 * 5 * 7 * 8
    assert (leak.count_before, leak.count_after) == (3, 21)
    assert report.calls == 6
    assert report.warmup == 1
    assert len(kept) == 21


class _Marked(torch.Tensor):
    pass


def test_an_alias_and_the_base_it_keeps_are_one_leak_at_their_line() -> None:
    # Before: two leaks, the second "+0 B/call ... created at an unknown line": the base
    # x.as_subclass() keeps alive, whose note torch drops as it keeps its Python object.
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(torch.zeros(10).as_subclass(_Marked))  # leak: an alias and its base

    report = dk.find_leaks(step, repeat=6, warmup=1)
    (leak,) = report.leaks
    assert leak.location == line_of("# leak: an alias and its base")
    assert leak.count_per_call == 2.0
    assert leak.bytes_per_call == 10 * 4  # one storage, counted once


def test_a_clean_function_reports_nothing() -> None:
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()

    report = dk.find_leaks(step)
    assert report.leaks == ()
    assert report.verdict == "no leak: nothing grew over 10 calls after 2 warm-up calls"
    assert str(report) == report.verdict


def test_losses_kept_with_their_graph() -> None:
    model = torch.nn.Linear(16, 4)
    losses = []

    def step() -> None:
        loss = model(torch.randn(8, 16)).pow(2).mean()  # the loss line
        loss.backward()
        losses.append(loss)

    (leak,) = dk.find_leaks(step).leaks
    assert leak.location == line_of("# the loss line")
    assert (leak.shape, leak.count_per_call) == ((), 1.0)


def test_a_cache_keyed_by_step_of_growing_shapes() -> None:
    cache: dict[int, torch.Tensor] = {}

    def step() -> None:
        cache[len(cache)] = torch.ones(len(cache) + 1)  # the cache line

    (leak,) = dk.find_leaks(step).leaks
    assert leak.location == line_of("# the cache line")
    assert leak.shape is None  # one tensor per call, each of a new shape
    assert leak.count_per_call == 1.0
    assert "various shapes" in str(leak)


def test_a_hook_that_stores_activations() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    stored: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda module, inputs, output: stored.append(output))
    try:
        report = dk.find_leaks(lambda: model(torch.randn(2, 8)))  # the model line
    finally:
        handle.remove()
    assert report.leaks
    assert all(leak.location == line_of("# the model line") for leak in report.leaks)
    assert sum(leak.count_per_call or 0 for leak in report.leaks) >= 1


def test_a_cache_that_fills_up_is_not_a_leak() -> None:
    cache: list[torch.Tensor] = []

    def step() -> None:
        cache.append(torch.ones(4))
        del cache[:-3]  # keeps the last three

    assert dk.find_leaks(step, warmup=0).leaks == ()


def test_the_recorder_is_active_only_while_it_runs() -> None:
    depth = torch._C._len_torch_function_stack()
    frozen = gc.get_freeze_count()
    dk.find_leaks(lambda: torch.ones(2), repeat=2)
    assert torch._C._len_torch_function_stack() == depth
    assert gc.get_freeze_count() == frozen
    with pytest.raises(ZeroDivisionError):
        dk.find_leaks(lambda: 1 / 0)
    assert torch._C._len_torch_function_stack() == depth
    assert gc.get_freeze_count() == frozen


def test_a_caller_s_own_frozen_objects_stay_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        kept: list[torch.Tensor] = []
        (leak,) = dk.find_leaks(lambda: kept.append(torch.ones(1)), repeat=3).leaks
        assert leak.count_per_call == 1.0
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_the_report_reads_in_text_html_and_json() -> None:
    kept: list[torch.Tensor] = []
    report = dk.find_leaks(lambda: kept.append(torch.ones(2, 3)), repeat=4)
    assert report.verdict.startswith("1 leak over 4 calls after 2 warm-up calls; worst: +1 tensor")
    assert repr(report) == f"LeakReport({report.verdict})"
    line = str(report).splitlines()[1]
    assert line.startswith("  +1 tensor/call, +24 B/call: cpu float32 [2, 3]")
    assert "<th>created at</th>" in report._repr_html_()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["leaks"][0]["count_per_call"] == 1.0
    assert data["verdict"] == report.verdict


def test_html_leaves_the_tensor_columns_of_memory_no_tensor_holds_as_not_applicable() -> None:
    report = dk.LeakReport(
        calls=4,
        warmup=2,
        leaks=(
            dk.Leak("cuda:0", None, None, None, None, 4096.0, None, None),
            dk.Leak("cpu", "float32", (2, 3), None, 1.0, 24.0, 0, 4),
        ),
        allocated=(),
    )
    page = report._repr_html_()
    assert "<tr><td>cuda:0</td>" + "<td>-</td>" * 4 + "<td>4.00 KiB</td></tr>" in page
    # A tensor leak whose line is unknown says so: "?" is unknown, "-" does not apply.
    assert "<tr><td>cpu</td><td>float32</td><td>[2, 3]</td><td>?</td><td>1</td>" in page


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        dk.find_leaks(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repeat must be an int >= 1, got 0; measure one call"):
        dk.find_leaks(lambda: None, repeat=0)
    with pytest.raises(ValueError, match=r"warmup must be an int >= 0, got -1$"):
        dk.find_leaks(lambda: None, warmup=-1)  # no "first device" hint for a count
    with pytest.raises(TypeError, match=r"repeat must be an int >= 1, got 2\.5 of type float"):
        dk.find_leaks(lambda: None, repeat=2.5)  # type: ignore[arg-type]


def test_cuda_is_not_started() -> None:
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already started in this process")
    dk.find_leaks(lambda: torch.ones(3), repeat=2)
    assert not torch.cuda.is_initialized()
    assert "torch" in sys.modules


@pytest.mark.gpu
def test_a_real_leak_on_the_gpu() -> None:
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(torch.empty(2**20, dtype=torch.uint8, device="cuda"))  # the gpu line

    report = dk.find_leaks(step)
    (leak,) = report.leaks  # the allocator's growth is explained by the tensors
    assert leak.device == f"cuda:{torch.cuda.current_device()}"
    assert leak.location == line_of("# the gpu line")
    assert leak.bytes_per_call == 2**20
    (growth,) = [g for g in report.allocated if g.device == leak.device]
    assert growth.per_call == 2**20
    kept.clear()


@pytest.mark.gpu
def test_a_graph_kept_alive_on_the_gpu_shows_as_memory_no_tensor_holds() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1)
    ).cuda()
    losses = []

    def step() -> None:
        losses.append(model(torch.randn(256, 1024, device="cuda")).mean())  # no backward

    report = dk.find_leaks(step)
    held = sum(leak.bytes_per_call for leak in report.leaks)
    # The saved activations: at least the ReLU output, 256 x 4096 floats per call.
    assert held >= 256 * 4096 * 4
    assert any(leak.shape == () for leak in report.leaks)
    losses.clear()


def test_a_function_whose_body_never_runs_is_refused() -> None:
    # Called as fn(), a generator or coroutine runs none of its body: "no leak" would be
    # an answer about nothing.
    kept: list[torch.Tensor] = []

    def generator() -> Iterator[None]:
        kept.append(torch.ones(3))
        yield

    async def coroutine() -> None:
        kept.append(torch.ones(3))

    for fn in (generator, coroutine):
        with pytest.raises(TypeError, match=r"fn\(\) returns a (generator|coroutine) without ru"):
            dk.find_leaks(fn)

    def plain_generator() -> Iterator[None]:
        return generator()

    def plain_coroutine() -> Coroutine[None, None, None]:
        return coroutine()

    # Ones that look plain are caught at their first call, without a note saying that fn
    # raised it (T50: "fn() raised this on call 1 of 12", of devicekit's own refusal).
    with pytest.raises(TypeError, match=r"lambda: list\(gen\(\)\) for a generator") as refused:
        dk.find_leaks(plain_generator)
    assert not getattr(refused.value, "__notes__", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match="returns a coroutine"):
            dk.find_leaks(plain_coroutine)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]  # it was closed
    assert kept == []


def test_an_error_from_fn_propagates_and_leaves_nothing_on() -> None:
    calls = []

    def fails_on_the_fourth_call() -> None:
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt

    frozen = gc.get_freeze_count()
    with pytest.raises(KeyboardInterrupt):
        dk.find_leaks(fails_on_the_fourth_call)
    assert gc.get_freeze_count() == frozen
    assert not torch.overrides._get_current_function_mode_stack()  # the recorder is off


def test_html_of_nothing_grown_is_the_verdict_and_shows_allocated_bytes() -> None:
    from devicekit._leaks import DeviceGrowth

    clean = dk.find_leaks(lambda: torch.ones(3).sum(), repeat=2)
    # A header over no rows says nothing: the verdict does.
    assert clean._repr_html_() == "<p>no leak: nothing grew over 2 calls after 2 warm-up calls</p>"
    # The CUDA allocated bytes str() lists are in the notebook's view too.
    growth = DeviceGrowth("cuda:0", 2**20, 3 * 2**20, 2**19)
    report = dk.LeakReport(calls=4, warmup=2, leaks=(), allocated=(growth,))
    assert "  cuda:0: allocated 1.00 MiB → 3.00 MiB (512.00 KiB/call)" in str(report)
    assert (
        "<tr><td>cuda:0</td><td>1.00 MiB</td><td>3.00 MiB</td><td>512.00 KiB</td></tr>"
        in report._repr_html_()
    )


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_an_error_from_fn_says_which_call_raised_it() -> None:
    calls = []

    def fails_on_the_fifth_call() -> None:
        calls.append(1)
        if len(calls) == 5:
            raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch") as caught:
        dk.find_leaks(fails_on_the_fifth_call, repeat=4, warmup=2)
    assert caught.value.__notes__ == [
        "devicekit.find_leaks: fn() raised this on call 5 of 6 (a measured call; warmup=2, "
        "repeat=4)"
    ]
    with pytest.raises(ValueError, match="invalid literal") as warm:
        dk.find_leaks(lambda: int("x"), warmup=1)
    assert "on call 1 of 11 (a warm-up call" in warm.value.__notes__[0]


def _compiled_or_skip(fn: Callable[[torch.Tensor], torch.Tensor], **options: Any) -> Any:
    """``torch.compile(fn, fullgraph=True, ...)``, called once; skips where it cannot run."""
    compiled = torch.compile(fn, fullgraph=True, **options)
    try:
        compiled(torch.ones(4))
    except Exception as error:  # noqa: BLE001 - any failure means no compiler here
        pytest.skip(f"torch.compile does not run here: {type(error).__name__}: {error}")
    return compiled


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_code_runs_whole_and_its_leak_is_found(backend: str) -> None:
    # Before: torch.compile traced the recorder's frame walk into the graph, so
    # fullgraph=True raised Unsupported ("sys._getframe"), noted as fn()'s error, and
    # without fullgraph the graph broke: what was measured was not what runs.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    step = _compiled_or_skip(lambda x: (x * 2).relu() + 1, backend=backend)
    counters.clear()
    kept: list[torch.Tensor] = []
    report = dk.find_leaks(lambda: kept.append(step(torch.ones(4))), repeat=4)
    assert not counters["graph_break"]
    (leak,) = report.leaks
    assert (leak.shape, leak.count_per_call, leak.bytes_per_call) == ((4,), 1.0, 16.0)
    assert leak.location is None  # made by compiled code: no line of the user's made it
    assert "created at an unknown line" in str(leak)


def test_a_leak_made_inside_an_installed_package_is_at_the_user_s_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: every row pointed into site-packages (a GPT-2 loss list gave 17 rows in
    # transformers), and the user's own line appeared nowhere.
    package = tmp_path / "site-packages"
    package.mkdir()
    (package / "fakelib_leaks.py").write_text(
        "import torch\n"
        "def make():\n"
        "    small = torch.zeros(3)\n"
        "    large = torch.ones(2, 2)\n"
        "    return small, large\n"
    )
    monkeypatch.syspath_prepend(str(package))
    fakelib = importlib.import_module("fakelib_leaks")
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.extend(fakelib.make())  # the user's line into a library

    (leak,) = dk.find_leaks(step, repeat=4).leaks  # one row, not one per library line
    assert leak.location == line_of("# the user's line into a library")
    assert leak.library_location == f"{package / 'fakelib_leaks.py'}:4"  # most bytes: 16 > 12
    assert (leak.shape, leak.count_per_call, leak.bytes_per_call) == (None, 2.0, 28.0)
    assert f"(inside {leak.library_location})" in str(leak)
    assert (
        f"(inside {leak.library_location})</td>" in dk.LeakReport(4, 2, (leak,), ())._repr_html_()
    )
    assert json.loads(json.dumps(leak.to_dict()))["library_location"] == leak.library_location


def test_a_leak_made_by_the_user_s_own_line_has_no_library_line() -> None:
    kept: list[torch.Tensor] = []
    (leak,) = dk.find_leaks(lambda: kept.append(torch.ones(2)), repeat=3).leaks
    assert leak.library_location is None
    assert "inside" not in str(leak)


def test_the_recorder_forgets_dead_tensors_and_never_gives_their_line_to_another() -> None:
    from devicekit._creationsites import CreationSites

    recorder = CreationSites()
    recorder._sweep_at = 100  # sweep early, as it does past 65,536 entries
    x = torch.ones(2)
    with recorder:
        kept = x + 1  # the kept line
        for _ in range(1000):
            x + 1  # made and dropped at once
    assert len(recorder.sites) < 300
    assert recorder.site(kept) == (line_of("# the kept line"), None)
    assert recorder.site(x) is None  # made before the recorder started
    # An entry whose tensor died names no other tensor, even one at the same address.
    dead = torch.ones(1)
    recorder.sites[id(x)] = (weakref.ref(dead), ("elsewhere.py:1", None))
    del dead
    assert recorder.site(x) is None


def test_a_tensor_made_larger_each_call_is_a_leak_of_zero_tensors() -> None:
    # One tensor, replaced by a longer one each call: the count stays, the bytes grow.
    model = torch.nn.Linear(256, 10)
    history = [torch.zeros(0, 10)]

    def step() -> None:
        out = model(torch.randn(32, 256)).detach()
        history[0] = torch.cat([history[0], out])  # leak: 1,280 bytes longer per call

    report = dk.find_leaks(step)
    (leak,) = report.leaks
    assert (leak.count_per_call, leak.bytes_per_call) == (0, 32 * 10 * 4)
    assert (leak.count_before, leak.count_after) == (1, 1)
    assert leak.location == line_of("# leak: 1,280 bytes longer per call")
    assert str(leak).startswith(
        "+0 tensor/call, +1.25 KiB/call (as many tensors, larger each call): cpu float32 [384, 10]"
    )
    assert "<td>0 (larger each call)</td>" in report._repr_html_()
    json.dumps(report.to_dict())


def test_a_tensor_resized_in_place_each_call_is_a_leak() -> None:
    buffer: list[torch.Tensor] = []

    def step() -> None:
        if not buffer:
            buffer.append(torch.zeros(0))
        buffer[0].resize_(buffer[0].numel() + 320)  # 1,280 bytes more, in place

    (leak,) = dk.find_leaks(step, repeat=6).leaks
    assert (leak.count_per_call, leak.bytes_per_call) == (0, 1280)


def test_a_kept_output_whose_size_varies_is_not_a_leak() -> None:
    # Larger at the end than at the start and the middle, yet it shrinks in between:
    # a sequence length that varies by batch, not a buffer that grows.
    sizes = iter([5, 3, 6, 2, 4, 3, 5, 2, 6, 4, 7, 3, 8])
    last: list[torch.Tensor] = []

    def step() -> None:
        last[:] = [torch.ones(next(sizes) * 100)]

    assert dk.find_leaks(step, repeat=10, warmup=2).leaks == ()


@pytest.mark.parametrize("inside", ["free_memory", "explain_oom"])
def test_a_census_inside_fn_does_not_hide_what_fn_keeps(inside: str) -> None:
    # Both count every tensor, frozen ones included: that census used to unfreeze and
    # freeze again, freezing what fn had kept so far, so no count could see it grow.
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(torch.ones(1000))
        if inside == "free_memory":
            dk.free_memory(devices="cpu")
            return
        try:
            with dk.explain_oom():
                torch.empty(2**62, dtype=torch.uint8)
        except torch.OutOfMemoryError:
            pass

    frozen = gc.get_freeze_count()
    (leak,) = dk.find_leaks(step, repeat=6).leaks
    assert (leak.count_per_call, leak.bytes_per_call) == (1, 4000)
    assert gc.get_freeze_count() == frozen


def test_a_census_in_a_process_that_froze_its_objects_freezes_nothing_new() -> None:
    # A pre-forking server freezes what it loaded; what it makes after must stay collectable.
    loaded = torch.ones(250_000)  # 1 MB, frozen with the rest
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()

        class Node:
            pass

        node = Node()
        node.me = node  # type: ignore[attr-defined]  # a reference cycle
        node.tensor = torch.ones(250_000)  # type: ignore[attr-defined]
        alive = weakref.ref(node.tensor)  # type: ignore[attr-defined]
        report = dk.free_memory(devices="cpu")
        assert gc.get_freeze_count() == frozen  # nothing frozen, nothing unfrozen
        # Both tensors counted: the frozen one too, found without unfreezing it.
        assert report.note is not None
        held = float(report.note.split("live tensors there hold ")[1].split(" MiB")[0])
        assert held >= 2 * 1_000_000 / 2**20
        del node
        gc.collect()
        assert alive() is None  # the cycle was not frozen for good
        assert loaded.sum() == 250_000
    finally:
        gc.unfreeze()


def test_views_of_a_tensor_made_before_add_no_bytes() -> None:
    big = torch.randn(1_000_000)
    kept: list[torch.Tensor] = []

    def views() -> None:
        kept.append(big[len(kept) : len(kept) + 10])  # a view: no new memory

    (leak,) = dk.find_leaks(views, warmup=0, repeat=4).leaks
    assert (leak.count_per_call, leak.bytes_per_call) == (1, 0)


def test_counts_of_other_int_types_make_a_json_ready_report() -> None:
    numpy = pytest.importorskip("numpy")
    report = dk.find_leaks(lambda: None, repeat=numpy.int64(3), warmup=torch.tensor(1))
    assert (type(report.calls), type(report.warmup)) == (int, int)
    assert json.loads(json.dumps(report.to_dict()))["calls"] == 3


def test_a_ctrl_c_in_fn_gets_the_note_of_its_call() -> None:
    calls: list[int] = []

    def interrupted_on_the_third_call() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        dk.find_leaks(interrupted_on_the_third_call, repeat=4, warmup=1)
    assert getattr(caught.value, "__notes__", None) == [
        "devicekit.find_leaks: fn() raised this on call 3 of 5 "
        "(a measured call; warmup=1, repeat=4)"
    ]


def test_cuda_growth_of_a_tensor_made_larger_each_call_is_explained_by_it() -> None:
    # The allocator rounds each block up to 512 bytes: a tensor 1,000 bytes longer each
    # call grows the allocated bytes by 1,024 a call here, and no 24 bytes are "held by no
    # tensor" (the autograd graph that sentence points to).
    from devicekit._leaks import Leak, _device_growth

    calls = 10
    sizes = [500 + 1000 * call for call in range(calls + 1)]
    allocated = [{"cuda:0": -(-size // 512) * 512} for size in sizes]
    leak = Leak("cuda:0", "float32", None, "train.py:3", 0.0, 1000.0, 1, 1)
    growth, unexplained = _device_growth(allocated, [(leak, sizes[-1])], calls)
    assert growth[0].per_call == (10752 - 512) / calls
    assert unexplained == []
