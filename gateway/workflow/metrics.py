"""The workflow feature's Prometheus families: cache actions, and the keep-warm refreshes and what came of them.

Declared on the gateway's registry once (:meth:`gateway.metrics.GatewayMetrics.owned`), by whichever of the
feature's parts is built first: the cache-action executor always is, so the families are exported whether or
not keep-warm is on. Producers: :class:`gateway.workflow.actions.CacheActionExecutor` and
:class:`gateway.workflow.refresh.Refresher` (cache actions), the refresher (keep-warm requests and tokens),
:class:`gateway.workflow.keep_warm.KeepWarm` (returns).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class WorkflowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.cache_actions = Counter(
            "gateway_cache_actions", "Workflow cache actions by action, reason and pod", ["action", "reason", "pod"],
            registry=registry,
        )
        self.keep_warm_requests = Counter(
            "gateway_keep_warm_requests", "Keep-warm refreshes sent, by pod and outcome (ok, failed, cancelled: a "
            "client request came for the pod)",
            ["pod", "outcome"], registry=registry)
        self.keep_warm_tokens = Counter(
            "gateway_keep_warm_tokens", "Prompt tokens of keep-warm refreshes as the pod counted them (prompt), "
            "and of those found cached (cached)", ["pod", "kind"], registry=registry)
        self.keep_warm_returns = Counter(
            "gateway_keep_warm_returns", "Refreshed contexts that came back and found their blocks (kept) or "
            "did not (lost)", ["outcome"], registry=registry)
