"""The identity step (resolve): who a request runs as comes from its API key, not from its headers.

A key's config (``auth.keys[]``) names its tenant, the highest priority band it may ask for, and whether it
may name another fairness id or set cache actions itself. A header asking for more than its key grants is
refused with a 403 in the route's shape (``identity_not_allowed``, naming the header) before anything is
tokenized, queued or charged, and counted in ``gateway_identity_refused_total{header}``:

- ``x-gateway-inference-fairness-id`` naming a tenant other than the key's (unless ``may_set_fairness_id``);
- ``x-priority``, or an objective (``x-gateway-inference-objective``) whose band is above ``max_priority``;
- ``x-stage-cache-policy`` (preserve, flush) or ``x-stage-preserve-threshold`` (unless
  ``may_set_cache_actions``).

Headers that ask for no more (the key's own tenant, a band at or below its bound, ``auto``) go on as sent.
With keys off, and for the admin key, headers choose as they always did.

Owner: nothing but its counter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter

from gateway.auth import ApiKey
from gateway.core.errors import ErrorKind, GatewayError
from gateway.flow.flows import FAIRNESS_HEADER, FlowPolicy
from gateway.request.types import ClientRequest

CACHE_POLICY_HEADER = "x-stage-cache-policy"
PRESERVE_THRESHOLD_HEADER = "x-stage-preserve-threshold"


class KeyIdentity:
    def __init__(self, flow_policy: Callable[[], FlowPolicy], registry: CollectorRegistry) -> None:
        self._flow_policy = flow_policy  # the flow controller's, replaced when the config is reloaded
        self._refused = Counter("gateway_identity_refused", "Requests refused (403) for a header asking for more "
                                "than their API key grants, by header", ["header"], registry=registry)

    def resolve(self, request: ClientRequest) -> None:
        key = request.key
        if key is None or key.admin:
            return None
        refusal = self.refusal(key, request.headers)
        if refusal is not None:
            header, why = refusal
            self._refused.labels(header).inc()
            raise GatewayError(ErrorKind.FORBIDDEN, f"{header}: this API key may not {why}.",
                               code="identity_not_allowed", param=header)
        return None

    def refusal(self, key: ApiKey, headers: Mapping[str, str]) -> tuple[str, str] | None:
        """The first header asking for more than ``key`` grants, and what it asked; none: all within."""
        grant, policy = key.config, self._flow_policy()
        fairness = headers.get(FAIRNESS_HEADER)
        if fairness is not None and not grant.may_set_fairness_id:
            tenant = policy.tenant(grant.name, grant.tenant)
            if fairness.strip() != tenant:
                return FAIRNESS_HEADER, f"run as another tenant than its own (`{tenant}`)"
        asked = policy.asked_band(headers)
        if asked is not None and asked[0] > grant.max_priority:
            return asked[1], f"ask for priority band {asked[0]} (at most {grant.max_priority})"
        if not grant.may_set_cache_actions:
            policy_asked = (headers.get(CACHE_POLICY_HEADER) or "auto").strip().lower()
            if policy_asked != "auto":
                return CACHE_POLICY_HEADER, "set cache actions"
            if headers.get(PRESERVE_THRESHOLD_HEADER) is not None:
                return PRESERVE_THRESHOLD_HEADER, "set cache actions"
        return None
