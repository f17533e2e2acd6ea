"""devicekit never starts CUDA by accident: proven in fresh interpreters.

Each check runs in a new process, because whether CUDA has started is a
property of the whole process. ``cuda_started()`` looks at both torch's flag and
the CUDA driver itself, so on a GPU machine these tests also prove that no
driver call was made.
"""

from __future__ import annotations

import textwrap

import pytest

from .conftest import run_python

_REPORT = """
import json, torch
from devicekit._visible import cuda_started
print(json.dumps({"torch": torch.cuda.is_initialized(), "started": cuda_started()}))
"""


def test_import_does_not_start_cuda() -> None:
    result = run_python("import devicekit\n" + _REPORT)
    assert result == {"torch": False, "started": None}


def test_no_query_starts_cuda() -> None:
    code = """
    import contextlib, io, os, subprocess, sys
    import torch
    import devicekit as dk
    from devicekit._cli import main

    dk.try_gpu(); dk.try_gpu(7); dk.try_all_gpus(); dk.local_device()
    dk.parse_visible_devices(); dk.parse_visible_devices("1,0")
    with dk.visible_devices("0") as parsed:
        dk.try_gpu(); dk.try_all_gpus()
    with dk.visible_devices(None):
        dk.try_gpu()
    infos = dk.gpus(); dk.gpus(all=True); dk.pick_gpu()
    if infos:
        dk.gpu(0); dk.gpu("cuda:0"); dk.pick_gpus(1)
    dk.release_gpu(dk.pick_gpu(wait=0.3, claim=True))
    with dk.claim_gpu(min_free_memory=2**60, wait=0.3):
        pass
    dk.nvml_available(); dk.nvml_error(); dk.driver_version(); dk.cuda_driver_version()
    dk.doctor(); dk.free_memory()
    from devicekit._energy import energy_counter
    energy_counter(torch.device("cuda", 0))
    for error in (lambda: torch.empty(2**62, dtype=torch.uint8),
                  lambda: (_ for _ in ()).throw(torch.OutOfMemoryError(
                      "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                      "capacity of 79.19 GiB of which 1.00 GiB is free."))):
        try:
            # record_history starts CUDA on purpose where there is CUDA; elsewhere a no-op
            with dk.explain_oom(record_history=not torch.version.cuda):
                error()
        except dk.DeviceOutOfMemoryError as oom:
            str(oom.report); oom.report._repr_html_()
    kept = []
    dk.find_leaks(lambda: kept.append(torch.ones(2)), repeat=2)
    def step(size):
        if size > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    dk.find_batch_size(step)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([]) == 0
        assert main(["--json"]) == 0
        assert main(["watch", "-n", "0.1", "--count", "2"]) == 0
        assert main(["doctor"]) in (0, 1)
    """
    result = run_python(textwrap.dedent(code) + _REPORT)
    assert result == {"torch": False, "started": None}


def test_job_wide_calls_do_not_start_cuda() -> None:
    # With and without a process group (a world of one, gloo), launcher variables set.
    code = """
    import os, tempfile
    import torch.distributed as dist
    import devicekit as dk

    os.environ["LOCAL_RANK"] = "0"
    os.environ["SLURM_LOCALID"] = "0"
    dk.job_status()
    detector = dk.StragglerDetector(every=2)
    for _ in range(2):
        with detector.section("compute"):
            pass
        detector.step()
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    dk.job_status()
    for _ in range(2):
        with detector.section("compute"):
            pass
        detector.step()
    dist.destroy_process_group()
    """
    result = run_python(textwrap.dedent(code) + _REPORT)
    assert result == {"torch": False, "started": None}


@pytest.mark.gpu
def test_the_check_can_fail() -> None:
    # Each way of starting CUDA is seen: a bare driver call, then torch's own init.
    result = run_python(
        """
        import json, torch
        from devicekit._visible import cuda_started
        states = [cuda_started()]
        torch.cuda.is_available()  # cudaGetDeviceCount: starts the driver, not torch
        states.append(cuda_started())
        torch.zeros(1, device="cuda")
        states.append(cuda_started())
        print(json.dumps(states))
        """,
        env={"PYTORCH_NVML_BASED_CUDA_CHECK": "0"},
    )
    assert result[0] is None
    assert result[1] is not None
    assert "driver was started" in result[1]
    assert result[2] == "torch has initialized CUDA in this process"


@pytest.mark.gpu
def test_visible_devices_refuses_after_a_real_cuda_start() -> None:
    result = run_python(
        """
        import json, torch, devicekit as dk
        torch.zeros(1, device="cuda")
        try:
            with dk.visible_devices(0):
                pass
        except dk.CUDAInitializedError as error:
            print(json.dumps(str(error)))
        """
    )
    assert "torch has initialized CUDA" in result
