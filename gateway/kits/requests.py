"""The request kit: the pipeline of every kit's steps, in the order of their extension points, the two
directors that run it, the prefill legs of disaggregated models, the front door the client edges use, and
the clients' routes that the directors serve."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from gateway.api import debug
from gateway.api.routes import PROXIED_ROUTES, directed, model_list
from gateway.auth import ApiKey, ApiKeyAuth
from gateway.config import GatewayConfig, ServerConfig
from gateway.core.inference_api import PATHS, RequestKind
from gateway.kits.flow import FlowKit
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.keys import LimitsKit, ResponsesKit
from gateway.kits.kit import Kit, Route
from gateway.kits.models import ModelsKit, RoutingKit
from gateway.kits.state import KvKit, LoadKit, TokensKit
from gateway.kits.workflows import KeepWarmKit, WorkflowKit
from gateway.models.rules import ModelRules
from gateway.pods.registry import PodRegistry
from gateway.proxy.forward import Proxy
from gateway.request.context_steps import ContextResolution, RoomForNewContexts
from gateway.request.director import NoPlanner, RequestDirector
from gateway.request.disaggregation import DisaggregationMetrics, PrefillLegs
from gateway.request.hooks import RequestHooks
from gateway.request.identity import KeyIdentity
from gateway.request.observers import (
    AccessLog,
    OutputLearning,
    PredictionCheck,
    RequestMetrics,
    RoutingMetrics,
    StepMetrics,
)
from gateway.request.pipeline import RequestPipeline
from gateway.request.responses_state import ResponsesState
from gateway.request.steps import LoadEstimation, PromptTokenization
from gateway.request.validation import RequestValidation
from gateway.workflow.planning import WorkflowService

Traced = Callable[[RequestPipeline], RequestPipeline]  # the pipeline, traced when tracing is on


@dataclass(eq=False)
class FrontDoor:
    """What the edges that serve clients use: who is asking, the two directors, the upstream side, the
    models a key may list, and whether the gateway still takes requests."""

    auth: ApiKeyAuth
    director: RequestDirector
    counting: RequestDirector  # for count_tokens: routed and relayed, nothing else
    proxy: Proxy  # the HTTP edge's upstream side
    pods: PodRegistry
    models: ModelRules  # public model names and their targets
    responses: ResponsesState  # the Responses API's stored responses
    workflows: WorkflowService  # a workflow's state, and its end as the client declares it
    config: ServerConfig
    # The one field that changes after start: set when shutdown begins (readiness answers 503).
    draining: bool = False

    def model_cards(self, key: ApiKey | None) -> list[dict[str, Any]]:
        """``/v1/models``: the pods' models and the public names (:meth:`ModelRules.cards`) that ``key`` may use."""
        return [c for c in self.models.cards(self.pods.model_cards()) if self.auth.may_use(key, str(c.get("id")))]

    def ready_pods(self) -> int:
        """The pods that can take a request now."""
        now = time.monotonic()
        return sum(1 for p in self.pods.all() if p.available(now))


