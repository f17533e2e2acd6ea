"""How long does this code really take, and can I trust the number?

1. The classic mistake: a host clock around GPU work measures the launch only.
2. dk.Timer measures the work; dk.benchmark repeats it until the median is
   precise and says whether anything could have spoiled it.
3. With a GPU: the same benchmark with another process hammering the GPU.

Runs on the CPU too: then the "GPU" work runs on the CPU, where nothing is
asynchronous and the host clock is right, though a single reading still varies
from run to run (which is why step 2 repeats it).
"""

import subprocess
import sys
import time

import torch

import devicekit as dk

device = dk.try_gpu()
n = 4096 if device.type == "cuda" else 512
a = torch.randn(n, n, device=device)
a @ a  # warm up (cuBLAS handles, kernels)

start = time.perf_counter()
a @ a
naive = time.perf_counter() - start
with dk.Timer() as timer:
    a @ a
print(f"{n}x{n} matmul on {device}:")
print(f"  time.perf_counter() around it: {naive * 1e3:8.3f} ms  (no synchronize)")
print(f"  dk.Timer:                      {timer.elapsed * 1e3:8.3f} ms")
if device.type == "cpu":
    # Nothing is asynchronous on the CPU: both readings are right, and they differ only as
    # any two single runs do. On a GPU the first would be the launch's microseconds.
    print("  (on the CPU both are right: single runs differ, which is why dk.benchmark repeats)")

quiet = dk.benchmark(torch.matmul, a, a, max_time=1)
print(f"\nalone on the device:\n{quiet!r}")

table = dk.compare(
    {
        "a @ a": lambda: a @ a,
        "torch.mm": lambda: torch.mm(a, a),
        "a @ a.T.contiguous()": lambda: a @ a.T.contiguous(),
    },
    max_time=0.5,
)
print(f"\n{table}")

if device.type == "cuda":
    hammer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch; a = torch.randn(8192, 8192, device='cuda'); print(flush=True)\n"
            "while True:\n    a @ a",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hammer.stdout.readline()
        time.sleep(1)  # let its utilization show in NVML's sample
        busy = dk.benchmark(torch.matmul, a, a, max_time=1)
    finally:
        hammer.kill()
        hammer.wait()
    print(f"\nwith another process hammering the GPU:\n{busy!r}")
