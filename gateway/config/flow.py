"""Whether and when a request goes: SLO admission and flow control between tenants."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class SloTargets(msgspec.Struct, forbid_unknown_fields=True):
    ttft_ms: float | None = None
    e2e_ms: float | None = None


class AdmissionConfig(msgspec.Struct, forbid_unknown_fields=True):
    """SLO admission: with ``enabled``, the pods' predicted load (GPU profiles, Little's law) is one more
    saturation signal of flow control, and a request whose SLO no pod can meet is refused at once. Its
    requests wait in flow control's one queue (``flow_control.max_queued``, ``max_wait_s``)."""

    enabled: bool = False
    # Per model, the SLO of requests that send no x-slo-* headers.
    slo_defaults: dict[str, SloTargets] = {}
    # Unused: Retry-After comes from flow control's recent dispatch rate. Still read, so that a config that
    # sets it loads; it will go in a later release.
    typical_e2e_s: float = 2.0


class ObjectiveConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A named objective (``x-gateway-inference-objective``): its priority band, SLO and weight."""

    # Higher bands are dispatched first while the fleet is saturated.
    priority: int = 0
    # Held longer than this (less the predicted TTFT, with profiles) the request is refused (429).
    ttft_ms: Annotated[float, Meta(gt=0)] | None = None
    # Share of capacity against other flows of its band (multiplies the tenant's weight).
    weight: float = 1.0
    # How long its requests may wait at the gateway; none: ``flow_control.max_wait_s``.
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        _check_flow_limits(self.weight, self.max_wait_s)


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One fairness id's share of the fleet, and how long its requests may wait."""

    weight: float = 1.0
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        _check_flow_limits(self.weight, self.max_wait_s)


def _check_flow_limits(weight: float, max_wait_s: float | None) -> None:
    if not weight > 0 or (max_wait_s is not None and max_wait_s < 0):
        raise ValueError("weight must be positive and max_wait_s not negative")


class SaturationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """When a pod has room for one more request (flow control holds requests while no candidate pod has).
    A pod is saturated while any of these holds."""

    # Prompt tokens (less those predicted cached) the pod has yet to prefill, from every worker: those it has
    # not begun answering, less what its measured rate got through since it last made progress. The prefill
    # queued in front of the next request: one long prompt may pass it; the next waits until the running one
    # drains below it. Higher keeps a chunked-prefill engine's steps fuller, at the cost of a newcomer's TTFT.
    # While several flows are served, a prompt joins a queue only where both fit in it (or the queue is empty).
    prefill_tokens: Annotated[int, Meta(ge=1)] = 2048
    # How long at most a prompt that does not fit beside a pod's queue waits for it to empty: an answer that is
    # not streamed counts as queued until it ends (its first token is not seen).
    prefill_fit_wait_s: Annotated[float, Meta(ge=0)] = 0.25
    # While several flows are served, a held request (routed among the pods with room when released) joins a
    # pod where its prompt fits the next step beside the running prefill's rest as counted down, not only
    # beside the whole queue. Off: measured, it doubled B's TTFT p90 on noisy-neighbor and made B wait longer
    # beside a flood of documents on real vLLM (docs/flow-isolation.md).
    join_beside_prefill: bool = False
    # While several flows are served, a prompt longer than ``prefill_tokens`` starts on a pod only while another
    # candidate pod has at most half as much prefill work left: the pods' long prefills end at staggered times,
    # so another flow's newcomer waits for half of one at most, not for a whole one on every pod at once (a
    # crowd of documents on 2 pods: docs/flow-isolation.md). One pod, or one flow served: nothing to stagger.
    stagger_prefills: bool = True
    # Requests waiting in the engine's own queue (vLLM's num_requests_waiting, SGLang's num_queue_reqs).
    engine_waiting: Annotated[int, Meta(ge=1)] = 5
    # KV-cache usage the engine reports (running requests' blocks, 0-1).
    kv_usage: Annotated[float, Meta(gt=0, le=1)] = 0.9
    # Requests in flight on the pod through the gateway (every worker); none: no limit of its own.
    in_flight: Annotated[int, Meta(ge=1)] | None = None
    # Engine metrics older than this are not read (the gateway's own counts decide alone).
    stale_after_s: Annotated[float, Meta(gt=0)] = 2.0


class TokenWeightsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """What a served token costs a flow's service counter (the Virtual Token Counter's weights)."""

    input: Annotated[float, Meta(ge=0)] = 1.0
    # Prompt tokens the engine found cached: their prefill is skipped.
    cached_input: Annotated[float, Meta(ge=0)] = 0.1
    output: Annotated[float, Meta(ge=0)] = 2.0


class FlowControlConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Flows (a fairness id and a priority band) share the fleet: while every candidate pod is saturated,
    new requests wait at the gateway and are dispatched band by band, the flow with the least weighted
    service first. Reloaded with the config file (all but ``enabled``: :mod:`gateway.config_reload`).
    On by default: an idle fleet holds nothing, and a request that is not held costs a few per cent more
    CPU (docs/benchmarks.md#flow-control has the numbers)."""

    enabled: bool = True
    saturation: SaturationConfig = msgspec.field(default_factory=SaturationConfig)
    # Requests held at the gateway, all flows together; past it a new one is refused (429).
    max_queued: Annotated[int, Meta(ge=1)] = 4096
    # How long a request may wait at the gateway (a flow's tenant or objective may say otherwise).
    max_wait_s: Annotated[float, Meta(ge=0)] = 120.0
    tokens: TokenWeightsConfig = msgspec.field(default_factory=TokenWeightsConfig)
    objectives: dict[str, ObjectiveConfig] = {}
    # By fairness id; flows of ids not listed have weight 1.
    tenants: dict[str, TenantConfig] = {}
    # API key name (``auth.keys[].name``) → fairness id; a named key not listed is its own tenant.
    keys: dict[str, str] = {}
    # Flows kept at once (each with its service counter); a new fairness id beyond it joins ``overflow``.
    max_flows: Annotated[int, Meta(ge=1)] = 10_000
    # A flow that starts to wait (it was idle, or kept up) has its counter lifted to the least-served waiting
    # flow's, less this much weighted service: what it may take before the flows that waited all along, so that
    # a tenant whose few requests come back one at a time sends them together, not one per long prompt of a
    # flood's (0: the Virtual Token Counter's lift, level with them).
    lift_credit: Annotated[float, Meta(ge=0)] = 4096.0
