"""How do I put a model and its data on a device, and find the tensor I forgot?

On a GPU machine the "other" device is the GPU; on a CPU-only machine the
example uses torch's `meta` device in its place, so the same mistakes show.
devicekit's suggested fix then points at the CPU instead: meta tensors hold no
values, so no real work can move there.
"""

import tempfile
from pathlib import Path

import torch

import devicekit as dk

device = dk.try_gpu()
if device.type == "cpu":
    device = torch.device("meta")  # a second device that exists everywhere
print(f"model device: {device}")

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
weights = {name: value.clone() for name, value in model.state_dict().items()}  # for step 3
model.to(device)
batch = {"inputs": torch.randn(4, 8), "labels": torch.tensor([0, 1, 1, 0])}

# 1. The classic mistake: the batch stayed on the CPU.
try:
    model(batch["inputs"])
except RuntimeError as error:
    print(f"\ntorch says:\n  {str(error).splitlines()[0]}")

# 2. devicekit names the culprits.
try:
    dk.assert_same_device(model=model, batch=batch)
except dk.DeviceMismatchError as error:
    print(f"\ndevicekit says:\n{error}")

# 3. The fix. On a GPU machine: move the whole nested batch to the model's device at
# once. With the meta stand-in, follow devicekit's advice above: meta holds no values,
# so the model comes back to the CPU (to_empty, then its weights) and the batch stays.
if device.type == "meta":
    model.to_empty(device="cpu")
    model.load_state_dict(weights)
    device = torch.device("cpu")
batch = dk.to_device(batch, device)
where = dk.assert_same_device(model=model, batch=batch)
print(f"\nafter the fix, everything is on {where}; model(inputs) gives shape", end=" ")
print(tuple(model(batch["inputs"]).shape))


# 4. Tensors that model.to() cannot see.
class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)
        self.scale = torch.ones(2)  # a plain attribute: left behind by .to()


print("\ncheck_module(Scaled()):")
for finding in dk.check_module(Scaled()):
    print(f"  {finding}")

# 5. A checkpoint written anywhere loads onto this machine's device.
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "weights.pt"
    torch.save(torch.nn.Linear(8, 2).state_dict(), path)
    state = dk.load(path)  # onto dk.try_gpu(), whatever device it was saved from
    print(f"\nloaded {sorted(state)} onto {state['weight'].device}")
