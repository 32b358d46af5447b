"""Stopping background tasks: a stop waits until the task has finished, and never for ever; the heap built
to start is kept out of later garbage collections."""

from __future__ import annotations

import asyncio
import gc
import weakref

from gateway.background import cancel_and_wait, freeze_start_up_heap


async def test_a_task_that_loses_a_cancellation_is_cancelled_again():
    # As a loop around Python 3.11's wait_for can: the cancellation meets a result and is dropped.
    lost = []

    async def heartbeat() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(True)  # the first is lost; the loop runs on

    task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.02)
    stop = asyncio.create_task(cancel_and_wait(task))
    await asyncio.wait({stop}, timeout=10)  # which, unlike wait_for, does not cancel it when the time is up
    assert stop.done(), "the stop still waits for a task that lost its cancellation"
    assert lost == [True] and task.cancelled()


async def test_a_task_that_failed_has_its_error_raised_and_none_is_no_task():
    async def fails() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    try:
        await cancel_and_wait(task)
    except ValueError as exc:
        assert str(exc) == "broken"
    else:
        raise AssertionError("the task's error was not raised")
    await cancel_and_wait(None)


def test_the_start_up_heap_is_frozen_once_its_garbage_is_collected():
    class Node:
        pass

    garbage = Node()
    garbage.cycle = garbage  # only a collection frees it
    collected = []
    weakref.finalize(garbage, collected.append, True)
    del garbage
    kept = [[n] for n in range(1_000)]  # what a start builds and keeps: vocabularies, templates, modules
    try:
        freeze_start_up_heap()
        assert collected == [True], "the start's garbage was frozen with the rest"
        assert gc.get_freeze_count() >= len(kept)
        tracked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert id(kept) not in tracked and id(kept[0]) not in tracked
    finally:
        gc.unfreeze()
