"""The flush at exit: a LogBuffer never flushed loses nothing silently when the script ends."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import devicekit as dk
from devicekit import _logexit

from .conftest import free_port
from .mapfns import REPO, importable, run_in_repo, run_python_args

_NEVER_FLUSHED = """
import sys, torch, devicekit as dk
logs = dk.LogBuffer(flush_every=100, sinks=[dk.CSVSink(sys.argv[1])])
for step in range(250):
    logs.log(step, loss=torch.tensor(1.0 / (step + 1)))
# the script ends here: no flush(), no with block
"""


def _script(body: str, *args: str) -> tuple[str, str]:
    """Run ``body`` as a script with ``args``, Python's default warning filters: its output.

    It must exit 0: what fails at exit is told, never raised.
    """
    done = run_python_args(["-c", body, *args])
    return done.stdout, done.stderr


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def test_a_buffer_never_flushed_is_flushed_at_exit(tmp_path: Path) -> None:
    # Before: the CSV held 100 rows of 250 (the automatic flushes' only), and nothing
    # was printed (a ResourceWarning is hidden by Python's default filters).
    path = tmp_path / "train.csv"
    _, stderr = _script(_NEVER_FLUSHED, str(path))
    assert [row["step"] for row in _rows(path)] == [str(step) for step in range(250)]
    assert "LogBuffer" not in stderr, stderr


def test_buffers_are_flushed_at_exit_in_the_order_they_were_made(tmp_path: Path) -> None:
    out = tmp_path / "order.txt"
    _, stderr = _script(
        "import sys, devicekit as dk\n"
        "out = open(sys.argv[1], 'a')\n"
        "def sink(name):\n"
        "    return lambda records: out.write(f'{name} {len(records)}\\n') and out.flush()\n"
        "first = dk.LogBuffer(sinks=[sink('first')])\n"
        "second = dk.LogBuffer(sinks=[sink('second')])\n"
        "second.log(0, x=1.0); first.log(0, x=1.0); first.log(1, x=2.0)\n"
        "quiet = dk.LogBuffer(); quiet.log(0, x=1.0)  # no sinks: its history ends with it\n",
        str(out),
    )
    assert out.read_text().splitlines() == ["first 2", "second 1"]
    assert "LogBuffer" not in stderr, stderr


def test_a_sink_that_fails_at_exit_is_told_never_raised(tmp_path: Path) -> None:
    _, stderr = _script(
        "import devicekit as dk\n"
        "def full_disk(records):\n"
        "    raise OSError(28, 'No space left on device')\n"
        "logs = dk.LogBuffer(flush_every=100, sinks=[full_disk])\n"
        "for step in range(3):\n"
        "    logs.log(step, loss=1.0)\n"
    )
    assert "RuntimeWarning: devicekit: at exit, LogBuffer(flush_every=100) of loss" in stderr
    assert "its flush at exit raised OSError: [Errno 28] No space left on device" in stderr
    assert "the sink that raised may not have written them all" in stderr
    assert "use it in a with block, or call logs.flush()" in stderr
    assert "Traceback" not in stderr, stderr  # told once, not raised past atexit
    assert stderr.count("RuntimeWarning") == 1  # not told again when the buffer is dropped


_REDUCING = (
    "import sys, devicekit as dk\n"
    "{setup}"
    "logs = dk.LogBuffer(flush_every=100, reduce='mean', sinks=[dk.CSVSink(sys.argv[1])])\n"
    "for step in range(250):\n"
    "    logs.log(step, loss=1.0)\n"
)


def _gloo(tmp_path: Path, rank: int = 0, world: int = 1) -> str:
    """Script lines that make a gloo group of ``world`` ranks through a file in ``tmp_path``."""
    return (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method={(tmp_path / 'rendezvous').as_uri()!r}, "
        f"rank={rank}, world_size={world})\n"
    )


@pytest.mark.parametrize(
    ("setup", "env"),
    [
        ("", {}),  # a DDP script run as one plain process
        ("", {"WORLD_SIZE": "1"}),  # a launcher's job of one rank
        ("group", {}),  # a group of one rank (torchrun --nproc_per_node=1)
        ("group+destroy", {}),
    ],
    ids=["alone", "launched-alone", "group-of-one", "group-of-one-destroyed"],
)
def test_a_reducing_buffer_whose_flushes_were_local_is_flushed_at_exit(
    tmp_path: Path, setup: str, env: dict[str, str]
) -> None:
    # Every flush of it was local (no group, or a group of one rank): its flush at exit is
    # one more, without a collective. Before, it was told, not flushed, and the CSV lost
    # its last 150 rows.
    path = tmp_path / "train.csv"
    script = _REDUCING.format(setup=_gloo(tmp_path) if setup else "")
    if setup.endswith("destroy"):
        script += "dist.destroy_process_group()\n"
    done = run_python_args(["-c", script, str(path)], env=env)
    assert [row["step"] for row in _rows(path)] == [str(step) for step in range(250)]
    assert "LogBuffer" not in done.stderr, done.stderr


_TWO_RANKS = 60  # seconds each rank of a two-rank script may take


def _two_ranks(
    tmp_path: Path, tail: str, *, script: str = _REDUCING, **env: str
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` as ranks 0 and 1 of a gloo job, ``tail`` after the loop."""
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                script.format(setup=_gloo(tmp_path, rank, 2)) + tail,
                str(tmp_path / f"rank{rank}.csv"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=importable(**env),
        )
        for rank in range(2)
    ]
    done = []
    for rank in ranks:
        stdout, stderr = rank.communicate(timeout=_TWO_RANKS)
        done.append(subprocess.CompletedProcess(rank.args, rank.returncode, stdout, stderr))
    return done


