"""``explain_oom``'s error against the real peers' retry loops: accelerate, Lightning.

accelerate's ``find_executable_batch_size`` (which transformers' Trainer uses
for ``auto_find_batch_size``) and Lightning's batch-size finder halve the
batch when their predicate says an error is out of memory: a ``RuntimeError``
with one argument, in which torch's words appear. Each predicate must say of
the explained error what it says of torch's own.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import devicekit as dk

# torch's own texts: the caching allocator's (c10/cuda/CUDACachingAllocator.cpp), and the
# CPU allocator's (c10/core/impl/alloc_cpu.cpp), raised as each is raised.
CUDA = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.11 GiB "
    "of which 3.19 MiB is free. Of the allocated memory 76.10 GiB is allocated by PyTorch, and "
    "512.50 MiB is reserved by PyTorch but unallocated."
)
CPU = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"
)
RAW = [torch.OutOfMemoryError(CUDA), RuntimeError(CPU)]


def explained(raw: BaseException) -> BaseException:
    """What leaves ``with dk.explain_oom():`` when ``raw`` is raised in it."""
    with pytest.raises(RuntimeError) as caught, dk.explain_oom():
        raise raw
    return caught.value


def accelerate_check() -> Callable[[BaseException], bool]:
    memory = pytest.importorskip("accelerate.utils.memory")
    check: Callable[[BaseException], bool] = memory.should_reduce_batch_size
    return check


def lightning_check() -> Callable[[BaseException], bool]:
    memory = pytest.importorskip("lightning.pytorch.utilities.memory")
    check: Callable[[BaseException], bool] = memory.is_oom_error
    return check


@pytest.mark.parametrize(
    "peer", [accelerate_check, lightning_check], ids=["accelerate", "lightning"]
)
@pytest.mark.parametrize("raw", RAW, ids=["cuda", "cpu"])
def test_the_peer_s_predicate_holds_for_the_explained_error_as_for_torch_s(
    peer: Callable[[], Callable[[BaseException], bool]], raw: BaseException
) -> None:
    is_oom = peer()
    assert is_oom(raw)  # so the test can fail: the peer knows torch's error
    error = explained(raw)
    assert isinstance(error, dk.DeviceOutOfMemoryError)
    assert is_oom(error)


def test_accelerate_s_finder_searches_down_through_an_explained_step() -> None:
    memory = pytest.importorskip("accelerate.utils.memory")

    def search(step: Callable[[int], None]) -> tuple[int, list[int]]:
        tried: list[int] = []

        @memory.find_executable_batch_size(starting_batch_size=64)
        def train(batch_size: int) -> int:
            tried.append(batch_size)
            step(batch_size)
            return batch_size

        return train(), tried

    def plain(batch_size: int) -> None:
        if batch_size > 8:
            raise torch.OutOfMemoryError(CUDA)

    found, tried = search(plain)
    assert found == 8
    assert search(dk.explain_oom(plain)) == (found, tried)  # was: gave up after [64]


def test_lightning_s_finder_predicate_holds_for_a_decorated_step_s_error() -> None:
    memory = pytest.importorskip("lightning.pytorch.utilities.memory")

    @dk.explain_oom
    def step() -> None:
        raise torch.OutOfMemoryError(CUDA)

    with pytest.raises(dk.DeviceOutOfMemoryError) as caught:
        step()
    assert memory.is_oom_error(caught.value)
