"""local_device() under torchrun, Slurm, Open MPI, MVAPICH and Ray, with GPU counts faked."""

from __future__ import annotations

import importlib.abc
import logging
import re
import sys
import types
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._launch import LAUNCHERS, resolve_local_device

from .conftest import GPU_COUNT, FakeAccelerator, run_python

VARIABLES = [variable for variable, _, _ in LAUNCHERS]


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher variable, no CUDA_VISIBLE_DEVICES, no ray module: a plain process."""
    sizes = ["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"]
    for variable in [*VARIABLES, *sizes, "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS"]:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delitem(sys.modules, "ray", raising=False)


@pytest.fixture
def made_current(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """What local_device() makes current (the fake GPUs cannot really be)."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    return calls


def fake_ray(
    monkeypatch: pytest.MonkeyPatch, gpu_ids: Sequence[int | str], *, initialized: bool = True
) -> None:
    """A ``ray`` module as a Ray worker sees it: initialized, with these GPUs assigned."""
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: initialized  # type: ignore[attr-defined]
    ray.get_gpu_ids = lambda: list(gpu_ids)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)


# --- without a launcher --------------------------------------------------------------------


@pytest.mark.usefixtures("no_launcher")
def test_without_a_launcher_it_is_try_gpu_and_nothing_is_made_current(
    fake_accelerator: FakeAccelerator, made_current: list[torch.device]
) -> None:
    fake_accelerator("cuda", 4)
    assert dk.local_device() == torch.device("cuda", 0)
    assert made_current == []


@pytest.mark.usefixtures("no_launcher")
def test_without_a_launcher_on_this_machine() -> None:
    assert dk.local_device() == dk.try_gpu()


# --- each launcher -------------------------------------------------------------------------


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize("variable", VARIABLES)
def test_each_launcher_gives_local_rank_r_gpu_r_made_current(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
    variable: str,
) -> None:
    fake_accelerator("cuda", 4)
    monkeypatch.setenv(variable, "2")
    assert dk.local_device() == torch.device("cuda", 2)
    assert made_current == [torch.device("cuda", 2)]


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        # torchrun under srun: the srun task's SLURM_LOCALID is inherited by every rank.
        ({"LOCAL_RANK": "3", "SLURM_LOCALID": "0"}, 3),
        # mpirun inside an sbatch script: the batch step's SLURM_LOCALID=0 is inherited.
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"}, 1),
        ({"MV2_COMM_WORLD_LOCAL_RANK": "2", "SLURM_LOCALID": "0"}, 2),
        ({"LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, 1),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "MV2_COMM_WORLD_LOCAL_RANK": "0"}, 3),
    ],
)
def test_the_innermost_launcher_wins(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
    environment: dict[str, str],
    expected: int,
) -> None:
    fake_accelerator("cuda", 4)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    assert dk.local_device() == torch.device("cuda", expected)


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize("variable", VARIABLES)
@pytest.mark.parametrize("rank", ["0", "3", " 7 "])
def test_every_rank_gets_the_cpu_without_an_accelerator(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
    variable: str,
    rank: str,
) -> None:
    fake_accelerator("cuda", 0)
    monkeypatch.setenv(variable, rank)
    assert dk.local_device() == torch.device("cpu")
    assert made_current == []


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize("variable", VARIABLES)
# "1_0", "+3" and "٣" (an Arabic-Indic 3) were read by int() as ranks 10, 3 and 3.
@pytest.mark.parametrize("raw", ["", "one", "-1", "1.5", "1_0", "+3", "\u0663", "0x1"])
def test_a_malformed_local_rank_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str
) -> None:
    monkeypatch.setenv(variable, raw)
    with pytest.raises(
        ValueError, match=re.escape(f"{variable} must be a non-negative integer, got {raw!r}")
    ):
        dk.local_device()


