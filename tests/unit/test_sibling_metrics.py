"""Merging the workers' expositions into one ``/metrics``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.cluster.sibling_metrics import merge_expositions
from gateway.metrics import Answer, GatewayMetrics


def worker_exposition(requests: int, in_flight: int, redis_up: int, latency: float) -> str:
    metrics = GatewayMetrics()
    for _ in range(requests):
        metrics.request_done(Answer("m", "pod-a", 200, "/v1/chat/completions", "ok"), latency, None, (10, 2))
    metrics.in_flight.labels("pod-a").set(in_flight)
    from prometheus_client import Gauge

    Gauge("gateway_shared_state_redis_up", "up", registry=metrics.registry).set(redis_up)
    return metrics.render().decode()


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_counters_and_histograms_sum_gauges_take_the_highest_redis_up_the_lowest():
    merged = samples(merge_expositions([worker_exposition(3, 4, 1, 0.02), worker_exposition(2, 4, 0, 3.0)],
                                       workers=3, unscraped=1))
    labels = (("model", "m"), ("outcome", "ok"), ("pod", "pod-a"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert merged[("gateway_requests_total", labels)] == 5
    assert merged[("gateway_tokens_total", (("kind", "prompt"), ("model", "m")))] == 50
    assert merged[("gateway_request_duration_seconds_count", (("model", "m"),))] == 5
    assert merged[("gateway_request_duration_seconds_bucket", (("le", "0.025"), ("model", "m")))] == 3
    assert merged[("gateway_in_flight_requests", (("pod", "pod-a"),))] == 4  # shared state: not 8
    assert merged[("gateway_shared_state_redis_up", ())] == 0
    assert merged[("gateway_workers", ())] == 3 and merged[("gateway_workers_unscraped", ())] == 1
    assert not any(name.endswith("_created") for name, _ in merged)
