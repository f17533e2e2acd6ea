from __future__ import annotations

import copy
import functools
import inspect
import linecache
import pickle
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import devicekit as dk

from .conftest import run_python

SLEEP = 0.02


def test_timer_as_context_manager_measures_a_known_duration() -> None:
    with dk.Timer() as timer:
        time.sleep(SLEEP)
    assert SLEEP <= timer.elapsed < SLEEP + 0.5


def test_timer_starts_when_created_like_d2l() -> None:
    timer = dk.Timer()
    time.sleep(SLEEP)
    assert timer.stop() >= SLEEP
    assert len(timer.times) == 1


def test_lap_api_matches_d2l() -> None:
    timer = dk.Timer()
    timer.stop()
    for _ in range(3):
        timer.start()
        time.sleep(0.005)
        timer.stop()
    times = timer.times
    assert len(times) == 4
    assert all(t >= 0.005 for t in times[1:])
    assert timer.sum() == pytest.approx(sum(times))
    assert timer.avg() == pytest.approx(sum(times) / 4)
    cumsum = timer.cumsum()
    assert cumsum == pytest.approx([sum(times[: i + 1]) for i in range(4)])


def test_timer_as_decorator_times_each_call() -> None:
    timer = dk.Timer()

    @timer
    def work(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    assert work(0.005) == "done"
    assert work(0.01) == "done"
    assert work.__name__ == "work"
    first, second = timer.times
    assert first >= 0.005
    assert second >= 0.01


def test_an_anonymous_decorator_timer_keeps_its_laps_on_the_function() -> None:
    @dk.Timer()
    def step(seconds: float) -> None:
        time.sleep(seconds)

    step(0.005)
    step(0.005)
    assert len(step.timer.times) == 2
    assert all(t >= 0.005 for t in step.timer.times)
    assert step.__name__ == "step"


def test_timer_repr_and_html() -> None:
    timer = dk.Timer(device="cpu")
    assert repr(timer) == "Timer(no lap finished yet; on cpu)"
    timer.stop()
    timer.start()
    timer.stop()
    text = repr(timer)
    assert text.startswith("Timer(2 laps: last ")
    assert ", mean " in text
    assert ", total " in text
    assert text.endswith("; on cpu)")
    assert "\n" not in text
    html = timer._repr_html_()
    assert html.startswith("<table><caption>Timer on cpu</caption>")
    assert '<th style="text-align:left">laps</th><td>2</td>' in html


def test_decorated_function_that_raises_still_ends_its_lap() -> None:
    timer = dk.Timer()

    @timer
    def broken() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        broken()
    assert len(timer.times) == 1


def test_stop_without_a_running_lap() -> None:
    timer = dk.Timer()
    timer.stop()
    with pytest.raises(RuntimeError, match=r"Timer\.stop\(\) needs a running lap"):
        timer.stop()


def test_elapsed_before_any_lap() -> None:
    fix = r"no lap has finished yet: time a `with` block or call stop\(\)$"
    with pytest.raises(RuntimeError, match=fix):
        _ = dk.Timer().elapsed
    with pytest.raises(RuntimeError, match=fix):  # before, avg() gave no fix
        dk.Timer().avg()


def test_benchmark_context_prints_like_d2l(capsys: pytest.CaptureFixture[str]) -> None:
    with dk.Benchmark("sleeping") as bench:
        time.sleep(SLEEP)
    assert bench.elapsed is not None
    assert bench.elapsed >= SLEEP
    assert capsys.readouterr().out == f"sleeping: {bench.elapsed:.4f} sec\n"


def test_a_block_under_a_millisecond_is_printed_in_human_units(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # d2l's "{:.4f} sec" printed "tiny: 0.0000 sec" for it: the symptom the timing page opens with.
    monkeypatch.setattr(dk.Timer, "elapsed", property(lambda self: 2.5e-5))
    with dk.Benchmark("tiny") as bench:
        pass
    assert bench.elapsed == 2.5e-5
    assert capsys.readouterr().out == "tiny: 25 µs\n"


def test_cpu_timers_do_not_start_cuda() -> None:
    result = run_python(
        """
        import json, time, torch, devicekit as dk
        from devicekit._visible import cuda_started
        with dk.Timer() as t:
            time.sleep(0.001)
        with dk.Timer(device="cpu", sync=True):
            pass
        dk.benchmark(sum, [1, 2, 3], max_time=0.2)
        print(json.dumps(cuda_started()))
        """
    )
    assert result is None


# --- on a real GPU ---------------------------------------------------------------------------


def _big_matmul() -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(8192, 8192, device="cuda")
    return a, a @ a  # the second warms cuBLAS up


@pytest.mark.gpu
def test_events_and_synchronized_host_clock_agree_on_a_long_kernel() -> None:
    a, _ = _big_matmul()
    with dk.Timer() as events:
        for _ in range(5):
            a @ a
    with dk.Timer(sync=True) as host:
        for _ in range(5):
            a @ a
    assert events.elapsed == pytest.approx(host.elapsed, rel=0.1)


@pytest.mark.gpu
def test_an_unsynchronized_host_clock_is_wrong_where_timer_is_right() -> None:
    a, _ = _big_matmul()
    torch.cuda.synchronize()
    start = time.perf_counter()
    a @ a
    naive = time.perf_counter() - start  # measures the launch only
    torch.cuda.synchronize()
    with dk.Timer() as timer:
        a @ a
    assert timer.elapsed > 20 * naive
    assert timer.elapsed > 1e-3  # an 8192^3 fp32 matmul cannot take under 1 ms on any GPU


@pytest.mark.gpu
def test_timer_starting_cuda_inside_a_lap_still_waits_for_the_gpu() -> None:
    result = run_python(
        """
        import json, torch, devicekit as dk
        with dk.Timer() as t:   # CUDA is not initialized yet: host clock, then a synchronize
            a = torch.randn(8192, 8192, device="cuda")
            for _ in range(5):
                a @ a
        with dk.Timer() as warm:   # now events
            for _ in range(5):
                a @ a
        print(json.dumps([t.elapsed, warm.elapsed]))
        """
    )
    first, warm = result
    assert first >= warm * 0.9  # the first lap includes the five matmuls, not only launches


def test_benchmark_context_has_a_readable_repr(capsys: pytest.CaptureFixture[str]) -> None:
    bench = dk.Benchmark("load data")
    assert repr(bench) == "Benchmark('load data': not run yet)"
    with bench:
        pass
    capsys.readouterr()
    assert re.fullmatch(r"Benchmark\('load data': [\d.]+ (s|ms|µs|ns)\)", repr(bench))


def test_a_decorated_function_may_recurse_and_run_in_threads() -> None:
    timer = dk.Timer()

    @timer
    def countdown(n: int) -> int:
        return 0 if n == 0 else 1 + countdown(n - 1)

    assert countdown(3) == 3  # before: "Timer.stop() needs a running lap"
    assert len(countdown.timer.times) == 4
    threads = [threading.Thread(target=countdown, args=(2,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(timer.times) == 4 + 4 * 3
    assert all(t >= 0 for t in timer.times)


def test_a_lap_remembers_its_seconds() -> None:
    timer = dk.Timer()
    with timer:
        pass
    first = timer.times
    assert timer.times == first  # read once, then kept: the same floats every time


def test_flags_and_labels_of_the_wrong_type_are_refused() -> None:
    with pytest.raises(TypeError, match=r"^sync must be True or False, got 'yes' of type str"):
        dk.Timer(sync="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^description must be a string, the label printed"):
        dk.Benchmark(3)  # type: ignore[arg-type]


def test_a_timer_refuses_a_with_block_inside_its_own() -> None:
    timer = dk.Timer()
    with (
        timer,
        pytest.raises(RuntimeError, match=r"^this Timer is already timing a `with` block"),
        timer,
    ):
        pass
    assert len(timer.times) == 1  # the outer block's lap, whole
    with timer:  # and it times the next block as before
        pass
    assert len(timer.times) == 2


def test_a_timer_in_a_block_of_another_thread_says_so_not_inner_block() -> None:
    # Before: "use a second Timer for the inner block", of a block no code was inside.
    timer, entered, leave = dk.Timer(), threading.Event(), threading.Event()

    def other() -> None:
        with timer:
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(10)
    try:
        with (
            pytest.raises(RuntimeError, match=r"^this Timer is timing a `with` block in another "),
            timer,
        ):
            pass
    finally:
        leave.set()
        thread.join()
    assert len(timer.times) == 1  # the other thread's lap, whole
    with timer:  # and this thread times its next block as before
        pass
    assert len(timer.times) == 2


def test_timer_as_a_decorator_without_parentheses_says_so() -> None:
    def step() -> None: ...

    with pytest.raises(TypeError, match=r"^Timer was given the function 'step' to decorate: "):
        dk.Timer(step)
    with pytest.raises(TypeError, match=r"write dk.Timer\(device='cpu'\)$"):
        dk.Timer("cpu")


@pytest.mark.parametrize("kind", ["generator", "async"])
def test_timer_refuses_to_decorate_what_a_call_would_not_run(kind: str) -> None:
    def gen() -> Iterator[int]:
        yield 1

    async def coro() -> None: ...

    fn, name = (gen, "gen") if kind == "generator" else (coro, "coro")
    # The message names the user's function, not a placeholder "fn".
    with pytest.raises(
        TypeError, match=rf"^@Timer\(\) on {name}: {name}\(\) returns a (generator|coroutine) "
    ):
        dk.Timer()(fn)


@pytest.mark.parametrize("kind", ["generator", "async"])
def test_a_decorated_call_that_returns_a_generator_is_refused_and_records_no_lap(
    kind: str,
) -> None:
    # A lambda (or partial) around a generator function looks plain when decorated:
    # its calls return at once, and their laps would time none of the work.
    def gen() -> Iterator[int]:
        yield 1

    async def coro() -> None: ...

    made: list[Any] = []

    def make() -> Any:
        made.append(gen() if kind == "generator" else coro())
        return made[-1]

    timer = dk.Timer()
    work = "consumes the generator" if kind == "generator" else "runs the coroutine"
    with pytest.raises(TypeError, match=rf"^@Timer\(\) on <lambda>: a call returns a .* {work}"):
        timer(lambda: make())()  # noqa: PLW0108 - a lambda: only its call shows what it returns
    if kind == "async":  # closed, so that it does not warn "never awaited" when collected
        assert inspect.getcoroutinestate(made[0]) == "CORO_CLOSED"
    assert timer.times == []
    timed_list = timer(lambda: [1])  # any other result is returned, and its lap recorded
    assert timed_list() == [1]
    assert len(timer.times) == 1

    def load_then_stream() -> Iterator[int]:  # a def that works, then returns a generator
        time.sleep(0.01)
        return (n for n in range(3))

    assert list(timer(load_then_stream)()) == [0, 1, 2]  # timed as it is: its own work ran
    assert len(timer.times) == 2
    assert timer.times[-1] >= 0.01


def test_timer_names_a_lazy_method_by_its_qualified_name() -> None:
    class Model:
        def steps(self) -> Iterator[int]:
            yield 1

    # Qualified as written in the code: Model.steps, without "test_....<locals>.".
    with pytest.raises(
        TypeError, match=r"^@Timer\(\) on Model\.steps: Model\.steps\(\) returns a generator "
    ):
        dk.Timer()(Model.steps)


def test_stop_inside_a_with_block_ends_its_lap_and_hides_no_exception() -> None:
    timer = dk.Timer()
    with timer:
        timer.stop()
    assert len(timer.times) == 1

    def stop_then_interrupt() -> None:
        with timer:
            timer.stop()
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the user's exception, not a RuntimeError
        stop_then_interrupt()
    assert len(timer.times) == 2


def test_start_inside_a_with_block_is_refused_as_it_would_drop_the_blocks_time() -> None:
    # Before, start() began the block's lap again: a 50 ms then 10 ms block kept 10 ms.
    timer = dk.Timer()
    with timer:
        with pytest.raises(RuntimeError, match=r"^Timer.start\(\) inside this Timer's `with` "):
            timer.start()
        timer.stop()  # the fix it gives: end the lap first
        timer.start()  # then a new lap, which the block's exit ends
    assert len(timer.times) == 2
    timer.start()  # outside a block, laps as ever
    timer.stop()
    assert len(timer.times) == 3


def test_timer_names_the_function_inside_a_partial() -> None:
    # Before: "@Timer() on fn: fn() returns a generator".
    def steps(n: int) -> Iterator[int]:
        yield n

    with pytest.raises(TypeError, match=r"^@Timer\(\) on steps: steps\(\) returns a generator"):
        dk.Timer()(functools.partial(steps, 3))


def test_a_benchmark_refuses_a_with_block_inside_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = dk.Benchmark("outer")
    with (
        bench,
        pytest.raises(RuntimeError, match=r"^this Benchmark \('outer'\) is already timing"),
        bench,
    ):
        pass
    assert bench.elapsed is not None
    assert capsys.readouterr().out.startswith("outer: ")


def test_a_call_s_result_given_to_timer_says_how_to_time_the_call() -> None:
    # Before, @Timer() took a tensor and failed only when the "function" was called
    # ("'Tensor' object is not callable"), and Timer(model(x)) said Timer(device=tensor(...)).
    result = torch.ones(2)
    with pytest.raises(TypeError, match=r"^@Timer\(\) decorates a function, got tensor\("):
        dk.Timer()(result)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"to time a call, use `with dk\.Timer\(\) as t:`") as told:
        dk.Timer(result)
    assert "device=" not in str(told.value)
    with pytest.raises(TypeError, match=r"write dk\.Timer\(device='cpu'\)$"):
        dk.Timer("cpu")


_HANDLER_ENTERS_A_TIMER = """
import json
import signal
import devicekit as dk
from devicekit import _timing

outer, seen = dk.Timer(sync=True), []

def handler(signum, frame):
    with dk.Timer(sync=True):  # another Timer: times its block as usual
        seen.append("other timer")
    try:
        with outer:  # the Timer whose block the signal interrupted: refused, not waited for
            pass
    except RuntimeError as error:
        seen.append(str(error))

signal.signal(signal.SIGUSR1, handler)
synchronize = _timing._synchronize
fired = []

def synchronize_then_signal(device):
    synchronize(device)
    if not fired:  # once: while `outer` enters its block
        fired.append(True)
        signal.raise_signal(signal.SIGUSR1)

_timing._synchronize = synchronize_then_signal
with outer:
    pass
print(json.dumps([seen, len(outer.times)]))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1")
def test_a_signal_handler_that_enters_timers_never_waits_on_one() -> None:
    # Before, one lock for every Timer was held while a block began: a handler that
    # entered any Timer there waited for ever on a lock its own thread held.
    seen, laps = run_python(_HANDLER_ENTERS_A_TIMER, timeout=60)
    assert "other timer" in seen
    assert any(said.startswith("this Timer is already timing a `with` block") for said in seen)
    assert laps == 1  # the block's own, ended by its own exit


def test_another_thread_cannot_enter_a_block_until_its_lap_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, the exit released the block before it ended the lap: another thread's
    # block could begin in between, and this exit ended that thread's lap instead.
    timer = dk.Timer()
    refused: list[str] = []
    finish = dk.Timer._finish

    def finish_while_another_thread_tries(self: dk.Timer) -> Any:
        def enter() -> None:
            try:
                with timer:
                    pass
            except RuntimeError as error:
                refused.append(str(error))

        thread = threading.Thread(target=enter)
        thread.start()
        thread.join(timeout=60)
        return finish(self)

    with timer:
        monkeypatch.setattr(dk.Timer, "_finish", finish_while_another_thread_tries)
    monkeypatch.undo()
    assert len(refused) == 1
    assert refused[0].startswith("this Timer is timing a `with` block in another thread")
    assert len(timer.times) == 1  # this block's, ended by its own exit: none lost


def test_a_timer_copied_inside_its_block_can_be_entered() -> None:
    timer = dk.Timer()
    with timer:
        copied = copy.deepcopy(timer)
        restored = pickle.loads(pickle.dumps(timer))
    for fresh in (copied, restored):
        with fresh:
            pass
    bench = dk.Benchmark("b")
    with (
        pytest.raises(RuntimeError, match=r"^this Benchmark \('b'\) is already timing"),
        bench,
        bench,
    ):
        pass


def test_a_ctrl_c_as_a_block_is_entered_leaves_the_timer_usable() -> None:
    # Before, a KeyboardInterrupt just after the block's lock was taken kept it taken:
    # the Timer refused every later block, saying another thread had one open.
    timer = dk.Timer()
    enter = dk.Timer.__enter__.__code__

    def interrupt(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is enter:
            if event == "line" and "_block_thread" in linecache.getline(
                frame.f_code.co_filename, frame.f_lineno
            ):
                sys.settrace(None)
                raise KeyboardInterrupt
            return interrupt
        return None

    sys.settrace(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), timer:
            pass
    finally:
        sys.settrace(None)
    with timer:  # usable again
        pass
    assert len(timer.times) == 1


def test_only_the_thread_that_entered_a_block_can_exit_it() -> None:
    # Before, another thread's __exit__ ended and released the owner's block.
    timer = dk.Timer()
    told: list[str] = []

    def exit_from_here() -> None:
        try:
            timer.__exit__(None, None, None)
        except RuntimeError as error:
            told.append(str(error))

    with timer:
        thread = threading.Thread(target=exit_from_here)
        thread.start()
        thread.join(timeout=60)
        assert timer._in_block  # still this thread's block
    assert told
    assert told[0].startswith("this Timer's `with` block was entered in another thread")
    assert len(timer.times) == 1


def test_a_timer_s_laps_go_to_json_and_a_lap_that_raised_is_kept() -> None:
    # Before, a Timer had no to_dict() and json.dumps(timer) raised TypeError.
    import json

    timer = dk.Timer()
    timer.stop()  # the lap that began when it was made
    with pytest.raises(ValueError, match="boom"), timer:
        raise ValueError("boom")
    data = json.loads(json.dumps(timer.to_dict()))
    assert data == {"device": None, "sync": False, "times": timer.times}
    assert len(data["times"]) == 2  # the block that raised is a lap, as documented
    assert dk.Timer(device="cpu", sync=True).to_dict()["device"] == "cpu"


def test_benchmark_decorates_a_function_each_call_a_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: TypeError: 'Benchmark' object is not callable.
    bench = dk.Benchmark("step")

    @bench
    def step(x: int) -> int:
        return 2 * x

    assert (step(1), step(2)) == (2, 4)
    assert step.__name__ == "step"
    assert capsys.readouterr().out.count("step: ") == 2
    assert bench.elapsed is not None

    @dk.Benchmark("fib")
    def fib(n: int) -> int:  # each call a block of its own, as a Timer's laps
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    assert fib(3) == 2
    assert capsys.readouterr().out.count("fib: ") == 5
    threads = [threading.Thread(target=step, args=(1,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert capsys.readouterr().out.count("step: ") == 2  # neither refused

    async def later() -> None: ...

    with pytest.raises(TypeError, match=r"returns a coroutine.*`with dk\.Benchmark\(\.\.\.\):`"):
        bench(later)
    with pytest.raises(TypeError, match=r"decorates a function, got 3"):
        bench(3)  # type: ignore[arg-type]


def test_a_benchmark_decorated_call_that_returns_a_generator_prints_no_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def gen() -> Iterator[int]:
        yield sum(range(10**6))  # the work, which a call never runs

    bench = dk.Benchmark("step")
    step = bench(lambda: gen())  # noqa: PLW0108 - a lambda, as a user writes it
    with pytest.raises(TypeError, match=r"^@dk\.Benchmark\('step'\): a call returns a generator"):
        step()
    assert capsys.readouterr().out == ""  # no "step: 1.2 µs" for a call that did no work
    assert repr(bench) == "Benchmark('step': not run yet)"  # before, the refused call's time
    assert bench(lambda: [1])() == [1]
    assert capsys.readouterr().out.startswith("step: ")


def test_a_timed_function_answers_isinstance() -> None:
    # Before: "Instance and class checks can only be used with @runtime_checkable protocols".
    timer = dk.Timer()
    assert isinstance(timer(sorted), dk.TimedFunction)
    assert not isinstance(sorted, dk.TimedFunction)
