"""How do I show the loss every step without slowing training down?

`loss.item()` or `print(loss)` each step makes the host wait for the GPU.
dk.LogBuffer keeps the values on the device and brings them over in bulk, and
a progress bar sink shows the latest loss at each flush. dk.detect_syncs
counts the hidden syncs of each approach; dk.free_memory gives the memory back.
"""

import sys

import torch

import devicekit as dk

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional: a one-line stand-in

    class tqdm:  # type: ignore[no-redef]
        def __init__(self, iterable, **kwargs):
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable)

        def set_postfix(self, values, refresh=True):
            # A terminal redraws one line; a log or a pipe gets a line per flush.
            end = "" if sys.stderr.isatty() else "\n"
            print(f"\r  training, loss {values['loss']}", end=end, file=sys.stderr)

        def close(self):
            if sys.stderr.isatty():
                print(file=sys.stderr)


def make_trainer(device: torch.device):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(4096, 32, device=device)
    y = x[:, :1] ** 2 + 0.1 * torch.randn(4096, 1, device=device)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step


device = dk.try_gpu()
train_step = make_trainer(device)

bar = tqdm(range(500), desc="training")
sinks = [dk.ProgressBarSink(bar)]
with dk.detect_syncs() as syncs, dk.LogBuffer(flush_every=50, sinks=sinks) as logs:
    for step in bar:
        logs.log(step, loss=train_step())
bar.close()
print(f"LogBuffer: {len(logs.history)} losses recorded, last {logs.latest['loss']:.4f}")
print(f"  {syncs.summary()}")

with dk.detect_syncs() as syncs:
    losses = [train_step().item() for _ in range(100)]
print(f".item() every step, 100 steps:\n  {syncs.summary().splitlines()[0]}")

del train_step  # the model, optimizer and data go with it
print(dk.free_memory())
