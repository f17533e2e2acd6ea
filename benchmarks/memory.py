"""What do devicekit's memory tools cost? The OOM report with many live tensors, and find_leaks.

1. Building an out-of-memory report while 100,000 tensors are alive (the goal:
   under a second on a GPU). Compared, in the same rounds and rotating order,
   with what people write by hand: the forum recipe that walks
   ``gc.get_objects()`` testing ``torch.is_tensor(obj) or torch.is_tensor(obj.data)``
   and prints each size, and a plain census that sorts every tensor by bytes.
   On a GPU, ``torch.cuda.memory_summary()`` too (it reports no tensors).
   The report on the CPU is a real CPU out-of-memory error, on the GPU a real
   CUDA one.
2. ``find_leaks`` on a small training step: the time of ``warmup + repeat``
   plain calls against ``find_leaks(step)``, and what one call costs under
   the creation-site recorder alone (the rest is the census and collection);
   then the recorder's cost per torch operation.
3. ``find_leaks`` on a function that leaks ``--many`` tensors a call (10,000:
   a user's trial took 11 to 17 s for 12 calls, the calls alone 0.14 to
   0.38 s), against the calls alone, and against ``find_leaks`` with the
   creation sites kept the old way, in torch's ``WeakIdKeyDictionary`` (the
   census is the new one in both; run this script on the release before
   2026-11-24 for the old census too: ``--only many``).

Each number is the median of ``--rounds`` rounds; ratios are to devicekit.

    python benchmarks/memory.py [--tensors 100000] [--many 10000] [--rounds 7] [--only many]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

import devicekit as dk
from devicekit import _creationsites, _leaks


def dk_report(device: torch.device) -> Callable[[], None]:
    def run() -> None:
        try:
            with dk.explain_oom():
                torch.empty(2**62, dtype=torch.uint8, device=device)
        except dk.DeviceOutOfMemoryError as error:
            if error.report is None or not error.report.tensor_count:
                raise AssertionError("a report that counted nothing is void") from error

    return run


def forum_recipe() -> None:
    """The snippet from the PyTorch forum's "How to debug causes of GPU memory leaks?"."""
    sink = io.StringIO()
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) or (hasattr(obj, "data") and torch.is_tensor(obj.data)):
                print(type(obj), obj.size(), file=sink)
        except Exception:  # noqa: BLE001 - the recipe skips what it cannot read
            continue


def plain_census() -> None:
    tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    sizes = sorted(((t.nbytes, tuple(t.shape), t.dtype) for t in tensors), reverse=True)
    assert sizes
    del tensors


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def rounds(variants: dict[str, Callable[[], object]], count: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(count):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(variants[name]))
    return times


def table(times: dict[str, list[float]], reference: str) -> None:
    """Median and best (noise only ever slows a run down) of each, with ratios to ``reference``."""
    base, best = statistics.median(times[reference]), min(times[reference])
    print(f"  {'':<34} {'median':>9}  {'ratio':>6}  {'best':>9}  {'ratio':>6}")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"  {name:<34} {median * 1e3:6.1f} ms  {median / base:5.2f}x  "
            f"{min(values) * 1e3:6.1f} ms  {min(values) / best:5.2f}x"
        )


def report_cost(device: torch.device, count: int, repeats: int) -> None:
    alive = [torch.zeros(4, device=device) for _ in range(count)]
    print(f"\nOOM report on {device}, {len(alive):,} live tensors ({repeats} rounds):")
    variants: dict[str, Callable[[], object]] = {
        "dk.explain_oom report": dk_report(device),
        "forum recipe (print every tensor)": forum_recipe,
        "plain census (sort every tensor)": plain_census,
    }
    if device.type == "cuda":
        variants["torch.cuda.memory_summary()"] = torch.cuda.memory_summary
    dk_report(device)()  # warm: the first report starts NVML
    table(rounds(variants, repeats), "dk.explain_oom report")
    del alive


def leak_cost(repeats: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)

    def step() -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    calls = 12  # find_leaks' default: 2 warm-up calls and 10 measured

    def plain() -> None:
        for _ in range(calls):
            step()

    recorder = _creationsites.CreationSites()

    def recorded() -> None:
        for _ in range(calls):
            with recorder:
                step()

    def leaks() -> None:
        assert dk.find_leaks(step).leaks == ()

    print(f"\nfind_leaks on a small training step, {calls} calls ({repeats} rounds):")
    times = rounds(
        {"plain calls": plain, "under the recorder only": recorded, "dk.find_leaks": leaks},
        repeats,
    )
    table(times, "plain calls")
    plain_best = min(times["plain calls"])
    added = min(times["dk.find_leaks"]) - plain_best
    recorder_cost = min(times["under the recorder only"]) - plain_best
    print(
        f"  added per call (best runs): {added / calls * 1e3:.1f} ms in all, of which the "
        f"recorder {recorder_cost / calls * 1e3:.2f} ms"
    )


