"""Which device should this script use, and how do I give a job only some GPUs?

Runs on any machine: with no GPU every answer is the CPU.
"""

import subprocess
import sys

import torch

import devicekit as dk

# 1. Pick a device. try_gpu never fails: it falls back to the CPU.
device = dk.try_gpu()
print(f"try_gpu()      -> {device}")
print(f"try_gpu(7)     -> {dk.try_gpu(7)}   (no 8th GPU here means cpu)")
print(f"try_all_gpus() -> {dk.try_all_gpus()}   (never empty)")

x = torch.randn(3, 3, device=device)
print(f"a tensor made on it lives on {x.device}")

# 2. CUDA_VISIBLE_DEVICES is read leniently: what you wrote is not always what CUDA reads.
for value in ["1,0", "0,1a,2", "0,x,1", "1,1", "-1"]:
    print(f"CUDA_VISIBLE_DEVICES={value!r:9} -> CUDA reads {dk.parse_visible_devices(value)}")

# 3. Give a child process only this script's first GPU; it sees it as cuda:0.
#    Entries are physical GPUs, not this script's cuda:N: under CUDA_VISIBLE_DEVICES=2,3
#    (a scheduler's share) this script's cuda:0 is GPU 2, so take what the variable lists.
#    subprocesses_only=True keeps this working even if this script had used CUDA already.
listed = dk.parse_visible_devices()  # None: every GPU is visible
first = [0] if listed is None else listed[:1]
child = "import torch; print(torch.cuda.device_count())"
with dk.visible_devices(first, subprocesses_only=True):
    seen = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
print(f"a child shown GPUs {first} sees {seen.stdout.strip()} CUDA device(s)")

# 4. Mistakes are caught before anything changes, instead of silently hiding GPUs.
try:
    with dk.visible_devices("0,0"):
        pass
except ValueError as error:
    print(f"visible_devices('0,0') -> ValueError: {error}")

# 5. Every devicekit function reads a device argument the same way, and a refusal says
#    what to write instead.
for value in ["CUDA:0", "cuda:-1", torch.tensor(1)]:
    try:
        dk.to_device(x, value)
    except (TypeError, ValueError) as error:
        print(f"to_device(x, {value!r}) -> {type(error).__name__}: {error}")
