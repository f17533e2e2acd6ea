"""gpu_map's workers: answers kept when another item fails, processes in fn, CPU threads.

The functions the workers run are defined here, at the top level: a worker
imports this module (``tests.test_workerfaults``) to find them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import textwrap
import time
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit._dispatch import run_map
from devicekit._workerslots import usable_cpus
from devicekit._workerstart import start_workers, stop_workers

from .mapfns import alive, run_in_repo

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
def test_fn_may_start_processes_of_its_own() -> None:
    # Before: the workers were daemonic processes, and multiprocessing refused them
    # children: "AssertionError: daemonic processes are not allowed to have children"
    # (with a note on the fix), for a DataLoader with workers, the common case.
    assert dk.gpu_map(loader_with_workers, [1, 2], devices=["cpu"]) == [7, 8]
    assert dk.gpu_map(with_a_pool, [-3], devices=["cpu"]) == [[3]]
    with dk.gpu_pool(devices=["cpu"]) as pool:
        assert pool.map(loader_with_workers, [5]) == [11]


@pytest.mark.timeout(300)
def test_a_loader_with_workers_runs_in_an_isolated_trial() -> None:
    # Before: the trial's child was daemonic: RuntimeError with the AssertionError above.
    assert dk.find_batch_size(step_with_loader, max_size=2, isolate=True, device="cpu") == 2


@pytest.mark.timeout(300)
def test_a_pool_never_closed_does_not_hold_up_exit() -> None:
    # Workers are not daemonic, and multiprocessing's exit handler joins such children:
    # an idle worker waits for work for ever. The pool's own handler stops them first.
    script = textwrap.dedent(
        """
        import os, devicekit as dk
        from tests.mapfns import where
        pool = dk.gpu_pool(devices=["cpu", "cpu"])
        print(sorted({pid for pid, _, _ in pool.map(where, range(4))}), flush=True)
        """
    )
    done = run_in_repo(script, timeout=120)
    assert done.returncode == 0, done.stderr
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pids) == 2
    assert not any(alive(pid) for pid in pids)


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


@pytest.mark.timeout(300)
def test_an_isolated_search_in_a_daemon_thread_does_not_hold_up_exit() -> None:
    # R20: the trial's child is not daemonic, so multiprocessing's exit handler waited for
    # the trial (60 s here, for ever for a hung one) once the main thread had returned.
    script = textwrap.dedent(
        """
        import threading, time, devicekit as dk
        from tests.mapfns import sleeps_a_minute
        search = lambda: dk.find_batch_size(sleeps_a_minute, device="cpu", isolate=True, max_size=4)
        threading.Thread(target=search, daemon=True).start()
        time.sleep(8)  # the child has started its trial
        print("main returns", flush=True)
        """
    )
    done = run_in_repo(script, timeout=40)  # raises TimeoutExpired where exit waits 60 s
    assert "main returns" in done.stdout, done.stderr
