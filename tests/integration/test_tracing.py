"""OpenTelemetry tracing: the client's trace continues through the gateway to the pod, with a span per
stage and the routing decision as attributes; with tracing off, nothing of it runs."""

from __future__ import annotations

from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import build_app, build_gateway
from gateway.config import load_config
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from tests.conftest import serve_app

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


def recording_pod(seen: list[str | None]) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent"))
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


async def test_the_clients_trace_reaches_the_pod_through_the_gateways_spans(start_backend, http):
    seen: list[str | None] = []
    pod_url = await start_backend(recording_pod(seen))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = load_config(overrides={
        "pods": [{"url": pod_url, "name": "pod0"}], "tracing": {"enabled": True},
        "routing": {"policy": "kv_aware"}, "admission": {"enabled": True}, "server": {"max_body_bytes": 65536},
        "tokenization": {"models": {"m": {"path": str(BUNDLED_TOKENIZER_DIR)}}}}, environ={})
    runner = await serve_app(build_app(build_gateway(config, tracer_provider=provider)))
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Trace me."}]}
        headers = {"traceparent": TRACEPARENT, "x-gateway-inference-fairness-id": "team-t", "x-priority": "3"}
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
        refused = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/chat/completions"]
        # Refused ones have spans too, with the status they got: a bad header, a body too large.
        async with http.post(f"{url}/v1/chat/completions", json=body, headers={"x-priority": "1e30"}) as resp:
            assert resp.status == 400
        async with http.post(f"{url}/v1/chat/completions", data=b"x" * 100_000) as resp:
            assert resp.status == 413
        refused = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/chat/completions"][len(refused):]
        assert [s.attributes["http.response.status_code"] for s in refused] == [400, 413]
    finally:
        await runner.cleanup()
    spans = {s.name: s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == CLIENT_TRACE}
    # A step gets a span when it waits: tokenizing did; flow control, on an idle pod, did not.
    assert set(spans) == {"POST /v1/chat/completions", "PromptTokenization", "route", "upstream"}
    root, upstream = spans["POST /v1/chat/completions"], spans["upstream"]
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE  # the client's trace, continued
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id
               for name, s in spans.items() if name != root.name)
    assert spans["route"].attributes["gateway.pod"] == "pod0"
    assert spans["route"].attributes["gateway.policy"] == "kv_aware"
    assert root.attributes["http.response.status_code"] == 200
    # The request's flow, as flow control told it from its headers (an idle pod: it was not held).
    assert root.attributes["gateway.flow.fairness_id"] == "team-t" and root.attributes["gateway.flow.priority"] == 3
    assert root.attributes["gateway.flow.queued_ms"] == 0
    # The time of each step it took (not a disaggregated model: no prefill leg).
    timed = {k.removeprefix("gateway.step.").removesuffix("_ms"): v for k, v in root.attributes.items()
             if k.startswith("gateway.step.")}
    assert set(timed) == {"parse", "tokenize", "prepare", "admit", "route", "dispatch", "connect", "first_byte"}
    assert all(v >= 0 for v in timed.values())
    # The pod received the upstream span's context: same trace, that span as parent.
    assert seen == [f"00-{CLIENT_TRACE}-{upstream.context.span_id:016x}-01"]


async def test_without_tracing_nothing_is_added(start_backend, start_gateway, http):
    seen: list[str | None] = []
    gw = await start_gateway([{"url": await start_backend(recording_pod(seen)), "name": "pod0"}])
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "No trace."}]}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    assert seen == [None] and gw.kits.tracing.provider is None
