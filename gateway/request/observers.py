"""The built-in steps that watch requests rather than change them: routing metrics, the policy's own
finish hooks, the check of predictions against the engines, output-length learning, request metrics and
the access log."""

from __future__ import annotations

import logging
import time

from gateway.kv.verification import PredictionVerifier
from gateway.load.predictor import OutputLengthPredictor
from gateway.logs import ACCESS_LOGGER
from gateway.metrics import GatewayMetrics
from gateway.request.context import RequestContext

access_log = logging.getLogger(ACCESS_LOGGER)


class RoutingMetrics:
    """dispatch: count each decision by policy and reason, and the prefix it predicted."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def dispatched(self, ctx: RequestContext) -> None:
        decision, rr = ctx.decision, ctx.routing
        assert decision is not None and rr is not None
        self._metrics.decision_made(decision.policy, decision.reason)
        if rr.token_ids is not None:
            self._metrics.prefix_hit_tokens.labels(decision.policy).observe(decision.prefix_tokens)


class PolicyFinishHooks:
    """finish: the policy's own ``on_finished`` hooks (e.g. a workflow's context starts thinking)."""

    def attempt_finished(self, ctx: RequestContext) -> None:
        if ctx.policy is None or ctx.routing is None or ctx.decision is None:
            return
        for hook in ctx.policy.on_finished:
            hook(ctx.routing, ctx.decision)


class PredictionCheck:
    """complete: compare the cached prefix predicted for the chosen pod, and the gateway's token count,
    with what the engine's usage reports (:mod:`gateway.kv.verification`)."""

    def __init__(self, verifier: PredictionVerifier) -> None:
        self._verifier = verifier

    def completed(self, ctx: RequestContext) -> None:
        usage, decision, rr = ctx.usage, ctx.decision, ctx.routing
        if usage is None or decision is None or rr is None or ctx.status != 200:
            return
        if ctx.probe_tokens is not None:
            self._verifier.probe(rr.base_model, ctx.probe_tokens, usage.prompt_tokens)
        reported = usage.cached_tokens
        match = rr.prefix
        if reported is None or rr.token_ids is None or match is None or not match.precise or not _one_prompt(ctx):
            return
        pod = decision.pod.name
        confirmed = match.pods[pod].gpu_tokens - match.pods[pod].speculative_tokens if pod in match.pods else 0
        self._verifier.observe(rr.base_model, pod, confirmed, reported, len(rr.token_ids), usage.prompt_tokens)


def _one_prompt(ctx: RequestContext) -> bool:
    """Whether the usage counts one prompt (a batch of completion prompts is routed by its first)."""
    prompt = ctx.parsed.prompt if ctx.parsed is not None else None
    return prompt is None or isinstance(prompt, str) or (isinstance(prompt, list) and not any(
        isinstance(p, str | list) for p in prompt))


class OutputLearning:
    """complete: feed the output-length predictor and the SLO telemetry from a finished request."""

    def __init__(self, predictor: OutputLengthPredictor, metrics: GatewayMetrics) -> None:
        self._predictor = predictor
        self._metrics = metrics

    def completed(self, ctx: RequestContext) -> None:
        if ctx.status != 200 or ctx.kind == "embeddings":
            return
        if ctx.usage is not None:
            prompt, output = ctx.usage.prompt_tokens, ctx.usage.completion_tokens
        elif ctx.streamed_events > 2:  # no usage asked for: about one token per event, less role and [DONE]
            prompt, output = 0, ctx.streamed_events - 2
        else:
            return
        if prompt:
            self._predictor.observe(ctx.base_model, prompt, output)
        self._metrics.output_actual.observe(output)
        if ctx.predicted_output_tokens:
            self._metrics.output_prediction_error.observe(output - ctx.predicted_output_tokens)
        if ctx.slo and ctx.slo.ttft_s is not None and ctx.first_byte_at is not None:
            self._metrics.slo_slack.labels("first_byte").observe(ctx.slo.ttft_s - (ctx.first_byte_at - ctx.started))


class RequestMetrics:
    """complete: requests, latency, time to first byte and tokens per model and pod."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def completed(self, ctx: RequestContext) -> None:
        self._metrics.request_done(
            ctx.model, ctx.decision.pod.name if ctx.decision else "-", ctx.status or 500,
            time.monotonic() - ctx.started,
            None if ctx.first_byte_at is None else ctx.first_byte_at - ctx.started,
            (ctx.usage.prompt_tokens, ctx.usage.completion_tokens) if ctx.usage else None,
        )


class AccessLog:
    """complete: one line per request, with its decision, as text and as structured fields."""

    def completed(self, ctx: RequestContext) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        d = ctx.decision
        pod = d.pod.name if d else "-"
        status = ctx.status or 500
        ttfb_ms = round((ctx.first_byte_at - ctx.started) * 1000, 2) if ctx.first_byte_at else None
        request = ctx.http
        fields = {
            "request_id": ctx.request_id, "method": request.method, "path": request.path,
            "status": status, "model": ctx.model, "pod": pod,
            "policy": d.policy if d else None, "reason": d.reason if d else None,
            "prefix_tokens": d.prefix_tokens if d else 0, "attempts": ctx.attempts,
            "duration_ms": round((time.monotonic() - ctx.started) * 1000, 2), "ttfb_ms": ttfb_ms,
            "queued_ms": round(ctx.queued_s * 1000, 2),
        }
        access_log.info(
            "%s %s %d model=%s pod=%s policy=%s reason=%s attempts=%d ms=%.2f ttfb_ms=%s id=%s",
            request.method, request.path, status, ctx.model, pod, fields["policy"], fields["reason"],
            ctx.attempts, fields["duration_ms"], ttfb_ms, ctx.request_id, extra=fields,
        )
