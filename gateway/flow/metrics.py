"""Per-flow Prometheus metrics: what waits, how long, what was refused, and the tokens each flow was served.

Labelled by tenant and priority band, as the config names them (:class:`FlowLabels`): a client chooses its
fairness id and band by header, so any the config does not name is counted as ``other``, and the series stay
as many as the config's tenants and bands whatever clients send. Owner: the flow controller and the
flow-control step write them.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.config import ApiKeyConfig, FlowControlConfig
from gateway.flow.flows import DEFAULT_FAIRNESS_ID, OVERFLOW_FAIRNESS_ID, FlowKey
from gateway.metrics import capped

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_KINDS = ("input", "cached_input", "output")
OTHER = "other"  # the label of a fairness id or a band the config does not name
Labels = tuple[str, str]  # (fairness_id, priority) as exported


class FlowLabels:
    """A flow's labels: its fairness id when the config names it (a tenant of ``flow_control.tenants``, a
    key's tenant of ``flow_control.keys`` or of its own ``auth.keys[].tenant``, an API key's name that is its
    own tenant, ``default``, ``overflow``), else ``other``; its band when an objective of
    ``flow_control.objectives`` has it (or 0), else ``other``. ``config``: the flow-control config in force
    (read again after a reload)."""

    CACHED = 4096  # flows whose labels are kept at once (every request asks: a lookup costs less)

    def __init__(self, config: Callable[[], FlowControlConfig], key_names: Iterable[str] = (),
                 key_tenants: Iterable[str] = ()) -> None:
        self._config = config
        self._key_names = frozenset(name for name in key_names if name)
        self._key_tenants = frozenset(tenant for tenant in key_tenants if tenant)
        self._read: FlowControlConfig | None = None  # the config the sets below were made from
        self._tenants: frozenset[str] = frozenset()
        self._bands: dict[int, str] = {}
        self._cached: dict[FlowKey, Labels] = {}

    @classmethod
    def of_keys(cls, config: Callable[[], FlowControlConfig], keys: Iterable[ApiKeyConfig]) -> FlowLabels:
        """The labels of a gateway with these API keys: each key's tenant, named or its own name."""
        keys = list(keys)
        return cls(config, [k.name for k in keys if k.tenant is None], [k.tenant for k in keys if k.tenant])

    def of(self, key: FlowKey) -> Labels:
        if self._config() is not self._read:
            self._learn(self._config())
        labels = self._cached.get(key)
        if labels is None:
            if len(self._cached) >= self.CACHED:  # a crowd of invented flows: start again
                self._cached.clear()
            tenant = key.fairness_id
            labels = self._cached[key] = (capped(tenant) if tenant in self._tenants else OTHER,
                                          self._bands.get(key.priority, OTHER))
        return labels

    def _learn(self, config: FlowControlConfig) -> None:
        self._read = config
        self._cached.clear()
        self._tenants = frozenset({DEFAULT_FAIRNESS_ID, OVERFLOW_FAIRNESS_ID, *config.tenants, *config.keys.values(),
                                   *self._key_tenants, *(self._key_names - config.keys.keys())})
        self._bands = {band: str(band) for band in {0, *(o.priority for o in config.objectives.values())}}


class FlowMetrics(Collector):
    """The counts every request touches (its outcome, its tokens) are plain tallies read at scrape time, so
    that a request that is never held costs no metric lock; the wait histogram, which only held requests
    touch, is kept by ``prometheus_client`` itself. The requests held now are counted per flow and labelled
    when scraped (a reload may name a flow anew while its requests wait)."""

    def __init__(self, registry: CollectorRegistry, labels: FlowLabels | None = None) -> None:
        if labels is None:  # the defaults': flows are default or other, in band 0 or other
            defaults = FlowControlConfig()
            labels = FlowLabels(lambda: defaults)
        self._labels = labels
        self._wait = Histogram("gateway_flow_wait_seconds", "How long requests that were held waited before "
                               "they were dispatched, by flow", ["fairness_id", "priority"], buckets=WAIT_BUCKETS,
                               registry=registry)
        self._queued: dict[FlowKey, int] = {}  # requests held now, per flow that has any
        self._queued_seen: set[Labels] = set()  # the labels that had some (exported at 0 once none wait)
        self._requests: dict[Labels, Tally[str]] = {}
        self._tokens: dict[Labels, _Tokens] = {}
        self._wait_children: dict[Labels, Any] = {}
        registry.register(self)

    def queued(self, key: FlowKey, delta: int) -> None:
        held = self._queued.get(key, 0) + delta
        if held:
            self._queued[key] = held
        else:
            self._queued.pop(key, None)

    def waited(self, key: FlowKey, seconds: float) -> None:
        labels = self._labels.of(key)
        child = self._wait_children.get(labels)
        if child is None:
            child = self._wait_children[labels] = self._wait.labels(*labels)
        child.observe(seconds)
        self.outcome(key, "after_wait")

    def outcome(self, key: FlowKey, outcome: str) -> None:
        """What flow control did with a request (at_once, after_wait, left), or why it refused it (its code)."""
        labels = self._labels.of(key)
        tally = self._requests.get(labels)
        if tally is None:
            tally = self._requests[labels] = Tally()
        tally[outcome] += 1

    def served(self, key: FlowKey, prefilled: int, cached: int, output: int) -> None:
        labels = self._labels.of(key)
        tokens = self._tokens.get(labels)
        if tokens is None:
            tokens = self._tokens[labels] = _Tokens()
        tokens.input += prefilled
        tokens.cached_input += cached
        tokens.output += output

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        queued = GaugeMetricFamily("gateway_flow_queued", "Requests held at the gateway now, by flow",
                                   labels=["fairness_id", "priority"])
        held = dict.fromkeys(self._queued_seen, 0)
        for key, n in list(self._queued.items()):
            labels = self._labels.of(key)
            held[labels] = held.get(labels, 0) + n
        self._queued_seen.update(held)
        for labels, n in held.items():
            queued.add_metric(list(labels), n)
        requests = CounterMetricFamily(
            "gateway_flow_requests", "Requests by flow and what flow control did: at_once (dispatched without "
            "waiting), after_wait, refused (queue_full, queue_timeout, slo_unreachable), left (the client left "
            "while held)", labels=["fairness_id", "priority", "outcome"])
        for labels, tally in list(self._requests.items()):
            for outcome, n in list(tally.items()):
                requests.add_metric([*labels, outcome], n)
        tokens = CounterMetricFamily("gateway_flow_tokens", "Tokens served by flow and kind (input: prefilled, "
                                     "cached_input: found in the engine's cache, output)",
                                     labels=["fairness_id", "priority", "kind"])
        for labels, served in list(self._tokens.items()):
            for kind in TOKEN_KINDS:
                tokens.add_metric([*labels, kind], getattr(served, kind))
        yield from (queued, requests, tokens)


class _Tokens:
    """The tokens one flow was served, by kind (see :data:`TOKEN_KINDS`)."""

    __slots__ = ("cached_input", "input", "output")

    def __init__(self) -> None:
        self.input = self.cached_input = self.output = 0
