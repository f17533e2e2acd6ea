"""What gpu_map refuses before or while workers load fn and items: pickling, the main guard."""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import devicekit as dk

from .mapfns import alive, run_in_repo, run_python_args, unpicklable_result


def _fail_to_load() -> None:
    raise RuntimeError("cannot be rebuilt in a worker")


class LoadsBadly:
    """Pickles here; unpickling it (in the worker) raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _fail_to_load, ()


class CallableThatLoadsBadly(LoadsBadly):
    def __call__(self, item: int) -> int:
        return item


async def fetch(item: int) -> int:
    return item


def lines(item: int) -> Iterator[int]:
    yield item


async def stream(item: int) -> AsyncIterator[int]:
    yield item


def test_an_async_generator_fn_gets_the_fix_for_its_kind() -> None:
    # Before: both fixes, list(...) and asyncio.run(...), neither of which works for it.
    with pytest.raises(TypeError) as caught:
        dk.gpu_map(stream, range(2), devices=["cpu"])
    assert str(caught.value).endswith(
        "async def collect(item): return [x async for x in stream(item)], then "
        "def run(item): return asyncio.run(collect(item))"
    )


@pytest.mark.parametrize(("fn", "kind"), [(fetch, "a coroutine"), (lines, "a generator")])
def test_an_async_or_generator_fn_is_refused_before_any_worker_starts(
    fn: Callable[[int], object], kind: str
) -> None:
    # Before, the workers started, each returned a coroutine that never ran (and warned
    # that it was never awaited), and the map failed on its pickle with a WorkerError.
    before = set(multiprocessing.active_children())
    name = fn.__name__
    # The one fix for the kind fn is (it gave both, for a generator and for async def).
    run = f"asyncio.run({name}(item))" if kind == "a coroutine" else f"list({name}(item))"
    fix = (
        "; pass a function that does the work, defined with def at the top level of a module: "
        f"def run(item): return {run}"
    )
    said = (
        f"got fn={name}, and {name}(item) returns {kind} without running its body, so no item "
        f"would be worked on, and a worker could not send back what it returns{fix}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no coroutine "was never awaited"
        with pytest.raises(TypeError, match="^" + re.escape(f"gpu_map() {said}") + "$"):
            dk.gpu_map(fn, [1], devices=["cpu"])
        with dk.gpu_pool(devices=["cpu"]) as pool:
            with pytest.raises(TypeError, match="^" + re.escape(f"GPUPool.map() {said}") + "$"):
                pool.map(fn, [1])
            assert not pool._workers  # refused before its workers started
        # Ray's serializer takes lambdas and closures: its fix asks for no top-level def.
        # Before, it did, as for the local executor (refused before Ray is needed).
        on_ray = said.replace(", defined with def at the top level of a module", "")
        with pytest.raises(TypeError, match="^" + re.escape(f"gpu_map() {on_ray}") + "$"):
            dk.gpu_map(fn, [1], devices=["cpu"], executor="ray")
        partial = functools.partial(fn)  # named by what it wraps (it read "fn=fn")
        with pytest.raises(TypeError, match="^" + re.escape(f"gpu_map() {said}") + "$"):
            dk.gpu_map(partial, [1], devices=["cpu"])
    assert set(multiprocessing.active_children()) == before


def test_an_unpicklable_function_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(TypeError, match=r"gpu_map\(\) sends fn to worker processes, so it must be"):
        dk.gpu_map(lambda x: x, [1], devices=["cpu"])


def test_fn_and_items_are_checked_before_any_worker_starts() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(TypeError, match=r"^gpu_map\(\) needs fn, the function to run on each "):
        dk.gpu_map(None, [1], devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^gpu_map\(\) needs items, an iterable .* got 5 of type int; pass a list"
    ):
        dk.gpu_map(math.sqrt, 5, devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^gpu_pool\(\) needs at least one device, got devices"):
        dk.gpu_pool(devices=[])
    with dk.gpu_pool(devices=["cpu"]) as pool:
        with pytest.raises(TypeError, match=r"^GPUPool.map\(\) needs fn"):
            pool.map("sqrt", [1])  # type: ignore[arg-type]
        assert not pool._workers  # refused before its workers started
    assert set(multiprocessing.active_children()) == before


def test_an_fn_that_cannot_be_unpickled_in_a_worker_is_named() -> None:
    # Before: "worker 1 exited with code 1 while running item 0. fn must return or
    # raise an Exception", about an fn that never ran.
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(CallableThatLoadsBadly(), [1, 2], devices=["cpu"])
    message = str(info.value)
    assert message.startswith(
        "gpu_map: fn could not be unpickled in worker 1 on the CPU: RuntimeError: cannot be "
        "rebuilt in a worker. A worker finds fn by its module and name, and imports that module: "
        "define fn with def at the top level of a module"
    ), message
    assert "in _fail_to_load" in message  # the worker's traceback


def test_an_fn_defined_in_python_c_is_named_as_not_importable() -> None:
    # What a notebook or `python -c` gives: fn pickles by reference to __main__,
    # which a spawned worker cannot import.
    script = textwrap.dedent(
        """
        import devicekit as dk
        def double(x):
            return 2 * x
        try:
            dk.gpu_map(double, [1], devices=["cpu"])
        except dk.WorkerError as error:
            print(str(error).splitlines()[0])
        """
    )
    result = run_in_repo(script)
    assert result.stdout.startswith(
        "gpu_map: fn could not be unpickled in worker 1 on the CPU: AttributeError: Can't get "
        "attribute 'double' on <module '__main__'"
    ), result.stdout
    assert "not in a notebook or `python -c`: put it in a .py file and import it" in result.stdout
    assert "Traceback" not in result.stderr  # the worker no longer dies, printing its own


def test_an_fn_defined_under_the_main_guard_is_told_to_move_above_it(tmp_path: Any) -> None:
    # Before, only "define fn with def at the top level of a module": it was, under the guard.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import devicekit as dk
            if __name__ == "__main__":
                def double(x):
                    return 2 * x
                try:
                    dk.gpu_map(double, [1], devices=["cpu"])
                except dk.WorkerError as error:
                    print(str(error).split(" The worker's traceback")[0])
            """
        )
    )
    result = run_python_args([str(script)])
    assert "on <module '__mp_main__'" in result.stdout, result.stdout
    assert result.stdout.rstrip().endswith(
        'If fn is defined under `if __name__ == "__main__":`, move its def above that line: '
        "a worker imports the script without running what the guard holds."
    ), result.stdout


