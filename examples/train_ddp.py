"""Training on several GPUs (or processes): DistributedDataParallel under torchrun.

    torchrun --nproc_per_node=2 examples/train_ddp.py

Each process gets its device from dk.local_device() (cuda:<LOCAL_RANK>, or the
CPU with gloo where there is no GPU), trains on its own shard of the data, and
logs through a LogBuffer that averages the loss across ranks at each flush.
Run without torchrun, it trains alone (a world of one).
"""

import os
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import devicekit as dk

# torchrun sets WORLD_SIZE with the rest. Without it, this is a world of one, even when a
# LOCAL_RANK is left over in the environment (from a notebook, or a Slurm allocation).
if "WORLD_SIZE" not in os.environ:  # plain `python train_ddp.py`
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    with socket.socket() as probe:  # a free port: two runs at once must not collide
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

device = dk.local_device()
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Linear(8, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(1024, 8)
y = x.sum(dim=1, keepdim=True)
shard = slice(rank, None, world)  # each rank trains on its own part of the data
x, y = x[shard].to(device), y[shard].to(device)

with dk.LogBuffer(flush_every=20, reduce="mean") as logs:
    for step in range(100):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        logs.log(step, loss=loss)

if rank == 0:
    processes = "1 process" if world == 1 else f"{world} processes"
    print(
        f"{processes} on {device.type}: mean loss {logs.history[0]['loss']:.3f} "
        f"at step 0, {logs.latest['loss']:.5f} at step {logs.latest['step']}"
    )
# Shut down in order: drop DDP, let every rank finish its collectives, then
# destroy the group, so that no collective is still in flight at exit.
del model, optimizer
dist.barrier()
dist.destroy_process_group()
