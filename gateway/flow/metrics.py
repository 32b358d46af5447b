"""Per-flow Prometheus metrics: what waits, how long, what was refused, and the tokens each flow was served.

Labelled by fairness id and priority band; ``flow_control.max_flows`` bounds how many flows there are (the
rest share their band's ``overflow`` flow). Owner: the flow controller and the flow-control step write them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.flow.flows import FlowKey

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OUTCOMES = ("at_once", "after_wait", "queue_full", "queue_timeout", "slo_unreachable", "left")


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._queued = Gauge("gateway_flow_queued", "Requests held at the gateway now, by flow",
                             ["fairness_id", "priority"], registry=registry)
        self._wait = Histogram("gateway_flow_wait_seconds", "How long requests that were held waited before "
                               "they were dispatched, by flow", ["fairness_id", "priority"], buckets=WAIT_BUCKETS,
                               registry=registry)
        self._requests = Counter(
            "gateway_flow_requests", "Requests by flow and what flow control did: at_once (dispatched without "
            "waiting), after_wait, refused (queue_full, queue_timeout, slo_unreachable), left (the client left "
            "while held)", ["fairness_id", "priority", "outcome"], registry=registry)
        self._tokens = Counter("gateway_flow_tokens", "Tokens served by flow and kind (input: prefilled, "
                               "cached_input: found in the engine's cache, output)",
                               ["fairness_id", "priority", "kind"], registry=registry)
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, key: FlowKey, *extra: str) -> Any:
        cache_key = (id(metric), key, *extra)
        child = self._children.get(cache_key)
        if child is None:
            child = self._children[cache_key] = metric.labels(key.fairness_id, str(key.priority), *extra)
        return child

    def queued(self, key: FlowKey, delta: int) -> None:
        self._child(self._queued, key).inc(delta)

    def at_once(self, key: FlowKey) -> None:
        self._child(self._requests, key, "at_once").inc()

    def waited(self, key: FlowKey, seconds: float) -> None:
        self._child(self._wait, key).observe(seconds)
        self._child(self._requests, key, "after_wait").inc()

    def rejected(self, key: FlowKey, reason: str) -> None:
        self._child(self._requests, key, reason).inc()

    def left(self, key: FlowKey) -> None:
        self._child(self._requests, key, "left").inc()

    def served(self, key: FlowKey, prefilled: int, cached: int, output: int) -> None:
        for kind, n in (("input", prefilled), ("cached_input", cached), ("output", output)):
            if n > 0:
                self._child(self._tokens, key, kind).inc(n)
