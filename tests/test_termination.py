"""SIGTERM and SIGHUP to a program whose gpu_map runs: nothing fn started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from devicekit import _termination
from devicekit._errors import TerminatedBySignal

REPO = os.path.dirname(os.path.dirname(__file__))
needs_posix = pytest.mark.skipif(
    not hasattr(signal, "SIGHUP") or not Path("/proc/self").is_dir(), reason="needs Linux"
)


def starts_a_sleeper(item: int) -> int:
    """Start a process that would outlive its worker, say where, and wait."""
    sleeper = subprocess.Popen(["sleep", "300"])
    Path(os.environ["SLEEPERS"], f"{sleeper.pid}").touch()
    time.sleep(300)
    return item


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by init, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@needs_posix
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, getattr(signal, "SIGHUP", 1)])
def test_a_signal_to_the_caller_stops_what_fn_started(tmp_path: Path, signum: int) -> None:
    # Before: `kill <pid>` ended the caller at once; its workers followed (the parent-death
    # signal), but each fn's `sleep 300` lived on, given to init.
    script = textwrap.dedent(
        """
        import devicekit as dk
        from tests.test_termination import starts_a_sleeper
        if __name__ == "__main__":
            dk.gpu_map(starts_a_sleeper, range(2), devices=["cpu", "cpu"])
        """
    )
    _signal_stops_the_sleepers(script, tmp_path, signum)


def _signal_stops_the_sleepers(script: str, tmp_path: Path, signum: int, idle: float = 0) -> None:
    """Run ``script``, send ``signum`` once its workers started two sleepers (and ``idle``
    seconds more), and check the program died of it with no sleeper left running."""
    env = {**os.environ, "SLEEPERS": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            assert process.poll() is None, "the program ended before its workers started"
            time.sleep(0.1)
        sleepers = [int(path.name) for path in tmp_path.iterdir()]
        assert len(sleepers) == 2, "the workers did not start their sleepers"
        time.sleep(idle)
        process.send_signal(signum)
        assert process.wait(timeout=60) == -signum  # it died of the signal, as it would have
        deadline = time.monotonic() + 30
        while any(map(_running, sleepers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in sleepers if _running(pid)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        for path in tmp_path.iterdir():
            if _running(int(path.name)):
                os.kill(int(path.name), signal.SIGKILL)


@needs_posix
def test_a_handler_of_the_program_s_own_is_left_alone() -> None:
    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with _termination.stops_workers_first():
            assert signal.getsignal(signal.SIGTERM) is own
            assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL  # taken over
        assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # given back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_nothing_is_taken_outside_the_main_thread() -> None:
    import threading

    seen: list[object] = []

    def run() -> None:
        with _termination.stops_workers_first():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert seen == [signal.getsignal(signal.SIGTERM)]


def test_the_internal_exception_exits_with_the_status_of_the_signal() -> None:
    # Where the signal cannot end the process (it never fails to on POSIX), SystemExit does,
    # with the shell's status for a process a signal ended.
    assert issubclass(TerminatedBySignal, SystemExit)
    assert TerminatedBySignal(15).code == 143


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs signal masks")
def test_ctrl_c_held_holds_sigint_in_this_thread_until_the_block_ends() -> None:
    # Sent to this thread: sent to the process, another thread (torch's) may take it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached = []

    def held_block() -> None:
        with _termination.ctrl_c_held():
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            time.sleep(0.2)  # unheld, the signal's KeyboardInterrupt is raised here
            reached.append("end of block")

    try:
        with pytest.raises(KeyboardInterrupt):
            held_block()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["end of block"]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def starts_a_sleeper_and_returns(item: int) -> int:
    """Start a process that would outlive its worker, say where, and return at once."""
    sleeper = subprocess.Popen(["sleep", "300"])
    Path(os.environ["SLEEPERS"], f"{sleeper.pid}").touch()
    return item


@needs_posix
@pytest.mark.timeout(180)
def test_a_signal_between_the_maps_of_a_pool_block_stops_what_fn_started(
    tmp_path: Path,
) -> None:
    # Before: a pool idle between maps left its default handlers: `kill <pid>` ended the
    # caller at once, and each fn's `sleep 300` lived on, given to init.
    script = textwrap.dedent(
        """
        import time
        import devicekit as dk
        from tests.test_termination import starts_a_sleeper_and_returns
        if __name__ == "__main__":
            with dk.gpu_pool(devices=["cpu", "cpu"]) as pool:
                pool.map(starts_a_sleeper_and_returns, range(2))
                time.sleep(300)
        """
    )
    _signal_stops_the_sleepers(script, tmp_path, signal.SIGTERM, idle=1)  # the pool idle


@needs_posix
@pytest.mark.timeout(120)
def test_the_same_signal_again_within_a_second_does_not_cut_the_cleanup_short(
    tmp_path: Path,
) -> None:
    # Before: the second SIGTERM of one request (GNU timeout signals the process, then its
    # group) found the default handler back and ended the process in the last flush: no
    # value reached the sink.
    written = tmp_path / "written.txt"
    script = textwrap.dedent(
        f"""
        import os, signal, time
        import devicekit as dk
        def sink(records):
            os.kill(os.getpid(), signal.SIGTERM)  # the same request again, mid-cleanup
            with open({str(written)!r}, "a") as out:
                out.write(f"{{len(records)}}\\n")
        with dk.LogBuffer(flush_every=1000, sinks=[sink]) as logs:
            for step in range(10):
                logs.log(step, loss=float(step))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        """
    )
    process = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, timeout=100, check=False, capture_output=True
    )
    assert process.returncode == -signal.SIGTERM, process.stderr
    assert written.read_text() == "10\n"
