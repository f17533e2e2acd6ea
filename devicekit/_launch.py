"""Which device is this process's, under whichever launcher started it.

Every launcher tells a process its place on the node in its own variable:
torchrun sets ``LOCAL_RANK``, Open MPI ``OMPI_COMM_WORLD_LOCAL_RANK``, MVAPICH
``MV2_COMM_WORLD_LOCAL_RANK``, Slurm's ``srun`` ``SLURM_LOCALID``; Ray instead
assigns GPUs to a worker and lists them in ``ray.get_gpu_ids()``. Launchers
nest (torchrun under ``srun``, ``mpirun`` inside an ``sbatch`` script, Ray
workers on a Slurm node), and the outer launcher's variables are inherited by
every process the inner one starts: ``mpirun`` in a batch script hands each of
its ranks the batch step's ``SLURM_LOCALID=0``. So the innermost launcher
wins, and the precedence is:

1. Ray: inside a Ray worker that Ray gave GPUs (only when ``ray`` is already
   imported; devicekit never imports it).
2. ``LOCAL_RANK`` (torchrun, and every ``torch.distributed.elastic`` launcher;
   Ray Train sets it too).
3. ``OMPI_COMM_WORLD_LOCAL_RANK``, then ``MV2_COMM_WORLD_LOCAL_RANK``.
4. ``SLURM_LOCALID``.

Nothing here initializes CUDA except ``set_device`` in [`local_device()`][devicekit.local_device].
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from ._accelerators import accelerator_count, accelerator_type, try_gpu
from ._devices import describe_devices
from ._errors import DeviceNotFoundError
from ._visible import ENV_VAR, parse_visible_devices

__all__ = ["LAUNCHERS", "local_device", "local_rank", "resolve_local_device"]

logger = logging.getLogger("devicekit")

_CPU = torch.device("cpu")
_SLURM_STEP_GPUS = "SLURM_STEP_GPUS"  # the GPUs of the whole step, as the node numbers them

LAUNCHERS: tuple[tuple[str, str, str], ...] = (
    # (variable, launcher, how to start at most {count} processes per node with it)
    ("LOCAL_RANK", "torchrun", "torchrun --nproc_per_node={count}"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI", "mpirun --map-by ppr:{count}:node"),
    ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH", "mpirun -ppn {count}"),
    (
        "SLURM_LOCALID",
        "Slurm",
        "srun --ntasks-per-node={count}, or srun --gpus-per-task=1 so that Slurm binds one "
        "GPU to each task",
    ),
)
"""The local-rank variables devicekit reads, in precedence order (after Ray)."""

# How many processes the launcher started on this node, where it says (Slurm's
# SLURM_TASKS_PER_NODE is per node of the job, as "2(x3),1": not read).
_LOCAL_SIZES = {
    "LOCAL_RANK": "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_RANK": "MV2_COMM_WORLD_LOCAL_SIZE",
}


def local_rank() -> tuple[str, int] | None:
    """The variable that gives this process's rank on its node, and its value; None without one.

    Raises:
        ValueError: The variable is set but is not a non-negative integer.

    Examples:
        >>> from devicekit._launch import local_rank
        >>> found = local_rank()
        >>> found is None or found[1] >= 0
        True
    """
    for variable, launcher, _ in LAUNCHERS:
        raw = os.environ.get(variable)
        if raw is None:
            continue
        digits = raw.strip()
        # ASCII digits only: int() also reads "1_0" as 10, "+3" and other scripts' digits,
        # none of which a launcher writes; such a value is a mistake, not a rank.
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(
                f"{variable} must be a non-negative integer, got {raw!r}; {launcher} sets it for "
                f"each process, so unset it when you are not launching with {launcher}"
            )
        return variable, int(digits)
    return None


def _local_size(variable: str, rank: int) -> tuple[str, int] | None:
    """How many processes the launcher that set ``variable`` started on this node, if it says.

    Read as strictly as the rank: a launcher writes a count above the rank in
    ASCII digits, so anything else (``x``, ``-3``, ``0``) is a mistake, and
    ignoring it skipped the check that every rank of the node has a GPU.

    Raises:
        ValueError: The size variable is set but is not an integer above ``rank``.
    """
    size_variable = _LOCAL_SIZES.get(variable)
    raw = None if size_variable is None else os.environ.get(size_variable)
    if size_variable is None or raw is None:
        return None
    digits = raw.strip()
    launcher = next(name for var, name, _ in LAUNCHERS if var == variable)
    if not (digits.isascii() and digits.isdigit()) or int(digits) == 0:
        raise ValueError(
            f"{size_variable} must be a positive integer (how many processes {launcher} started "
            f"on this node), got {raw!r}; {launcher} sets it for each process, so unset it when "
            f"you are not launching with {launcher}"
        )
    size = int(digits)
    if size <= rank:
        raise ValueError(
            f"{size_variable}={size} but {variable}={rank}: a node's ranks are 0 to "
            f"{size_variable} - 1, so one of the two is not {launcher}'s; unset both when you are "
            f"not launching with {launcher}"
        )
    return size_variable, size


def _ray_gpu_ids() -> list[str] | None:
    """The GPUs Ray assigned to this worker (as Ray writes them), or None outside one.

    Read only when ``ray`` is already imported: a process that has not imported
    ray is not a Ray worker, and importing it costs seconds.
    """
    ray = sys.modules.get("ray")
    is_initialized = getattr(ray, "is_initialized", None)
    get_gpu_ids = getattr(ray, "get_gpu_ids", None)
    if not callable(is_initialized) or not callable(get_gpu_ids) or not is_initialized():
        return None
    ids = [str(gpu_id).strip() for gpu_id in get_gpu_ids()]  # ints or strings, by Ray version
    return ids or None  # the driver, and workers given no GPU, get an empty list


def _ray_index(ids: list[str], count: int) -> int:
    """This process's index of the first GPU Ray assigned it.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPUs it assigned a worker, so a
    worker given one GPU sees it as ``cuda:0``. Ray Train lists the GPUs of all
    its workers on the node in each of them (so they can reach each other's
    GPUs), so the worker's GPU is where its ID sits in that list. With
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` Ray leaves the variable
    alone, and its IDs are the indices this process sees.
    """
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        entries: list[str] = [str(index) for index in range(count)]
    else:
        entries = [str(entry) for entry in parse_visible_devices(raw) or []]
    if ids[0] in entries and entries.index(ids[0]) < count:
        return entries.index(ids[0])
    where = "is not set" if raw is None else f"is {raw!r}"
    raise DeviceNotFoundError(
        f"Ray assigned this worker GPU {ids[0]} (ray.get_gpu_ids() = {ids}), but "
        f"{ENV_VAR} {where} and {describe_devices()}, so none of them is that GPU. Let Ray set "
        f"{ENV_VAR} (unset RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), and do not change it "
        "inside the worker."
    )


def resolve_local_device() -> tuple[torch.device, bool, str | None]:
    """This process's device by the launcher precedence, without making it current.

    Returns:
        The device; whether a launcher chose it (else it is [`try_gpu()`][devicekit.try_gpu]'s);
        and a warning worth logging, or None.

    Examples:
        >>> from devicekit._launch import resolve_local_device
        >>> device, launched, warning = resolve_local_device()
        >>> device.type in ("cpu", "cuda", "xpu", "mps")
        True
    """
    ray_ids = _ray_gpu_ids()
    found = None if ray_ids else local_rank()
    if ray_ids is None and found is None:
        return try_gpu(), False, None
    started = None if found is None else _local_size(*found)  # refused on every machine alike
    kind = accelerator_type()
    count = accelerator_count()
    if kind is None or count == 0:
        return _CPU, True, None  # every rank on the CPU: gloo's case
    if count == 1:
        # The launcher (Slurm's GPU binding, Ray, a wrapper script) gave this
        # process exactly one GPU: that is its GPU, whatever its local rank.
        warning = None
        # Only CUDA: CUDA_VISIBLE_DEVICES and NCCL are its words. A Mac has one MPS device
        # by design, so ranks sharing it under gloo is how multi-process runs there go.
        if kind == "cuda" and found is not None and found[1] > 0 and ENV_VAR not in os.environ:
            variable, rank = found
            warning = (
                f"{variable}={rank} but this node's only {kind} device is visible to every "
                f"process ({ENV_VAR} is not set), so this rank shares {kind}:0 with rank 0 of "
                "the node; NCCL refuses that with 'Duplicate GPU detected'. Start one process "
                "per GPU, or bind one GPU to each process."
            )
        return torch.device(kind, 0), True, warning
    if ray_ids is not None:
        return torch.device(kind, _ray_index(ray_ids, count)), True, None
    assert found is not None
    variable, rank = found
    if rank >= count or (started is not None and started[1] > count):
        launcher, start = next((name, how) for var, name, how in LAUNCHERS if var == variable)
        if rank < count and started is not None:
            # Every rank of the node says so at once, not only those past the GPUs: the
            # others would otherwise start and wait for their peers until a timeout.
            size_variable, size = started
            raise DeviceNotFoundError(
                f"{size_variable}={size} (set by {launcher}): {size} processes on this node, "
                f"one GPU each, but {describe_devices()}. Start at most {count} processes per "
                f"node ({start.format(count=count)}); devicekit never puts two ranks on one GPU."
            )
        step_gpus = os.environ.get(_SLURM_STEP_GPUS)
        if variable == "SLURM_LOCALID" and step_gpus is not None:
            launcher += f", which gave this step GPUs {_SLURM_STEP_GPUS}={step_gpus!r}"
        raise DeviceNotFoundError(
            f"{variable}={rank} (set by {launcher}) has no device to match: {describe_devices()}. "
            f"Start at most {count} processes per node ({start.format(count=count)}); devicekit "
            "never wraps a rank around onto another rank's GPU."
        )
    return torch.device(kind, rank), True, None


def local_device() -> torch.device:
    """Return this process's device under any launcher, made current; else `try_gpu()`.

    The launcher decides, in this order (the innermost launcher first, since
    outer launchers' variables are inherited by the processes inner ones start):

    1. **Ray**: inside a Ray worker that Ray gave GPUs (when ``ray`` is already
       imported; devicekit never imports it), the first GPU of
       ``ray.get_gpu_ids()``, found by its place in ``CUDA_VISIBLE_DEVICES``
       (Ray sets that variable, so a worker's only GPU is ``cuda:0``).
    2. ``LOCAL_RANK`` (torchrun and every ``torch.distributed.elastic`` launcher).
    3. ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI), then
       ``MV2_COMM_WORLD_LOCAL_RANK`` (MVAPICH).
    4. ``SLURM_LOCALID`` (``srun``).

    Local rank ``r`` gets accelerator ``r``. When the process sees exactly one
    GPU, that GPU is its device whatever its local rank: the launcher bound it
    (``srun --gpus-per-task=1`` sets ``CUDA_VISIBLE_DEVICES`` per task, so
    ``SLURM_STEP_GPUS`` lists the node's GPUs while each task sees one). The
    device becomes current (``torch.cuda.set_device``) so that NCCL and
    ``torch.cuda.current_device()`` agree with it. Without an accelerator every
    rank gets the CPU (use the ``gloo`` backend). Without any launcher, it is
    [`try_gpu()`][devicekit.try_gpu] and nothing is made current.

    Returns:
        The device for this process.

    Raises:
        ValueError: A launcher variable is set but is not a non-negative integer,
            or its local size (``LOCAL_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_SIZE``,
            ``MV2_COMM_WORLD_LOCAL_SIZE``) is not an integer above the rank.
        DeviceNotFoundError: The local rank has no GPU to match (the message
            names the variable and the GPUs visible), the launcher started more
            processes on the node than there are GPUs (``LOCAL_WORLD_SIZE``, or
            Open MPI's and MVAPICH's local size: every rank is refused, not only
            those past the GPUs), or Ray's GPU is not among the visible ones.
            devicekit never wraps a rank around: two ranks
            on one GPU halve its speed, and NCCL refuses them.

    Examples:
        >>> import os, devicekit as dk
        >>> from devicekit._launch import LAUNCHERS
        >>> if not any(variable in os.environ for variable, _, _ in LAUNCHERS):
        ...     assert dk.local_device() == dk.try_gpu()  # no launcher here
    """
    device, launched, warning = resolve_local_device()
    if warning is not None:
        logger.warning(warning)
    if launched and device.type != "cpu":
        module = torch.get_device_module(device.type)
        if hasattr(module, "set_device"):  # MPS has a single device and no set_device
            module.set_device(device)
    return device
