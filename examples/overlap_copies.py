"""Can the GPU keep computing while results are copied back to the host?

Yes, with pinned host memory, a non-blocking copy on a second stream, and an
event per result: the copy of result i overlaps the computation of result i+1.
Runs on the CPU too (there is nothing to overlap, and it says so).
"""

import torch

import devicekit as dk

device = dk.try_gpu()
if device.type != "cuda":
    print("no CUDA GPU: copies to the host are plain memory copies here, nothing to overlap")
    raise SystemExit(0)

x = torch.randn(4096, 4096, device=device)
steps = 8
hosts = [torch.empty(4096, 4096, pin_memory=True) for _ in range(steps)]
copier = torch.cuda.Stream()


def blocking() -> None:
    for i in range(steps):
        y = x @ x
        hosts[i].copy_(y)  # the host waits for y, then for the copy


def overlapped() -> None:
    done = []
    for i in range(steps):
        y = x @ x
        copier.wait_stream(torch.cuda.current_stream())  # the copy starts after y is ready
        with torch.cuda.stream(copier):
            hosts[i].copy_(y, non_blocking=True)
            y.record_stream(copier)  # keep y's memory until the copy is done
        done.append(torch.cuda.Event())
        done[-1].record(copier)
    for event in done:
        event.synchronize()  # read hosts[i] only after its event


print(dk.compare({"blocking copies": blocking, "overlapped copies": overlapped}, max_time=3))
