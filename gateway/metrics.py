"""Prometheus metrics of the gateway, on a registry of its own (several apps may share a process).

Each family is declared by its owner: this module declares those of the HTTP edge, the proxy, the pods and
routing; a feature declares its own in its module (``gateway/kv/verification.py``, ``gateway/flow/metrics.py``,
...), on the one registry. Names, labels and help texts are what dashboards and alerts read: never renamed."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Generic, NamedTuple, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from gateway.config import POD_ROLES
from gateway.loop_histogram import LoopHistogram

LOOP_LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# A request's steps (gateway.request.timings): tens of microseconds (a parse) to seconds (a pod's prefill).
STEP_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01,
                0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# The ``model`` label of a name the gateway does not serve (a client's name is no label), and the ``route`` label
# of a request no route matched (its path is the client's to choose).
UNKNOWN_MODEL = "unknown"
UNMATCHED_ROUTE = "unmatched"
# The longest label value exported: a name the config or the fleet gives (a model, a pod, a tenant) may be
# longer, and each character is written into every series of every scrape.
MAX_LABEL_CHARS = 256
_DIGEST_CHARS = 8
F = TypeVar("F")  # a feature's class of families (see GatewayMetrics.owned)
M = TypeVar("M", bound=MetricWrapperBase)


def capped(value: str) -> str:
    """``value`` as a label of at most :data:`MAX_LABEL_CHARS` characters: a longer one is its beginning, ``~``
    and a digest of the whole (two long names alike at first stay two series)."""
    if len(value) <= MAX_LABEL_CHARS:
        return value
    digest = hashlib.blake2s(value.encode(errors="replace"), digest_size=_DIGEST_CHARS // 2).hexdigest()
    return f"{value[:MAX_LABEL_CHARS - _DIGEST_CHARS - 1]}~{digest}"


class Children(Generic[M]):
    """A family's children by their label values, each looked up once: ``labels()`` checks its arguments and
    takes a lock, and costs more than the observation it serves. Only for values of a bounded set (names the
    config or the fleet gives): every one asked for is kept."""

    __slots__ = ("_children", "_family")

    def __init__(self, family: M) -> None:
        self._family = family
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._family.labels(*values)
        return child


class Answer(NamedTuple):
    """One answer's labels in ``gateway_requests_total``."""

    model: str
    pod: str
    status: int
    route: str
    outcome: str


