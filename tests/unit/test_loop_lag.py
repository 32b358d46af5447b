"""The event loop's lag probe: a stall of the loop is reported as the lateness of its sleep."""

from __future__ import annotations

import asyncio
import time

from gateway.background import LoopLagProbe, own_stall


async def test_a_stalled_loop_is_reported_as_late_and_an_idle_one_is_not() -> None:
    lags: list[float] = []
    probe = LoopLagProbe(0.01, lags.append)
    await probe.start()
    await asyncio.sleep(0.1)  # idle: every sample about on time
    idle = list(lags)
    time.sleep(0.2)  # noqa: ASYNC251 (the point: a stall, nothing on the loop runs for 200 ms)
    await asyncio.sleep(0.05)
    await probe.stop()
    stalled = lags[len(idle):]
    assert len(idle) >= 3, idle
    assert sorted(idle)[len(idle) // 2] < 0.05, idle
    assert max(stalled) >= 0.15, stalled  # the sample that spanned the stall
    assert all(lag >= 0 for lag in lags)
    count = len(lags)
    await asyncio.sleep(0.05)
    assert len(lags) == count  # stopped: no more samples


async def test_an_interval_of_zero_takes_no_samples() -> None:
    lags: list[float] = []
    probe = LoopLagProbe(0, lags.append)
    await probe.start()
    await asyncio.sleep(0.05)
    await probe.stop()
    assert lags == []


def test_a_timeout_is_the_gateways_own_stall_when_the_loop_stood_still_for_half_of_it_or_more() -> None:
    asked: list[float] = []

    def stalled_since(since: float) -> float:
        asked.append(since)
        return 1.0

    assert own_stall(stalled_since, 5.0, 2.0) == 1.0  # half of the 2 s: the gateway's
    assert own_stall(stalled_since, 5.0, 1.9) == 1.0
    assert own_stall(stalled_since, 5.0, 2.1) is None  # less than half: the peer's
    assert own_stall(lambda since: 0.0, 5.0, 2.0) is None  # the probe off: never the gateway's
    assert asked == [5.0, 5.0, 5.0]  # the stalls counted are those since the timeout began
