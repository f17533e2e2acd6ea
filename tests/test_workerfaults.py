"""gpu_map's workers: answers kept when another item fails, processes in fn, CPU threads.

The functions the workers run are defined here, at the top level: a worker
imports this module (``tests.test_workerfaults``) to find them.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit._dispatch import run_map
from devicekit._workerslots import usable_cpus
from devicekit._workerstart import start_workers, stop_workers

_WAIT = 60.0  # seconds a worker waits for a file at most: the test's own limit is far below


def _wait_for(path: Path) -> None:
    end = time.monotonic() + _WAIT
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.01)


def ordered(item: tuple[int, str]) -> int:
    """Item 0 fails once item 1 has returned; item 1 returns once the caller says go.

    Item 2 returns once both have started: the caller has sent every item.
    """
    index, folder = item
    here = Path(folder)
    (here / f"{index} started").touch()
    if index == 2:
        _wait_for(here / "0 started")
        _wait_for(here / "1 started")
    elif index == 1:
        _wait_for(here / "go")
        (here / "1 returned").touch()
    elif index == 0:
        _wait_for(here / "1 returned")
        (here / "0 raised").touch()
        raise ValueError("item 0 fails")
    return index


def loader_with_workers(item: int) -> int:
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=1)
    return sum(int(batch.sum()) for batch in loader) + item


def with_a_pool(item: int) -> list[int]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.map(abs, [item])


def step_with_loader(size: int) -> None:
    loader_with_workers(size)


def threads(item: int) -> tuple[int, str | None]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


@pytest.mark.timeout(300)
def test_answers_already_in_the_pipes_are_kept_when_another_item_fails(tmp_path: Path) -> None:
    # Before: the first fault read ended the map, and an answer that had come back in the
    # same wait from a later worker (or waited in another pipe) was never read: lost.
    # Worker 3's item 2 comes back first (once the others have theirs); while the caller
    # counts it (step), item 1 returns and then item 0 fails: both answers wait together.
    items = [(index, str(tmp_path)) for index in range(3)]

    def step() -> None:
        if not (tmp_path / "go").exists():
            (tmp_path / "go").touch()
            _wait_for(tmp_path / "0 raised")
            time.sleep(2.0)  # both answers are in their pipes by now

    workers = start_workers(["cpu", "cpu", "cpu"])
    try:
        with pytest.raises(dk.WorkerError, match="item 0 fails") as caught:
            run_map(
                workers,
                1,
                pickle.dumps(ordered),
                items,
                [pickle.dumps(item) for item in items],
                step=step,
                timeout=None,
            )
    finally:
        stop_workers(workers, gently=False)
    assert caught.value.index == 0
    assert caught.value.results == {1: 1, 2: 2}
    assert "2 of 3 items had finished" in str(caught.value.__notes__)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fn", [loader_with_workers, with_a_pool])
def test_a_process_started_in_fn_names_the_cause_and_the_fix(fn: object) -> None:
    # Before: the bare "AssertionError: daemonic processes are not allowed to have children".
    with pytest.raises(dk.WorkerError) as caught:
        dk.gpu_map(fn, [1], devices=["cpu"])  # type: ignore[call-overload]
    said = str(caught.value)
    assert "daemonic processes are not allowed to have children" in said
    assert "fn started a multiprocessing process (a DataLoader with num_workers > 0" in said
    assert "gpu_map's and gpu_pool's workers are daemonic processes" in said
    assert "DataLoader(..., num_workers=0)" in said


@pytest.mark.timeout(300)
def test_a_loader_with_workers_in_an_isolated_trial_names_the_fix() -> None:
    with pytest.raises(RuntimeError) as caught:
        dk.find_batch_size(step_with_loader, max_size=2, isolate=True, device="cpu")
    said = str(caught.value)
    assert "daemonic processes are not allowed to have children" in said
    assert "find_batch_size(isolate=True) runs each trial in a daemonic child process" in said
    assert "DataLoader(..., num_workers=0)" in said


@pytest.mark.timeout(300)
def test_cpu_workers_share_the_cores() -> None:
    # Before: each of one worker per core used every core (torch's default), cores² threads.
    share = max(1, usable_cpus() // 2)
    assert dk.gpu_map(threads, range(2), devices=["cpu", "cpu"]) == [(share, str(share))] * 2
    cores = usable_cpus()
    assert dk.gpu_map(threads, range(1), devices=["cpu"]) == [(cores, str(cores))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_a_thread_count_the_user_set_is_kept(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cores = usable_cpus()  # torch uses no more threads than cores, whatever is asked
    monkeypatch.setenv(variable, str(cores))
    (got, omp), (got_too, _) = dk.gpu_map(threads, range(2), devices=["cpu", "cpu"])
    assert got == got_too == cores
    assert omp == (str(cores) if variable == "OMP_NUM_THREADS" else None)
