"""The pod registry: every pod the gateway knows, its models and health.

Owner: :class:`PodRegistry` owns the set of pods and the LoRA adapters that may be registered on a pod of
their base model (``loadable``, set from the config by the adapter loader); :class:`HealthChecker` writes a
pod's health and model list, and the adapter loader (:mod:`gateway.models.adapters`) adds or removes one
adapter from it as it registers or unregisters it there (the next model refresh says the pod's truth); the
proxy reports upstream outcomes through the registry (passive ejection). Everything else reads. What is in
flight on a pod is the in-flight ledger's (:mod:`gateway.load.ledger`).

The pods a request may go to (:meth:`PodRegistry.candidates`) are kept per model and leg, and made again
only when a pod joins, leaves, turns healthy or not, is ejected or comes back, or lists other models (an
adapter registered or unregistered included): a request costs a copy of that list, not a look at every pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.config import HealthConfig, PodConfig

# How long after start a request waits for pods that have not answered yet.
FIRST_ANSWERS_WINDOW_S = 15.0

log = logging.getLogger("gateway.backends.registry")  # the name log filters know (the package was backends/)

# A leg of a request served by two pods (prefill/decode disaggregation).
Leg = Literal["prefill", "decode"]


@dataclass(eq=False, slots=True)
class Pod:
    config: PodConfig
    name: str
    url: str
    # Model cards as the pod lists them at /v1/models (LoRA adapters included).
    model_cards: list[dict[str, Any]] = field(default_factory=list)
    models: frozenset[str] = frozenset()
    _healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # Passive ejection (the proxy's reports): out of rotation until ``ejected_until``; ``ejections`` in a
    # row double the backoff. ``ejected_at`` is None while the pod is not ejected.
    ejected_until: float = 0.0
    ejected_at: float | None = None
    ejections: int = 0
    consecutive_5xx: int = 0
    last_error: str | None = None
    last_check: float | None = None
    # Its registry's: told when the pod's health or models change (the registry's candidates are made again).
    _changed: Callable[[], None] = field(default=lambda: None, repr=False)

    @property
    def healthy(self) -> bool:
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        if value != self._healthy:
            self._healthy = value
            self._changed()

    def serves(self, model: str) -> bool:
        return model in self.models

    def takes(self, leg: Leg | None) -> bool:
        """Whether the pod serves this leg of a disaggregated request (None: a whole request: any pod)."""
        return leg is None or self.config.role == "both" or self.config.role == leg

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def set_models(self, cards: list[dict[str, Any]]) -> None:
        self.model_cards = cards
        models = frozenset(str(c["id"]) for c in cards if "id" in c)
        if models != self.models:
            self.models = models
            self._changed()


class PodRegistry:
    def __init__(self, pods: list[PodConfig], health: HealthConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._health = health
        self._clock = clock
        self._pods: dict[str, Pod] = {}
        # Adapter → its base model, for the adapters the gateway registers where they are needed: any pod of
        # the base model is a candidate for them.
        self._loadable: dict[str, str] = {}
        # Per (model, leg): the candidates, the version they were made at, and when they expire (an ejection
        # ends); the version counts every change that may alter them.
        self._candidates: dict[tuple[str, Leg | None], tuple[int, float, list[Pod]]] = {}
        self._version = 0
        # Until then a request may wait for the pods' first answers (:meth:`first_answers`), woken by a change.
        self._first_answers_until = time.monotonic() + FIRST_ANSWERS_WINDOW_S
        self._changes = asyncio.Event()
        for cfg in pods:
            self.add(cfg)

    def _changed(self) -> None:
        self._version += 1
        self._changes.set()

    @property
    def loadable(self) -> dict[str, str]:
        return self._loadable

    @loadable.setter
    def loadable(self, adapters: dict[str, str]) -> None:
        """The adapters that may be registered on a pod of their base model (each one's candidates change)."""
        self._loadable = adapters
        self._changed()

    def add(self, cfg: PodConfig) -> Pod:
        assert cfg.name is not None
        if cfg.name in self._pods:
            raise ValueError(f"duplicate pod name {cfg.name!r}")
        pod = Pod(config=cfg, name=cfg.name, url=cfg.url, _changed=self._changed)
        self._changed()
        if cfg.models:
            pod.set_models([{"id": m, "object": "model", "owned_by": "gateway"} for m in cfg.models])
        self._pods[cfg.name] = pod
        return pod

    def remove(self, name: str) -> Pod | None:
        self._changed()
        return self._pods.pop(name, None)

    def get(self, name: str) -> Pod | None:
        return self._pods.get(name)

    def all(self) -> list[Pod]:
        return list(self._pods.values())

    def knows_model(self, model: str) -> bool:
        return next(self._serving(model), None) is not None

    def models_pending(self) -> bool:
        """Whether a pod has not yet said what it serves (it has not answered since the gateway started): a
        model no pod lists may still be one of its, so a request for it is told to retry, not that it does
        not exist (a worker listens before its first health checks have answered)."""
        return any(not pod.models for pod in self._pods.values())

    async def first_answers(self) -> None:
        """Until every pod has said what it serves, within the first ``FIRST_ANSWERS_WINDOW_S`` of the gateway's
        life: a worker listens before its first health checks have answered (on a loaded host they may time
        out once), and a request or a model list meanwhile waits for them rather than hear that no pod serves
        its model. A pod down from the start holds nobody past the window."""
        while True:
            self._changes.clear()  # before looking: a change after this wakes the wait below
            left = self._first_answers_until - time.monotonic()
            if not self.models_pending() or left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changes.wait()

    def _serving(self, model: str) -> Iterator[Pod]:
        """The pods that list ``model``, or (an adapter registered where it is needed) its base model."""
        base = self._loadable.get(model)
        return (p for p in self._pods.values() if p.serves(model) or (base is not None and p.serves(base)))

    def base_model(self, model: str) -> str:
        """The base model of a LoRA adapter (its card's ``parent``, else the config's), or ``model`` itself."""
        for pod in self._pods.values():
            for card in pod.model_cards:
                if card.get("id") == model:
                    parent = card.get("parent")
                    return str(parent) if parent else model
        return self.loadable.get(model, model)

    def max_model_len(self, model: str) -> int | None:
        """The context length the pods list for ``model`` (vLLM's ``max_model_len``), if any."""
        for pod in self._pods.values():
            for card in pod.model_cards:
                if card.get("id") == model and isinstance(card.get("max_model_len"), int):
                    return card["max_model_len"]
        return None

    def candidates(self, model: str, exclude: frozenset[str] = frozenset(), leg: Leg | None = None) -> list[Pod]:
        """Pods serving ``model`` (``leg`` of it, when given) that are healthy, not ejected and not excluded;
        for an adapter the gateway registers where needed, every pod of its base model."""
        now = self._clock()
        cached = self._candidates.get((model, leg))
        if cached is None or cached[0] != self._version or now >= cached[1]:
            cached = self._candidates[(model, leg)] = self._available(model, leg, now)
        pods = cached[2]
        return [p for p in pods if p.name not in exclude] if exclude else list(pods)

    def _available(self, model: str, leg: Leg | None, now: float) -> tuple[int, float, list[Pod]]:
        serving = [p for p in self._serving(model) if p.takes(leg)]
        # They hold until the soonest ejection among them ends: that pod is back.
        until = min((p.ejected_until for p in serving if p.healthy and p.ejected_until > now), default=math.inf)
        return self._version, until, [p for p in serving if p.available(now)]

    def back_in_s(self, model: str, leg: Leg | None = None) -> float:
        """How soon a pod of ``model`` may take requests again, at the earliest: an ejected pod when its
        ejection ends or its next health check passes, whichever is first; an unhealthy one after the
        passing checks it still needs (``success_threshold``), the next one due ``interval_s`` after its
        last. What a client told to retry is told (Retry-After); ``interval_s`` when no pod is known."""
        now, interval = self._clock(), self._health.interval_s
        return min((self._pod_back_in(pod, now) for pod in self._serving(model) if pod.takes(leg)), default=interval)

    def _pod_back_in(self, pod: Pod, now: float) -> float:
        interval = self._health.interval_s
        next_check = max(0.0, (pod.last_check if pod.last_check is not None else now) + interval - now)
        if pod.healthy:
            return min(max(0.0, pod.ejected_until - now), next_check)
        needed = max(1, self._health.success_threshold - pod.consecutive_successes)
        return next_check + interval * (needed - 1)

    def disaggregated(self, model: str) -> bool:
        """Whether ``model`` is served by pods with roles: its requests are split into prefill and decode."""
        return any(p.config.role != "both" and p.serves(model) for p in self._pods.values())

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the healthy pods' models, one card per id (first pod's card wins): a model whose
        pods are all unhealthy is not listed (a request for it would get 503)."""
        cards: dict[str, dict[str, Any]] = {}
        for pod in self._pods.values():
            if not pod.healthy:
                continue
            for card in pod.model_cards:
                cards.setdefault(str(card.get("id")), card)
        return list(cards.values())

    # Adapters the loader registered or unregistered on a pod, before its next model refresh says so.

    def adapter_registered(self, pod: Pod, name: str, base: str, path: str) -> None:
        if not pod.serves(name):
            pod.set_models([*pod.model_cards, {"id": name, "object": "model", "root": path, "parent": base}])

    def adapter_unregistered(self, pod: Pod, name: str) -> None:
        if pod.serves(name):
            pod.set_models([c for c in pod.model_cards if c.get("id") != name])

    # Passive health, reported by the proxy; ended early by a passing health check.

    def report_connect_failure(self, pod: Pod, error: str) -> None:
        self._eject(pod, error)

    def report_server_error(self, pod: Pod, error: str) -> None:
        """A 5xx answer: eject after ``eject_after_5xx`` in a row."""
        pod.consecutive_5xx += 1
        pod.last_error = error
        if pod.consecutive_5xx >= self._health.eject_after_5xx:
            pod.consecutive_5xx = 0
            self._eject(pod, error)

    def _eject(self, pod: Pod, error: str) -> None:
        """Eject the pod for a backoff that doubles with each ejection in a row. Failures of requests sent
        before the ejection (a burst to a pod that just died) are the same outage: they do not lengthen it."""
        pod.last_error = error
        now = self._clock()
        if now < pod.ejected_until:
            return
        pod.ejections += 1
        backoff = min(self._health.ejection_base_s * 2 ** (pod.ejections - 1), self._health.ejection_max_s)
        pod.ejected_at = now
        pod.ejected_until = now + backoff
        self._changed()
        log.warning("pod %s ejected for %.1f s: %s", pod.name, backoff, error)

    def report_success(self, pod: Pod) -> None:
        pod.consecutive_5xx = 0
        if pod.ejections:
            self._end_ejection(pod)

    def health_passed(self, pod: Pod, probe_started: float) -> None:
        """A health probe sent at ``probe_started`` passed: an ejection that began before it is over (the
        pod answers again), one that began while it was on the wire stands."""
        if pod.ejected_at is not None and pod.ejected_at < probe_started:
            self._end_ejection(pod)

    def _end_ejection(self, pod: Pod) -> None:
        pod.ejections = 0
        pod.ejected_until = 0.0
        pod.ejected_at = None
        self._changed()
