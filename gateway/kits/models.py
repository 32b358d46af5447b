"""The kits of what a request asks for: model rules and LoRA adapters, and routing (the policies and
profiles that pick a pod)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

from gateway.api import debug
from gateway.config import GatewayConfig, ModelsConfig
from gateway.kits.flow import FlowKit
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.kit import Apply, Kit, Route, Running
from gateway.kits.state import KvKit, LoadKit
from gateway.kits.workflows import WorkflowKit
from gateway.models.adapters import AdapterLoader, AdapterPlacement, AdapterUse
from gateway.models.rules import ModelRules
from gateway.plugin_registry import PluginRegistry
from gateway.request.models import AdapterTracking, ModelUse
from gateway.routing.policy import PolicyContext
from gateway.routing.profiles import POLICY_GROUP
from gateway.routing.router import Router


class ModelsKit(Kit):
    """Public model names and their targets (``rules``), and LoRA adapters: where each is used, where it
    should go, and registering it on a pod (``adapters``, on ``/debug/adapters``); with the steps that track
    and count their use."""

    name = "models"
    requires = ("foundation", "fleet")  # adapters are registered on the pods the health checks find

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit,
                 flow: FlowKit, workflows: WorkflowKit) -> None:
        detector = flow.detector
        self.adapter_use = AdapterUse(shared.sinks.adapters)
        self.adapter_placement = AdapterPlacement(self.adapter_use, load.load.engine,
                                                  lambda pod: detector.saturated_by(pod) is not None,
                                                  config.models.lora)
        self.rules = ModelRules(config.models, workflows.signals, shared.sinks.models)
        self.adapters = AdapterLoader(config.models, base.pods, base.http, self.adapter_use, self.adapter_placement,
                                      base.metrics.registry)
        self.tracking = AdapterTracking(self.adapter_use)
        self.use = ModelUse(self.rules, base.metrics.registry)
        self._page = partial(debug.adapters_page, base.auth, self.adapters)

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/debug/adapters", self._page)]

    def running(self) -> Iterable[Running]:
        return [Running(self.adapters.start, self.adapters.stop)]

    def reloads(self) -> Mapping[str, Apply]:
        return {"models": self._reconfigure}

    def _reconfigure(self, models: ModelsConfig) -> None:
        self.rules.reconfigure(models)
        self.adapters.reconfigure(models)


class RoutingKit(Kit):
    """The router: the routing policies (plugins), the profiles built of them, and what they read; the pods
    as it sees them on ``/debug/pods``."""

    name = "routing"

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit, kv: KvKit,
                 models: ModelsKit) -> None:
        rc = config.routing
        context = PolicyContext(pods=base.pods, index=kv.index, approximate=kv.approximate, metrics=base.metrics,
                                load=load.load, ledger=shared.ledger, working_set=kv.working_set,
                                capacity_of=load.capacity_of, adapter_placement=models.adapter_placement)
        self.router = Router(base.pods, PluginRegistry(POLICY_GROUP, "routing policy"), rc.policy, rc.options,
                             context, max_candidates=rc.max_candidates, profiles=rc.profiles)
        self._page = partial(debug.pods_page, base.auth, base.pods, shared.ledger, self.router)

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/debug/pods", self._page)]

    def reloads(self) -> Mapping[str, Apply]:
        return {"routing": self.router.reconfigure}

    def checks(self) -> Mapping[str, Apply]:
        return {"routing": self.router.check}
