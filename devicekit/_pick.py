"""Picking GPUs: the least busy that meet the limits, claimed so that jobs do not share one.

`pick_gpu` and `pick_gpus` rank the GPUs this process can see (`_gpus`
describes them, keyed by their ``cuda:N`` index) by free memory and
utilization, skip those another job has claimed (`_claims`), and can wait,
bounded, for one to free up.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Iterable

import torch

from . import _claims, _nvml
from ._devices import DeviceLike, parse_cuda_indices
from ._errors import GPUUnavailableError
from ._findings import NVML_FIX, nvml_describes
from ._format import format_bytes, format_seconds, plural
from ._gpuinfo import GPUInfo
from ._gpus import cuda_devices_torch_sees, gpus, unread_by_nvml, why_none_visible
from ._keywords import suggest_keywords
from ._options import check_count, check_flag, check_number, check_seconds
from ._shortrepr import got, short_repr

__all__ = ["pick_gpu", "pick_gpus"]


def _rejection(
    info: GPUInfo, min_free_memory: int | None, max_utilization: float | None
) -> str | None:
    if info.error is not None:  # lost: whatever the limits, no work will run there
        return f"it cannot be read ({info.error})"
    if min_free_memory is not None:
        if info.memory_free is None:
            return "free memory is unknown"
        if info.memory_free < min_free_memory:
            return (
                f"{format_bytes(info.memory_free)} free < {format_bytes(min_free_memory)} required"
            )
    if max_utilization is not None:
        if info.utilization is None:
            return "utilization is unknown"
        if info.utilization > max_utilization:
            return f"{info.utilization}% utilized > {max_utilization:g}% allowed"
    return None


_UNRANKED = "found no GPU it could rank: "


def _unranked() -> str | None:
    """Why the GPUs torch sees were passed over, where NVML cannot read them; else None.

    Without NVML (or where it describes none of them) no GPU can be ranked or
    checked against the limits. Before, that read as "no GPU": the CPU, with
    nothing said, on a machine of GPUs.
    """
    unread = unread_by_nvml()
    if unread is not None:
        return f"{_UNRANKED}{unread}: {NVML_FIX}, or pick one yourself (dk.try_gpu() is cuda:0)"
    torch_sees = cuda_devices_torch_sees()
    if not torch_sees:
        return None
    # NVML works, but could not open or match any of them (a GPU lost at cuda:0).
    return (
        f"{_UNRANKED}{nvml_describes(torch_sees, [])} (dk.status() says why): fix what it "
        "names, or pick one yourself (cuda:0 may be the GPU NVML cannot open)"
    )


_POLL_SECONDS = 0.2  # between looks while waiting: an NVML snapshot takes well under 1 ms per GPU


def _ranked(
    min_free_memory: int | None, max_utilization: float | None, excluded: set[int]
) -> tuple[list[tuple[torch.device, str | None]], list[tuple[int, str]]]:
    """The qualifying GPUs with their UUIDs, best first, and why each other one was turned down."""
    eligible: list[tuple[int, GPUInfo]] = []
    rejected: list[tuple[int, str]] = []
    for index, info in enumerate(gpus()):  # visible GPUs: result[i] is cuda:i
        reason = (
            "excluded" if index in excluded else _rejection(info, min_free_memory, max_utilization)
        )
        if reason is None:
            eligible.append((index, info))
        else:
            rejected.append((index, reason))
    # What is unknown ranks after what is known: unknown utilization is not idle.
    eligible.sort(
        key=lambda item: (
            item[1].memory_free is None,
            -(item[1].memory_free or 0),
            item[1].utilization is None,
            item[1].utilization or 0,
            item[0],
        )
    )
    return [(torch.device("cuda", index), info.uuid) for index, info in eligible], rejected


def _take(
    ranked: list[tuple[torch.device, str | None]], count: int, claim: bool
) -> tuple[list[torch.device], list[tuple[int, str]]]:
    """The best ``count`` of ``ranked``, claimed if asked; ``[]`` and the refusals if too few."""
    if not claim:
        return [device for device, _ in ranked[:count]] if len(ranked) >= count else [], []
    taken: list[tuple[torch.device, str]] = []
    refused: list[tuple[int, str]] = []
    try:
        for device, uuid in ranked:
            if len(taken) == count:
                break
            if uuid is None:
                refused.append((device.index, "its UUID is unknown, so it cannot be claimed"))
            elif _claims.claim(uuid, device.index):
                taken.append((device, uuid))
            elif _claims.is_held(uuid):
                refused.append((device.index, "claimed by this process"))
            else:
                pid = _claims.holder(uuid)
                refused.append((device.index, f"claimed by another process (pid {pid or '?'})"))
    except BaseException:
        # A claim that raised (a full disk, Ctrl-C) leaves none of the others held.
        _release(taken)
        raise
    if len(taken) < count:
        # All or nothing: two jobs that each held some GPUs while waiting for the
        # rest could wait for each other forever.
        _release(taken)
        return [], refused
    return [device for device, _ in taken], refused


def _release(taken: list[tuple[torch.device, str]]) -> None:
    for _, uuid in taken:
        _claims.release(uuid)


def _check_wait(wait: object) -> float:
    if wait is None:
        return 0.0
    return check_seconds(
        wait,
        name="wait",
        zero_ok=True,
        fix="None looks once; to wait as long as it takes, give a generous bound (24 * 3600)",
    )


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt])(i?)b?\s*", re.IGNORECASE)


def _check_free_memory(value: object) -> None:
    """Refuse a ``min_free_memory`` that is not bytes, or is bytes by mistake, saying what to write.

    ``"10GB"`` was refused without a word on what to write instead, and ``10``
    (meant as GB) picked any GPU: 10 bytes are free on every one. A value
    below 1 MiB is refused, as a fraction is for ``max_utilization``.
    """
    if isinstance(value, str):
        size = _SIZE.fullmatch(value)
        example = "such as 10 * 2**30 for 10 GiB"
        if size is not None:
            number, unit, binary = size.group(1), size.group(2).upper(), bool(size.group(3))
            step = "KMGT".index(unit) + 1
            as_int = f"{number} * 2**{10 * step}" if binary else f"{number} * 10**{3 * step}"
            example = f"{as_int} for {number} {unit}{'i' if binary else ''}B"
        raise TypeError(
            f"min_free_memory is a number of bytes, got {got(value)}; write it as a number, "
            f"{example}"
        )
    free = check_number(value, name="min_free_memory", at_least=0, meaning="bytes")
    if 0 < free < 2**20:
        raise ValueError(
            f"min_free_memory is in bytes, got {short_repr(value)}: {free:g} bytes are free on "
            f"any GPU, so every GPU qualifies. For {free:g} GiB, write {free:g} * 2**30 "
            f"({free:g} * 10**9 for GB)"
        )


def _pick(
    count: int,
    *,
    min_free_memory: int | None,
    max_utilization: float | None,
    exclude: Iterable[DeviceLike] | DeviceLike,
    wait: float | None,
    claim: bool,
) -> tuple[list[torch.device], str | None]:
    """Look, claiming if asked, until ``count`` GPUs qualify or ``wait`` runs out.

    Returns the GPUs, or ``[]`` and why not: ``None`` when no GPU is visible
    at all, else a message for [`GPUUnavailableError`][devicekit.GPUUnavailableError].
    """
    excluded = set(parse_cuda_indices(exclude, name="exclude"))
    if min_free_memory is not None:
        _check_free_memory(min_free_memory)
    if max_utilization is not None:
        check_number(
            max_utilization, name="max_utilization", at_least=0, at_most=100, meaning="percent"
        )
        if 0 < max_utilization < 1:  # a fraction (0.5 for half) read as a percentage
            raise ValueError(
                f"max_utilization is a percentage from 0 to 100, got "
                f"{short_repr(max_utilization)}: "
                f"{max_utilization:g} % is below NVML's whole-percent resolution, so it means "
                f"idle GPUs only. For {max_utilization * 100:g} %, write {max_utilization * 100:g} "
                "(0 stays allowed: idle GPUs only)"
            )
    seconds = _check_wait(wait)
    check_flag(claim, name="claim")
    if claim:
        _claims.check_claims_supported()
        # Here, not only where a GPU is claimed: a bad setting must fail on a laptop or in
        # CI as it will on the GPU node, not pass wherever there is no GPU to claim.
        _claims.check_chosen_directory()
    deadline = time.monotonic() + seconds
    while True:
        ranked, rejected = _ranked(min_free_memory, max_utilization, excluded)
        chosen, refused = _take(ranked, count, claim)
        if len(chosen) == count:
            return chosen, ""
        seen = len(ranked) + len(rejected)
        remaining = deadline - time.monotonic()
        if seen < count or remaining <= 0:  # waiting cannot add GPUs this process does not see
            break
        # Jittered, so that jobs started together do not keep retrying in step.
        time.sleep(min(remaining, _POLL_SECONDS * random.uniform(0.75, 1.25)))
    if seen == 0:
        return [], _unranked()
    waited = f" after waiting {format_seconds(seconds)}" if seconds else ""
    found = len(ranked) - len(refused)
    parts = [
        f"found {plural(found, 'GPU')} that {'qualifies' if found == 1 else 'qualify'}{waited}"
    ]
    if seen < count:
        torch_sees = cuda_devices_torch_sees()
        if torch_sees > seen:  # a GPU NVML lost or cannot match: not one this process lacks
            parts.append(
                f"NVML describes only {plural(seen, 'GPU')} of the {torch_sees} torch sees "
                "(dk.status() says why)"
            )
        else:
            parts.append(f"this process sees only {plural(seen, 'GPU')}")
    if rejected or refused:
        reasons = sorted(rejected + refused)
        parts.append("rejected: " + "; ".join(f"cuda:{i}: {why}" for i, why in reasons))
    return [], "; ".join(parts)


@suggest_keywords
def pick_gpu(
    *,
    min_free_memory: int | None = None,
    max_utilization: float | None = None,
    exclude: Iterable[DeviceLike] | DeviceLike = (),
    wait: float | None = None,
    claim: bool = False,
) -> torch.device:
    """The visible GPU with the most free memory that meets the limits, else the CPU.

    Ties go to the lower utilization, then the lower index. A GPU NVML
    cannot read at all (lost: fallen off the bus) never qualifies. Reads NVML only,
    so it never initializes CUDA: pick first, then start working.

    Jobs started at the same moment see the same free GPU. With
    ``claim=True`` each takes an exclusive claim on the GPU it picks, and
    skips GPUs that other devicekit processes have claimed, so they get
    different GPUs. A claim lasts until [`release_gpu()`][devicekit.release_gpu] or until the
    process exits, however it exits (the operating system drops it), or
    calls exec (claim in the program that uses the GPU); see
    [`claim_gpu()`][devicekit.claim_gpu] for a ``with`` block. Claims are advisory: only calls
    with ``claim=True`` honour them.

    Args:
        min_free_memory: Bytes that must be free (a GPU whose free memory is
            unknown does not qualify).
        max_utilization: Highest acceptable utilization, a percentage from 0
            to 100 (``50`` for half; NVML reports whole percents). ``0`` means
            idle GPUs only; a fraction between 0 and 1 (``0.5``) is refused,
            since it is most likely meant as a share, not a percent.
        exclude: GPUs not to pick: a CUDA device (``1``, ``"cuda:1"``) or a
            list of them. One this process cannot see is ignored, so the same
            call runs on any machine.
        wait: Seconds to keep looking, five times a second, until a GPU
            qualifies (and, with ``claim``, is not claimed); then the CPU.
            ``None`` looks once. Returns at once when this process sees no
            GPU at all, since waiting cannot change that.
        claim: Claim the chosen GPU for this process (see above).

    Returns:
        ``torch.device("cuda", i)``, or ``torch.device("cpu")`` when no GPU
        qualifies or there is none.

    Raises:
        TypeError: ``wait`` is not a number or ``claim`` not a bool.
        ValueError: ``wait`` is negative, infinite or NaN, or
            ``max_utilization`` is outside 0 to 100 or a fraction between 0
            and 1 (a percentage is meant: ``50`` for half), or ``claim=True``
            and ``$DEVICEKIT_CLAIMS_DIR`` is a relative path.
        NotImplementedError: ``claim=True`` on a system without file locks (Windows).
        PermissionError: ``claim=True``, and the directory of claims belongs
            to another user, is not a directory, or (one you chose) others can
            write to it (the message names it). The setting is checked on every
            ``claim=True`` call, with or without a GPU to claim.
        OSError: ``claim=True``, and the directory of claims cannot be made or
            written (a full or read-only disk); the message names it and the fix.

    Examples:
        >>> import devicekit as dk
        >>> dk.pick_gpu(min_free_memory=2**60)  # nobody has an exbibyte free
        device(type='cpu')
        >>> device = dk.pick_gpu(claim=True)  # other jobs asking with claim=True skip it
        >>> dk.release_gpu(device) == (device.type == "cuda")
        True
    """
    chosen, why_not = _pick(
        1,
        min_free_memory=min_free_memory,
        max_utilization=max_utilization,
        exclude=exclude,
        wait=wait,
        claim=claim,
    )
    if chosen:
        return chosen[0]
    if why_not is not None:
        # GPUs passed over unseen are a problem to fix; GPUs that do not qualify are not.
        level = logging.WARNING if why_not.startswith(_UNRANKED) else logging.INFO
        _nvml.logger.log(level, "pick_gpu: %s; using the CPU", why_not)
    return torch.device("cpu")


@suggest_keywords
def pick_gpus(
    n: int,
    *,
    min_free_memory: int | None = None,
    max_utilization: float | None = None,
    exclude: Iterable[DeviceLike] | DeviceLike = (),
    wait: float | None = None,
    claim: bool = False,
) -> list[torch.device]:
    """The best ``n`` visible GPUs by the rules of [`pick_gpu()`][devicekit.pick_gpu].

    With ``claim=True`` it claims all ``n`` or none: it never holds some
    GPUs while it waits for the others, so two jobs cannot wait for each other.

    Args:
        n: How many GPUs are needed.
        min_free_memory: As for [`pick_gpu()`][devicekit.pick_gpu].
        max_utilization: As for [`pick_gpu()`][devicekit.pick_gpu].
        exclude: As for [`pick_gpu()`][devicekit.pick_gpu].
        wait: As for [`pick_gpu()`][devicekit.pick_gpu]; then it raises. Raises at once when
            this process sees fewer than ``n`` GPUs.
        claim: As for [`pick_gpu()`][devicekit.pick_gpu]; release each GPU
            with [`release_gpu()`][devicekit.release_gpu].

    Returns:
        ``n`` CUDA devices, best first.

    Raises:
        GPUUnavailableError: Fewer than ``n`` GPUs qualify (after ``wait``);
            the message gives the reason each GPU was rejected.
        TypeError: ``wait`` is not a number or ``claim`` not a bool.
        ValueError: ``wait`` is negative, infinite or NaN, or
            ``max_utilization`` is outside 0 to 100 or a fraction between 0
            and 1 (a percentage is meant: ``50`` for half), or as for
            [`pick_gpu()`][devicekit.pick_gpu].
        NotImplementedError: ``claim=True`` on a system without file locks (Windows).
        PermissionError: As for [`pick_gpu()`][devicekit.pick_gpu].
        OSError: As for [`pick_gpu()`][devicekit.pick_gpu]; no GPU stays
            claimed, not even those claimed before the error.

    Examples:
        >>> import devicekit as dk
        >>> dk.pick_gpus(0)
        []
    """
    count = check_count(n, name="n")
    chosen, why_not = _pick(
        count,
        min_free_memory=min_free_memory,
        max_utilization=max_utilization,
        exclude=exclude,
        wait=wait,
        claim=claim,
    )
    if len(chosen) == count:
        return chosen
    if why_not is None:
        raise GPUUnavailableError(f"pick_gpus({count}) found no GPU: {why_none_visible()}")
    raise GPUUnavailableError(f"pick_gpus({count}) {why_not}")
