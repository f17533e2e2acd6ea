"""Logging 1,000 values: one at a time with .item(), or all at once?

Each `.item()` makes the host wait for the GPU. Computing the Frobenius norms of
1,000 matrix products and reading each one right away serializes host and GPU;
keeping them on the device and copying once lets the GPU run ahead.

On the CPU there is nothing to run ahead of, so the matrices are small there
(32 x 32, not 256 x 256): each variant's call then takes milliseconds, the
benchmark times many calls, and the table shows what logging itself costs.
What the numbers show differs from machine to machine, so the summary under
the table is read from the measurements, never written in advance.
"""

import torch

import devicekit as dk

device = dk.try_gpu()
size = 256 if device.type == "cuda" else 32  # on the CPU, 256 x 256 takes seconds per call
a = torch.randn(size, size, device=device)
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


def what_it_shows(table: dk.Comparison) -> str:
    """The table in words, against one copy at the end: from the measurements, not assumed."""
    measured = {row.name: row.measurement for row in table.rows}
    # compare() with measurements times nothing again: it only sets them against a baseline.
    against = dk.compare(measured, baseline="stack, one copy")
    lines = [f"On {device}, against stacking the norms and copying them once:"]
    lines += [
        f"  {row.name}: {row.verdict(against.reference)}"
        for row in against.rows
        if row.name != against.reference
    ]
    if not all(m.trustworthy for m in measured.values()):
        lines.append("  (some rows are not trustworthy: the notes under the table say why)")
    if device.type == "cpu":
        lines.append("On a GPU, each .item() also makes the host wait for the GPU.")
    return "\n".join(lines)


assert one_at_a_time() == in_bulk() == with_log_buffer()  # the same numbers, bit for bit
table = dk.compare(
    {".item() each": one_at_a_time, "stack, one copy": in_bulk, "LogBuffer": with_log_buffer},
    max_time=1,
)
print(table)
print()
print(what_it_shows(table))
