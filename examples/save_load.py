"""How do I save parameters on one device and load them on another?

Save the state dict (not the model object); load it with dk.load, which maps
every tensor to this machine's device, whatever device it was saved from.
"""

import tempfile
from pathlib import Path

import torch

import devicekit as dk

device = dk.try_gpu()
model = torch.nn.Linear(16, 4).to(device)

with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "linear.pt"
    torch.save(model.state_dict(), path)
    print(f"saved from {device}")

    for target in ["cpu", device]:
        state = dk.load(path, target)  # weights_only=True by default: no code runs
        restored = torch.nn.Linear(16, 4).to(target)
        restored.load_state_dict(state)
        same = torch.equal(restored.weight.cpu(), model.weight.cpu())
        print(f"loaded onto {target}: weights on {restored.weight.device}, identical: {same}")
