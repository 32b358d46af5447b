"""The steps of model names and adapters.

- :class:`ModelUse` watches what model names meant (:mod:`gateway.models.rules`): complete counts each
  request by the public name it asked for and the target that served it, each fallback by why it was
  taken, and pins the answer of a split's Responses request to its target (the response that continues it
  gets the same one);
- :class:`AdapterTracking` tells the adapters' use (:mod:`gateway.models.adapters`) where each LoRA
  request went (dispatch) and that it ended (finish).

Owner: nothing of its own (the metrics' children, cached).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gateway.models.adapters import AdapterUse
from gateway.models.rules import ModelRules
from gateway.proxy.outcome import RelayOutcome
from gateway.request.types import Attempt, CompletedRequest


class ModelUse:
    def __init__(self, rules: ModelRules, registry: CollectorRegistry) -> None:
        self._rules = rules
        self._requests = Counter("gateway_model_requests", "Requests by the model name they asked for, the "
                                 "target that served them (or was tried last) and status class",
                                 ["model", "target", "status"], registry=registry)
        self._fallbacks = Counter("gateway_model_fallbacks", "Targets a request left for the next of its model "
                                  "rule, and why: no_pod, saturated (it would wait past the rule's limit) or "
                                  "failed (its pods failed before the first byte)",
                                  ["model", "target", "cause"], registry=registry)
        self._children: dict[tuple[Any, ...], Any] = {}

    def completed(self, done: CompletedRequest) -> None:
        route, routing = done.route, done.routing
        if route is None or routing is None:
            return
        self._inc(self._requests, route.public, routing.model, f"{done.status // 100}xx")
        for target, cause in done.fallbacks:
            self._inc(self._fallbacks, route.public, target, cause)
        outcome = done.outcome
        if route.split and outcome is not None and outcome.response_id and done.status == 200:
            self._rules.answered(route, routing.model, outcome.response_id)

    def _inc(self, metric: Counter, *labels: str) -> None:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        child.inc()


class AdapterTracking:
    def __init__(self, use: AdapterUse) -> None:
        self._use = use

    def dispatched(self, attempt: Attempt) -> None:
        if (adapter := attempt.routing.lora_name) is not None:
            self._use.routed(attempt.decision.pod.name, adapter)

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        if (adapter := attempt.routing.lora_name) is not None:
            self._use.ended(attempt.decision.pod.name, adapter)