# --- exactly one GPU -----------------------------------------------------------------------


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize("variable", VARIABLES)
def test_a_process_that_sees_one_gpu_gets_it_whatever_its_local_rank(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
    caplog: pytest.LogCaptureFixture,
    variable: str,
) -> None:
    # srun --gpus-per-task=1: the step has GPUs 4 to 7, each task sees only its own.
    fake_accelerator("cuda", 1)
    monkeypatch.setenv(variable, "3")
    monkeypatch.setenv("SLURM_STEP_GPUS", "4,5,6,7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        assert dk.local_device() == torch.device("cuda", 0)
    assert made_current == [torch.device("cuda", 0)]
    assert caplog.records == []


@pytest.mark.usefixtures("no_launcher")
def test_one_gpu_that_nobody_bound_is_shared_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # torchrun --nproc_per_node=2 on a machine with one GPU: rank 1 lands on rank 0's GPU.
    fake_accelerator("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        assert dk.local_device() == torch.device("cuda", 0)
    (record,) = caplog.records
    assert "LOCAL_RANK=1 but this node's only cuda device is visible to every process" in (
        record.getMessage()
    )
    assert "Duplicate GPU detected" in record.getMessage()


@pytest.mark.usefixtures("no_launcher")
def test_ranks_sharing_a_mac_s_one_mps_device_get_no_cuda_warning(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # torchrun --nproc_per_node=2 on a Mac: MPS is one device by design, and the CUDA
    # advice (CUDA_VISIBLE_DEVICES, NCCL's 'Duplicate GPU detected') does not apply.
    fake_accelerator("mps", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        assert resolve_local_device() == (torch.device("mps", 0), True, None)
    assert caplog.records == []


# --- a rank with no GPU --------------------------------------------------------------------


@pytest.mark.usefixtures("no_launcher")
def test_a_rank_beyond_the_gpus_names_the_variable_and_the_gpus(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    fake_accelerator("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(
        dk.DeviceNotFoundError,
        match=r"LOCAL_RANK=2 \(set by torchrun\) has no device to match: 2 GPUs are visible "
        r"\(CUDA_VISIBLE_DEVICES='4,5'\): cuda:0, cuda:1\. Start at most 2 processes per node "
        r"\(torchrun --nproc_per_node=2\)",
    ):
        dk.local_device()


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize(
    ("variable", "size_variable", "fix"),
    [
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun --nproc_per_node=2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun --map-by ppr:2"),
        ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", "mpirun -ppn 2"),
    ],
)
def test_every_rank_is_refused_when_the_node_has_more_ranks_than_gpus(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    variable: str,
    size_variable: str,
    fix: str,
) -> None:
    # Rank 0 has a GPU, but ranks 2 and 3 do not: rank 0 must not start and wait for them.
    fake_accelerator("cuda", 2)
    monkeypatch.setenv(variable, "0")
    monkeypatch.setenv(size_variable, "4")
    with pytest.raises(
        dk.DeviceNotFoundError,
        match=rf"{size_variable}=4 \(set by .*\): 4 processes on this node, one GPU each, but "
        rf"2 GPUs are visible: cuda:0, cuda:1\. Start at most 2 processes per node \({fix}",
    ):
        dk.local_device()
    monkeypatch.setenv(size_variable, "2")  # as many as the GPUs: rank 0 gets cuda:0
    assert resolve_local_device()[0] == torch.device("cuda", 0)


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize(
    "names",
    [
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
        ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", "MVAPICH"),
    ],
    ids=lambda names: names[1],
)
@pytest.mark.parametrize("raw", ["x", "two", "-3", "0", "", "1.5", "\u0663"])
@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_a_malformed_local_size_is_refused_like_a_malformed_rank(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    names: tuple[str, str, str],
    raw: str,
    gpus: int,
) -> None:
    variable, size_variable, launcher = names
    # Before: ignored, so the check that every rank of the node has a GPU was skipped.
    fake_accelerator("cuda", gpus)
    monkeypatch.setenv(variable, "0")
    monkeypatch.setenv(size_variable, raw)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{size_variable} must be a positive integer (how many processes {launcher} started "
            f"on this node), got {raw!r}; {launcher} sets it for each process, so unset it when "
            f"you are not launching with {launcher}"
        ),
    ):
        dk.local_device()


@pytest.mark.usefixtures("no_launcher")
def test_a_local_size_at_or_below_the_rank_is_refused(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    fake_accelerator("cuda", 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "LOCAL_WORLD_SIZE=2 but LOCAL_RANK=3: a node's ranks are 0 to LOCAL_WORLD_SIZE - 1"
        ),
    ):
        dk.local_device()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", " 4 ")  # whitespace aside, as the rank is read
    assert resolve_local_device()[0] == torch.device("cuda", 3)


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize(
    ("variable", "fix"),
    [
        ("OMPI_COMM_WORLD_LOCAL_RANK", "mpirun --map-by ppr:3:node"),
        ("MV2_COMM_WORLD_LOCAL_RANK", "mpirun -ppn 3"),
        ("SLURM_LOCALID", "srun --ntasks-per-node=3"),
    ],
)
def test_each_launcher_says_how_to_start_fewer_processes(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator, variable: str, fix: str
) -> None:
    fake_accelerator("cuda", 3)
    monkeypatch.setenv(variable, "5")
    with pytest.raises(dk.DeviceNotFoundError, match=f"{variable}=5 .*{fix}"):
        dk.local_device()


@pytest.mark.usefixtures("no_launcher")
def test_slurm_s_error_shows_the_step_s_gpus(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    fake_accelerator("cuda", 2)
    monkeypatch.setenv("SLURM_LOCALID", "2")
    monkeypatch.setenv("SLURM_STEP_GPUS", "4,5")
    with pytest.raises(dk.DeviceNotFoundError, match=r"this step GPUs SLURM_STEP_GPUS='4,5'"):
        dk.local_device()


# --- Ray -----------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_launcher")
def test_a_ray_worker_s_only_gpu_is_cuda_0(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
) -> None:
    # @ray.remote(num_gpus=1): Ray set CUDA_VISIBLE_DEVICES to the GPU it assigned.
    fake_ray(monkeypatch, [3])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    fake_accelerator("cuda", 1)
    assert dk.local_device() == torch.device("cuda", 0)
    assert made_current == [torch.device("cuda", 0)]


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize("gpu_id", [3, "3"])  # ints or strings, by Ray version
def test_under_ray_train_the_worker_s_gpu_is_found_among_its_node_s(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
    gpu_id: int | str,
) -> None:
    # Ray Train lists every worker's GPU on the node in each worker, and sets LOCAL_RANK
    # by its own order: Ray's assignment decides.
    fake_ray(monkeypatch, [gpu_id])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    fake_accelerator("cuda", 2)
    assert dk.local_device() == torch.device("cuda", 1)
    assert made_current == [torch.device("cuda", 1)]


@pytest.mark.usefixtures("no_launcher")
def test_when_ray_leaves_cuda_visible_devices_alone_its_id_is_the_index(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
) -> None:
    fake_ray(monkeypatch, ["1"])  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
    fake_accelerator("cuda", 4)
    assert dk.local_device() == torch.device("cuda", 1)


@pytest.mark.usefixtures("no_launcher")
def test_a_ray_gpu_this_process_cannot_see_is_an_error(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    fake_ray(monkeypatch, [5])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    fake_accelerator("cuda", 2)
    with pytest.raises(
        dk.DeviceNotFoundError,
        match=r"Ray assigned this worker GPU 5 \(ray.get_gpu_ids\(\) = \['5'\]\), but "
        r"CUDA_VISIBLE_DEVICES is '0,1'",
    ):
        dk.local_device()


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize(
    ("gpu_ids", "initialized"),
    [([], True), ([2], False)],  # the driver or a worker given no GPU; ray imported, not started
)
def test_ray_without_an_assigned_gpu_leaves_it_to_the_other_launchers(
    monkeypatch: pytest.MonkeyPatch,
    fake_accelerator: FakeAccelerator,
    made_current: list[torch.device],
    gpu_ids: list[int],
    initialized: bool,
) -> None:
    fake_ray(monkeypatch, gpu_ids, initialized=initialized)
    monkeypatch.setenv("LOCAL_RANK", "3")
    fake_accelerator("cuda", 4)
    assert dk.local_device() == torch.device("cuda", 3)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.asked: list[str] = []

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        self.asked.append(name)


@pytest.mark.usefixtures("no_launcher", "made_current")
def test_ray_is_never_imported(
    monkeypatch: pytest.MonkeyPatch, fake_accelerator: FakeAccelerator
) -> None:
    watcher = _ImportWatcher()
    monkeypatch.setattr(sys, "meta_path", [watcher, *sys.meta_path])
    fake_accelerator("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    dk.local_device()
    dk.job_status()
    assert "ray" not in watcher.asked
    assert "ray" not in sys.modules


# --- on a real GPU -------------------------------------------------------------------------


@pytest.mark.gpu
def test_local_device_makes_the_rank_current_on_a_real_gpu() -> None:
    last = GPU_COUNT - 1
    result = run_python(
        """
        import json, torch, devicekit as dk
        device = dk.local_device()
        print(json.dumps({"device": str(device), "current": torch.cuda.current_device()}))
        """,
        env={"LOCAL_RANK": str(last)},
    )
    assert result == {"device": f"cuda:{last}", "current": last}


@pytest.mark.gpu
def test_slurm_binding_one_gpu_per_task_on_a_real_gpu() -> None:
    last = GPU_COUNT - 1
    result = run_python(
        """
        import json, torch, devicekit as dk
        device = dk.local_device()
        print(json.dumps({"device": str(device), "uuid": dk.gpu(device).uuid}))
        """,
        env={"SLURM_LOCALID": "5", "CUDA_VISIBLE_DEVICES": str(last)},
    )
    expected = run_python(
        "import json, devicekit as dk; print(json.dumps(dk.gpus()[-1].uuid))",
    )
    assert result == {"device": "cuda:0", "uuid": expected}