class GatewayMetrics:
    """The one registry, and the families of what every request passes through: the HTTP edge (answers, their
    times and tokens, the steps, the loop), the proxy, the pods and routing. A feature declares its own
    families in its own module, on this registry (:meth:`owned`, or the registry handed to it)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._declare_answers(r)
        self._declare_proxy(r)
        self._declare_pods(r)
        self._declare_routing(r)
        self._per_request: dict[Answer, tuple] = {}
        self._owned: dict[type, object] = {}

    def owned(self, families: type[F]) -> F:
        """A feature's own families (``families``: a class of its module that declares them on the registry it
        is given), declared on this registry once, by whichever of the feature's parts asks first."""
        declared = self._owned.get(families)
        if declared is None:
            declared = self._owned[families] = families(self.registry)  # type: ignore[call-arg]
        return declared  # type: ignore[return-value]

    def _declare_answers(self, r: CollectorRegistry) -> None:
        """What every answer is counted by (labels, time, first byte, tokens, steps), and the loop it waited on."""
        self.requests = Counter(
            "gateway_requests", "Requests answered, each once: by model (a name the gateway serves, else "
            "unknown), pod, the HTTP status the client got, route (the path template, or unmatched) and outcome "
            "(ok, error, or how a stream that began with 200 ended: engine_error, malformed, upstream_broke, "
            "client_gone, client_stalled)",
            ["model", "pod", "status", "route", "outcome"], registry=r,
        )
        self.latency = LoopHistogram(
            "gateway_request_duration_seconds", "Time from request received to response complete",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = LoopHistogram(
            "gateway_time_to_first_byte_seconds",
            "Time from request received to the first response byte relayed (TTFT for streams)",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens", "Tokens reported in usage, by model and kind", ["model", "kind"], registry=r
        )
        self.request_steps = LoopHistogram(
            "gateway_request_step_seconds",
            "Time of each step of a request, by step: parse, tokenize, prepare, admit, route, dispatch, prefill, "
            "connect (sent until the pod's headers), first_byte (headers until the first byte)",
            ["step"], buckets=STEP_BUCKETS, registry=r,
        )
        self.loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            "How much later than asked the event loop woke a sleeping task (sampled every "
            "server.loop_lag_interval_s): what a request waiting on the loop waited too",
            buckets=LOOP_LAG_BUCKETS, registry=r,
        )

    def _declare_proxy(self, r: CollectorRegistry) -> None:
        """What the proxy saw go wrong with a pod: retries, failures, stalled connects, streams cut."""
        self.retries = Counter(
            "gateway_retries", "Requests moved to another pod before the first byte, by failed pod and cause",
            ["pod", "cause"], registry=r,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "Pod failures seen by the proxy", ["pod", "kind"], registry=r
        )
        self.stalled_connects = Counter(
            "gateway_stalled_connects", "Connects sent to their pod again because their timeout ran out while "
            "the gateway's event loop stood still (not the pod's failure)", ["pod"], registry=r,
        )
        self.stream_aborts = Counter(
            "gateway_stream_aborts", "Streams ended early, by side", ["pod", "side"], registry=r
        )

    def _declare_pods(self, r: CollectorRegistry) -> None:
        """Each pod's live numbers and state, exported per pod while it is in the fleet."""
        self.in_flight = Gauge("gateway_in_flight_requests", "Requests in flight per pod", ["pod"], registry=r)
        self.pending_load = Gauge("gateway_pod_pending_load", "Little's-law pending load (1 = full)", ["pod"],
                                  registry=r)
        self.kv_usage = Gauge("gateway_pod_kv_usage", "KV-cache usage the pod reports (0-1)", ["pod"], registry=r)
        self.pod_role = Gauge("gateway_pod_role", "1 for the role each pod plays: prefill, decode or both",
                              ["pod", "role"], registry=r)
        self.pod_healthy = Gauge("gateway_pod_healthy", "1 when the pod passes health checks", ["pod"],
                                 registry=r)
        # Written by the pressure monitor alone, but a pod's gauge, gone with the pod (:meth:`forget_pod`),
        # and exported whether or not pressure is on.
        self.pressure_mode = Gauge(
            "gateway_pod_pressure_mode", "KV pressure mode (0 relaxed .. 4 emergency)", ["pod"], registry=r
        )

    def _declare_routing(self, r: CollectorRegistry) -> None:
        """How requests were routed (by any policy or plugin), and the cached prefixes their pods held."""
        self.decisions = Counter(
            "gateway_routing_decisions", "Routing decisions by policy and reason", ["policy", "reason"],
            registry=r,
        )
        self._decisions = Children(self.decisions)
        self.prefix_hit_tokens = LoopHistogram(
            "gateway_prefix_hit_tokens", "Cached prompt tokens predicted on the chosen pod, per decision",
            ["policy"], buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536), registry=r,
        )
        self.lookup_seconds = LoopHistogram(
            "gateway_prefix_lookup_seconds", "Prefix index lookup time per routing decision", [],
            buckets=(0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01), registry=r,
        )
        self.routing_plugin_seconds = LoopHistogram(
            "gateway_routing_plugin_seconds", "Time of each call of a plugin, by kind and name: a routing policy's "
            "part (kind filter, preparer, scorer or picker; the router measures it) or a request hook (kind "
            "pre_request or response_complete; the director measures it)", ["kind", "plugin"],
            buckets=(0.000005, 0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03), registry=r,
        )

    def watch_pod(self, pod: str, in_flight: Callable[[], float], pending_load: Callable[[], float],
                  kv_usage: Callable[[], float]) -> None:
        """Export the pod's live numbers, read at scrape time (nothing to update per request)."""
        self.in_flight.labels(pod).set_function(in_flight)
        self.pending_load.labels(pod).set_function(pending_load)
        self.kv_usage.labels(pod).set_function(kv_usage)

    def forget_pod(self, pod: str) -> None:
        """The pod left the fleet: its per-pod gauges go (a pod that comes back is exported anew)."""
        for gauge, labels in ((self.in_flight, (pod,)), (self.pending_load, (pod,)), (self.kv_usage, (pod,)),
                              (self.pod_healthy, (pod,)), *((self.pod_role, (pod, role)) for role in POD_ROLES)):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)

    def decision_made(self, policy: str, reason: str) -> None:
        self._decisions(policy, reason).inc()

    def request_done(
        self, answer: Answer, seconds: float, first_byte_s: float | None, usage: tuple[int, int] | None,
    ) -> None:
        """Everything observed when a request ends (labelled children cached: ``labels()`` is slow)."""
        children = self._per_request.get(answer)
        if children is None:
            model = answer.model
            children = self._per_request[answer] = (
                self.requests.labels(model, answer.pod, str(answer.status), answer.route, answer.outcome),
                self.latency.labels(model),
                self.ttft.labels(model),
                self.tokens.labels(model, "prompt"),
                self.tokens.labels(model, "completion"),
            )
        requests, latency, ttft, prompt_tokens, completion_tokens = children
        requests.inc()
        latency.observe(seconds)
        if first_byte_s is not None:
            ttft.observe(first_byte_s)
        if usage:
            prompt_tokens.inc(usage[0])
            completion_tokens.inc(usage[1])

    def render(self) -> bytes:
        return generate_latest(_CappedLabels(self.registry))  # type: ignore[arg-type]


class _CappedLabels:
    """The registry as exported: a label value past :data:`MAX_LABEL_CHARS` is :func:`capped` in whichever
    family it is (the steps that label with a name capped it already; this keeps the bound for every other)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if any(len(value) > MAX_LABEL_CHARS for sample in family.samples for value in sample.labels.values()):
                family.samples = [sample._replace(labels={k: capped(v) for k, v in sample.labels.items()})
                                  for sample in family.samples]
            yield family