def test_an_item_that_cannot_be_unpickled_in_a_worker_is_named() -> None:
    # Before: "fn raised on item 1", though fn never saw it.
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(abs, [1, LoadsBadly(), 3], devices=["cpu"])
    message = str(info.value)
    assert re.match(
        r"gpu_map: item 1 \(<tests\.test_m.*\) could not be unpickled in "
        r"worker 1 on the CPU: RuntimeError: cannot be rebuilt in a worker\. Each item is rebuilt "
        r"in its worker from its pickle",
        message,
    ), message
    assert "in _fail_to_load" in message


def test_an_unpicklable_item_is_named_before_any_worker_starts() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(TypeError) as info:
        dk.gpu_map(math.sqrt, [1, lambda: 2, 3], devices=["cpu"])
    message = str(info.value)
    assert "item 1 (<function " in message
    assert "<lambda>" in message
    assert "of type function) is not: " in message
    assert set(multiprocessing.active_children()) == before


def test_an_unpicklable_result_names_its_item() -> None:
    with pytest.raises(dk.WorkerError, match=r"the result of item 2 \(2\) cannot be sent back"):
        dk.gpu_map(unpicklable_result, range(5), devices=["cpu"])


def _run_without_main_guard(
    tmp_path: Any, imports: str, call: str
) -> subprocess.CompletedProcess[str]:
    """Run ``call`` at the top of a script, with no main guard; print its WorkerError."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        f"{imports}\nimport devicekit as dk\n"
        "try:\n"
        f"    {call}\n"
        "except dk.WorkerError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_a_missing_main_guard_is_named_in_a_few_lines(tmp_path: Any) -> None:
    result = _run_without_main_guard(
        tmp_path, "import math", "dk.gpu_map(math.sqrt, range(4), devices=['cpu', 'cpu'])"
    )
    assert 'if __name__ == "__main__":' in result.stdout
    assert "stopped while importing the main module" in result.stdout
    assert "bootstrapping phase" not in result.stderr  # multiprocessing's long story
    assert "Traceback" not in result.stderr
    own = [
        line
        for line in result.stderr.splitlines()
        if "NumPy" not in line and "_conversion_method_template" not in line  # the parent's torch
    ]
    assert own, result.stderr
    assert all(line.startswith("devicekit: gpu_map() called at import time") for line in own), own
    assert len(own) <= 2  # one line per worker


def test_a_missing_main_guard_with_large_items_is_named_too(tmp_path: Any) -> None:
    # Before, sending an item larger than the pipe's buffer to a worker that died
    # importing the main module raised a bare BrokenPipeError.
    result = _run_without_main_guard(
        tmp_path, "", "dk.gpu_map(len, [bytes(2_000_000)] * 2, devices=['cpu'])"
    )
    assert "stopped while importing the main module" in result.stdout, result.stderr
    assert "BrokenPipeError" not in result.stderr


class Squares:
    """Map-style, like ``torch.utils.data.Dataset``: ``len()`` and ``[i]``, no ``__iter__``."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < 4:
            raise IndexError(index)
        return index * index