class RequestsKit(Kit):
    """``director`` (the generating routes), ``counting`` (count_tokens), ``front`` (what the client edges
    use), and ``steps``, the time of each step of the director's requests (/debug/steps). It serves the
    generating routes, count_tokens and ``/v1/models``."""

    name = "requests"

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit, kv: KvKit,
                 tokens: TokensKit, flow: FlowKit, workflows: WorkflowKit, keep_warm: KeepWarmKit,
                 models: ModelsKit, routing: RoutingKit, limits: LimitsKit, responses: ResponsesKit,
                 traced: Traced) -> None:
        pods, metrics, rules = base.pods, base.metrics, models.rules
        self.proxy = base.proxy
        self._worker = base.identity.name
        self.validation = RequestValidation(pods, base.auth, config.server, rules.is_public)

        def served(model: str) -> bool:  # a name the gateway answers for: a metrics label (the rest are "unknown")
            return rules.is_public(model) or pods.knows_model(model)

        self.steps = StepMetrics(metrics)
        self.served = served
        hooks = RequestHooks(config.hooks, metrics)  # the config's request hooks, last at dispatch and complete
        pipeline = traced(hooks.around(self._pipeline(config, base, load, kv, tokens, flow, workflows, keep_warm,
                                                      models, limits, responses)))
        directing = {"max_retries": config.routing.max_retries, "default_consumption": load.load.default_consumption,
                     "allow_strategy_header": config.routing.allow_strategy_header,
                     "max_body_bytes": config.server.max_body_bytes}
        router, ledger = routing.router, shared.ledger
        self.prefill = PrefillLegs(config.disaggregation, pods, router, ledger, self.proxy,
                                   metrics.owned(DisaggregationMetrics), dispatched=[kv.routed],
                                   default_consumption=load.load.default_consumption)
        self.director = RequestDirector(pipeline, router, workflows.planning, ledger, self.proxy, pods,
                                        prefill=self.prefill, models=rules, adapters=models.adapters, **directing)
        # Requests a pod answers without inferring (Anthropic's count_tokens): no tokenization, admission,
        # workflow or prediction steps, since nothing is cached or learnt by them.
        counting = hooks.around(RequestPipeline(resolve=[self.validation],
                                                complete=[RequestMetrics(metrics, served), AccessLog()]))
        self.counting = RequestDirector(counting, router, NoPlanner(), ledger, self.proxy, pods, models=rules,
                                        **directing)
        self.front = FrontDoor(base.auth, self.director, self.counting, self.proxy, pods, rules, responses.state,
                               workflows.service, config.server)

    def routes(self) -> Iterable[Route]:
        front = self.front
        door = partial(directed, front.auth, front.proxy, front.config.body_timeout_s)
        return [*(Route("POST", path, partial(door, self.director, kind)) for path, kind in PROXIED_ROUTES.items()),
                Route("POST", PATHS[RequestKind.COUNT_TOKENS], partial(door, self.counting, RequestKind.COUNT_TOKENS)),
                Route("GET", "/v1/models", partial(model_list, front.auth, front.pods, front.model_cards)),
                Route("GET", "/debug/steps", partial(debug.steps_page, front.auth, self._worker, self.steps))]

    def _pipeline(self, config: GatewayConfig, base: Foundation, load: LoadKit, kv: KvKit, tokens: TokensKit,
                  flow: FlowKit, workflows: WorkflowKit, keep_warm: KeepWarmKit, models: ModelsKit,
                  limits: LimitsKit, responses: ResponsesKit) -> RequestPipeline:
        """Each kit's steps at their extension points, in the order they run."""
        pods, metrics, planning = base.pods, base.metrics, workflows.planning
        admit = [flow.admit] if flow.admit is not None else []
        recency = [keep_warm.recency] if keep_warm.recency is not None else []
        hold_new_s = config.placement.hold_new_s
        tokenization = PromptTokenization(pods, tokens.tokens, kv.verifier, config.server, limits.limits.counts_input,
                                          kv.index if config.tokenization.defer_new_text else None)
        return RequestPipeline(
            resolve=[self.validation, KeyIdentity(lambda: flow.flow.policy, metrics.registry), responses.state],
            prepare=[tokenization,
                     ContextResolution(pods, kv.index, kv.working_set, workflows.signals),
                     LoadEstimation(pods, load.load, load.predictor, metrics, config.admission.enabled)],
            # A starting context waits for KV room first: a request flow control lets go is dispatched at once.
            admit=[limits.step,
                   *([RoomForNewContexts(pods, kv.working_set, load.capacity_of, hold_new_s, metrics)]
                     if hold_new_s else []), *admit],
            # Cache recency reads a context as it was before this request: before placement holds it anew.
            dispatch=[RoutingMetrics(metrics), kv.routed, *recency, kv.placement, planning, *admit, models.tracking],
            # A prompt routed on its head is made whole first: the rest hold and return all of it.
            finish=[tokenization, *admit, planning, kv.routed, kv.placement, *recency, models.tracking],
            complete=[*admit, *([PredictionCheck(kv.verifier)] if config.verification.enabled else []),
                      OutputLearning(load.predictor, metrics), RequestMetrics(metrics, self.served), models.use,
                      limits.step, limits.accounting, self.steps, AccessLog()],
        )
