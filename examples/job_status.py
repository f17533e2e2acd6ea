"""Which rank runs where, on which GPU, and which rank makes the others wait.

Every rank calls dk.job_status() at the start of the job and gets the same
table. Then DDP trains a small model; its gradient all-reduce makes every
rank's step take as long as the slowest rank's, so a StragglerDetector times
what each rank does alone (the forward pass and the loss). Here the last rank
plays the straggler: it sleeps 30 ms plus three times its own forward pass
per step, so it stays well past the detector's 1.2x threshold even on a
loaded machine, where every rank's forward pass slows down. The reports name
it, and say how long the job waits for it per step.

    python examples/job_status.py [ranks]                  # spawns gloo ranks (default 2)
    torchrun --nproc_per_node=2 examples/job_status.py     # or under torchrun, GPUs or not
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import devicekit as dk


def train(device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    status = dk.job_status(timeout=60)  # every rank calls it, together
    if rank == 0:
        print(status, end="\n\n")

    detector = dk.StragglerDetector(every=20, sinks=[print] if rank == 0 else [], timeout=60)
    ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(torch.nn.Linear(256, 256).to(device), device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(64, 256, device=device)
    try:
        for _ in range(40):
            with detector.section("forward"):  # what each rank does alone
                start = time.perf_counter()
                loss = model(batch).square().mean()
                if rank == world - 1:  # the straggler: a fixed 20 ms would drown in load
                    time.sleep(0.03 + 3 * (time.perf_counter() - start))
            loss.backward()  # DDP's all-reduce: every rank waits for the slowest here
            optimizer.step()
            optimizer.zero_grad()
            detector.step()  # every rank, every step: a report every 20 steps
    except Exception:
        # In a failure handler that every rank reaches (a collective timed out, the
        # loss went NaN everywhere), the table says what each rank's GPU was doing.
        if rank == 0:
            print(dk.job_status(timeout=30))
        raise


def spawned(rank: int, world: int, port: int) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun would set it
    device = dk.local_device()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        train(device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # torchrun sets WORLD_SIZE (a LOCAL_RANK alone may be left over from elsewhere).
    if "WORLD_SIZE" in os.environ:  # started by torchrun: one process per rank already
        device = dk.local_device()  # before the process group: NCCL needs the current device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        try:
            train(device)
        finally:
            dist.destroy_process_group()
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            free = sock.getsockname()[1]
        given = sys.argv[1] if len(sys.argv) > 1 else "2"
        if not given.isdigit() or int(given) < 1:
            sys.exit(f"usage: python examples/job_status.py [ranks], 1 or more, got {given!r}")
        mp.spawn(spawned, args=(int(given), free), nprocs=int(given))
