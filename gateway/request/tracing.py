"""OpenTelemetry tracing of the request path, as pipeline steps (the ``otel`` extra, ``tracing.enabled``).

Each request gets a server span, the child of the client's W3C ``traceparent`` when it sent one; inside
it, spans for the steps that wait (tokenization, queueing for admission), each routing decision (with
the pod, policy, reason and predicted prefix as attributes) and each upstream attempt, whose context
travels to the pod in ``traceparent``. Spans go to the OTLP/HTTP exporter configured by the standard
``OTEL_*`` variables. With tracing off none of these steps is in the pipeline, and nothing here is
imported.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from gateway.metrics import capped
from gateway.proxy.outcome import RelayOutcome
from gateway.request.pipeline import AdmitStep, PrepareStep, RequestPipeline
from gateway.request.timings import STEP_NAMES, timed_as
from gateway.request.types import Admitted, Attempt, ClientRequest, CompletedRequest
from gateway.routing.policy import Policy, RoutingRequest

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

T = TypeVar("T")

INSTRUMENTATION = "kv-gateway"


@dataclass(slots=True)
class RequestSpans:
    root: Span
    upstream: Span | None = None


def tracer_provider() -> TracerProvider:
    """The SDK provider exporting over OTLP/HTTP, as the ``OTEL_*`` variables configure it."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError("tracing.enabled needs the otel extra: pip install 'kv-gateway[otel]'") from exc
    resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "kv-gateway"}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class RequestTracing:
    """resolve (first): the request's span; dispatch: the decision's span (from when the router began),
    and the attempt's span whose context goes upstream; finish: the attempt's span ends; complete: the
    request's span ends with its outcome, and the time of each step it reached
    (:mod:`gateway.request.timings`) as ``gateway.step.<step>_ms`` attributes.

    Owner: the spans of the requests in flight, each kept from resolve to complete, under the request's id
    and arrival (a resolve step may hand on a rewritten request: the same request)."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._spans: dict[tuple[str, float], RequestSpans] = {}

    def resolve(self, request: ClientRequest) -> None:
        parent = propagate.extract(request.headers)
        # The client's id and model as it wrote them (before they are checked), capped as a label is: an
        # exporter sends whatever it is given.
        attributes = {"gateway.request_id": capped(request.id), "gen_ai.request.model": capped(request.model),
                      "gateway.kind": request.kind}
        root = self._tracer.start_span(f"{request.method} {request.path.partition('?')[0]}", context=parent,
                                       kind=SpanKind.SERVER, attributes=attributes)
        self._spans[request.id, request.started] = RequestSpans(root)

    def root_of(self, request: ClientRequest) -> Span | None:
        spans = self._spans.get((request.id, request.started))
        return spans.root if spans is not None else None

    def dispatched(self, attempt: Attempt) -> None:
        request = attempt.request
        spans, decision = self._spans.get((request.id, request.started)), attempt.decision
        if spans is None:
            return
        parent = trace.set_span_in_context(spans.root)
        # The router began before this step ran: the route span starts when it did.
        started_ns = time.time_ns() - int((time.monotonic() - attempt.routing_started) * 1e9)
        route = self._tracer.start_span("route", context=parent, start_time=started_ns, attributes={
            "gateway.pod": decision.pod.name, "gateway.policy": decision.policy, "gateway.reason": decision.reason,
            "gateway.prefix_tokens": decision.prefix_tokens, "gateway.attempt": attempt.number})
        route.end()
        spans.upstream = self._tracer.start_span("upstream", context=parent, kind=SpanKind.CLIENT, attributes={
            "gateway.pod": decision.pod.name, "server.address": decision.pod.url, "gateway.attempt": attempt.number})
        propagate.inject(attempt.upstream_headers, context=trace.set_span_in_context(spans.upstream))

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        spans = self._spans.get((attempt.request.id, attempt.request.started))
        if spans is None or spans.upstream is None:
            return
        if outcome.first_byte_at is None:
            spans.upstream.set_status(Status(StatusCode.ERROR, "no answer relayed"))
        spans.upstream.set_attribute("gateway.ending", outcome.ending.value)
        spans.upstream.end()
        spans.upstream = None

    def completed(self, done: CompletedRequest) -> None:
        key = done.request.id, done.request.started
        if key not in self._spans:  # refused before it was resolved (its key, its body): a span all the same
            self.resolve(done.request)
        spans = self._spans.pop(key)
        spans.root.set_attribute("http.response.status_code", done.status)
        spans.root.set_attribute("gateway.attempts", done.attempts)
        if done.routing is not None:  # the target that served it (the public name is the request's model)
            spans.root.set_attribute("gen_ai.response.model", done.routing.model)
        if done.fallbacks:
            spans.root.set_attribute("gateway.model.fallbacks", [f"{t}:{why}" for t, why in done.fallbacks])
        if done.admitted is not None and (flow := done.admitted.flow) is not None:
            spans.root.set_attribute("gateway.flow.fairness_id", flow.fairness_id)
            spans.root.set_attribute("gateway.flow.priority", flow.priority)
            spans.root.set_attribute("gateway.flow.queued_ms", round(done.admitted.queued_s * 1000, 2))
        if done.prefill is not None:
            spans.root.set_attribute("gateway.prefill", done.prefill.outcome.value)
            if (prefill_pod := done.prefill.pod) is not None:
                spans.root.set_attribute("gateway.prefill_pod", prefill_pod.name)
        usage = done.outcome.usage if done.outcome is not None else None
        if usage is not None:
            spans.root.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            spans.root.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        if done.steps is not None:
            for name, seconds in zip(STEP_NAMES, done.steps.seconds, strict=True):
                if seconds == seconds:  # reached (not NaN)
                    spans.root.set_attribute(f"gateway.step.{name}_ms", round(seconds * 1000, 3))
        if done.status >= 500:
            spans.root.set_status(Status(StatusCode.ERROR))
        spans.root.end()


def traced(pipeline: RequestPipeline, tracer: Tracer) -> RequestPipeline:
    """``pipeline`` with the tracing steps at each extension point, and every prepare or admit step that
    waits (tokenizing, queueing for admission) inside a span named after it."""
    spans = RequestTracing(tracer)
    wrap = _Spanned(spans, tracer)
    return RequestPipeline(
        resolve=[spans, *pipeline.resolve],
        prepare=[TracedPrepare(s, wrap) for s in pipeline.prepare],
        admit=[TracedAdmit(s, wrap) for s in pipeline.admit],
        dispatch=[*pipeline.dispatch, spans],
        finish=[spans, *pipeline.finish],
        complete=[*pipeline.complete, spans],
    )


class _Spanned:
    """Runs what a step waits for inside a span of its own, under the request's span."""

    def __init__(self, spans: RequestTracing, tracer: Tracer) -> None:
        self._spans = spans
        self._tracer = tracer

    async def run(self, name: str, request: ClientRequest, waiting: Awaitable[T]) -> T:
        root = self._spans.root_of(request)
        parent = trace.set_span_in_context(root) if root is not None else None
        with self._tracer.start_as_current_span(name, context=parent):
            return await waiting


class TracedPrepare:
    def __init__(self, step: PrepareStep, spanned: _Spanned) -> None:
        self._step = step
        self._spanned = spanned
        self.timed_as = timed_as(step)  # the step's, for the request's timings

    def prepare(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> Awaitable[None] | None:
        waiting = self._step.prepare(request, policy, routing)
        return None if waiting is None else self._spanned.run(type(self._step).__name__, request, waiting)


class TracedAdmit:
    def __init__(self, step: AdmitStep, spanned: _Spanned) -> None:
        self._step = step
        self._spanned = spanned

    def admit(
        self, request: ClientRequest, policy: Policy, routing: RoutingRequest
    ) -> Admitted | Awaitable[Admitted | None] | None:
        waiting = self._step.admit(request, policy, routing)
        if waiting is None or isinstance(waiting, Admitted):
            return waiting
        return self._spanned.run(type(self._step).__name__, request, waiting)
