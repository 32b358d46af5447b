"""SLO admission: a request's SLO, and what the pods' predicted load says of it.

A request's TTFT and end-to-end targets come from ``x-slo-ttft-ms`` / ``x-slo-e2e-ms``, else its
objective's TTFT target (``flow_control.objectives``), else ``admission.slo_defaults.<model>``. Flow control
(:mod:`gateway.flow.controller`) holds the request while the fleet is saturated, ordered within its flow by
the deadline these give, and refuses it (429) once it has waited past it. With ``admission.enabled`` the
GPU profiles also predict, per pod, the request's TTFT and end-to-end time and the share of the pod it takes
(:mod:`gateway.load.pending`): a request no pod can serve within its SLO is refused at once, a pod the
request would take past full is saturated for it, and the wait allowed is the TTFT target less the
predicted TTFT.

Owner: nothing that changes: the :class:`SloPolicy` reads the config and the pending load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config import AdmissionConfig
from gateway.core.errors import ErrorKind, GatewayError, bad_request
from gateway.load.pending import Estimate
from gateway.pods.registry import Pod


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    e2e_s: float | None = None


NO_SLO = Slo()


class SloPolicy:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config

    @property
    def enabled(self) -> bool:
        """Whether the GPU profiles' predictions take part (``admission.enabled``)."""
        return self.config.enabled

    def slo_for(self, model: str, ttft_ms: str | None, e2e_ms: str | None, objective_ttft_s: float | None) -> Slo:
        if not (ttft_ms or e2e_ms or objective_ttft_s or self.config.slo_defaults):
            return NO_SLO
        defaults = self.config.slo_defaults.get(model)
        try:
            ttft = float(ttft_ms) / 1000 if ttft_ms else objective_ttft_s or (
                defaults.ttft_ms / 1000 if defaults and defaults.ttft_ms else None)
            e2e = float(e2e_ms) / 1000 if e2e_ms else (defaults.e2e_ms / 1000 if defaults and defaults.e2e_ms
                                                        else None)
        except ValueError:
            raise bad_request("x-slo-ttft-ms and x-slo-e2e-ms must be numbers.", code="invalid_slo_header") from None
        if (ttft is not None and not ttft > 0) or (e2e is not None and not e2e > 0):
            raise bad_request("SLO targets must be positive.", code="invalid_slo_header")
        return Slo(ttft, e2e)

    def check(self, pods: list[Pod], estimates: dict[str, Estimate], slo: Slo) -> None:
        """Refuse (429) a request that no pod can serve within its SLO, by the profiles' predictions."""
        if not self.enabled or not pods:
            return
        if not any(_can_meet(estimates[p.name], slo) for p in pods if p.name in estimates):
            raise GatewayError(ErrorKind.RATE_LIMITED, "No pod can serve this request within its SLO. Retry after "
                               "1 s.", code="slo_unreachable", retry_after_s=1)

    def wait_allowed(self, pods: list[Pod], estimates: dict[str, Estimate], slo: Slo) -> float | None:
        """How long the request may wait at the gateway and still meet its TTFT target (None: no target)."""
        if slo.ttft_s is None:
            return None
        if not self.enabled:
            return slo.ttft_s
        expected = min(((e.ttft_s or 0.0) for p in pods if (e := estimates.get(p.name)) is not None), default=0.0)
        return max(0.0, slo.ttft_s - expected)


def _can_meet(estimate: Estimate, slo: Slo) -> bool:
    if not math.isfinite(estimate.consumption):
        return False
    if slo.ttft_s is not None and estimate.ttft_s is not None and estimate.ttft_s > slo.ttft_s:
        return False
    return not (slo.e2e_s is not None and estimate.e2e_s is not None and estimate.e2e_s > slo.e2e_s)
