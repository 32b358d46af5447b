"""A connect timeout that ran out while the gateway's own event loop stood still is not the pod's failure.

On a loaded 2-core machine the gateway's loop (or the whole machine) can stop for a couple of seconds. A
connect to a pod on loopback completes in the kernel at once, but the gateway learns of it only when its
loop runs again, and then the connect's timer, long expired, fires first (asyncio and uvloop alike): the pod
was ejected, and with every pod ejected at once an e2e run answered two requests with errors. Here a real
pod on a real socket, and a real stall of the loop (``time.sleep`` on it) started just as the connect is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.background import LoopLagProbe
from gateway.cluster.bus import BusMetrics, RedisLink
from gateway.config import AuthConfig, HealthConfig, PodConfig, ServerConfig, SharedStateConfig, TimeoutConfig
from gateway.http_client import HttpClient
from gateway.metrics import GatewayMetrics
from gateway.pods.health import HealthChecker
from gateway.pods.registry import PodRegistry
from gateway.proxy.forward import Proxy
from gateway.proxy.outcome import RetryableFailure
from tests.conftest import serve_app

CONNECT_S = 1.0
STALL_S = 1.2  # past the connect timeout, and past the half of it that marks a stall the pod is not blamed for

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


class StallingClient(HttpClient):
    """The gateway's client, with the loop stopped for ``STALL_S`` just after each of its first ``stalls``
    connects began: the stall starts once the connecting task waits for the socket, as a burst of other work
    (or the machine paused) would hold the loop then."""

    def __init__(self, stalls: int) -> None:
        super().__init__()
        self.stalls = stalls

    async def start(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(self._stall_soon)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                              trace_configs=[trace])

    async def _stall_soon(self, *_: object) -> None:
        if self.stalls > 0:
            self.stalls -= 1
            asyncio.get_running_loop().call_soon(time.sleep, STALL_S)


async def _one_pod(method: str, path: str, handler: Any) -> tuple[web.AppRunner, PodRegistry]:
    """A pod on a real socket answering ``path``, and a registry of that one pod (``p0``)."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = await serve_app(app)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return runner, PodRegistry([PodConfig(url=url, name="p0", models=["m"])], HealthConfig())


async def _exchange_through_stalls(stalls: int, probe_interval_s: float) -> tuple[PodRegistry, GatewayMetrics,
                                                                                  tuple[int, bytes] | str]:
    runner, pods = await _one_pod("POST", "/v1/completions", _answer)
    metrics, http = GatewayMetrics(), StallingClient(stalls)
    probe = LoopLagProbe(probe_interval_s, metrics.loop_lag.observe)
    proxy = Proxy(pods, metrics, http, TimeoutConfig(connect_s=CONNECT_S), AuthConfig(), ServerConfig(),
                  probe.stalled_since)
    await http.start()
    await probe.start()
    try:
        await asyncio.sleep(0.2)  # the probe's sleeps under way, as in a running gateway
        return pods, metrics, await proxy.exchange(pods.get("p0"), "/v1/completions", b'{"prompt": "hi"}', {})
    except RetryableFailure as exc:
        return pods, metrics, exc.error.message
    finally:
        await probe.stop()
        await http.stop()
        await runner.cleanup()


async def _answer(request: web.Request) -> web.Response:
    return web.json_response({"text": "ok"})