@pytest.mark.timeout(3 * _TWO_RANKS)
@pytest.mark.parametrize(
    ("tail", "why"),
    [
        ("", "its flush is a collective across ranks, which at exit can hang"),
        (
            "dist.destroy_process_group()\n",
            "the process group is gone (destroy_process_group()), and its flushes combined "
            "the ranks' values: this one would record this rank's own values as the job's",
        ),
    ],
    ids=["group-alive", "group-destroyed"],
)
def test_a_reducing_buffer_of_a_job_of_two_ranks_is_told_not_flushed_at_exit(
    tmp_path: Path, tail: str, why: str
) -> None:
    for rank, done in enumerate(_two_ranks(tmp_path, tail)):
        assert done.returncode == 0, done.stderr
        assert len(_rows(tmp_path / f"rank{rank}.csv")) == 100  # the first automatic flush
        assert "was left with 150 values never recorded" in done.stderr
        assert f"reduce='mean' is not flushed at exit, because {why}" in done.stderr
        assert "before destroy_process_group()" in done.stderr
        assert done.stderr.count("RuntimeWarning") == 1, done.stderr


_SHORT = _REDUCING.replace("range(250)", "range(3)")  # no flush before the group is gone


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"])
def test_a_rank_a_launcher_started_without_a_group_is_told_not_flushed_at_exit(
    tmp_path: Path, variable: str
) -> None:
    # Its values may have been logged in a group since destroyed: they are one rank's.
    path = tmp_path / "train.csv"
    done = run_python_args(["-c", _REDUCING.format(setup=""), str(path)], env={variable: "4"})
    assert len(_rows(path)) == 100  # the automatic flushes' (local, as they were)
    assert f"{variable}=4 says this process is one of 4 ranks" in done.stderr
    assert "was left with 150 values never recorded" in done.stderr
    # Its first automatic flush said so too, once: it recorded this rank's values.
    assert "its flush recorded this rank's own values, unreduced" in done.stderr
    assert done.stderr.count("RuntimeWarning") == 2, done.stderr


@pytest.mark.timeout(3 * _TWO_RANKS)
def test_a_launched_rank_whose_group_is_gone_before_any_flush_is_told_not_flushed(
    tmp_path: Path,
) -> None:
    # A short eval buffer: values logged in a group of two, which is destroyed before
    # any flush combined them. Flushed at exit, each rank wrote its own values as if
    # they were the job's mean (rank 1: 1.0 where the job's is 0.5), without a word.
    tail = "dist.destroy_process_group()\n"
    script = _SHORT.replace("loss=1.0", "loss=float(dist.get_rank())")
    for rank, done in enumerate(_two_ranks(tmp_path, tail, script=script, WORLD_SIZE="2")):
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / f"rank{rank}.csv").exists()
        assert "WORLD_SIZE=2 says this process is one of 2 ranks" in done.stderr
        assert "was left with 3 values never recorded" in done.stderr


