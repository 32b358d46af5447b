"""The gateway's KV-event subscriptions as a whole: stopping them all (at shutdown) over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import logging

from gateway.config import PodConfig
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriptions import KvEventService
from gateway.pods.registry import Pod
from simulator.pod import free_port


def pod(i: int) -> Pod:
    config = PodConfig(name=f"pod{i}", url=f"http://127.0.0.1:{free_port()}", models=["m"],
                       kv_events=f"tcp://127.0.0.1:{free_port()}", kv_replay=f"tcp://127.0.0.1:{free_port()}")
    return Pod(config=config, name=config.name, url=config.url)


async def test_subscriptions_stop_together_and_each_even_if_another_fails(caplog):
    """The stops run at once (one after another, each waits a turn of a loop that a busy fleet's events keep
    full: 26 s for 1,000 pods); one that fails is logged and the others are still stopped."""
    service = KvEventService(PrefixIndex())
    for i in range(4):
        service.add_pod(pod(i))
    subs = service.subscribers()
    together = asyncio.Barrier(len(subs))  # passed only if every stop is under way before any finishes
    stopped: list[str] = []

    def stop_of(sub):
        real_stop = sub.stop

        async def stop() -> None:
            await asyncio.wait_for(together.wait(), 5)
            if sub.view.pod == "pod1":
                raise RuntimeError("socket already gone")
            await real_stop()
            stopped.append(sub.view.pod)

        return stop

    for sub in subs:
        sub.stop = stop_of(sub)
    with caplog.at_level(logging.ERROR, logger="gateway.kv"):
        await service.stop()
    assert sorted(stopped) == ["pod0", "pod2", "pod3"]
    assert all(task.done() for sub in subs if sub.view.pod != "pod1" for task in sub._tasks)
    assert "pod pod1 rank 0: its KV-event subscription failed to stop" in caplog.text
    assert service.subscribers() == []
    for task in subs[1]._tasks:  # pod1's own stop failed before it cancelled anything (its sockets are closed)
        task.cancel()
