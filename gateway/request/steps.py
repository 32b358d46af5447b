"""The built-in steps that run before routing: validation, the policy, token ids, load and admission."""

from __future__ import annotations

import time
from collections.abc import Awaitable

from gateway.admission import AdmissionController
from gateway.api.auth import ApiKeyAuth
from gateway.api.errors import bad_request, unknown_model
from gateway.backends.registry import PodRegistry
from gateway.config import RoutingConfig, ServerConfig
from gateway.kv.verification import PredictionVerifier
from gateway.load.pending import PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.metrics import GatewayMetrics
from gateway.request.context import RequestContext
from gateway.routing.policy import Policy, RoutingRequest
from gateway.routing.router import Router
from gateway.tokenization.service import TokenizationService


class RequestValidation:
    """prepare: refuse what no pod should see (too many messages, a model the key may not use or no pod
    serves)."""

    def __init__(self, pods: PodRegistry, key_auth: ApiKeyAuth, server: ServerConfig) -> None:
        self._pods = pods
        self._key_auth = key_auth
        self._max_messages = server.max_messages

    def prepare(self, ctx: RequestContext) -> None:
        parsed = ctx.parsed
        assert parsed is not None
        if parsed.messages is not None and len(parsed.messages) > self._max_messages:
            raise bad_request(f"Too many messages: {len(parsed.messages)} (at most {self._max_messages}).",
                              param="messages", code="too_many_messages")
        self._key_auth.authorize(ctx.http, ctx.model)
        if not self._pods.knows_model(ctx.model):
            raise unknown_model(ctx.model)


class PolicyResolution:
    """prepare: the routing policy (the default, or ``x-routing-strategy`` where allowed) and the routing
    view of the request, which the later steps fill."""

    def __init__(self, pods: PodRegistry, router: Router, routing: RoutingConfig) -> None:
        self._pods = pods
        self._router = router
        self._allow_override = routing.allow_strategy_header

    def prepare(self, ctx: RequestContext) -> None:
        override = ctx.http.headers.get("x-routing-strategy") if self._allow_override else None
        ctx.policy = self._router.resolve(override)
        ctx.base_model = base = self._pods.base_model(ctx.model)
        ctx.routing = RoutingRequest(ctx.request_id, ctx.model, ctx.kind, ctx.parsed, base_model=base,
                                     lora_name=ctx.model if base != ctx.model else None)


def _routed(ctx: RequestContext) -> tuple[Policy, RoutingRequest]:
    assert ctx.policy is not None and ctx.routing is not None  # PolicyResolution runs first
    return ctx.policy, ctx.routing


class PromptTokenization:
    """prepare: the prompt's token ids, when the policy needs them; a prompt longer than the model's
    context is refused here, before any pod is bothered. For a model whose predictions drift from the
    engines' (:mod:`gateway.kv.verification`), the ids come from a pod's ``/tokenize`` instead of the local
    tokenizer (or, without one, there are none: routing is approximate), and now and then the configured
    tokenizer is asked too, as a probe of whether it agrees again."""

    def __init__(self, pods: PodRegistry, tokens: TokenizationService, verifier: PredictionVerifier,
                 server: ServerConfig) -> None:
        self._pods = pods
        self._tokens = tokens
        self._verifier = verifier
        self._max_prompt_tokens = server.max_prompt_tokens

    def prepare(self, ctx: RequestContext) -> Awaitable[None] | None:
        policy, rr = _routed(ctx)
        if not policy.needs_tokens:
            return None
        if self._verifier.drifting(rr.base_model):
            return self._tokenize_drifting(ctx, rr)
        return self._tokenize(ctx, rr)

    async def _tokenize_drifting(self, ctx: RequestContext, rr: RoutingRequest) -> None:
        local = self._tokens.has_local(ctx.model)
        if self._verifier.probe_due(rr.base_model):
            probe = await self._tokens.tokenize(ctx.model, ctx.kind, rr.body)
            ctx.probe_tokens = len(probe) if probe is not None else None
        if local:
            await self._tokenize(ctx, rr, avoid_local=True)

    async def _tokenize(self, ctx: RequestContext, rr: RoutingRequest, avoid_local: bool = False) -> None:
        rr.token_ids = ids = await self._tokens.tokenize(ctx.model, ctx.kind, rr.body, avoid_local=avoid_local)
        limit = self._max_prompt_tokens or self._pods.max_model_len(ctx.model)
        if ids is not None and limit and len(ids) > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {len(ids)}.",
                param="messages", code="context_length_exceeded")


class LoadEstimation:
    """prepare: the request's predicted output length and its cost on each candidate pod, when admission
    is on or the policy weighs load."""

    def __init__(self, pods: PodRegistry, load: PendingLoad, predictor: OutputLengthPredictor,
                 metrics: GatewayMetrics, admission_enabled: bool) -> None:
        self._pods = pods
        self._load = load
        self._predictor = predictor
        self._metrics = metrics
        self._admission_enabled = admission_enabled

    def prepare(self, ctx: RequestContext) -> None:
        policy, rr = _routed(ctx)
        if not (self._admission_enabled or policy.needs_load):
            return
        parsed = rr.body
        rr.input_tokens = len(rr.token_ids) if rr.token_ids else max(1, len(ctx.body) // 4)
        rr.predicted_output_tokens = self._predictor.predict(
            rr.base_model, rr.input_tokens, parsed.max_completion_tokens or parsed.max_tokens)
        self._metrics.output_predicted.observe(rr.predicted_output_tokens)
        rr.estimates = {p.name: self._load.estimate(p.name, rr.base_model, rr.input_tokens,
                                                    rr.predicted_output_tokens)
                        for p in self._pods.candidates(rr.model)}


class SloAdmission:
    """admit: ADMIT, QUEUE or REJECT by the request's SLO and the pods' predicted load
    (:mod:`gateway.admission`); ``finish``: a finished attempt lets the next waiter re-check."""

    def __init__(self, pods: PodRegistry, admission: AdmissionController, metrics: GatewayMetrics) -> None:
        self._pods = pods
        self._admission = admission
        self._metrics = metrics

    def admit(self, ctx: RequestContext) -> Awaitable[None] | None:
        policy, rr = _routed(ctx)
        return self._admit(ctx, rr) if self._admission.config.enabled or policy.needs_load else None

    async def _admit(self, ctx: RequestContext, rr: RoutingRequest) -> None:
        h = ctx.http.headers
        ctx.slo = slo = self._admission.slo_for(rr.base_model, h.get("x-slo-ttft-ms"), h.get("x-slo-e2e-ms"),
                                                h.get("x-priority"))
        ticket = await self._admission.admit(self._pods.candidates(rr.model), ctx.kind, rr.estimates, slo)
        ctx.queued_s = ticket.waited_s
        if slo.ttft_s is not None:
            self._metrics.slo_slack.labels("dispatch").observe(slo.ttft_s - (time.monotonic() - ctx.started))

    def attempt_finished(self, ctx: RequestContext) -> None:
        self._admission.release()