@pytest.mark.timeout(3 * _TWO_RANKS)
def test_a_flush_after_the_group_is_gone_says_it_recorded_one_ranks_values(
    tmp_path: Path,
) -> None:
    # Before, a flush() after destroy_process_group() recorded each rank's own values
    # as the job's without a word, where the flush at exit told it.
    tail = "dist.destroy_process_group()\nlogs.flush()\nlogs.log(999, loss=1.0)\nlogs.flush()\n"
    for rank, done in enumerate(_two_ranks(tmp_path, tail)):
        assert done.returncode == 0, done.stderr
        assert len(_rows(tmp_path / f"rank{rank}.csv")) == 251  # recorded, and told: once
        assert "LogBuffer(reduce='mean'): the process group is gone" in done.stderr
        assert "this one recorded this rank's own values as the job's" in done.stderr
        assert done.stderr.count("RuntimeWarning") == 1, done.stderr


@pytest.mark.timeout(3 * _TWO_RANKS)
def test_a_forked_child_of_a_rank_flushes_its_copy_locally(tmp_path: Path) -> None:
    # The copy in a forked worker is no rank: following the warning's advice (sinks of
    # its own, flush() before it ends), its flush joined the job's collective from the
    # child, and hung there.
    tail = (
        "import os\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    mine = []\n"
        "    logs.sinks = [mine.extend]\n"
        "    logs.log(7, loss=2.0); logs.flush()\n"
        "    print('child recorded', [r['step'] for r in mine], flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n"
        "logs.flush()\n"
    )
    for done in _two_ranks(tmp_path, tail):
        assert done.returncode == 0, done.stderr
        assert "child recorded [7]" in done.stdout


def test_ctrl_c_in_a_sink_at_exit_stops_the_flushes_and_tells_the_rest(tmp_path: Path) -> None:
    _, stderr = _script(
        "import devicekit as dk\n"
        "def hangs(records):\n"
        "    raise KeyboardInterrupt  # the user's Ctrl-C in a sink that hangs\n"
        "first = dk.LogBuffer(sinks=[hangs]); first.log(0, a=1.0)\n"
        "second = dk.LogBuffer(sinks=[print]); second.log(0, b=1.0)\n"
    )
    assert "its flush at exit raised KeyboardInterrupt" in stderr
    assert "of b (sinks print) was left with 1 value never recorded: KeyboardInterrupt " in stderr
    assert "stopped the flushes at exit before it was flushed" in stderr
    assert "Traceback" not in stderr, stderr


def test_a_sink_interrupted_before_the_exit_is_not_called_again_at_exit() -> None:
    # One Ctrl-C gets out of a sink that hangs: the flush at exit must not call it again.
    stdout, stderr = _script(
        "import devicekit as dk\n"
        "calls = []\n"
        "def hangs(records):\n"
        "    calls.append(1); print('called', len(calls), flush=True)\n"
        "    logs.log(9, derived=1.0)\n"
        "    raise KeyboardInterrupt\n"
        "logs = dk.LogBuffer(sinks=[hangs])\n"
        "try:\n"
        "    with logs:\n"
        "        logs.log(0, loss=1.0)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
    )
    assert stdout.split() == ["called", "1"]
    assert "was left with 1 record never handed to its sinks: a sink was interrupted" in stderr


def test_a_forked_child_does_not_flush_its_parents_buffer_at_its_exit(tmp_path: Path) -> None:
    out = tmp_path / "pids.txt"
    _script(
        "import os, sys, devicekit as dk\n"
        "def sink(records):\n"
        "    with open(sys.argv[1], 'a') as file:\n"
        "        file.write(f'{os.getpid()} {len(records)}\\n')\n"
        "logs = dk.LogBuffer(sinks=[sink]); logs.log(0, loss=1.0)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    sys.exit(0)  # a normal exit: atexit's hooks run in the child too\n"
        "os.waitpid(child, 0)\n"
        "print(os.getpid())\n",
        str(out),
    )
    lines = out.read_text().splitlines()
    assert len(lines) == 1  # the parent's flush only, not the child's copy too
    assert lines[0].endswith(" 1")


