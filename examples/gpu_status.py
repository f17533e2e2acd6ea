"""What is each GPU doing right now, and which one should this job use?

Reads NVML directly (no nvidia-smi subprocess) and never initializes CUDA, so
it is safe at the top of a script that forks or sets CUDA_VISIBLE_DEVICES.
Without a GPU it says why there is no status and picks the CPU.
"""

import json

import devicekit as dk

if not dk.nvml_available():
    print(f"no GPU status here: {dk.nvml_error()}")

for info in dk.gpus(all=True):
    # No torch index: CUDA_VISIBLE_DEVICES hides it, torch has no CUDA, or it is a GPU
    # in MIG mode (its MIG instances, listed after it, are the devices).
    where = info.device or "not usable by this process"
    print(f"{where}: {info!r}")  # a lost GPU says "cannot be read: ..." here
    for process in info.processes or ():
        print(f"    {process}")  # pid, name (escaped), memory in GiB; "?" when unknown

# Which GPU has room for a 20 GiB job and is not busy? cpu when none does.
device = dk.pick_gpu(min_free_memory=20 * 2**30, max_utilization=50)
print(f"pick_gpu(min_free_memory=20 GiB, max_utilization=50%) -> {device}")

# Snapshots are plain data: log them as JSON.
visible = dk.gpus()
if visible:
    print(f"{visible[0].device} as JSON:")
    print(json.dumps(visible[0].to_dict(), indent=2))
else:
    print("as JSON: [] (no GPU is visible to this process, so there is no snapshot to log)")
