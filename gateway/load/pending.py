"""Pending load per pod by Little's law, and the engines' own view of their queues.

Owner: :class:`PendingLoad` owns no counts of its own: it reads what is in flight from the
:class:`~gateway.load.ledger.InFlightLedger`, the engines' numbers from the :class:`EngineStats` that the
metrics scraper alone writes, and which pods are in a KV-memory emergency from the pressure monitor's
:class:`~gateway.load.pressure_modes.PressureModes`. Routing and admission read :meth:`PendingLoad.load`.

A request of signature ``s`` on a pod whose profile says it sustains ``tputs[s]`` req/s at latency
``e2e[s]`` consumes ``1 / (tputs[s] * e2e[s])`` of that pod; a pod's load is the sum over its in-flight
requests, 1.0 being full. Without a profile a pod holds ``default_capacity`` requests. The engines'
scraped counts correct the gateway's (other replicas send work too): a pod with requests waiting in its
own queue is full whatever this gateway thinks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.inference_api import RequestKind
from gateway.load.ledger import InFlightLedger
from gateway.load.slo_profiles import ProfileStore


@dataclass(slots=True)
class EngineStats:
    """What a pod's ``/metrics`` said last (vLLM or SGLang names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    requests_finished: float = 0.0
    kv_capacity_tokens: float = 0.0  # 0: the engine does not say
    block_size: float = 0.0  # tokens per KV block (vLLM's cache_config_info); 0: the engine does not say
    # vLLM's lora_requests_info (its latest series): the adapters running and waiting, and its --max-loras
    # (0: the engine does not say: no LoRA).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0
    scraped_at: float = 0.0
    stale: bool = True
    failures: int = 0


@dataclass(slots=True)
class Estimate:
    """A request's predicted cost on one pod."""

    consumption: float  # share of the pod it takes while in flight (inf: the SLO cannot be met there)
    signature: tuple[int, int] | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


class PendingLoad:
    def __init__(self, profiles: ProfileStore, ledger: InFlightLedger, default_capacity: int,
                 deployment_of: Callable[[str], str], embedding_share: float = 0.2,
                 blocked: Callable[[str], bool] = lambda pod: False) -> None:
        self.profiles = profiles
        self.ledger = ledger
        self.default_capacity = default_capacity
        self.embedding_share = embedding_share
        self._deployment_of = deployment_of
        # Pods in a KV-memory emergency: full for admission and routing.
        self._blocked = blocked
        self.engine: dict[str, EngineStats] = {}

    @property
    def default_consumption(self) -> float:
        return 1.0 / self.default_capacity

    def estimate(self, pod: str, model: str, input_tokens: int, output_tokens: int) -> Estimate:
        profile = self.profiles.get(model, self._deployment_of(pod))
        if profile is None:
            return Estimate(1.0 / self.default_capacity)
        sig = profile.signature(output_tokens, input_tokens)
        capacity = profile.capacity(sig)
        return Estimate(1.0 / capacity if capacity > 0 else math.inf, sig, profile.ttft_s(sig), profile.e2e_s(sig))

    def load(self, pod: str) -> float:
        """The pod's pending load, corrected by its engine's own counts when they are fresh."""
        own = self.ledger.consumption(pod)
        stats = self.engine.get(pod)
        if stats is None or stats.stale:
            return own
        if stats.waiting > 0:
            return max(own, 1.0)
        in_flight = self.ledger.on_pod(pod)
        per_request = own / in_flight if in_flight else 1.0 / self.default_capacity
        return max(own, stats.running * per_request)

    def fits(self, pod: str, estimate: Estimate, kind: RequestKind) -> bool:
        if self._blocked(pod):
            return False
        if kind == RequestKind.EMBEDDINGS and (self.ledger.embedding_consumption(pod) + estimate.consumption
                                     > self.embedding_share):
            return False
        return self.load(pod) + estimate.consumption <= 1.0
