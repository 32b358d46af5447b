"""The flow-control and SLO-admission kit: a request no pod has room for waits in the flow controller's
queue, ordered by its flow's service, and released as room frees up here or in a sibling worker."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

from gateway.admission import SloPolicy
from gateway.api import debug
from gateway.config import GatewayConfig
from gateway.flow.controller import FlowController
from gateway.flow.metrics import FlowLabels, FlowMetrics
from gateway.flow.saturation import SaturationDetector
from gateway.flow.service_counters import ServiceCounters, WorkflowFlows
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.kit import Apply, Kit, Route, Running
from gateway.kits.state import LoadKit
from gateway.request.flow_control import FlowControlStep


class FlowKit(Kit):
    """The saturation detector, each flow's service (here and shared), the flow controller, and the request
    step that holds and releases (``admit``: present when flow control or SLO admission is on); what it holds
    on ``/debug/flows``."""

    name = "flow_control"
    requires = ("shared_state", "fleet")  # it releases to the pods the health checks find

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit) -> None:
        fc = config.flow_control
        self.service = ServiceCounters(shared.sinks.flows)
        self.detector = SaturationDetector(fc.saturation, shared.ledger, load.load, config.admission.enabled,
                                           flow_control=fc.enabled, active_flows=self.service.active_flows)
        self.workflow_flows = WorkflowFlows(publish=shared.sinks.flows)
        self.metrics = FlowMetrics(base.metrics.registry,
                                   FlowLabels.of_keys(lambda: self.flow.config, config.auth.keys))
        self.flow = FlowController(fc, base.pods, self.detector, self.service, shared.room_freed, self.metrics,
                                   shared.release_order)
        # SLO admission and flow control hold requests in one queue, the flow controller's.
        self.admit = (FlowControlStep(self.flow, SloPolicy(config.admission), self.workflow_flows, base.pods,
                                      self.metrics)
                      if fc.enabled or config.admission.enabled else None)
        self._page = partial(debug.flows_page, base.auth, fc.enabled, self.flow)

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/debug/flows", self._page)]

    def running(self) -> Iterable[Running]:
        return [Running(self.flow.start, self.flow.stop)]

    def reloads(self) -> Mapping[str, Apply]:
        return {"flow_control": self.flow.reconfigure}
