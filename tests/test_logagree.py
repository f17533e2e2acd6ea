"""Whether reducing flushes combine: ranks whose ``with`` block ended flush no more.

A rank whose block ends makes its last flush. Where another rank still holds
values it never logged (validation logged on rank 0 only), or calls one more
flush than it (``flush()`` on rank 0 only), the two never meet again. Before,
the ended rank left in silence and the other waited the whole timeout, then
was told a rank had crashed, and the job's collectives were broken for good.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _logagree

from .conftest import spawn_ranks
from .test_logbuffer import _join_job, _raised

LOSS = (("loss", None),)


def _answer(steps: tuple[int, ...]) -> Any:
    keys = LOSS if steps else ()
    return ((steps, keys), f"logged {len(steps)} steps", False, ("loss",) if steps else ())


def test_a_rank_in_its_last_flush_with_fewer_values_is_never_realigned() -> None:
    answers = [_answer((0, 1, 2)), _answer(())]
    with pytest.raises(dk.RanksDisagreeError, match=r"rank 1 ended its with block") as told:
        _logagree.agreed_entries(answers, [("mean", 3, "automatic"), ("mean", 3, "final")], "mean")
    assert "a LogBuffer of its own, with reduce=None" in str(told.value)
    assert told.value.ended_ranks == (1,)
    # Every rank in its last flush, holding different steps: the usual reasons, no end.
    with pytest.raises(dk.RanksDisagreeError, match=r"the ranks disagree, they flushed") as told:
        _logagree.agreed_entries(answers, [("mean", 3, "final")] * 2, "mean")  # type: ignore[arg-type]
    assert "ended" not in str(told.value)
    assert told.value.ended_ranks == ()
    # The same answers from a flush() that is not the last: realigned, as before.
    terms = [("mean", 3, "automatic"), ("mean", 3, "flush")]
    assert _logagree.agreed_entries(answers, terms, "mean") == 0  # type: ignore[arg-type]
    # Every rank in its last flush, all agreeing: combined whole.
    same = [_answer((0, 1)), _answer((0, 1))]
    assert _logagree.agreed_entries(same, [("mean", 3, "final")] * 2, "mean") is None  # type: ignore[arg-type]


def _log_steps(logs: dk.LogBuffer, rank: int, steps: range) -> None:
    for step in steps:
        logs.log(step, loss=float(step + rank))


def _one_rank_logs(rank: int) -> list[Any]:
    """Validation on rank 0 only: past flush_every, its automatic flush meets rank 1's last."""
    only = dk.LogBuffer(flush_every=3, reduce="mean", timeout=30)

    def validate() -> None:
        with only:
            for step in range(5):
                if rank == 0:
                    only.log(step, val_loss=float(step))

    return [_raised(validate), only.history]


def _flush_on_one(rank: int) -> list[Any]:
    """flush() on rank 0 only, then values only it logs: its flush() meets rank 1's last.

    Its next automatic flush (flush_every=2) and its block's end have no rank to meet.
    """
    extra = dk.LogBuffer(flush_every=2, reduce="mean", timeout=30)

    def flush_on_rank_0() -> None:
        with extra:
            _log_steps(extra, rank, range(5))
            if rank == 0:
                extra.flush()
                for step in (5, 6, 7):
                    extra.log(step, loss=50.0)

    return _warned_outcome(flush_on_rank_0, extra)


def _midway(rank: int) -> list[Any]:
    """flush() on rank 0 only, mid-way: it meets rank 1's last flush, which holds more."""
    midway = dk.LogBuffer(flush_every=100, reduce="mean", timeout=30)

    def flush_midway() -> None:
        with midway:
            for step in range(5):
                midway.log(step, loss=float(step + rank))
                if rank == 0 and step == 2:
                    midway.flush()

    return _warned_outcome(flush_midway, midway)


def _nested(rank: int) -> list[Any]:
    """Only the outermost end is a rank's last flush: rank 0 nests, rank 1 flushes there."""
    nested = dk.LogBuffer(flush_every=100, reduce="sum", timeout=30)

    def nest() -> None:
        with nested:
            nested.log(0, loss=float(rank))
            if rank == 0:
                with nested:
                    nested.log(1, loss=1.0)
            else:
                nested.log(1, loss=2.0)
                nested.flush()  # rank 0's inner block ends: as a flush(), not its last
            nested.log(2, loss=3.0)

    return [_raised(nest), nested.history]


