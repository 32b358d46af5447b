"""OpenTelemetry tracing of the request path, as pipeline steps (the ``otel`` extra, ``tracing.enabled``).

Each request gets a server span, the child of the client's W3C ``traceparent`` when it sent one; inside
it, spans for the steps that wait (tokenization, queueing for admission), each routing decision (with
the pod, policy, reason and predicted prefix as attributes) and each upstream attempt, whose context
travels to the pod in ``traceparent``. Spans go to the OTLP/HTTP exporter configured by the standard
``OTEL_*`` variables. With tracing off none of these steps is in the pipeline, and nothing here is
imported.

Owner: the tracing steps own the request context's ``trace`` field.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from gateway.request.pipeline import AdmitStep, PrepareStep, RequestPipeline

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from gateway.request.context import RequestContext

INSTRUMENTATION = "kv-gateway"


@dataclass(slots=True)
class RequestSpans:
    root: Span
    phase_started_ns: int = 0  # when the current routing decision began
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
    """prepare (first): the request's span; route (last): a decision begins; dispatch: the decision's
    span, and the attempt's span whose context goes upstream; finish: the attempt's span ends;
    complete: the request's span ends with its outcome."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def prepare(self, ctx: RequestContext) -> None:
        parent = propagate.extract(ctx.http.headers)
        attributes = {"gateway.request_id": ctx.request_id, "gen_ai.request.model": ctx.model, "gateway.kind": ctx.kind}
        root = self._tracer.start_span(f"{ctx.http.method} {ctx.http.path}", context=parent, kind=SpanKind.SERVER,
                                       attributes=attributes)
        ctx.trace = RequestSpans(root)

    def before_route(self, ctx: RequestContext) -> None:
        if ctx.trace is not None:
            ctx.trace.phase_started_ns = time.time_ns()

    def dispatched(self, ctx: RequestContext) -> None:
        spans, decision = ctx.trace, ctx.decision
        if spans is None or decision is None:
            return
        parent = trace.set_span_in_context(spans.root)
        route = self._tracer.start_span("route", context=parent, start_time=spans.phase_started_ns, attributes={
            "gateway.pod": decision.pod.name, "gateway.policy": decision.policy, "gateway.reason": decision.reason,
            "gateway.prefix_tokens": decision.prefix_tokens, "gateway.attempt": decision.attempt})
        route.end()
        spans.upstream = self._tracer.start_span("upstream", context=parent, kind=SpanKind.CLIENT, attributes={
            "gateway.pod": decision.pod.name, "server.address": decision.pod.url, "gateway.attempt": decision.attempt})
        propagate.inject(ctx.upstream_headers, context=trace.set_span_in_context(spans.upstream))

    def attempt_finished(self, ctx: RequestContext) -> None:
        spans = ctx.trace
        if spans is None or spans.upstream is None:
            return
        if ctx.first_byte_at is None:
            spans.upstream.set_status(Status(StatusCode.ERROR, "no answer relayed"))
        spans.upstream.end()
        spans.upstream = None
        spans.phase_started_ns = time.time_ns()  # a retry decides again from here

    def completed(self, ctx: RequestContext) -> None:
        spans = ctx.trace
        if spans is None:
            return
        status = ctx.status or 500
        spans.root.set_attribute("http.response.status_code", status)
        spans.root.set_attribute("gateway.attempts", ctx.attempts)
        if ctx.usage is not None:
            spans.root.set_attribute("gen_ai.usage.input_tokens", ctx.usage.prompt_tokens)
            spans.root.set_attribute("gen_ai.usage.output_tokens", ctx.usage.completion_tokens)
        if status >= 500:
            spans.root.set_status(Status(StatusCode.ERROR))
        spans.root.end()


def traced(pipeline: RequestPipeline, tracer: Tracer) -> RequestPipeline:
    """``pipeline`` with the tracing steps at each extension point, and every prepare or admit step that
    waits (tokenizing, queueing for admission) inside a span named after it."""
    spans = RequestTracing(tracer)
    return RequestPipeline(
        prepare=[spans, *(TracedPrepare(s, tracer) for s in pipeline.prepare)],
        admit=[TracedAdmit(s, tracer) for s in pipeline.admit],
        route=[*pipeline.route, spans],
        dispatch=[*pipeline.dispatch, spans],
        finish=[spans, *pipeline.finish],
        complete=[*pipeline.complete, spans],
    )


class TracedPrepare:
    def __init__(self, step: PrepareStep, tracer: Tracer) -> None:
        self._step = step
        self._tracer = tracer

    def prepare(self, ctx: RequestContext) -> Awaitable[None] | None:
        waiting = self._step.prepare(ctx)
        return None if waiting is None else _in_span(self._tracer, type(self._step).__name__, ctx, waiting)


class TracedAdmit:
    def __init__(self, step: AdmitStep, tracer: Tracer) -> None:
        self._step = step
        self._tracer = tracer

    def admit(self, ctx: RequestContext) -> Awaitable[None] | None:
        waiting = self._step.admit(ctx)
        return None if waiting is None else _in_span(self._tracer, type(self._step).__name__, ctx, waiting)


async def _in_span(tracer: Tracer, name: str, ctx: RequestContext, waiting: Awaitable[None]) -> None:
    parent = trace.set_span_in_context(ctx.trace.root) if ctx.trace is not None else None
    with tracer.start_as_current_span(name, context=parent):
        await waiting