def test_a_map_style_dataset_is_its_items() -> None:
    # Before: "needs items, an iterable ...; pass a list, such as [<Squares>]", the
    # dataset as one item, for the commonest container of items in PyTorch.
    assert dk.gpu_map(abs, Squares(), devices=["cpu"]) == [0, 1, 4, 9]


def test_the_missing_main_guard_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, print() wrote the line and its newline apart: under PYTHONUNBUFFERED,
    # two workers' lines could interleave into one long line and an empty one.
    from devicekit import _mapguards

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    recorder = Recorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    monkeypatch.setattr(_mapguards, "in_worker_bootstrap", lambda: True)
    with pytest.raises(SystemExit) as info:
        dk.gpu_map(abs, [1], devices=["cpu"])
    assert info.value.code == 87
    assert len(recorder.writes) == 1
    assert recorder.writes[0].startswith("devicekit: gpu_map() called at import time. ")
    assert recorder.writes[0].endswith(" above that line).\n")


def test_a_main_module_that_hangs_in_a_worker_is_stopped_at_the_startup_limit(
    tmp_path: Any,
) -> None:
    # A hang in the worker's import of the main module, with an item larger than
    # the pipe's buffer: before, the item was written to the worker at once and
    # the write blocked forever on a worker that never read it.
    script = tmp_path / "hangs_in_workers.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, pathlib, time
            if __name__ == "__mp_main__":  # what a worker runs, importing this module
                pathlib.Path("pids", str(os.getpid())).touch()
                time.sleep(3600)
            import json, multiprocessing, devicekit as dk
            from devicekit import _dispatch
            _dispatch._STARTUP_SECONDS = 3.0
            if __name__ == "__main__":
                try:
                    dk.gpu_map(len, [bytes(3_000_000)], devices=["cpu"], timeout=0.5)
                except dk.WorkerTimeoutError as error:
                    print(json.dumps([str(error), len(multiprocessing.active_children())]))
            """
        )
    )
    (tmp_path / "pids").mkdir()
    try:
        result = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
            check=False,
        )
    finally:
        # A worker still importing has no parent-death signal yet: were the call to
        # hang and the script be killed, it would outlive the test.
        for name in os.listdir(tmp_path / "pids"):
            if alive(int(name)):
                os.kill(int(name), signal.SIGKILL)
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path / "pids")  # the hang happened, in a worker
    message, children = json.loads(result.stdout.strip().splitlines()[-1])
    assert message.startswith(
        "gpu_map: worker 1 on the CPU was still starting (importing the main module, in a "
        "fresh Python) 3 s after it was given this map"
    ), message
    assert children == 0


def test_an_fn_that_cannot_be_loaded_keeps_no_results_and_names_no_item() -> None:
    with pytest.raises(dk.WorkerError) as info:
        dk.gpu_map(CallableThatLoadsBadly(), [1, 2], devices=["cpu"])
    assert (info.value.index, info.value.results) == (None, {})


def test_a_missing_main_guard_is_named_before_the_workers_read_the_items(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, each worker importing the script read every item (a generator, a
    # dataset loading each one) before it was refused.
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("DK_TEST_PIDS", str(pids))
    imports = (
        "import os, pathlib\n"
        "def items():\n"
        "    if __name__ == '__mp_main__':  # read in a worker\n"
        "        pathlib.Path(os.environ['DK_TEST_PIDS'], str(os.getpid())).touch()\n"
        "    yield from range(4)\n"
    )
    result = _run_without_main_guard(
        tmp_path, imports, "dk.gpu_map(abs, items(), devices=['cpu', 'cpu'])"
    )
    assert "stopped while importing the main module" in result.stdout
    assert os.listdir(pids) == []


def test_a_script_read_from_stdin_is_refused_before_any_worker_starts(tmp_path: Any) -> None:
    # Before, every worker printed multiprocessing's FileNotFoundError for '<stdin>',
    # and the error said to add the main guard, which the script had.
    script = textwrap.dedent(
        """
        import devicekit as dk
        if __name__ == "__main__":
            try:
                dk.gpu_map(abs, [1], devices=["cpu"])
            except RuntimeError as error:
                print(error)
        """
    )
    result = run_python_args(["-"], input=script, cwd=tmp_path)
    assert result.stdout == (
        "gpu_map() cannot start its workers: the main module was read from standard input "
        "(`python -`), which is read once. Workers are started with spawn, and each one imports "
        "the main module again, from its file. Save the code to a .py file and run that file "
        "(or, from `python -c`, import fn from a module).\n"
    )
    assert "Traceback" not in result.stderr


def test_a_main_module_whose_file_is_gone_is_refused_before_any_worker_starts(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None, raising=False)  # a script, not `python -m`
    monkeypatch.setattr(main, "__file__", str(tmp_path / "gone.py"), raising=False)
    before = set(multiprocessing.active_children())
    gone = re.escape(repr(str(tmp_path / "gone.py")))
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: dk.gpu_pool(devices=["cpu"]), r"gpu_pool\(\)"),
        (lambda: dk.gpu_map(abs, [1], devices=["cpu"]), r"gpu_map\(\)"),
    ]
    for call, caller in calls:
        with pytest.raises(
            RuntimeError,
            match=rf"^{caller} cannot start its workers: the main module's file, {gone}, does "
            r"not exist\. Workers are started with spawn",
        ):
            call()
    assert set(multiprocessing.active_children()) == before


def test_a_main_module_that_fails_in_a_worker_is_not_said_to_lack_the_guard(
    tmp_path: Any,
) -> None:
    # Before: "... could not import the main module ... a script must call gpu_map()
    # under `if __name__ == "__main__":`", to a script that does.
    script = tmp_path / "fails_in_workers.py"
    script.write_text(
        textwrap.dedent(
            """
            import devicekit as dk
            if __name__ == "__mp_main__":  # what a worker runs, importing this module
                raise RuntimeError("this module fails in a worker")
            if __name__ == "__main__":
                try:
                    dk.gpu_map(abs, [1], devices=["cpu"])
                except dk.WorkerError as error:
                    print(error)
            """
        )
    )
    result = run_python_args([str(script)], cwd=tmp_path)
    assert result.stdout == (
        "gpu_map: worker 1 on the CPU exited with code 1 before it started, while it imported "
        "the main module (a spawned worker imports it again): that import failed in the "
        "worker, and its own error is printed above, on stderr. Fix what it says (the main "
        "module must import without error in a fresh Python, from its file).\n"
    )
    assert "RuntimeError: this module fails in a worker" in result.stderr


class IndexedOnly:
    """Iterable by the old protocol only: ``[i]`` until ``IndexError``, no ``__iter__`` or len()."""

    def __getitem__(self, index: int) -> int:
        if index >= 3:
            raise IndexError(index)
        return -index


def test_items_none_and_items_iterable_by_index_only() -> None:
    # Before: "pass a list, such as [None]". And an object with [i] alone was read from
    # [0] to the first IndexError: where [i] never raises one, for ever, its memory
    # growing; it is refused, saying what to give it.
    with pytest.raises(TypeError) as info:
        dk.gpu_map(abs, None, devices=["cpu"])  # type: ignore[arg-type]
    assert str(info.value) == (
        "gpu_map() needs items, an iterable (a list, a generator) or a map-style dataset "
        "(len() and [i]) of the items to run fn on, got None"
    )
    before = set(multiprocessing.active_children())
    with pytest.raises(TypeError) as info:
        dk.gpu_map(abs, IndexedOnly(), devices=["cpu"])  # type: ignore[arg-type]
    assert re.fullmatch(
        r"gpu_map\(\) needs items, an iterable \(a list, a generator\) or a map-style dataset "
        r"\(len\(\) and \[i\]\) of the items to run fn on, got <tests\.test_mapinputs\."
        r"IndexedOnly object at 0x[0-9a-f]+> of type IndexedOnly, which has \[i\] but neither "
        r"len\(\) nor __iter__, so where its items end is not known \(read \[0\], \[1\]\.\.\. "
        r"until an IndexError, it is read for ever if \[i\] never raises one\)\. Give its "
        r"class __len__ \(a map-style dataset\) or __iter__, or pass a list of its items",
        str(info.value),
    ), str(info.value)
    assert set(multiprocessing.active_children()) == before
    with (
        dk.gpu_pool(devices=["cpu"]) as pool,
        pytest.raises(TypeError, match=r"^GPUPool\.map\(\) needs items, .* neither len"),
    ):
        pool.map(abs, IndexedOnly())  # type: ignore[arg-type]


class _Huge:
    """A callable, and not picklable, whose repr is a megabyte long."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, item: object) -> object:
        return item

    def __repr__(self) -> str:
        return "H" * 10**6


def test_errors_show_a_large_fn_or_items_cut_short() -> None:
    # Before, each error quoted the whole repr: a megabyte of message.
    huge = list(range(10**6))
    refused: list[tuple[Callable[[], object], str]] = [
        (lambda: dk.gpu_map(huge, [1], devices=["cpu"]), r"got \[0, 1, 2, .*\.\.\. of type list"),
        (lambda: dk.gpu_map(abs, _Huge(), devices=["cpu"]), r"got H+\.\.\.H+ of type _Huge"),
        (lambda: dk.gpu_map(_Huge(), [1], devices=["cpu"]), r"picklable, and H+\.\.\.H+ is not"),
    ]
    for call, shown in refused:
        with pytest.raises(TypeError) as info:
            call()
        assert re.search(shown, str(info.value)), str(info.value)
        assert len(str(info.value)) < 1000, str(info.value)[:300]
