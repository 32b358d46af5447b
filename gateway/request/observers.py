"""The built-in steps that watch requests rather than change them: routing metrics, the check of
predictions against the engines, output-length learning, request metrics, step timings and the access log."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from gateway.core.inference_api import PATHS, RequestKind
from gateway.kv.verification import PredictionVerifier
from gateway.load.predictor import OutputLengthPredictor
from gateway.logs import ACCESS_LOGGER
from gateway.metrics import MAX_LABEL_CHARS, UNKNOWN_MODEL, Answer, GatewayMetrics, capped
from gateway.request.disaggregation import DisaggregationMetrics
from gateway.request.timings import STEP_NAMES, RecentSteps
from gateway.request.types import Attempt, CompletedRequest

access_log = logging.getLogger(ACCESS_LOGGER)


class RoutingMetrics:
    """dispatch: count each decision by policy and reason, and the prefix it predicted."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def dispatched(self, attempt: Attempt) -> None:
        decision = attempt.decision
        self._metrics.decision_made(decision.policy, decision.reason)
        if attempt.routing.token_ids is not None:
            self._metrics.prefix_hit_tokens.labels(decision.policy).observe(decision.prefix_tokens)


class PredictionCheck:
    """complete: compare the cached prefix predicted for the chosen pod, and the gateway's token count,
    with what the engine's usage reports (:mod:`gateway.kv.verification`)."""

    def __init__(self, verifier: PredictionVerifier) -> None:
        self._verifier = verifier

    def completed(self, done: CompletedRequest) -> None:
        outcome, rr, attempt = done.outcome, done.routing, done.last
        if outcome is None or outcome.usage is None or rr is None or attempt is None or done.status != 200:
            return
        usage = outcome.usage
        if rr.probe_tokens is not None:
            self._verifier.probe(rr.base_model, rr.probe_tokens, usage.prompt_tokens)
        match, decision = rr.prefix, attempt.decision
        prefill = done.prefill
        if prefill is not None and prefill.decision is not None and prefill.routing is not None:
            # Split: the decode pod's cached tokens count what it was sent (or, with NIXL, what the prefill
            # pod had cached); the prefill leg is the one routed by its own cache.
            match, decision, usage = prefill.routing.prefix, prefill.decision, prefill.usage
        if usage is None or (reported := usage.cached_tokens) is None or rr.token_ids is None or match is None \
                or not match.precise or not _one_prompt(done):
            return
        pod = decision.pod.name
        confirmed = match.pods[pod].gpu_tokens - match.pods[pod].speculative_tokens if pod in match.pods else 0
        self._verifier.observe(rr.base_model, pod, confirmed, reported, len(rr.token_ids), usage.prompt_tokens)


def _one_prompt(done: CompletedRequest) -> bool:
    """Whether the usage counts one prompt (a batch of completion prompts is routed by its first)."""
    prompt = done.request.parsed.prompt
    return prompt is None or isinstance(prompt, str) or (isinstance(prompt, list) and not any(
        isinstance(p, str | list) for p in prompt))


