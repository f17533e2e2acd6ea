"""How do I save parameters on one device and load them on another?

Save the state dict (not the model object); load it with dk.load, which maps
every tensor to this machine's device, whatever device it was saved from. A
file that is not a checkpoint (cut short by a killed writer, or another
format) gets a dk.CheckpointError that says what it is.
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

    for target in dict.fromkeys(["cpu", str(device)]):  # once where the device is the CPU
        state = dk.load(path, target)  # weights_only=True by default: no code runs
        restored = torch.nn.Linear(16, 4).to(target)
        restored.load_state_dict(state)
        same = torch.equal(restored.weight.cpu(), model.weight.cpu())
        print(f"loaded onto {target}: weights on {restored.weight.device}, identical: {same}")

    # A save cut short (a full disk, a killed job), and a file that is not torch's.
    cut = Path(folder) / "cut.pt"
    cut.write_bytes(path.read_bytes()[:200])
    other = Path(folder) / "config.json"
    other.write_text('{"lr": 0.1}')
    for bad in [cut, other]:
        try:
            dk.load(bad, "cpu")
        except dk.CheckpointError as error:
            print(error)
