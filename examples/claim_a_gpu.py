"""Several jobs on one machine: each claims its own GPU, and waits when all are taken.

Start it several times at once and each run gets a different GPU:

    for i in 1 2 3 4; do python examples/claim_a_gpu.py & done; wait

With more runs than GPUs, the extra runs wait (here up to 10 minutes) for a
GPU to be released, then take it. A claim ends with the `with` block, or when
the process exits however it exits (even killed), so a crashed job never
leaves a GPU claimed. Without a GPU every run uses the CPU at once. While
they run, `devicekit claims` shows which process holds which GPU.

Claims live in /tmp/devicekit-<uid>, so jobs started from a shell, cron or
Slurm see each other's. Where jobs cannot share /tmp (Slurm's per-job /tmp, a
container), give them all one directory of yours on a local disk:

    export DEVICEKIT_CLAIMS_DIR=/var/tmp/$USER-gpu-claims
"""

import os
import time

import torch

import devicekit as dk

# Only GPUs with 4 GiB free qualify; look five times a second for up to 10 minutes.
with dk.claim_gpu(min_free_memory=4 * 2**30, wait=600) as device:
    if device.type == "cpu":
        print(f"process {os.getpid()}: no GPU here, so nothing to claim; working on the CPU")
    else:
        print(f"process {os.getpid()} claimed {device}")
    x = torch.randn(1024, 1024, device=device)
    w = torch.randn(1024, 1024, device=device) / 32  # scaled so that x keeps its spread
    started = time.perf_counter()
    for _ in range(5):
        x = torch.tanh(x @ w)
    spread = x.std().item()  # the result, read back: the work was done
    print(f"worked on {device} for {time.perf_counter() - started:.2f} s: std {spread:.3f}")
if device.type != "cpu":
    print(f"process {os.getpid()} released {device}")

# For a whole script, claim without a block: the claim lasts until the process exits.
device = dk.pick_gpu(claim=True)
held = "" if device.type == "cpu" else "; held until exit or dk.release_gpu(device)"
print(f"pick_gpu(claim=True) -> {device}{held}")