def _warned_outcome(run: Callable[[], None], logs: dk.LogBuffer) -> list[Any]:
    """What ``run`` raised, the history of ``logs`` after, and the warnings given meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = [_raised(run), logs.history]
    return [*outcome, [str(w.message) for w in caught]]


def _ranks_end_apart(rank: int, world: int, port: int, folder: str) -> None:
    dist = _join_job(rank, world, port, seconds=120)
    try:
        cases = (_one_rank_logs, _flush_on_one, _midway, _nested)
        results = {case.__name__: case(rank) for case in cases}
        after = dk.LogBuffer(reduce="sum", timeout=30)  # the job's collectives still work
        after.log(0, loss=float(rank + 1))
        results["after"] = [_raised(after.flush), after.history]
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_ranks_whose_blocks_end_apart_are_told_at_once_and_never_wait(tmp_path: Path) -> None:
    spawn_ranks(_ranks_end_apart, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for rank, results in enumerate(ranks):
        raised, history = results["_one_rank_logs"]
        assert raised is not None, rank
        assert raised[0] == "RanksDisagreeError", raised  # before: rank 1 none, rank 0 a timeout
        assert "rank 1 ended its with block (the last flush)" in raised[1]
        # Each rank's own values, unreduced: none lost (rank 0's loop stopped at the
        # error, raised by log() at step 2, its automatic flush's).
        expected = [{"step": s, "val_loss": float(s)} for s in range(3)] if rank == 0 else []
        assert history == expected
        raised, history, warned = results["_flush_on_one"]
        assert raised is None, raised  # before: rank 0 waited 30 s at its block's end
        means = [{"step": s, "loss": s + 0.5} for s in range(5)]
        own = [{"step": s, "loss": 50.0} for s in (5, 6, 7)]  # before: a 30 s wait, then
        assert history == ([*means, *own] if rank == 0 else means)  # a broken job
        raised, history, midway_warned = results["_midway"]
        assert raised is not None, rank
        assert raised[0] == "RanksDisagreeError", raised
        # Before, it said the automatic flushes would realign the ranks, and rank 0's
        # last values were then recorded unreduced with nothing saying so.
        assert "rank 1 ended its with block (the last flush) while the ranks hold" in raised[1]
        assert "realign" not in raised[1]
        # Its own; rank 0's loop stopped at the error, which its flush() raised at step 2.
        assert history == [{"step": s, "loss": float(s + rank)} for s in range(3 + 2 * rank)]
        raised, history = results["_nested"]
        assert raised is None, raised
        assert history == [
            {"step": 0, "loss": 1.0},
            {"step": 1, "loss": 3.0},
            {"step": 2, "loss": 6.0},
        ]
        assert results["after"] == [None, [{"step": 0, "loss": 3.0}]]
        told = any("rank 1 ended its with block in a flush" in said for said in warned)
        assert told is (rank == 0), warned  # rank 0 recorded steps 5 to 7 unreduced
        assert not any("unreduced" in said for said in midway_warned)  # the error said so


def _spoiled_in_the_part_left_pending(rank: int, world: int, port: int, folder: str) -> None:
    """Rank 0's automatic flush holds step 4 twice, the second spoiled; rank 1 flushes one."""
    dist = _join_job(rank, world, port)
    try:
        logs = dk.LogBuffer(flush_every=3, reduce="sum")
        raised = []
        logs.log(4, loss=1.0)
        if rank == 0:
            spoiled = torch.tensor(2.0)
            logs.log(4, loss=spoiled)
            spoiled.resize_(0)  # changed after log(): cannot be read
            # Its automatic flush meets rank 1's flush() of one entry: it takes one only.
            raised.append(_raised(lambda: logs.log(5, loss=1.0)))
        else:
            raised.append(_raised(logs.flush))
            logs.log(4, loss=1.0)
            logs.log(5, loss=1.0)
        raised.append(_raised(logs.flush))  # the entries left pending on rank 0
        results = {"raised": raised, "history": logs.history}
        Path(folder, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_a_spoiled_value_left_pending_by_a_realigned_flush_is_told_once(tmp_path: Path) -> None:
    # Before, the realigned flush told of rank 0's spoiled value, which it had left pending
    # (its step, 4, was also that of the entry taken), and the next flush told of it again.
    spawn_ranks(_spoiled_in_the_part_left_pending, 2, str(tmp_path))
    zero, one = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2))
    assert zero["raised"][0] is None
    name, message, _ = zero["raised"][1]
    assert name == "ValueError"
    assert "could not read 1 logged value" in message
    assert "'loss' at step 4" in message
    assert one["raised"] == [None, None]
    for results in (zero, one):
        history = results["history"]
        assert [record["step"] for record in history] == [4, 4, 5]
        assert history[0]["loss"] == 2.0
        assert math.isnan(history[1]["loss"])
        assert history[2]["loss"] == 2.0
