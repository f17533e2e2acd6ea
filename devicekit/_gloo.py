"""Gloo's hold on a collective past ``wait()``: the timeout it runs under, when it lets go.

Letting go. Gloo's worker thread holds each collective's tensors a little
past ``wait()``: past its completion, and past a ``wait()`` that gave up,
until gloo's own timeout ends the collective too. A worker that lets go
while the interpreter exits aborts the process, so every collective of
devicekit's (``_dist``) returns, or raises, only once the worker has let go
(``gloo_lets_go``).

The timeout. torch without ``ProcessGroup.set_timeout`` runs a gloo group's
collectives under the timeout the group was made with, whatever a later call
asks (``gloo_keeps_first_timeout``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

import torch

from ._format import format_seconds

__all__ = ["gloo_keeps_first_timeout", "gloo_lets_go"]

logger = logging.getLogger("devicekit")


def _use_count(tensor: torch.Tensor) -> int:
    """How many C++ owners ``tensor`` has (its ``TensorImpl``'s count), its Python object's one."""
    count: int = tensor._use_count()  # type: ignore[attr-defined]  # private; in torch 2.6 to 2.13
    return count


def _holders(tensors: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
    return [(sys.getrefcount(tensor), _use_count(tensor)) for tensor in tensors]


def _until_let_go(
    tensors: tuple[torch.Tensor, ...], before: list[tuple[int, int]], seconds: float
) -> bool:
    """Wait up to ``seconds`` until the counts of ``tensors`` are back to ``before``."""
    deadline = time.monotonic() + seconds
    pause = 0.0
    while _holders(tensors) != before:
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)  # hands the GIL to the worker thread, should it need it
        pause = min(0.01, 2 * pause + 1e-5)  # microseconds first: the usual wait
    return True


@contextlib.contextmanager
def gloo_lets_go(*tensors: torch.Tensor, failed_within: float = 1.0) -> Iterator[None]:
    """Around a gloo collective: on the way out, wait until gloo's worker lets go of ``tensors``.

    Gloo runs a collective on a worker thread, which holds its work, and so
    ``tensors``, a little longer than ``wait()`` does: until just after the
    collective completes, and after a ``wait()`` that gave up first (a rank
    never came), until gloo's own timeout gives up too. Letting go may take
    the GIL: on torch >= 2.10 always (each C++ owner of a Python tensor counts
    as a Python reference), on torch 2.6 when the work holds the last
    reference to a tensor whose Python object is gone. A thread that takes
    the GIL while the interpreter exits (a job-wide call on a script's last
    line, or the exit that follows a failed one) is made to exit in the middle
    of a C++ destructor, and the process aborts: "terminate called without an
    active exception" (torch 2.6: 5 runs in 12 of the test whose ranks fail
    job-wide calls, before this waited after a failure too).

    So wait here, while this frame still holds ``tensors`` (on torch 2.6 the
    worker then lets go without the GIL), until their counts, Python
    references and C++ owners, are back where they were. The caller must not
    hold the work itself, or they never are. After a collective that
    completed, at most a second (normally microseconds); after one that
    raised, at most ``failed_within`` seconds (see ``_dist._gloo_gives_up``),
    with a warning past 5 s. NCCL's watchdog lets go much later; torch shuts
    it down in ``destroy_process_group``.
    """
    before = _holders(tensors)
    try:
        yield
    except BaseException:
        if not _until_let_go(tensors, before, min(failed_within, 5.0)) and failed_within > 5:
            logger.warning(
                "A job-wide call ended while gloo still runs its collective; waiting up to %s "
                "more for gloo's own timeout to end it too: a process that exits before then "
                "can abort",
                format_seconds(failed_within - 5.0),
            )
            _until_let_go(tensors, before, failed_within - 5.0)
        raise
    _until_let_go(tensors, before, 1.0)


def gloo_keeps_first_timeout() -> bool:
    """Whether gloo runs a group's collectives under the timeout the group was made with, always.

    torch without ``ProcessGroup.set_timeout`` (2.6 among them) gives gloo's
    connections their timeout once, when the group is made; its
    ``_set_pg_timeout`` records a new one that gloo's collectives never read
    (on torch 2.6, a 60 s call failed after 1 s in a group made with 1 s).
    """
    import torch.distributed as dist  # noqa: PLC0415 - only with a process group

    return not hasattr(dist.ProcessGroup, "set_timeout")
