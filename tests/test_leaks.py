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

    # Ones that look plain are caught at their first call.
    with pytest.raises(TypeError, match=r"lambda: list\(gen\(\)\) for a generator"):
        dk.find_leaks(plain_generator)
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
