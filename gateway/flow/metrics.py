"""Per-flow Prometheus metrics: what waits, how long, what was refused, and the tokens each flow was served.

Labelled by fairness id and priority band; ``flow_control.max_flows`` bounds how many flows there are (the
rest share their band's ``overflow`` flow). Owner: the flow controller and the flow-control step write them.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.flow.flows import FlowKey

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_KINDS = ("input", "cached_input", "output")


class FlowMetrics(Collector):
    """The counts every request touches (its outcome, its tokens) are plain tallies read at scrape time, so
    that a request that is never held costs no metric lock; what only held requests touch (the queue gauge,
    the wait histogram) is kept by ``prometheus_client`` itself."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._queued = Gauge("gateway_flow_queued", "Requests held at the gateway now, by flow",
                             ["fairness_id", "priority"], registry=registry)
        self._wait = Histogram("gateway_flow_wait_seconds", "How long requests that were held waited before "
                               "they were dispatched, by flow", ["fairness_id", "priority"], buckets=WAIT_BUCKETS,
                               registry=registry)
        self._requests: dict[FlowKey, Tally[str]] = {}
        self._tokens: dict[FlowKey, _Tokens] = {}
        self._children: dict[tuple[Any, ...], Any] = {}
        registry.register(self)

    def _child(self, metric: Any, key: FlowKey) -> Any:
        cache_key = (id(metric), key)
        child = self._children.get(cache_key)
        if child is None:
            child = self._children[cache_key] = metric.labels(key.fairness_id, str(key.priority))
        return child

    def queued(self, key: FlowKey, delta: int) -> None:
        self._child(self._queued, key).inc(delta)

    def waited(self, key: FlowKey, seconds: float) -> None:
        self._child(self._wait, key).observe(seconds)
        self.outcome(key, "after_wait")

    def outcome(self, key: FlowKey, outcome: str) -> None:
        """What flow control did with a request (at_once, after_wait, left), or why it refused it (its code)."""
        tally = self._requests.get(key)
        if tally is None:
            tally = self._requests[key] = Tally()
        tally[outcome] += 1

    def served(self, key: FlowKey, prefilled: int, cached: int, output: int) -> None:
        tokens = self._tokens.get(key)
        if tokens is None:
            tokens = self._tokens[key] = _Tokens()
        tokens.input += prefilled
        tokens.cached_input += cached
        tokens.output += output

    def forget(self, keys: Iterable[FlowKey]) -> None:
        """Drops the series of flows forgotten (none of their requests waits): a returning flow starts anew, as a
        counter after a restart does."""
        for key in keys:
            self._requests.pop(key, None)
            self._tokens.pop(key, None)
            for metric in (self._queued, self._wait):
                if self._children.pop((id(metric), key), None) is not None:
                    metric.remove(key.fairness_id, str(key.priority))

    def collect(self) -> Iterator[CounterMetricFamily]:
        requests = CounterMetricFamily(
            "gateway_flow_requests", "Requests by flow and what flow control did: at_once (dispatched without "
            "waiting), after_wait, refused (queue_full, queue_timeout, slo_unreachable), left (the client left "
            "while held)", labels=["fairness_id", "priority", "outcome"])
        for key, tally in list(self._requests.items()):
            for outcome, n in list(tally.items()):
                requests.add_metric([key.fairness_id, str(key.priority), outcome], n)
        tokens = CounterMetricFamily("gateway_flow_tokens", "Tokens served by flow and kind (input: prefilled, "
                                     "cached_input: found in the engine's cache, output)",
                                     labels=["fairness_id", "priority", "kind"])
        for key, served in list(self._tokens.items()):
            for kind in TOKEN_KINDS:
                tokens.add_metric([key.fairness_id, str(key.priority), kind], getattr(served, kind))
        yield from (requests, tokens)


class _Tokens:
    """The tokens one flow was served, by kind (see :data:`TOKEN_KINDS`)."""

    __slots__ = ("cached_input", "input", "output")

    def __init__(self) -> None:
        self.input = self.cached_input = self.output = 0
