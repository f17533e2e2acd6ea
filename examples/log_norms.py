"""Logging 1,000 values: one at a time with .item(), or all at once?

Each `.item()` makes the host wait for the GPU. Computing the Frobenius norms of
1,000 matrix products and reading each one right away serializes host and GPU;
keeping them on the device and copying once lets the GPU run ahead.
"""

import torch

import devicekit as dk

device = dk.try_gpu()
a = torch.randn(256, 256, device=device)
products = [a @ a for _ in range(4)]  # warm up


def one_at_a_time() -> list[float]:
    return [torch.linalg.matrix_norm(a @ a).item() for _ in range(1000)]


def in_bulk() -> list[float]:
    norms = [torch.linalg.matrix_norm(a @ a) for _ in range(1000)]
    return torch.stack(norms).tolist()  # one copy to the host


def with_log_buffer() -> list[float]:
    with dk.LogBuffer(flush_every=1000) as logs:
        for step in range(1000):
            logs.log(step, norm=torch.linalg.matrix_norm(a @ a))
    return logs.values("norm")


assert one_at_a_time() == in_bulk() == with_log_buffer()  # the same numbers, bit for bit
if device.type == "cpu":
    print(
        "On the CPU, .item() waits for nothing, so the copies in bulk save nothing here and\n"
        "LogBuffer's bookkeeping is pure cost; on a GPU they are what lets it run ahead.\n"
    )
print(
    dk.compare(
        {".item() each": one_at_a_time, "stack, one copy": in_bulk, "LogBuffer": with_log_buffer},
        max_time=2,
    )
)
