"""Why does nvidia-smi still show my memory after `del`, and how do I get it back?

`del` returns a tensor's memory to PyTorch's cache, not to the driver. dk.free_memory
collects garbage, empties the cache and reports what went back. dk.memory_scope measures
a block's peak; scopes nest, and the outer one still sees the inner one's peak.
"""

import torch

import devicekit as dk

device = dk.try_gpu()
size = 256 * 2**20 if device.type == "cuda" else 2**20  # on the CPU nothing is counted
with dk.memory_scope(device) as step:
    with dk.memory_scope(device) as forward:
        blocks = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(4)]
        del blocks
    kept = torch.empty(size, dtype=torch.uint8, device=device)
print(f"inside the inner block: {forward.report}")
print(f"the whole step:         {step.report}")  # its peak includes the inner block's
del kept
print(dk.free_memory())
