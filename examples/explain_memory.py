"""Where did my memory go? An out-of-memory report, a leak finder and a batch-size finder.

Runs on the CPU; on a GPU it uses the GPU, and its out-of-memory errors are real.

1. dk.explain_oom: turn an out-of-memory error into a report with fixes.
2. dk.find_leaks: the classic leak, keeping a loss whose graph is alive, found with its line.
3. dk.find_batch_size: the largest batch that fits, and the allocator left as it was.
"""

import torch

import devicekit as dk

device = dk.try_gpu()
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(batch_size: int) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.randn(batch_size, 1024, device=device)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


# 1. An allocation no device can serve: a shape gone wrong (a batch of 2**40 rows).
train_step(8)  # gradients exist now, so the report can name them too
print("1. dk.explain_oom")
try:
    with dk.explain_oom(model=model, top=4):
        torch.empty(2**40, 1024, device=device)
except torch.OutOfMemoryError as error:  # DeviceOutOfMemoryError is one
    print(error)

# 2. A leak: a loss keeps its graph, and the graph keeps the activations saved for
# backward(), until backward() frees them. A validation loss never gets a backward(),
# so keeping it keeps all of that: 4 tensors a call here (the input, two activations and
# the loss itself). The fix: keep a number (.item()), or compute it under torch.no_grad().
print("\n2. dk.find_leaks")


def validation_loss() -> torch.Tensor:
    return model(torch.randn(64, 1024, device=device)).pow(2).mean()


val_losses = []
print("keeping the loss tensor:")
print(dk.find_leaks(lambda: val_losses.append(validation_loss())))
val_losses.clear()
print("the fix, keeping loss.item():")
print(dk.find_leaks(lambda: val_losses.append(validation_loss().item())))

# 3. The largest batch that fits. A CPU has no out-of-memory error one can safely
# provoke, so there the step gets a budget and fails like torch does above it.
print("\n3. dk.find_batch_size")
budget = 8 * 2**20  # bytes the step may use, on the CPU


def step(batch_size: int) -> None:
    if device.type == "cpu" and batch_size * 4096 * 4 * 3 > budget:  # activations, roughly
        raise torch.OutOfMemoryError(f"CPU budget exceeded: batch {batch_size}")
    train_step(batch_size)


if device.type == "cuda":
    reserved = torch.cuda.memory_reserved(device)
within = "" if device.type == "cuda" else f" (with an {budget // 2**20} MiB budget on the CPU)"
print(f"largest batch that fits{within}: {dk.find_batch_size(step, max_size=2**16)}")
print(f"with 10% kept free: {dk.find_batch_size(step, max_size=2**16, margin=0.1)}")
if device.type == "cuda":
    print(f"reserved before: {reserved} bytes, after: {torch.cuda.memory_reserved(device)} bytes")