def _counted(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("loop", RUNNERS)
def test_a_connect_timed_out_by_a_stall_of_the_gateways_loop_is_sent_again_and_ejects_nobody(
        loop: str, caplog: pytest.LogCaptureFixture):
    pods, metrics, answer = RUNNERS[loop](_exchange_through_stalls(stalls=1, probe_interval_s=0.05))
    assert answer == (200, b'{"text": "ok"}')
    assert pods.get("p0").ejected_at is None
    assert _counted(metrics, "gateway_stalled_connects_total", pod="p0") == 1
    assert _counted(metrics, "gateway_upstream_errors_total", pod="p0", kind="connect") == 0
    # The probe saw the stall too: it is the loop's, on record.
    assert _counted(metrics, "gateway_event_loop_lag_seconds_bucket", le="+Inf") > 0
    assert metrics.registry.get_sample_value("gateway_event_loop_lag_seconds_sum") >= STALL_S * 0.9
    logged = [r.getMessage() for r in caplog.records]
    assert any("sent again" in m and "p0" in m for m in logged), logged
    assert any(m.startswith("the event loop stood still for") for m in logged), logged


@pytest.mark.parametrize("loop", RUNNERS)
def test_the_same_stall_without_the_probe_ejects_the_pod(loop: str):
    """The hazard is real: without the probe (``server.loop_lag_interval_s: 0``) nothing tells the stall from
    a pod that does not answer, and the pod is ejected as it was before."""
    pods, metrics, answer = RUNNERS[loop](_exchange_through_stalls(stalls=1, probe_interval_s=0.0))
    assert isinstance(answer, str) and "unreachable" in answer and "timeout" in answer.lower()
    assert pods.get("p0").ejected_at is not None
    assert _counted(metrics, "gateway_upstream_errors_total", pod="p0", kind="connect") == 1
    assert _counted(metrics, "gateway_stalled_connects_total", pod="p0") == 0


@pytest.mark.parametrize("loop", RUNNERS)
def test_a_connect_that_times_out_again_after_the_stall_is_the_pods_failure(loop: str):
    """Sent again once, not for ever: a second stall through the second connect (a pod that really does not
    answer looks the same from here) ejects the pod."""
    pods, metrics, answer = RUNNERS[loop](_exchange_through_stalls(stalls=2, probe_interval_s=0.05))
    assert isinstance(answer, str) and "unreachable" in answer
    assert pods.get("p0").ejected_at is not None
    assert _counted(metrics, "gateway_stalled_connects_total", pod="p0") == 1
    assert _counted(metrics, "gateway_upstream_errors_total", pod="p0", kind="connect") == 1


class _StallingPublishes:
    """A Redis client whose publishes stand the loop still for ``STALL_S`` once each is sent, ``stalls`` times."""

    def __init__(self, client: Any, stalls: int) -> None:
        self._client, self.stalls = client, stalls

    async def publish(self, channel: str, data: bytes) -> Any:
        if self.stalls > 0:
            self.stalls -= 1
            asyncio.get_running_loop().call_soon(time.sleep, STALL_S)
        return await self._client.publish(channel, data)

    async def aclose(self) -> None:
        await self._client.aclose()


async def _publish_through_a_stall(url: str, probe_interval_s: float) -> tuple[BusMetrics, list[bytes], bool]:
    """One batch published through a stall; what the metrics say, what a subscriber got, whether the link
    was up throughout."""
    import redis.asyncio as redis

    config = SharedStateConfig(redis_url=url, channel="stall-test", redis_timeout_s=CONNECT_S)
    metrics = BusMetrics(CollectorRegistry())
    probe = LoopLagProbe(probe_interval_s, metrics.redis_up.set)  # any sink: the probe's record is its own
    received: list[bytes] = []
    listener = redis.from_url(url).pubsub()
    await listener.subscribe("stall-test")
    link = RedisLink(config, lambda data, remote: None, metrics, probe.stalled_since)
    link.start()
    await probe.start()
    ups: list[bool] = []
    try:
        await asyncio.sleep(0.3)  # the link up (its subscription answered), the probe's sleeps under way
        link._client = _StallingPublishes(link._client, stalls=1)
        link.send(b"facts")
        for _ in range(100):
            ups.append(link.up)
            message = await listener.get_message(ignore_subscribe_messages=True, timeout=0.05)
            if message is not None:
                received.append(message["data"])
            if received and not link.queue:
                break
        return metrics, received, all(ups)
    finally:
        await probe.stop()
        await link.stop()
        await listener.aclose()


@pytest.mark.parametrize("probe_interval_s", [0.05, 0.0], ids=["probe", "no probe"])
def test_a_publish_timed_out_by_a_stall_is_sent_again_at_once_and_the_link_stays_up(redis_server,
                                                                                     probe_interval_s: float):
    metrics, received, always_up = uvloop.run(_publish_through_a_stall(redis_server.url, probe_interval_s))
    errors = metrics.errors.labels("redis", "publish")._value.get()
    assert received and set(received) == {b"facts"}  # delivered (twice, when the first had reached Redis)
    if probe_interval_s:
        assert errors == 0 and always_up
    else:  # without the probe the stall looks like Redis gone: counted, the link down until the next try
        assert errors == 1 and not always_up


async def _health_check_through_a_stall(probe_interval_s: float) -> tuple[int, str | None]:
    runner, pods = await _one_pod("GET", "/health", _healthy)
    http, metrics = StallingClient(stalls=1), GatewayMetrics()
    probe = LoopLagProbe(probe_interval_s, metrics.loop_lag.observe)
    checker = HealthChecker(pods, http, HealthConfig(timeout_s=CONNECT_S), loop_stalled=probe.stalled_since)
    await http.start()
    await probe.start()
    try:
        await asyncio.sleep(0.2)
        pod = pods.get("p0")
        await checker.check(pod)
        return pod.consecutive_failures, pod.last_error
    finally:
        await probe.stop()
        await http.stop()
        await runner.cleanup()


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.mark.parametrize("probe_interval_s", [0.05, 0.0], ids=["probe", "no probe"])
def test_a_health_check_timed_out_by_a_stall_counts_as_no_failure(probe_interval_s: float):
    failures, error = uvloop.run(_health_check_through_a_stall(probe_interval_s))
    if probe_interval_s:
        assert failures == 0 and error is None
    else:  # without the probe: one of the failures in a row that make the pod unhealthy
        assert failures == 1 and error is not None and "TimeoutError" in error
