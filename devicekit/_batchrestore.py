"""``find_batch_size(restore=...)``: put back what the search's trial steps changed.

Each trial runs a real step, so a step with ``optimizer.step()`` trains the
model on the search's batches, fills the optimizer's state, leaves
gradients and moves torch's random number generator on. Lightning's
batch-size finder restores the model for this reason. The objects given
(anything with ``state_dict()`` and ``load_state_dict()``: a module, an
optimizer, a learning-rate scheduler, a ``GradScaler``) are saved before the
first trial and loaded again after the last, however the search ended; a
module's gradients and torch's CPU generator (and CUDA's, where CUDA had
started before the search) are put back too.

The saved states are serialized to host memory (``torch.save`` into bytes):
a copy in device memory would take from what the trials measure, and a
reference would follow the trials' in-place updates. Loading one back holds
its bytes and the loaded copy at once: twice its size, briefly, one object
at a time.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._shortrepr import got
from ._visible import torch_cuda_initialized

__all__ = ["saved_states"]


def _checked(restore: object) -> list[Any]:
    """The objects of ``restore``, each with ``state_dict`` and ``load_state_dict``."""
    # One model given alone (an nn.Sequential iterates its layers), a tensor (its rows).
    alone = hasattr(restore, "state_dict") or isinstance(restore, torch.Tensor)
    if alone or isinstance(restore, (str, bytes)) or not isinstance(restore, Iterable):
        raise TypeError(
            "restore must be a list of objects whose state to put back (a model, its "
            f"optimizer: restore=[model, optimizer]), got {got(restore)}"
            + ("; put it in a list: restore=[model]" if alone else "")
        )
    objects = list(restore)
    if not objects:
        return objects
    for index, obj in enumerate(objects):
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"restore[{index}] must have state_dict() and load_state_dict() (a module, an "
                f"optimizer, a learning-rate scheduler, a GradScaler), got {got(obj)}"
            )
    return objects


def _refuse_lazy(obj: object, index: int) -> None:
    """Refuse a module with lazy parameters not made yet: its state cannot be loaded back."""
    if not isinstance(obj, torch.nn.Module):
        return
    lazy = [
        name
        for name, tensor in [*obj.named_parameters(), *obj.named_buffers()]
        if torch.nn.parameter.is_lazy(tensor)
    ]
    if lazy:
        raise ValueError(
            f"restore[{index}] ({type(obj).__name__}) has lazy parameters not made yet "
            f"({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}), whose state cannot be "
            "loaded back after the trials make them: run one forward pass first"
        )


def _grad_scalers() -> tuple[type, ...]:
    """The GradScaler class of ``torch.amp`` (``torch.cuda.amp``'s is a subclass of it)."""
    from torch.amp import GradScaler  # noqa: PLC0415 - only with restore

    return (GradScaler,)


def saved_states(restore: object) -> Callable[[], None]:
    """Save what ``restore`` holds (and torch's generators); return what puts it all back.

    Raises:
        TypeError: ``restore`` is not a list of objects with ``state_dict()``
            and ``load_state_dict()``, or a state does not pickle.
        ValueError: A module has lazy parameters not made yet.
    """
    objects = _checked(restore)
    if not objects:
        return lambda: None
    states = []
    for index, obj in enumerate(objects):
        _refuse_lazy(obj, index)
        buffer = io.BytesIO()
        try:
            torch.save(obj.state_dict(), buffer)
        except Exception as error:  # pickling runs the state's own code: anything
            raise TypeError(
                f"restore[{index}] ({type(obj).__name__}) cannot be saved to be put back: its "
                f"state_dict() does not pickle ({type(error).__name__}: {error}); leave it out "
                "of restore, and save and load it yourself around the search"
            ) from error
        states.append(buffer)
    grads = [
        (
            parameter,
            None if parameter.grad is None else parameter.grad.detach().to("cpu", copy=True),
        )
        for obj in objects
        if isinstance(obj, torch.nn.Module)
        for parameter in obj.parameters()
    ]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch_cuda_initialized() else None

    def put_back() -> None:
        for obj, state in zip(objects, states, strict=True):
            state.seek(0)
            # Our own bytes, made just above: every object a state_dict holds loads back.
            obj.load_state_dict(torch.load(state, map_location="cpu", weights_only=False))
            # A GradScaler keeps, outside its state_dict, which optimizers it unscaled since
            # its last update(): a trial stopped inside scaler.step() left it "unscaled", and
            # the next real step then skipped unscaling (an update as large as the scale).
            per_optimizer: Any = getattr(obj, "_per_optimizer_states", None)
            if isinstance(obj, _grad_scalers()) and hasattr(per_optimizer, "clear"):
                per_optimizer.clear()
        for parameter, grad in grads:
            parameter.grad = None if grad is None else grad.to(parameter.device)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    return put_back
