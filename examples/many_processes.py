"""Can several processes share one GPU, or use one GPU each? gpu_map does both.

Workers are spawned (never forked) and each sees only its GPU as cuda:0. With
several workers per GPU they share it. Without a GPU they run on the CPU.
"""

import os

import torch

import devicekit as dk


def work(seed: int) -> tuple[int, str, float]:
    torch.manual_seed(seed)
    device = dk.try_gpu()  # cuda:0 inside every worker: its own GPU
    x = torch.randn(512, 512, device=device)
    return os.getpid(), str(device), float(torch.linalg.matrix_norm(x @ x))


if __name__ == "__main__":  # spawned workers import this file: guard the main work
    gpus = [d.index for d in dk.try_all_gpus() if d.type == "cuda"]
    devices = gpus or ["cpu", "cpu"]
    # timeout: an item that hangs fails the map (dk.WorkerTimeoutError) instead of waiting forever.
    results = dk.gpu_map(work, range(8), devices=devices, workers_per_device=2, timeout=300)
    for seed, (pid, device, norm) in enumerate(results):
        print(f"item {seed}: worker {pid} on {device}: norm {norm:.1f}")
    print(f"results came from {len({pid for pid, _, _ in results})} worker processes")
