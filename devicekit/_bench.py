"""``bench``: is the GPU used, and how much faster than the CPU is it?

A survey of the machine, not a timer for your code (that is [`benchmark()`][devicekit.benchmark]).
Rates are in TFLOP/s (10^12 floating-point operations per second), bandwidth
in GB/s (10^9 bytes per second), latencies in seconds. Everything is measured
with [`benchmark()`][devicekit.benchmark], so each number comes with the same care (warm-up, CUDA
events, repeats until precise) and the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._accelerators import try_all_gpus
from ._devices import DeviceLike, resolve_cuda_devices
from ._format import PlainResult, format_seconds, html_table, plain_data, safe_text, shown
from ._keywords import suggest_keywords
from ._measure import DEFAULT_MIN_TIME, benchmark
from ._measurement import Measurement
from ._options import check_seconds

__all__ = ["BenchReport", "BenchResult", "bench"]

_BUDGET = 0.4  # seconds of measuring per number by default: the run stays well under 30 s
# Of a shorter max_time, the share min_time gets: the warm-up may take up to half of it, so
# a min_time of all of it could never be reached, and every number would stop at max_time.
_MIN_SHARE = 0.4
_SCHEMA = 2  # 2: latencies in seconds (unit "s", were "us"), and each result's notes


@dataclass(frozen=True)
class BenchResult(PlainResult):
    """One number from [`bench()`][devicekit.bench].

    Attributes:
        name: What was measured, such as ``"matmul 4096 bf16"``.
        device: Where, such as ``"cuda:0"``.
        value: The number, in ``unit``.
        unit: ``"TFLOP/s"``, ``"GB/s"`` (10^9 bytes per second) or ``"s"``.
        trustworthy: Whether [`benchmark()`][devicekit.benchmark] judged the timing trustworthy.
        notes: Why not (or anything else worth knowing): the measurement's notes.
    """

    name: str
    device: str
    value: float = field(metadata=shown(of_row=lambda result: result.formatted()))
    unit: str
    trustworthy: bool
    notes: tuple[str, ...] = ()

    @classmethod
    @suggest_keywords
    def of(cls, name: str, device: object, value: float, unit: str, m: Measurement) -> BenchResult:
        """A result carrying ``m``'s verdict and notes."""
        return cls(name, str(device), value, unit, m.trustworthy, tuple(m.notes))

    def formatted(self) -> str:
        """The value with its unit, seconds in ms/µs: ``"51.4 TFLOP/s"``, ``"8.6 µs"``."""
        if self.unit == "s":
            return format_seconds(self.value)
        return f"{self.value:.3g} {self.unit}"

    def _title(self) -> str:
        return f"{safe_text(self.name)} on {safe_text(self.device)}"