_FORKED_WHILE_LOCKED = """
import os, signal, sys, threading, devicekit as dk
from devicekit import _csvclaims, _logexit

held, release = threading.Event(), threading.Event()

def inside():  # as a thread making a CSVSink and a LogBuffer would be, at the fork
    with _csvclaims._lock, _logexit._registering:
        held.set()
        release.wait()

threading.Thread(target=inside, daemon=True).start()
held.wait()
child = os.fork()
if child == 0:
    signal.alarm(60)  # a hang ends as SIGALRM, not as the test's timeout
    logs = dk.LogBuffer(sinks=[dk.CSVSink(sys.argv[1])])
    logs.log(0, loss=1.0)
    logs.flush()
    os._exit(0)
release.set()
_, status = os.waitpid(child, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_thread_made_a_sink_makes_its_own(tmp_path: Path) -> None:
    # Before, the child's copies of the module locks stayed held by a thread it does not
    # have: its CSVSink (and its LogBuffer) waited for ever.
    path = tmp_path / "child.csv"
    stdout, _ = _script(_FORKED_WHILE_LOCKED, str(path))
    assert stdout.split() == ["0"]
    assert path.read_text().splitlines() == ["step,loss", "0,1.0"]


_DATALOADER_LOGS = """
import os, sys, torch, devicekit as dk
from torch.utils.data import DataLoader, Dataset

