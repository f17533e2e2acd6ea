"""Do two GPUs finish twice as fast? Two in parallel against one after the other.

Each GPU gets its own half of the work; CUDA runs them at the same time because
each device has its own queue. With fewer than two GPUs this says so and stops.
"""

import torch

import devicekit as dk

devices = dk.try_all_gpus()
if len(devices) < 2 or devices[0].type == "cpu":
    print(f"this needs two GPUs; here: {', '.join(map(str, devices))}. Nothing to compare.")
    raise SystemExit(0)

n = 8192
mats = [torch.randn(n, n, device=d) for d in devices[:2]]


def one_gpu_in_sequence() -> None:
    for _ in range(2):
        mats[0] @ mats[0]


def two_gpus_in_parallel() -> None:
    for m in mats:  # queued on both devices before either finishes
        m @ m


def both() -> None:
    two_gpus_in_parallel()
    torch.cuda.synchronize(devices[1])  # benchmark times cuda:0; wait for cuda:1 too


print(
    dk.compare(
        {"one GPU, twice": one_gpu_in_sequence, "two GPUs, once each": both},
        device=devices[0],
        max_time=2,
    )
)
