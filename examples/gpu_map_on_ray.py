"""More items than one machine: gpu_map's items as Ray tasks, each with its share of a GPU.

On this machine (starts a local Ray for the call, then shuts it down):

    python examples/gpu_map_on_ray.py

On a Ray cluster (every node needs devicekit, torch and this file's imports):

    RAY_ADDRESS=ray://head-node:10001 python examples/gpu_map_on_ray.py

Each item is a Ray task that asks for half a GPU (workers_per_device=2); Ray
runs it where that much is free and hides every other GPU, so inside the task
dk.try_gpu() is its GPU, as cuda:0. Without a GPU the tasks run on the CPU.
"""

import importlib.util
import os
import sys

import torch

import devicekit as dk


def evaluate(seed: int) -> tuple[int, str, str, float]:
    """One "checkpoint": a random model scored on random data."""
    torch.manual_seed(seed)
    device = dk.try_gpu()  # the GPU Ray assigned to this task, or the CPU
    model = torch.nn.Linear(256, 10).to(device)
    x = torch.randn(1024, 256, device=device)
    with torch.no_grad():  # scoring only: no graph to keep, and a plain float to return
        loss = model(x).logsumexp(dim=1).mean()
    return seed, str(device), os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"), loss.item()


if __name__ == "__main__":
    if importlib.util.find_spec("ray") is None:
        print("skipped: this example needs Ray; pip install 'devicekit[ray]'")
        sys.exit(0)
    results = dk.gpu_map(evaluate, range(8), workers_per_device=2, executor="ray")
    for seed, device, visible, loss in results:
        print(f"checkpoint {seed}: {device} (CUDA_VISIBLE_DEVICES={visible}): loss {loss:.4f}")
