"""Whether this process is one rank of several: its process group, and what launchers say.

A job-wide call needs an initialized ``torch.distributed`` process group;
without one it describes this process alone. Launchers say how many ranks
they started in variables of their own (``_WORLD_SIZES``), which tell a
process that forgot ``init_process_group`` from one meant to run alone.
"""

from __future__ import annotations

import logging
import os

__all__ = ["initialized", "launched_world", "warn_if_launched_alone", "world_size"]

logger = logging.getLogger("devicekit")


def initialized() -> bool:
    """Whether this process is part of an initialized ``torch.distributed`` job."""
    import torch.distributed as dist  # noqa: PLC0415 - only when asked

    return bool(dist.is_available() and dist.is_initialized())


def world_size() -> int:
    """The ranks of this process's ``torch.distributed`` job; 1 without a process group."""
    import torch.distributed as dist  # noqa: PLC0415 - only when asked

    return dist.get_world_size() if initialized() else 1


def _launched_ranks(raw: str) -> int:
    """The ranks a launcher's ``WORLD_SIZE`` names; 1 where it names none (unset, malformed)."""
    return int(raw) if raw.isascii() and raw.isdigit() else 1


# Where launchers say how many processes the job has: torchrun, Slurm, Open MPI, MPICH/PMI.
_WORLD_SIZES = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_world() -> tuple[str, int] | None:
    """The first launcher variable that says this process is one of several; None if none does.

    Examples:
        >>> import os
        >>> launched_world() is None or launched_world()[1] > 1
        True
    """
    for variable in _WORLD_SIZES:
        ranks = _launched_ranks(os.environ.get(variable, "").strip())
        if ranks > 1:
            return variable, ranks
    return None


_warned_alone: set[str] = set()


def warn_if_launched_alone(what: str) -> None:
    """Log once per call when a launcher says there are several ranks but no process group exists.

    Under ``torchrun`` (``WORLD_SIZE=4``) without ``init_process_group``, a
    job-wide call describes each process alone: four one-rank tables, and a
    straggler detector that can never find a straggler. That is legal (the
    group may come later), so it is a warning, not an error.
    """
    raw = os.environ.get("WORLD_SIZE", "").strip()
    if what in _warned_alone or _launched_ranks(raw) < 2:
        return
    _warned_alone.add(what)
    logger.warning(
        "%s: WORLD_SIZE=%s says this process is one of %s ranks, but torch.distributed is not "
        "initialized, so it describes this process alone. Call "
        "torch.distributed.init_process_group() first.",
        what,
        raw,
        raw,
    )
