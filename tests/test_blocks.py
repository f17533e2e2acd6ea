"""``with`` blocks made by a call (`_blocks.EnterOnce`): entered once, decorating with care."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import devicekit as dk
from devicekit._blocks import EnterOnce


def test_a_block_that_refused_its_arguments_was_never_entered() -> None:
    # Before, it read "entered", and a second with said it was entered already.
    block = dk.visible_devices("0,0")
    with pytest.raises(ValueError, match=r"0"), block:
        pass
    assert repr(block) == "<dk.visible_devices('0,0') block, not entered yet>"
    with pytest.raises(ValueError, match=r"0"), block:  # the same refusal, not "entered"
        pass


def test_leaving_a_block_never_entered_says_so() -> None:
    # Before, a bare AssertionError.
    with pytest.raises(
        RuntimeError,
        match=r"^dk.memory_scope\(\) was left without being entered: call __enter__ first, or "
        r"write with dk.memory_scope\(\) as scope: \.\.\.$",
    ):
        dk.memory_scope().__exit__(None, None, None)


def test_reading_what_the_block_gives_off_the_call_says_the_with_gives_it() -> None:
    # Before: "... then devices.devices".
    with pytest.raises(
        AttributeError,
        match=r"^dk.visible_devices\(\[1\]\) has no .devices: it has not run yet; its `with` "
        r"gives the devices itself: with dk.visible_devices\(\[1\]\) as devices: \.\.\.$",
    ):
        dk.visible_devices([1]).devices  # noqa: B018 - the read is the test


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (dk.memory_scope, r"each call's report would be lost"),
        (dk.claim_gpu, r"the function would never learn which device was claimed"),
        (dk.detect_syncs, r"in mode='record', each call's report would be lost"),
    ],
)
def test_blocks_whose_value_a_decorator_would_lose_are_no_decorators(
    make: object, why: str
) -> None:
    # Before, each decorated call made its report (or claimed its GPU) for nothing.
    def step() -> None:
        pass

    with pytest.raises(TypeError, match=rf"cannot decorate .*step: {why}"):
        make()(step)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("make", "name", "gives"),
    [
        (lambda: dk.visible_devices(1), r"dk.visible_devices\(1\)", "devices"),
        (lambda: dk.detect_syncs(mode="error"), r"dk.detect_syncs\(\)", "syncs"),
    ],
)
def test_no_block_decorates_a_function_whose_body_runs_after_the_call(
    make: Callable[[], Any], name: str, gives: str
) -> None:
    # Before, the block opened and closed around making the generator or coroutine: the
    # body ran outside it (CUDA_VISIBLE_DEVICES back to its old value, syncs unwatched).
    def steps() -> Iterator[str | None]:
        yield os.environ.get("CUDA_VISIBLE_DEVICES")

    async def step() -> None:
        pass

    async def agen() -> AsyncIterator[int]:
        yield 1

    for fn, kind in [
        (steps, "a generator function"),
        (step, "an async function"),
        (agen, "an async generator function"),
        (functools.partial(steps), "a generator function"),
    ]:
        with pytest.raises(
            TypeError,
            match=rf"^{name} cannot decorate .*, {kind}: its body runs after the call returns, "
            r"outside the block, so the block would cover none of it; open the block in its "
            rf"body instead: with {name} as {gives}: \.\.\.$",
        ):
            make()(fn)


def test_a_plain_function_is_decorated_with_a_fresh_block_per_call() -> None:
    made = []

    def make() -> contextlib.AbstractContextManager[int]:
        made.append(1)
        return contextlib.nullcontext(len(made))

    @EnterOnce(make, again="again")
    def step(x: int) -> int:
        return x + 1

    assert [step(1), step(2)] == [2, 3]
    assert len(made) == 2
