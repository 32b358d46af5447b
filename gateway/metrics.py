"""Prometheus metrics of the gateway, on a registry of its own (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gateway_requests", "Requests answered, by model, pod and HTTP status",
            ["model", "pod", "status"], registry=r,
        )
        self.latency = Histogram(
            "gateway_request_duration_seconds", "Time from request received to response complete",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_byte_seconds",
            "Time from request received to the first response byte relayed (TTFT for streams)",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge("gateway_in_flight_requests", "Requests in flight per pod", ["pod"], registry=r)
        self.decisions = Counter(
            "gateway_routing_decisions", "Routing decisions by policy and reason", ["policy", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "gateway_retries", "Requests moved to another pod before the first byte, by failed pod and cause",
            ["pod", "cause"], registry=r,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "Pod failures seen by the proxy", ["pod", "kind"], registry=r
        )
        self.stream_aborts = Counter(
            "gateway_stream_aborts", "Streams ended early, by side", ["pod", "side"], registry=r
        )
        self.tokens = Counter(
            "gateway_tokens", "Tokens reported in usage, by model and kind", ["model", "kind"], registry=r
        )
        self.pod_healthy = Gauge("gateway_pod_healthy", "1 when the pod passes health checks", ["pod"],
                                 registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