class OutputMetrics:
    """The families of output lengths and SLO slack, on the gateway's registry (:meth:`GatewayMetrics.owned`).
    Producers: :class:`gateway.request.steps.LoadEstimation` (the predictions) and :class:`OutputLearning`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.output_tokens = Histogram(
            "gateway_output_tokens", "Output tokens per request: predicted at admission and actual",
            ["kind"], buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384), registry=registry,
        )
        # Children looked up once: labels() costs more than the observation on the request path.
        self.predicted = self.output_tokens.labels("predicted")
        self.actual = self.output_tokens.labels("actual")
        self.prediction_error = Histogram(
            "gateway_output_prediction_error_tokens", "Actual minus predicted output tokens, per request",
            buckets=(-4096, -1024, -256, -64, -16, 0, 16, 64, 256, 1024, 4096), registry=registry,
        )
        self.slo_slack = Histogram(
            "gateway_slo_slack_seconds", "TTFT target minus time spent, at dispatch and at first byte",
            ["stage"], buckets=(-10, -1, -0.1, 0, 0.1, 0.5, 1, 2, 5, 10, 30), registry=registry,
        )


class OutputLearning:
    """complete: feed the output-length predictor and the SLO telemetry from a request whose answer
    reached the client whole (a cut stream says nothing true about output lengths)."""

    def __init__(self, predictor: OutputLengthPredictor, metrics: GatewayMetrics) -> None:
        self._predictor = predictor
        self._metrics = metrics.owned(OutputMetrics)

    def completed(self, done: CompletedRequest) -> None:
        outcome, rr = done.outcome, done.routing
        if done.status != 200 or outcome is None or not outcome.complete or rr is None:
            return
        if done.request.kind == RequestKind.EMBEDDINGS:
            return
        if outcome.usage is not None:
            prompt, output = outcome.usage.prompt_tokens, outcome.usage.completion_tokens
        elif outcome.streamed_events > 2:  # no usage asked for: about one token per event, less role and [DONE]
            prompt, output = 0, outcome.streamed_events - 2
        else:
            return
        if prompt:
            self._predictor.observe(rr.base_model, prompt, output)
        self._metrics.actual.observe(output)
        if rr.predicted_output_tokens:
            self._metrics.prediction_error.observe(output - rr.predicted_output_tokens)
        slo = done.admitted.slo if done.admitted is not None else None
        if slo is not None and slo.ttft_s is not None and (first_byte := done.first_byte_s) is not None:
            self._metrics.slo_slack.labels("first_byte").observe(slo.ttft_s - first_byte)


class RequestMetrics:
    """complete: requests, latency, time to first byte and tokens per model and pod. ``known``: whether a model
    name is one the gateway serves (any other is labelled ``unknown``: the client chose it)."""

    def __init__(self, metrics: GatewayMetrics, known: Callable[[str], bool]) -> None:
        self._metrics = metrics
        self._pd_requests = metrics.owned(DisaggregationMetrics).requests
        self._models = ModelLabels(known)

    def completed(self, done: CompletedRequest) -> None:
        decision, outcome = done.decision, done.outcome
        usage = outcome.usage if outcome is not None else None
        answer = Answer(self._models.label(done.model), decision.pod.name if decision else "-", done.answered,
                        PATHS[done.request.kind], done.result)
        self._metrics.request_done(answer, done.finished - done.request.started, done.first_byte_s,
                                   (usage.prompt_tokens, usage.completion_tokens) if usage else None)
        if done.prefill is not None:
            self._pd_requests.labels(self._models.label(done.model), done.prefill.outcome.value).inc()


class ModelLabels:
    """A request's model name as a metrics label: the name when the gateway serves it (a public name of the
    config, or a model the fleet lists), capped at :data:`~gateway.metrics.MAX_LABEL_CHARS`, else ``unknown``."""

    def __init__(self, known: Callable[[str], bool]) -> None:
        self._known = known
        self._served: dict[str, str] = {"-": "-"}  # names found served once → their label (at most the fleet's)

    def label(self, model: str) -> str:
        label = self._served.get(model)
        if label is not None:
            return label
        if self._known(model):
            label = self._served[model] = capped(model)
            return label
        return UNKNOWN_MODEL


class StepMetrics:
    """complete: the time of each step the request reached (:mod:`gateway.request.timings`), into
    ``gateway_request_step_seconds{step}`` and the window of recent times ``/debug/steps`` reads.

    Owner: that window (:class:`~gateway.request.timings.RecentSteps`)."""

    def __init__(self, metrics: GatewayMetrics, window: int = 1024) -> None:
        # Children looked up once: labels() costs more than the observation.
        self._children = tuple(metrics.request_steps.labels(name) for name in STEP_NAMES)
        self._recent = RecentSteps(window)

    def completed(self, done: CompletedRequest) -> None:
        steps = done.steps
        if steps is None:
            return
        children, recent = self._children, self._recent
        for step, seconds in enumerate(steps.seconds):
            if seconds == seconds:  # reached (not NaN)
                children[step].observe(seconds)
                recent.add(step, seconds)

    def debug(self) -> dict[str, Any]:
        """Per step, over the recent window: percentiles and mean in ms (``/debug/steps``)."""
        return self._recent.summary()


class AccessLog:
    """complete: one line per request, with its decision, as text and as structured fields."""

    def completed(self, done: CompletedRequest) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        d = done.decision
        first_byte = done.first_byte_s
        request = done.request
        fields: dict[str, Any] = {
            "request_id": done.request.id, "method": request.method, "path": request.path,
            "status": done.answered, "outcome": done.result, "route": PATHS[request.kind],
            "model": done.model[:MAX_LABEL_CHARS], "pod": d.pod.name if d else "-",
            "policy": d.policy if d else None, "reason": d.reason if d else None,
            "prefix_tokens": d.prefix_tokens if d else 0, "attempts": done.attempts,
            "duration_ms": round((done.finished - done.request.started) * 1000, 2),
            "ttfb_ms": round(first_byte * 1000, 2) if first_byte is not None else None,
            "queued_ms": round(done.admitted.queued_s * 1000, 2) if done.admitted else 0.0,
            "ending": done.outcome.ending.value if done.outcome else None,
        }
        flow = done.admitted.flow if done.admitted is not None else None
        if flow is not None:
            fields["flow"], fields["priority"] = flow.fairness_id, flow.priority
            if done.admitted is not None and done.admitted.objective:
                fields["objective"] = done.admitted.objective
        if done.last is not None:
            fields["pod_in_flight"] = done.last.dispatch.in_flight_before
        if done.steps is not None:  # what each step took (a step not reached: absent), to split its latency
            fields["steps_ms"] = {name: round(s * 1000, 3) for name, s in zip(STEP_NAMES, done.steps.seconds,
                                                                           strict=True) if s == s}
        if (prefill := done.prefill) is not None:
            fields["prefill_pod"] = prefill.pod.name if prefill.pod is not None else None
            fields["prefill"] = prefill.outcome.value
            fields["prefill_ms"] = round(prefill.seconds * 1000, 2)
        log_answer(fields, flow)


def log_answer(fields: dict[str, Any], flow: object = None) -> None:
    """The access log's line of one answer, from its structured fields (those :class:`AccessLog` writes; an
    answer no director handled has only the first ones)."""
    access_log.info(
        "%s %s %d outcome=%s route=%s model=%s pod=%s policy=%s reason=%s attempts=%d ms=%.2f ttfb_ms=%s flow=%s "
        "queued_ms=%s id=%s",
        fields["method"], fields["path"], fields["status"], fields["outcome"], fields["route"], fields["model"],
        fields["pod"], fields.get("policy"), fields.get("reason"), fields.get("attempts", 0),
        fields["duration_ms"], fields.get("ttfb_ms"), flow or "-", fields.get("queued_ms", 0.0),
        fields["request_id"], extra=fields,
    )