@dataclass(frozen=True)
class BenchReport:
    """All of [`bench()`][devicekit.bench]'s numbers, and the GPU's matmul speed-up over the CPU.

    ``str()`` prints a table with each untrustworthy number's reasons under
    it; ``to_dict()`` is what ``devicekit bench --json`` prints.
    """

    results: tuple[BenchResult, ...]

    def value(self, name: str, device: str) -> float | None:
        """The value measured for ``name`` on ``device``, or None."""
        found = [r.value for r in self.results if r.name == name and r.device == device]
        return found[0] if found else None

    @property
    def speedups(self) -> dict[str, float]:
        """Per GPU: its fp32 matmul rate over the CPU's (1024 fp32 on the CPU)."""
        cpu = self.value("matmul 1024 fp32", "cpu")
        gpus = {r.device for r in self.results if r.device != "cpu"}
        rates = {device: self.value("matmul 4096 fp32", device) for device in sorted(gpus)}
        return {d: rate / cpu for d, rate in rates.items() if rate is not None and cpu}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: schema version, results (with their notes) and speed-ups."""
        return {
            "schema": _SCHEMA,
            "results": plain_data(self.results),
            "speedups": plain_data(self.speedups),
        }

    def _summary(self) -> list[str]:
        lines = [
            f"{device} multiplies fp32 matrices {speedup:.0f}x faster than the CPU"
            for device, speedup in self.speedups.items()
        ]
        return lines or ["no GPU: only the CPU was measured"]

    def __str__(self) -> str:
        lines = [f"{'measurement':28} {'device':8} {'value':>14}"]
        for r in self.results:
            mark = "" if r.trustworthy else "  (not trustworthy)"
            lines.append(f"{r.name:28} {r.device:8} {r.formatted():>14}{mark}")
            lines += [f"    - {note}" for note in r.notes]
        return "\n".join([*lines, "", *self._summary()])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = [
            (r.name, r.device, r.formatted(), "yes" if r.trustworthy else "no", "\n".join(r.notes))
            for r in self.results
        ]
        header = ("measurement", "device", "value", "trustworthy", "notes")
        return html_table(rows, header=header, caption="; ".join(self._summary()))


def _time(fn: Callable[..., Any], *args: Any, max_time: float, **kwargs: Any) -> Measurement:
    min_time = min(DEFAULT_MIN_TIME, max_time * _MIN_SHARE)
    return benchmark(fn, *args, min_time=min_time, max_time=max_time, **kwargs)


def _matmul(n: int, dtype: torch.dtype, device: torch.device, max_time: float) -> BenchResult:
    a = torch.randn(n, n, device=device, dtype=dtype)
    m = _time(torch.matmul, a, a, max_time=max_time)
    name = f"matmul {n} {str(dtype).removeprefix('torch.').replace('float32', 'fp32')}"
    name = name.replace("bfloat16", "bf16")
    return BenchResult.of(name, device, 2 * n**3 / m.median / 1e12, "TFLOP/s", m)


def _copies(device: torch.device, max_time: float) -> list[BenchResult]:
    size = 64 * 2**20
    gpu = torch.empty(size, dtype=torch.uint8, device=device)
    results = []
    for pinned in (False, True):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        kind = "pinned" if pinned else "pageable"
        for name, dst, src in (("host to device", gpu, host), ("device to host", host, gpu)):
            m = _time(dst.copy_, src, non_blocking=pinned, device=device, max_time=max_time)
            rate = size / m.median / 1e9
            results.append(BenchResult.of(f"{name}, {kind}", device, rate, "GB/s", m))
    return results


def _latencies(device: torch.device, max_time: float) -> list[BenchResult]:
    x = torch.zeros(1, device=device)
    launch = _time(x.add_, 1, max_time=max_time)
    sync = _time(torch.cuda.synchronize, device, device="cpu", max_time=max_time)
    issue = launch.host_median
    assert issue is not None  # benchmark() keeps the host time of every timed call
    return [
        BenchResult.of("kernel launch (host)", device, issue, "s", launch),
        BenchResult.of("synchronize, idle GPU", device, sync.median, "s", sync),
    ]


@suggest_keywords
def bench(
    *, devices: list[DeviceLike] | DeviceLike | None = None, max_time: float = _BUDGET
) -> BenchReport:
    """Survey this machine: matmul rates, copy bandwidth, launch and sync costs.

    Not for timing your own code: that is [`benchmark()`][devicekit.benchmark] (one function,
    a [`Measurement`][devicekit.Measurement]) or [`Timer`][devicekit.Timer] (a block). On the CPU:
    an fp32
    1024x1024 matmul. On each GPU: fp32 and (where supported) bf16 4096x4096
    matmuls, host-to-device and device-to-host bandwidth from pageable and
    from pinned memory (64 MiB), the host's cost of launching one small
    kernel, and of one ``synchronize`` on an idle GPU. Rates are in TFLOP/s,
    bandwidth in GB/s (10^9 bytes per second), latencies in seconds. Takes
    well under 30 seconds by default (about ``max_time`` per number: 1 on
    the CPU, 7 or 8 per GPU). Initializes CUDA (it has to use the GPU).

    Args:
        devices: GPUs to measure, as a list of [`DeviceLike`][devicekit.DeviceLike] (``[0]``,
            ``["cuda:1"]``) or one. Default: every visible GPU. The CPU is
            always measured; ``[]`` measures only the CPU.
        max_time: Seconds [`benchmark()`][devicekit.benchmark] may spend on each
            number (its ``max_time``). A note such as "allow max_time of at
            least 1.43 s" means this.

    Returns:
        A [`BenchReport`][devicekit.BenchReport].

    Raises:
        TypeError: ``max_time`` is not a number.
        ValueError: One of ``devices`` is not a CUDA device, or ``max_time``
            is not a finite number of seconds > 0.
        DeviceNotFoundError: One of ``devices`` does not exist here.

    Examples:
        >>> import devicekit as dk
        >>> report = dk.bench(devices=[])  # the CPU only
        >>> report.results[0].unit
        'TFLOP/s'
    """
    max_time = check_seconds(max_time, name="max_time", fix="the default is 0.4 per number")
    if devices is None:
        targets = [d for d in try_all_gpus() if d.type == "cuda"]
    else:
        why = "bench() measures CUDA GPUs there, and always measures the CPU"
        fix = "pass devices=[] for the CPU only, or leave devices out for every GPU there is"
        targets = resolve_cuda_devices(devices, name="devices", why=why, fix=fix)
    results = [_matmul(1024, torch.float32, torch.device("cpu"), max_time)]
    for device in targets:
        results.append(_matmul(4096, torch.float32, device, max_time))
        if torch.cuda.get_device_capability(device) >= (8, 0):  # bf16 matmuls: Ampere on
            results.append(_matmul(4096, torch.bfloat16, device, max_time))
        results += _copies(device, max_time)
        results += _latencies(device, max_time)
    return BenchReport(tuple(results))
