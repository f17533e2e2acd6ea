"""Whether reducing flushes combine: ranks whose ``with`` block ended flush no more.

A rank whose block ends makes its last flush. Where another rank still holds
values it never logged (validation logged on rank 0 only), or calls one more
flush than it (``flush()`` on rank 0 only), the two never meet again. Before,
the ended rank left in silence and the other waited the whole timeout, then
was told a rank had crashed, and the job's collectives were broken for good.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

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
    # The same answers from a flush() that is not the last: realigned, as before.
    terms = [("mean", 3, "automatic"), ("mean", 3, "flush")]
    assert _logagree.agreed_entries(answers, terms, "mean") == 0  # type: ignore[arg-type]
    # Every rank in its last flush, all agreeing: combined whole.
    same = [_answer((0, 1)), _answer((0, 1))]
    assert _logagree.agreed_entries(same, [("mean", 3, "final")] * 2, "mean") is None  # type: ignore[arg-type]


def _ranks_end_apart(rank: int, world: int, port: int, folder: str) -> None:
    dist = _join_job(rank, world, port, seconds=120)
    results: dict[str, Any] = {}
    try:
        # Validation on rank 0 only: past flush_every, its automatic flush meets
        # rank 1's last one (rank 1 logged nothing).
        only = dk.LogBuffer(flush_every=3, reduce="mean", timeout=30)

        def validate() -> None:
            with only:
                for step in range(5):
                    if rank == 0:
                        only.log(step, val_loss=float(step))

        results["one_rank_logs"] = [_raised(validate), only.history]
        # flush() on rank 0 only, then a value only rank 0 logs: rank 0's flush() meets
        # rank 1's last, and rank 0's own last flush has no rank left to meet.
        extra = dk.LogBuffer(flush_every=100, reduce="mean", timeout=30)

        def flush_on_rank_0() -> None:
            with extra:
                for step in range(5):
                    extra.log(step, loss=float(step + rank))
                if rank == 0:
                    extra.flush()
                    extra.log(5, loss=50.0)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results["flush_on_one"] = [_raised(flush_on_rank_0), extra.history]
        results["warned"] = [str(w.message) for w in caught]
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
        raised, history = results["one_rank_logs"]
        assert raised is not None, rank
        assert raised[0] == "RanksDisagreeError", raised  # before: rank 1 none, rank 0 a timeout
        assert "rank 1 ended its with block (the last flush)" in raised[1]
        # Each rank's own values, unreduced: none lost (rank 0's loop stopped at the
        # error, raised by log() at step 2, its automatic flush's).
        expected = [{"step": s, "val_loss": float(s)} for s in range(3)] if rank == 0 else []
        assert history == expected
        raised, history = results["flush_on_one"]
        assert raised is None, raised  # before: rank 0 waited 30 s at its block's end
        means = [{"step": s, "loss": s + 0.5} for s in range(5)]
        assert history == ([*means, {"step": 5, "loss": 50.0}] if rank == 0 else means)
        assert results["after"] == [None, [{"step": 0, "loss": 3.0}]]
    assert any("rank(s) 1 ended their with block" in said for said in ranks[0]["warned"])
    assert not any("ended their with block" in said for said in ranks[1]["warned"])
