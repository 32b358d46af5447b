"""The time of each step of a request: how the director marks them, and how they are aggregated into
``gateway_request_step_seconds`` and the recent window of ``/debug/steps``."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from bench.metrics_text import bucket_quantile, buckets_since, histogram_buckets
from bench.runner import gateway_split
from gateway.api.http_edge import HttpEdge
from gateway.core.errors import GatewayError, upstream_failed
from gateway.core.inference_api import RequestKind
from gateway.metrics import GatewayMetrics
from gateway.proxy.outcome import Ending, RelayOutcome, RetryableFailure
from gateway.request.observers import StepMetrics
from gateway.request.timings import STEP_NAMES, RecentSteps, Step, StepTimes, quantile, timed_as
from gateway.request.types import CompletedRequest
from tests.unit.test_pipeline import chat, client_request, director, http_request


def reached(times: StepTimes) -> set[Step]:
    return {step for step in Step if not math.isnan(times.seconds[step])}


def test_a_step_never_reached_is_nan_and_one_taken_twice_adds_up():
    times = StepTimes()
    times.between(Step.CONNECT, 10.0, 10.5)
    times.between(Step.CONNECT, 20.0, 20.25)  # a retry connects again
    times.between(Step.FIRST_BYTE, 10.5, None)  # no first byte: nothing
    times.between(Step.PREFILL, 5.0, 4.0)  # clocks never run back: at least nothing
    times.mark(Step.PARSE)
    assert reached(times) == {Step.PARSE, Step.CONNECT, Step.PREFILL}
    assert times.seconds[Step.CONNECT] == 0.75 and times.seconds[Step.PREFILL] == 0.0
    assert times.seconds[Step.PARSE] >= 0.0


def test_prepare_steps_count_to_prepare_unless_they_name_their_step():
    class Tokenizing:
        timed_as = Step.TOKENIZE

    class Odd:
        timed_as = "tokenize"  # not a Step: ignored

    assert timed_as(Tokenizing()) is Step.TOKENIZE
    assert timed_as(Odd()) is timed_as(object()) is Step.PREPARE


def test_the_recent_window_keeps_the_last_times_of_each_step():
    recent = RecentSteps(size=4)
    for ms in (1, 2, 3, 4, 5, 6):
        recent.add(Step.ROUTE, ms / 1000)
    summary = recent.summary()
    assert list(summary) == list(STEP_NAMES)
    assert summary["route"] == {"seen": 6, "window": 4, "p50_ms": 4.0, "p90_ms": 6.0, "p99_ms": 6.0,
                                "mean_ms": 4.5}
    assert summary["parse"] == {"seen": 0, "window": 0}


def test_quantiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert [quantile(values, q) for q in (0.0, 0.5, 0.9, 0.99, 1.0)] == [1.0, 50.0, 90.0, 99.0, 100.0]
    assert quantile([7.0], 0.99) == 7.0


def test_step_metrics_observe_each_step_reached_once_per_request():
    metrics = GatewayMetrics()
    steps = StepMetrics(metrics, window=8)
    request = client_request(chat())
    for connect in (0.002, 0.004, 0.006):
        times = StepTimes()
        times.mark(Step.PARSE)
        times.between(Step.CONNECT, 1.0, 1.0 + connect)
        steps.completed(CompletedRequest(request, 200, time.monotonic(), 1, steps=times))
    steps.completed(CompletedRequest(request, 400, time.monotonic(), 0))  # no timings (another edge's): nothing

    def count(step: str) -> Any:
        return metrics.registry.get_sample_value("gateway_request_step_seconds_count", {"step": step})

    assert count("parse") == count("connect") == 3
    assert count("prefill") == count("first_byte") == 0
    assert math.isclose(metrics.registry.get_sample_value("gateway_request_step_seconds_sum", {"step": "connect"}),
                        0.012)
    view = steps.debug()
    assert view["connect"]["p50_ms"] == 4.0 and view["connect"]["window"] == 3
    assert view["first_byte"] == {"seen": 0, "window": 0}


async def test_the_director_times_each_step_up_to_the_first_byte():
    # The answer's headers and first byte stamped far ahead: the connect and first-byte steps are known.
    headers_at = time.monotonic() + 1000
    answer = RelayOutcome(200, Ending.COMPLETE, headers_at + 0.25, headers_at=headers_at)
    the_director, _, recorder = director([RetryableFailure(upstream_failed("refused"), "connect"), answer])
    started = time.monotonic()
    await the_director.handle(HttpEdge(http_request(chat()), the_director._proxy), RequestKind.CHAT, None)  # type: ignore[arg-type]
    ended = time.monotonic()
    done = recorder.done
    times = done.steps
    assert times is not None
    # Not disaggregated (no prefill leg), and no prepare step names tokenization.
    assert reached(times) == set(Step) - {Step.PREFILL, Step.TOKENIZE}
    assert times.seconds[Step.FIRST_BYTE] == 0.25
    # From dispatch (within the handling) to the headers: the failed try's time included, however slow the machine.
    assert headers_at - ended <= times.seconds[Step.CONNECT] <= headers_at - started
    # The steps follow each other: together they are the time to the first byte, from just after the start.
    total = sum(s for s in times.seconds if not math.isnan(s))
    assert done.first_byte_s is not None and 1000 < total <= done.first_byte_s


async def test_a_body_that_does_not_parse_times_no_step():
    the_director, _, recorder = director([])
    edge = HttpEdge(http_request({"model": "mock-llama", "max_tokens": -1}), the_director._proxy)  # type: ignore[arg-type]
    with pytest.raises(GatewayError):
        await the_director.handle(edge, RequestKind.CHAT, None)
    assert recorder.done.steps is not None and reached(recorder.done.steps) == set()


# The bench's reading of them: quantiles from the histograms' buckets, over a run


def test_quantiles_from_buckets_are_estimated_as_prometheus_does():
    buckets = {0.001: 0.0, 0.002: 40.0, 0.005: 80.0, float("inf"): 100.0}
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.002 + 0.003 * 10 / 40)  # within (2, 5] ms
    assert bucket_quantile(buckets, 0.2) == pytest.approx(0.0015)  # from the bucket's lower bound
    assert bucket_quantile(buckets, 0.99) == 0.005  # past the last finite bound: that bound
    assert bucket_quantile({0.001: 0.0, float("inf"): 0.0}, 0.5) is None and bucket_quantile({}, 0.5) is None
    assert buckets_since(buckets, {0.001: 0.0, 0.002: 40.0, 0.005: 40.0, float("inf"): 40.0}) == {
        0.001: 0.0, 0.002: 0.0, 0.005: 40.0, float("inf"): 60.0}


def test_the_bench_splits_a_run_from_the_gateways_histograms_change():
    metrics = GatewayMetrics()
    route = metrics.request_steps.labels("route")
    for _ in range(10):  # before the run: not the run's
        route.observe(0.2)
    before = metrics.render().decode()
    for _ in range(100):
        metrics.loop_lag.observe(0.0003)  # (0.25, 0.5] ms
        route.observe(0.0004)  # (0.3, 0.5] ms
    metrics.loop_lag.observe(0.3)
    after = metrics.render().decode()
    assert histogram_buckets(after, "gateway_request_step_seconds", "step")["route"][float("inf")] == 110
    split = gateway_split([before], [after])
    assert split == {"loop_lag_ms_p50": pytest.approx(0.25 + 0.25 * 50.5 / 100, abs=1e-3),
                     "loop_lag_ms_p99": pytest.approx(0.5, abs=1e-3),
                     "step_route_ms_p50": pytest.approx(0.3 + 0.2 * 50 / 100, abs=1e-3)}
    # Two gateways (replicas): their histograms add up.
    assert gateway_split([before, before], [after, after])["step_route_ms_p50"] == split["step_route_ms_p50"]