class Timed(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        logs.log(index, load_ms=1.0)  # in the worker: the parent's buffer, copied by fork
        return torch.tensor(float(index))

logs = dk.LogBuffer(flush_every=1, sinks=[dk.CSVSink(sys.argv[1])])
loader = DataLoader(Timed(), batch_size=2, num_workers=1, multiprocessing_context="fork")
for step, batch in enumerate(loader):
    logs.log(step, loss=batch.mean())
logs.flush()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_dataloader_workers_copy_never_writes_the_parents_sinks(tmp_path: Path) -> None:
    # Before: the worker's automatic flush wrote its rows into the parent's CSV, and the
    # parent's next log() raised that the file had changed under its CSVSink.
    path = tmp_path / "train.csv"
    _, stderr = _script(_DATALOADER_LOGS, str(path))
    assert path.read_text().splitlines() == ["step,loss", "0,0.5", "1,2.5"]
    assert "this LogBuffer is a forked process's copy of its parent's buffer" in stderr
    assert "CSVSink(" in stderr
    assert "stayed with the parent" in stderr
    # Sinks of its own need a flush there: a worker ends with os._exit, no exit hooks.
    assert "and call logs.flush() before the worker ends" in stderr
    assert stderr.count("RuntimeWarning") == 1, stderr  # once, at the worker's first flush


_TERMINATED = """
import os, signal, sys, devicekit as dk

def network(records):  # a slow sink (a network logger): the signal may land in it
    if sys.argv[2] == "in a sink" and records[-1]["step"] >= 9:
        os.kill(os.getpid(), signal.SIGTERM)

if sys.argv[3] == "own handler":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + 15))  # kept as it is
with dk.LogBuffer(flush_every=5, sinks=[dk.CSVSink(sys.argv[1]), network]) as logs:
    for step in range(100):
        logs.log(step, loss=float(step))
        if step == 12 and sys.argv[2] == "in the loop":
            os.kill(os.getpid(), signal.SIGTERM)  # as torchrun or Slurm stops a rank
"""


@pytest.mark.parametrize("handler", ["own handler", "default handler"])
@pytest.mark.parametrize("where", ["in the loop", "in a sink"])
def test_sigterm_keeps_every_value_of_the_block(tmp_path: Path, where: str, handler: str) -> None:
    # "in a sink": a first version of "one Ctrl-C gets out of a hung sink" skipped the
    # sinks as the block left on that sys.exit, and the CSV lost the last values.
    # "default handler": before, the process ended at once, and every value the block
    # had not flushed yet was lost (up to 2 * flush_every - 1 steps).
    path = tmp_path / "train.csv"
    done = subprocess.run(
        [sys.executable, "-c", _TERMINATED, str(path), where, handler],
        capture_output=True,
        text=True,
        timeout=120,
        env=importable(),
        check=False,
    )
    # The program's own handler exits as it says; without one, the process dies of the
    # signal after the block's last flush, as it would have at once (the status a
    # scheduler expects).
    assert done.returncode == (143 if handler == "own handler" else -signal.SIGTERM), done.stderr
    assert "Traceback" not in done.stderr
    last = 12 if where == "in the loop" else 14  # step 14's automatic flush hands on 9
    assert [row["step"] for row in _rows(path)] == [str(step) for step in range(last + 1)]


_MAP_INSIDE = """
import os, signal, sys, devicekit as dk
from devicekit import _termination

with dk.LogBuffer(flush_every=100, sinks=[dk.CSVSink(sys.argv[1])]) as logs:
    for step in range(3):
        logs.log(step, loss=float(step))
    with _termination.stops_workers_first():  # a gpu_map inside the block
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached", flush=True)
"""


def test_sigterm_during_a_map_inside_the_block_is_the_block_s_to_die_of(tmp_path: Path) -> None:
    # The map leaves the dying to the block that took the signal: had it died of it
    # itself, the block's last flush would never run.
    path = tmp_path / "train.csv"
    done = subprocess.run(
        [sys.executable, "-c", _MAP_INSIDE, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=importable(),
        check=False,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "not reached" not in done.stdout
    assert [row["step"] for row in _rows(path)] == ["0", "1", "2"]


def test_the_block_gives_the_signals_back_and_takes_none_outside_the_main_thread() -> None:
    default = signal.getsignal(signal.SIGTERM)
    if default is not signal.SIG_DFL:
        pytest.skip("this process has a SIGTERM handler of its own")
    with dk.LogBuffer() as logs:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # taken for the block
        with logs:  # a nested block takes nothing more
            pass
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    seen: list[object] = []

    def in_a_thread() -> None:
        with dk.LogBuffer():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(timeout=60)
    assert seen == [signal.SIG_DFL]  # only the main thread can set handlers


_SPAWNED_LOGS = """
import multiprocessing, sys, devicekit as dk

# The script's top level, not under if __name__ == "__main__": a spawned child runs
# it again (as __mp_main__), so it makes this buffer and its CSVSink again.
logs = dk.LogBuffer(flush_every=100, sinks=[dk.CSVSink(sys.argv[1])])

def load(index):
    logs.log(index, load_ms=0.5)  # in the child: the buffer made again there
    logs.flush()

if __name__ == "__main__":
    for step in range(3):
        logs.log(step, loss=float(step))
    logs.flush()
    child = multiprocessing.get_context("spawn").Process(target=load, args=(7,))
    child.start()
    child.join()
    logs.log(3, loss=3.0)
    logs.flush()
"""


def test_a_buffer_a_spawned_child_makes_again_never_writes_the_parents_sinks(
    tmp_path: Path,
) -> None:
    # Before: the child's buffer wrote its own CSV over the parent's (['step,load_ms',
    # '7,0.5']), and the parent's next flush was refused: the file had been replaced.
    path, script = tmp_path / "train.csv", tmp_path / "train.py"
    script.write_text(_SPAWNED_LOGS)
    _, stderr = _script_file(script, str(path))
    assert [row["step"] for row in _rows(path)] == ["0", "1", "2", "3"]
    assert "load_ms" not in path.read_text()
    assert "this LogBuffer was made again as a process started by spawn or forkserver" in stderr
    assert "if __name__ == '__main__':" in stderr


_SPAWNED_RANKS = """
import os, sys, torch.distributed as dist, torch.multiprocessing as mp, devicekit as dk

logs = dk.LogBuffer(flush_every=2, reduce="mean")  # top level: made again in each rank

def main(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:
        logs.sinks = [dk.CSVSink(path)]
    with logs:
        for step in range(4):
            logs.log(step, loss=float(rank))  # 0.0 and 1.0: their mean is 0.5
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[2], sys.argv[1]), nprocs=2)
"""


def test_a_buffer_made_again_in_a_spawned_rank_still_reduces(tmp_path: Path) -> None:
    # A first version took such a buffer for a forked copy, which is no rank: each rank
    # recorded its own values, and the CSV said 0.0 where the mean is 0.5, silently.
    path, script = tmp_path / "train.csv", tmp_path / "ddp.py"
    script.write_text(_SPAWNED_RANKS)
    _script_file(script, str(path), str(free_port()))
    assert [row["loss"] for row in _rows(path)] == ["0.5"] * 4


def _script_file(script: Path, *args: str) -> tuple[str, str]:
    """`_script`, for a script in a file: a spawned child runs it again, as it is."""
    done = run_python_args([str(script), *args])
    return done.stdout, done.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_flushes_though_a_parent_thread_held_the_lock(tmp_path: Path) -> None:
    # The thread holding the lock at the fork does not exist in the child: before, the
    # child's flush() waited for it for ever. Given sinks of its own, the child writes them.
    out = tmp_path / "child.txt"
    stdout, _ = _script(
        "import os, sys, threading, devicekit as dk\n"
        "parent = []\n"
        "logs = dk.LogBuffer(sinks=[parent.extend]); logs.log(0, loss=1.0)\n"
        "taken, release = threading.Event(), threading.Event()\n"
        "def hold():\n"
        "    with logs._lock:\n"
        "        taken.set(); release.wait(60)\n"
        "holder = threading.Thread(target=hold); holder.start(); taken.wait(60)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    mine = []\n"
        "    logs.sinks = [mine.extend]\n"
        "    logs.log(1, loss=2.0); logs.flush()\n"
        "    with open(sys.argv[1], 'w') as file:\n"
        "        file.write(repr(mine))\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n"
        "release.set(); holder.join(); logs.flush()\n"
        "print(parent)\n",
        str(out),
    )
    assert out.read_text() == "[{'step': 1, 'loss': 2.0}]"  # not the parent's pending value
    assert stdout.strip() == "[{'step': 0, 'loss': 1.0}]"  # the parent's, once, by the parent


def test_a_buffer_another_thread_keeps_flushing_is_told_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_logexit, "_EXIT_LOCK_WAIT", 0.0)
    logs = dk.LogBuffer(sinks=[lambda records: None])
    logs.log(0, loss=1.0)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with logs._lock:
            taken.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert taken.wait(60)
        with pytest.warns(RuntimeWarning, match="another thread was still flushing it after 0 s"):
            _logexit._end(logs)
    finally:
        release.set()
        holder.join()
    assert logs._pending_count() == 1
    logs.flush()


def test_a_buffer_dealt_with_at_exit_is_not_told_again_when_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logs = dk.LogBuffer(reduce="sum", sinks=[lambda records: None])
    monkeypatch.setattr(logs, "_reduced_across_ranks", True)  # as after a job's flushes
    logs.log(0, loss=1.0)
    with pytest.warns(RuntimeWarning, match="reduce='sum' is not flushed at exit"):
        _logexit._end(logs)  # its group is gone: told, not flushed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del logs  # its __del__ would raise (printed as ignored) if it warned


def test_the_flush_at_exit_ends_a_buffer_as_a_with_block_does() -> None:
    seen: list[dk.Record] = []

    def derive(records: list[dk.Record]) -> None:
        seen.extend(records)
        for record in records:
            if "loss" in record:
                logs.log(record["step"], half=record["loss"] / 2)

    logs = dk.LogBuffer(sinks=[derive])
    logs.log(0, loss=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _logexit._end(logs)
    assert seen == logs.history == [{"step": 0, "loss": 1.0}, {"step": 0, "half": 0.5}]


def test_the_children_import_the_tree_under_test() -> None:
    # Not an installed copy: these tests must see the devicekit beside them.
    done = run_in_repo("import devicekit, sys; sys.stdout.write(devicekit.__file__)")
    assert Path(done.stdout).parent == Path(__file__).parents[1] / "devicekit"


def _stop(how: str) -> None:
    if how == "error":
        raise ValueError("stop")
    sys.exit(0)


def _leave_early(rank: int, world: int, port: int, folder: str) -> None:
    import json

    from .test_logbuffer import _join_job

    dist = _join_job(rank, world, port)
    told: dict[str, object] = {}
    try:
        for how in ("error", "exit"):
            logs = dk.LogBuffer(flush_every=4, reduce="mean", timeout=30)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with logs:
                        for step in range(10):
                            logs.log(step, loss=float(rank))
                            if step == 9:
                                _stop(how)
                except (ValueError, SystemExit) as error:
                    told[how] = [
                        list(getattr(error, "__notes__", [])),
                        [str(w.message) for w in caught],
                        logs.values("loss"),
                    ]
        # A with block in a generator, closed when the loop over it breaks.
        logs = dk.LogBuffer(flush_every=4, reduce="mean", timeout=30)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in _steps_logged(logs, rank):
                if step == 9:
                    break
            told["generator"] = [[], [str(w.message) for w in caught], logs.values("loss")]
        Path(folder, f"{rank}.json").write_text(json.dumps(told))
    finally:
        dist.destroy_process_group()


def _steps_logged(logs: dk.LogBuffer, rank: int) -> Iterator[int]:
    with logs:
        for step in range(100):
            logs.log(step, loss=float(rank))
            yield step


def test_a_reducing_block_that_leaves_early_says_its_last_values_are_unreduced(
    tmp_path: Path,
) -> None:
    # Before, sys.exit(0) on every rank at step 9 recorded steps 8 and 9 as each rank's
    # own values, in history and the CSV, with nothing saying so.
    import json

    from .conftest import spawn_ranks

    spawn_ranks(_leave_early, 2, str(tmp_path))
    for rank in range(2):
        told = json.loads((tmp_path / f"{rank}.json").read_text())
        said = "its last flush recorded this rank's 2 values unreduced, its own, not the job's"
        notes, warned, losses = told["error"]
        assert any(said in note for note in notes), notes
        assert not warned
        notes, warned, _ = told["exit"]
        assert not notes
        assert any(said in message for message in warned), warned  # exit shows no note
        assert losses == [0.5] * 8 + [float(rank)] * 2
        assert any("leave the loop with break, not sys.exit()" in said for said in warned)
        # A generator closed after its loop broke: not told to use break, which it did.
        _, warned, losses = told["generator"]
        assert any(said in message for message in warned), warned
        assert any("in a generator that was closed before it ended" in m for m in warned)
        assert not any("not sys.exit()" in message for message in warned)
        assert losses == [0.5] * 8 + [float(rank)] * 2


def test_a_subclass_s_own_flush_is_called_at_the_end_of_the_block() -> None:
    flushed: list[bool] = []

    class Counted(dk.LogBuffer):
        def flush(self, *, wait: bool = True) -> list[dk.Record]:
            flushed.append(wait)
            return super().flush(wait=wait)

    with Counted() as logs:
        logs.log(0, loss=1.0)
    assert flushed == [True]
    assert logs.history == [{"step": 0, "loss": 1.0}]


_WRITER_CLOSED_AT_EXIT = """
import atexit, sys, devicekit as dk

class Writer:  # as a SummaryWriter, wandb or mlflow: its own exit hook closes it
    def __init__(self):
        self.closed, self.got = False, []
        atexit.register(self.close)
    def add_scalar(self, tag, value, step):
        if self.closed:
            raise ValueError("I/O operation on closed writer")
        self.got.append(step)
    def close(self):
        self.closed = True
        print(f"writer got {len(self.got)}", flush=True)

first = dk.LogBuffer()  # any buffer made earlier: an eval buffer, an earlier notebook cell
if sys.argv[1] == "writer first":
    writer = Writer()
    logs = dk.LogBuffer(flush_every=100, sinks=[dk.TensorBoardSink(writer)])
else:  # the sinks given later, after the writer was set up
    logs = dk.LogBuffer(flush_every=100)
    writer = Writer()
    logs.sinks = [dk.TensorBoardSink(writer)]
for step in range(150):
    logs.log(step, loss=1.0 / (step + 1))
"""


@pytest.mark.parametrize("order", ["writer first", "sinks given later"])
def test_the_flush_at_exit_runs_before_a_writer_set_up_after_the_first_buffer_closes(
    order: str,
) -> None:
    # Before: the hook ran in the order of the process's first buffer, so a writer set up
    # after it was closed first: "writer got 100", and a warning of 50 records lost.
    out, err = _script(_WRITER_CLOSED_AT_EXIT, order)
    assert out.strip() == "writer got 150"
    assert "RuntimeWarning" not in err, err


_HOOK_MAKES_A_BUFFER = """
import atexit, os, sys, devicekit as dk

folder, mode = sys.argv[1], sys.argv[2]
logs = dk.LogBuffer(flush_every=100, sinks=[dk.CSVSink(os.path.join(folder, "train.csv"))])
for step in range(5):
    logs.log(step, loss=float(step))
kept = []

def summary():  # an exit hook of the script's own, registered after the buffer
    if mode == "a new buffer":
        made = dk.LogBuffer(sinks=[dk.CSVSink(os.path.join(folder, "summary.csv"))])
        made.log(0, best=1.0)
        kept.append(made)
    else:
        logs.sinks = [*logs.sinks, dk.CSVSink(os.path.join(folder, "copy.csv"))]

atexit.register(summary)
"""


@pytest.mark.parametrize("mode", ["a new buffer", "sinks given"])
def test_an_exit_hook_that_makes_a_buffer_or_gives_sinks_does_not_stop_the_flush_at_exit(
    tmp_path: Path, mode: str
) -> None:
    # A first version moved devicekit's hook to the end from inside the other hook, while
    # exit hooks ran: Python never ran it, and train.csv was never written.
    _script(_HOOK_MAKES_A_BUFFER, str(tmp_path), mode)
    assert [row["step"] for row in _rows(tmp_path / "train.csv")] == ["0", "1", "2", "3", "4"]
    other = tmp_path / ("summary.csv" if mode == "a new buffer" else "copy.csv")
    assert len(_rows(other)) == (1 if mode == "a new buffer" else 5)


_LAZY_WRITER = """
import atexit, devicekit as dk

class LazyWriter:  # set up at its first call, as Lightning's logger.experiment or wandb.init
    def __init__(self):
        self.open, self.rows = None, 0
    def __call__(self, records):
        if self.open is None:
            self.open = True
            atexit.register(self.close)  # what a SummaryWriter, wandb or mlflow does
        if not self.open:
            raise RuntimeError("writer is closed")
        self.rows += len(records)
    def close(self):
        self.open = False
        print(f"writer got {self.rows}", flush=True)

logs = dk.LogBuffer(flush_every=10, sinks=[LazyWriter()])
for step in range(25):
    logs.log(step, loss=float(step))
"""


def test_the_flush_at_exit_runs_before_a_writer_a_sink_set_up_at_its_first_call() -> None:
    # A review found the writer's hook, registered at the sink's first call (a flush),
    # running first: "writer got 20", and a warning of 5 records lost.
    out, err = _script(_LAZY_WRITER)
    assert out.strip() == "writer got 25"
    assert "RuntimeWarning" not in err, err


def test_buffers_and_sinks_made_before_a_reload_of_devicekit_still_count(
    tmp_path: Path,
) -> None:
    # importlib.reload (IPython's %autoreload) ran _logexit and _csvclaims again with
    # empty registries: a buffer made before was never flushed at exit (its rows lost,
    # with a "dropped" warning), and a second CSVSink on its file was not refused.
    path = tmp_path / "train.csv"
    stdout, stderr = _script(
        "import atexit, importlib, sys, devicekit as dk\n"
        "from devicekit import _csvclaims, _logexit\n"
        "logs = dk.LogBuffer(sinks=[dk.CSVSink(sys.argv[1])])\n"
        "logs.log(0, loss=1.0)\n"
        "importlib.reload(_logexit); importlib.reload(_csvclaims)\n"
        "try:\n"
        "    dk.CSVSink(sys.argv[1])\n"
        "except ValueError as refused:\n"
        "    print('refused:', refused)\n"
        "got = []\n"
        "atexit.register(lambda: print('at exit, after devicekit:', got))\n"
        "later = dk.LogBuffer(sinks=[got.extend])  # its hook is registered again: once\n"
        "later.log(0, acc=0.5)\n",
        str(path),
    )
    assert [row["loss"] for row in _rows(path)] == ["1.0"]
    assert "another CSVSink alive in this process" in stdout
    assert "at exit, after devicekit: [{'step': 0, 'acc': 0.5}]" in stdout  # flushed once
    assert "LogBuffer" not in stderr, stderr
