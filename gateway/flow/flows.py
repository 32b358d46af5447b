"""Flows: which tenant and priority band a request belongs to, as the config says to tell them.

A request's *flow* is its fairness id and its priority band (the Gateway API Inference Extension's
model): the fairness id from ``x-gateway-inference-fairness-id``, else its workflow's (a stage inherits
the flow its workflow began with), else its API key's tenant (``flow_control.keys``; a named key is its
own tenant), else ``default``. The band from ``x-gateway-inference-objective`` (a named objective of the
config: band, TTFT target, weight), else ``x-priority``, else its workflow's, else 0. Higher bands are
served first. An objective the config does not name counts as none, as the Inference Extension treats an
unknown ``InferenceObjective``.

Owner: the :class:`FlowPolicy` owns nothing that changes: it is the config's reading. The flow controller
holds the one in use and replaces it whole when the config is reloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from gateway.config import FlowControlConfig
from gateway.core.errors import bad_request

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
PRIORITY_HEADER = "x-priority"
DEFAULT_FAIRNESS_ID = "default"
# The fairness id of flows beyond ``flow_control.max_flows``: they share one.
OVERFLOW_FAIRNESS_ID = "overflow"
MAX_FAIRNESS_ID_CHARS = 128


class FlowKey(NamedTuple):
    """A flow: a fairness id within a priority band. A tuple: every request looks its flow up in a few
    dicts, and a tuple hashes in C."""

    fairness_id: str
    priority: int = 0

    def __str__(self) -> str:
        return f"{self.fairness_id}@{self.priority}"


@dataclass(frozen=True, slots=True)
class Flow:
    """A request's flow and what the config says of it when the request arrived."""

    key: FlowKey
    objective: str | None = None
    weight: float = 1.0  # the tenant's weight times the objective's
    max_wait_s: float = 120.0  # how long it may wait at the gateway
    ttft_s: float | None = None  # the objective's TTFT target


# A band's span of engine priorities: a flow's service never reaches into the next band's.
ENGINE_BAND_SPAN = 1 << 40
INT64 = 1 << 63


def engine_priority(band: int, service: float) -> int:
    """The priority of a request in vLLM's terms (lower values are served first): the higher its band, the
    lower, then the less service its flow had when it was sent (its tag, in weighted tokens: see
    :meth:`gateway.flow.service_counters.ServiceCounters.tag`), the lower. A pod ordering its waiting requests by it
    serves the least-served flow's request first within a band, each flow's in the order sent."""
    value = -band * ENGINE_BAND_SPAN + min(ENGINE_BAND_SPAN - 1, max(0, int(service)))
    return max(-INT64, min(INT64 - 1, value))


class FlowPolicy:
    def __init__(self, config: FlowControlConfig) -> None:
        self.config = config

    def tenant(self, key_name: str | None, key_tenant: str | None = None) -> str:
        """The fairness id of a key's requests that name none: its own config's tenant (``key_tenant``), else
        ``flow_control.keys``' entry for its name, else its name; ``default`` with no named key."""
        if key_tenant:
            return key_tenant
        return self.config.keys.get(key_name, key_name) if key_name else DEFAULT_FAIRNESS_ID

    def asked_band(self, headers: Mapping[str, str]) -> tuple[int, str] | None:
        """The band the headers ask for and the header that asks (an objective the config names, else
        ``x-priority``); none: they ask for none."""
        name = headers.get(OBJECTIVE_HEADER)
        objective = self.config.objectives.get(name) if name else None
        if objective is not None:
            return objective.priority, OBJECTIVE_HEADER
        if (raw := headers.get(PRIORITY_HEADER)) is not None:
            return _priority(raw), PRIORITY_HEADER
        return None

    def resolve(self, headers: Mapping[str, str], key_name: str | None, inherited: FlowKey | None,
                key_tenant: str | None = None) -> Flow:
        """The flow of a request with these headers, sent with the API key named ``key_name`` (none: no key,
        or keys off) whose config names ``key_tenant``, continuing a workflow whose flow is ``inherited``
        (none: it starts one, or has none). What the key may not ask for was refused before
        (:mod:`gateway.request.identity`)."""
        config = self.config
        fairness_id = _fairness_id(headers.get(FAIRNESS_HEADER))
        if fairness_id is None:
            fairness_id = inherited.fairness_id if inherited is not None else self.tenant(key_name, key_tenant)
        name = headers.get(OBJECTIVE_HEADER)
        objective = config.objectives.get(name) if name else None
        asked = self.asked_band(headers)
        if asked is not None:
            priority = asked[0]
        else:
            priority = inherited.priority if inherited is not None else 0
        tenant = config.tenants.get(fairness_id)
        weight = (tenant.weight if tenant else 1.0) * (objective.weight if objective else 1.0)
        limits = [w for w in (objective.max_wait_s if objective else None, tenant.max_wait_s if tenant else None)
                  if w is not None]
        return Flow(FlowKey(fairness_id, priority), name if objective is not None else None, weight,
                    min(limits) if limits else config.max_wait_s,
                    objective.ttft_ms / 1000 if objective is not None and objective.ttft_ms else None)


def _fairness_id(raw: str | None) -> str | None:
    if raw is None:
        return None
    value = raw.strip()
    if not value or len(value) > MAX_FAIRNESS_ID_CHARS or not value.isprintable():
        raise bad_request(f"{FAIRNESS_HEADER} must be 1 to {MAX_FAIRNESS_ID_CHARS} printable characters.",
                          param=FAIRNESS_HEADER, code="invalid_fairness_id")
    return value


def _priority(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise bad_request("x-priority must be an integer.", param=PRIORITY_HEADER, code="invalid_slo_header") from None
