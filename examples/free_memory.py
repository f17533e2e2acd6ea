"""Why does nvidia-smi still show my memory after `del`, and how do I get it back?

`del` returns a tensor's memory to PyTorch's cache, not to the driver. dk.free_memory
collects garbage, empties the cache and reports what went back.
"""

import torch

import devicekit as dk

device = dk.try_gpu()
with dk.memory_scope(device) as scope:
    blocks = [torch.empty(256 * 2**20, dtype=torch.uint8, device=device) for _ in range(4)]
    del blocks
print(f"inside the block: {scope.report}")
print(dk.free_memory())
