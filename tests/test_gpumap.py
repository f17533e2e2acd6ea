"""gpu_map's own frame: what a Ctrl-C while it closes its pool keeps."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import devicekit as dk
from devicekit import _gpumap


@pytest.mark.timeout(120)
def test_a_ctrl_c_while_the_pool_closes_keeps_every_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: every item had finished, but the interrupt raised in close() replaced the
    # return value, and its .results was {}, which the docs say means "before any item ran".
    close = _gpumap.GPUPool.close

    def interrupted(pool: dk.GPUPool) -> None:
        close(pool)
        raise KeyboardInterrupt

    monkeypatch.setattr(_gpumap.GPUPool, "close", interrupted)
    with pytest.raises(KeyboardInterrupt) as stopped:
        dk.gpu_map(math.sqrt, [1, 4, 9], devices=["cpu"])
    assert stopped.value.results == {0: 1.0, 1: 2.0, 2: 3.0}  # type: ignore[attr-defined]
    assert "gpu_map() had every result" in "\n".join(stopped.value.__notes__)


@pytest.mark.timeout(120)
def test_a_pool_s_map_names_a_mistyped_option() -> None:
    # Before: Python's bare "unexpected keyword argument 'timout'", where gpu_map suggests.
    with (
        dk.gpu_pool(devices=["cpu"]) as pool,
        pytest.raises(TypeError, match=r"'timout'; did you mean 'timeout'\?"),
    ):
        pool.map(math.sqrt, [1], timout=3)  # type: ignore[call-arg]


@pytest.mark.timeout(120)
def test_a_pool_s_repr_counts_a_worker_that_ended_between_maps() -> None:
    # Before: "2 running" after one worker was killed (the list's length, not live ones).
    with dk.gpu_pool(devices=["cpu", "cpu"]) as pool:
        pool.map(math.sqrt, [1, 4])
        worker = pool._workers[0]
        worker.process.kill()
        worker.process.join(timeout=60)
        assert repr(pool) == "GPUPool(2 workers: cpu x2; 1 running, 1 ended)"
        assert pool.map(math.sqrt, [9, 16]) == [3.0, 4.0]  # replaced at the next map
        if "OMP_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" not in os.environ:
            # The replacement shares the cores as the first workers did (it took them all).
            share = str(max(1, len(os.sched_getaffinity(0)) // 2))
            assert set(pool.map(_threads, range(8))) == {share}  # each worker takes some


def _threads(item: int) -> str | None:
    time.sleep(0.2)  # long enough that both workers take items
    return os.environ.get("OMP_NUM_THREADS")


def _done_or_waits(item: int) -> int:
    """Items below 2 return at once; the others say they started, then wait."""
    if item >= 2:
        Path(os.environ["DK_TEST_STARTED"], str(item)).touch()
        time.sleep(120)
    return item * 10


@pytest.mark.timeout(120)
def test_a_handler_s_sys_exit_keeps_the_results_that_had_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pre-emption pattern: a SIGTERM handler of the program's own calls sys.exit(143)
    # to save a checkpoint. Before, its SystemExit carried no .results, as Ctrl-C's did.
    monkeypatch.setenv("DK_TEST_STARTED", str(tmp_path))
    previous = signal.signal(signal.SIGUSR1, lambda *_: sys.exit(143))

    def stop_once_the_slow_items_run() -> None:
        while len(list(tmp_path.iterdir())) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    watcher = threading.Thread(target=stop_once_the_slow_items_run, daemon=True)
    watcher.start()
    try:
        with pytest.raises(SystemExit) as stopped:
            dk.gpu_map(_done_or_waits, range(4), devices=["cpu", "cpu"])
    finally:
        signal.signal(signal.SIGUSR1, previous)
        watcher.join(timeout=10)
    assert stopped.value.code == 143
    assert stopped.value.results == {0: 0, 1: 10}  # type: ignore[attr-defined]