def recorder_per_op(repeats: int) -> None:
    """The creation-site recorder's cost per torch operation: ``x + 1`` on 4 floats."""
    x = torch.ones(4)
    recorder = _creationsites.CreationSites()

    def ops() -> None:
        for _ in range(2000):
            x + 1

    def recorded() -> None:
        with recorder:
            ops()

    print(f"\nper torch operation, 2000 of x + 1 ({repeats} rounds):")
    times = rounds({"plain": ops, "under the recorder": recorded}, repeats)
    table(times, "plain")
    added = (min(times["under the recorder"]) - min(times["plain"])) / 2000
    print(f"  the recorder adds {added * 1e6:.2f} µs per operation (best runs)")


class _WeakKeyedSites(_creationsites.CreationSites):
    """The recorder before 2026-11-24: sites in a ``WeakIdKeyDictionary``."""

    def __init__(self) -> None:
        super().__init__()
        self.weak: Any = WeakIdKeyDictionary()

    def _note(self, tensor: torch.Tensor) -> None:
        if tensor not in self.weak:
            where = self._site(sys._getframe(2))
            if where is not None:
                self.weak[tensor] = where

    def site(self, tensor: torch.Tensor) -> Any:
        return self.weak.get(tensor)


def many_leaks_cost(per_call: int, repeats: int) -> None:
    """``find_leaks`` on a function that keeps ``per_call`` new tensors each call."""
    kept: list[torch.Tensor] = []
    calls = 12  # find_leaks' default: 2 warm-up calls and 10 measured

    def leaky() -> None:
        kept.extend(torch.zeros(1) for _ in range(per_call))

    def alone() -> None:
        for _ in range(calls):
            leaky()
        kept.clear()

    def found() -> None:
        (leak,) = dk.find_leaks(leaky).leaks
        assert leak.count_per_call == per_call, leak
        kept.clear()

    def found_weak_keyed() -> None:
        new = _leaks.CreationSites  # what find_leaks makes its recorder of
        _leaks.CreationSites = _WeakKeyedSites  # type: ignore[misc]
        try:
            found()
        finally:
            _leaks.CreationSites = new  # type: ignore[misc]

    print(
        f"\nfind_leaks with {per_call:,} tensors leaked per call, {calls} calls ({repeats} rounds):"
    )
    variants: dict[str, Callable[[], object]] = {"the calls alone": alone, "dk.find_leaks": found}
    if hasattr(_creationsites, "_FIRST_SWEEP"):  # this release's recorder: the old one can stand in
        variants["find_leaks, weak-keyed sites"] = found_weak_keyed
    table(rounds(variants, repeats), "the calls alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--many", type=int, default=10_000, help="tensors leaked per call")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=["many"], help="run one part only")
    args = parser.parse_args()
    print(
        f"memory benchmark, {datetime.date.today()}, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    if args.only is None:
        report_cost(torch.device("cpu"), args.tensors, args.rounds)
        if torch.cuda.is_available():
            report_cost(torch.device("cuda", 0), args.tensors, args.rounds)
        leak_cost(args.rounds)
        recorder_per_op(args.rounds)
    many_leaks_cost(args.many, min(args.rounds, 5))
    load_cost(args.rounds)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


def load_cost(repeats: int, megabytes: int = 512) -> None:
    """``dk.load`` of a checkpoint from the page cache, with and without ``verify=True``.

    Against plain ``torch.load`` and the CRC-32 of every record alone (devicekit's
    reader, and zlib over an mmap of the whole file), in the same rounds.
    """
    import mmap
    import tempfile
    import zlib

    from devicekit._ziparchive import check_archive

    count = megabytes // 8
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "big.pt")
        torch.save({f"layer{i}.weight": torch.randn(2_000_000) for i in range(count)}, path)
        size = os.path.getsize(path)

        def crc_mmap() -> None:
            with (
                open(path, "rb") as file,
                mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m,
            ):
                view, crc = memoryview(m), 0
                for at in range(0, size, 1 << 20):
                    crc = zlib.crc32(view[at : at + (1 << 20)], crc)
                view.release()

        variants: dict[str, Callable[[], object]] = {
            "torch.load": lambda: torch.load(path, map_location="cpu", weights_only=True),
            "dk.load": lambda: dk.load(path, "cpu"),
            "dk.load(verify=True)": lambda: dk.load(path, "cpu", verify=True),
            "CRC-32 of every record (devicekit)": lambda: check_archive(path, tensors=True),
            "CRC-32 of the file (zlib, mmap)": crc_mmap,
        }
        torch.load(path, map_location="cpu", weights_only=True)  # warm the page cache
        print(f"\nload of a {size / 1e6:.0f} MB checkpoint from the page cache ({repeats} rounds):")
        table(rounds(variants, repeats), "torch.load")


if __name__ == "__main__":
    main()
