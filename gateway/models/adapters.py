"""LoRA adapters, kept where they are resident and registered where they are needed (``models.adapters``).

vLLM registers any number of adapters by name and path (``/v1/load_lora_adapter``), keeps
``--max-cpu-loras`` of them in memory and ``--max-loras`` in one batch, and reads another from its path again
when a request needs it; requests of more adapters than a batch holds wait, and the prefix cache is per
adapter (``/work/shared/specs/lora-on-vllm-cpu.md``). So what costs is switching, and this module keeps an
adapter's requests where it is resident:

- :class:`AdapterUse` is where each adapter was served lately, per pod (every process's requests, through
  :class:`~gateway.core.facts.AdapterServed` facts), and this process's requests of it in flight there;
- :class:`AdapterPlacement` is a filter the router runs for every policy: an adapter's requests go to the
  pods that list it while one of them has room; to any pod of its base model when none lists it, and to
  those with room when the pods that list it are saturated. It writes each kept pod's ``switch_cost`` (tokens):
  nothing where the adapter is active (the engine says it runs there, or it is among the pod's
  ``max_loras`` most recently served), a switch where it is registered, a switch and a read where it is not;
  ``kv_aware`` adds it to its placement cost, beside the prefix (in the adapter's own namespace) and load;
- :class:`AdapterLoader` registers an adapter on the pod a request was routed to when that pod does not list
  it (once per pod and adapter at a time, bounded by ``lora.load_timeout_s``; a failure sends the request to
  another pod), and unregisters what a pod has not served for ``lora.idle_unload_s`` since its last request
  ended, unless the engine runs it (another process's or client's request). Registrations are counted
  (``gateway_lora_registrations_total``) and shown at ``/debug/adapters``.

Owners: :class:`AdapterUse` of the recency and in-flight counts (written by the dispatch and finish steps,
and by other processes' facts); :class:`AdapterLoader` of the registrations in flight and their counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from gateway.background import cancel_and_wait
from gateway.config import LoraConfig, ModelsConfig
from gateway.core.facts import AdapterServed, Publish, unshared
from gateway.http_client import HttpClient
from gateway.load.pending import EngineStats
from gateway.pods.registry import Pod, PodRegistry
from gateway.routing.policy import RoutingRequest

log = logging.getLogger("gateway.adapters")


@dataclass(slots=True)
class _OnPod:
    served: dict[str, float] = field(default_factory=dict)  # adapter → last served (monotonic), oldest first
    in_flight: Counter[str] = field(default_factory=Counter)  # this process's requests
    told: dict[str, float] = field(default_factory=dict)  # when this process last told the others


class AdapterUse:
    """Which adapters each pod served lately (everyone's requests) and runs now (this process's)."""

    def __init__(self, publish: Publish = unshared, tell_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._publish = publish
        self._tell_every_s = tell_every_s
        self._clock = clock
        self._pods: dict[str, _OnPod] = {}

    def _on(self, pod: str) -> _OnPod:
        state = self._pods.get(pod)
        if state is None:
            state = self._pods[pod] = _OnPod()
        return state

    def routed(self, pod: str, adapter: str) -> None:
        state = self._on(pod)
        self._used(state, pod, adapter)
        state.in_flight[adapter] += 1

    def ended(self, pod: str, adapter: str) -> None:
        """A request of ``adapter`` ended on ``pod``: the adapter was in use until now, so its idle time (and
        its place among the pod's recent adapters) counts from here, not from when the request began."""
        state = self._on(pod)
        self._used(state, pod, adapter)
        state.in_flight[adapter] -= 1
        if state.in_flight[adapter] <= 0:
            del state.in_flight[adapter]

    def _used(self, state: _OnPod, pod: str, adapter: str) -> None:
        """``adapter`` is in use on ``pod`` now; the other processes are told at most every ``tell_every_s``."""
        now = self._clock()
        self._served(state, adapter, now)
        if now - state.told.get(adapter, -self._tell_every_s) >= self._tell_every_s:
            state.told[adapter] = now
            self._publish(AdapterServed(pod, adapter))

    def apply_remote(self, origin: str, fact: AdapterServed) -> None:
        self._served(self._on(fact.pod), fact.adapter, self._clock())

    @staticmethod
    def _served(state: _OnPod, adapter: str, now: float) -> None:
        state.served.pop(adapter, None)
        state.served[adapter] = now

    def recent(self, pod: str, n: int) -> list[str]:
        """The ``n`` adapters served most recently on ``pod``, the latest first."""
        state = self._pods.get(pod)
        return list(reversed(state.served))[:n] if state is not None and n > 0 else []

    def last_served(self, pod: str, adapter: str) -> float | None:
        state = self._pods.get(pod)
        return state.served.get(adapter) if state is not None else None

    def running_here(self, pod: str, adapter: str) -> int:
        state = self._pods.get(pod)
        return state.in_flight[adapter] if state is not None else 0

    def seen(self, pod: str, adapter: str, now: float) -> None:
        """An adapter found on a pod: counted as served now, so that it is not unloaded before it had a chance."""
        state = self._on(pod)
        state.served.setdefault(adapter, now)

    def forget_pod(self, pod: str) -> None:
        self._pods.pop(pod, None)

    def debug(self, pod: str) -> dict[str, Any]:
        state = self._pods.get(pod)
        now = self._clock()
        if state is None:
            return {}
        return {adapter: {"served_s_ago": round(now - at, 1), "in_flight_here": state.in_flight[adapter]}
                for adapter, at in reversed(state.served.items())}


class AdapterPlacement:
    """The router's filter for a LoRA request (every policy's, before its own): see the module."""

    name = "adapter_resident"

    def __init__(self, use: AdapterUse, engine: Mapping[str, EngineStats], saturated: Callable[[str], bool],
                 config: LoraConfig) -> None:
        self._use = use
        self._engine = engine
        self._saturated = saturated
        self.config = config

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        adapter = request.lora_name
        if adapter is None:
            return pods
        request.switch_cost = {}  # this attempt's own
        resident = [p for p in pods if p.serves(adapter)]
        if resident and len(resident) < len(pods):
            if any(not self._saturated(p.name) for p in resident):
                pods = resident
            else:  # its pods are saturated: to the best of those with room, else it waits where it is resident
                pods = [p for p in pods if not p.serves(adapter) and not self._saturated(p.name)] or resident
        for pod in pods:
            if (cost := self._cost(pod, adapter)) > 0:
                request.switch_cost[pod.name] = cost
        return pods

    def _cost(self, pod: Pod, adapter: str) -> float:
        """What sending a request of ``adapter`` to ``pod`` costs besides its prompt, in tokens: nothing where
        the adapter is active; else a switch into a slot, twice when every slot holds another adapter served
        there lately (that one switches back when its requests return), and a read where it is not registered."""
        slots = self._slots(pod.name)
        recent = self._use.recent(pod.name, slots)
        if adapter in recent or adapter in self.running(pod.name):
            return 0.0
        config = self.config
        cost = config.switch_cost_tokens * (2 if len(recent) >= slots else 1)
        return cost + (0 if pod.serves(adapter) else config.load_cost_tokens)

    def active(self, pod: str, adapter: str) -> bool:
        """Whether ``adapter`` is in one of the pod's batch slots: the engine runs it, or it is among the
        ``max_loras`` adapters served there most recently."""
        return adapter in self.running(pod) or adapter in self._use.recent(pod, self._slots(pod))

    def _slots(self, pod: str) -> int:
        stats = self._engine.get(pod)
        return stats.max_loras if stats is not None and stats.max_loras else 1

    def running(self, pod: str) -> tuple[str, ...]:
        """The adapters the pod's engine runs requests of, as its last scrape says (whoever sent them)."""
        stats = self._engine.get(pod)
        return stats.lora_running if stats is not None else ()


class AdapterUnavailable(Exception):
    """The pod could not register the adapter (refused, unreachable, too slow): another pod may."""


class AdapterLoader:
    def __init__(self, config: ModelsConfig, pods: PodRegistry, http: HttpClient, use: AdapterUse,
                 placement: AdapterPlacement, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pods = pods
        self._http = http
        self._use = use
        self._placement = placement
        self._clock = clock
        self._registering: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._registrations = PromCounter(
            "gateway_lora_registrations", "LoRA adapters registered on a pod by the gateway, by outcome: loaded, "
            "already (the pod had it), failed, timeout", ["pod", "adapter", "outcome"], registry=registry)
        self._unregistrations = PromCounter(
            "gateway_lora_unregistrations", "LoRA adapters the gateway unregistered from a pod after they idled, "
            "by outcome: unloaded, gone (the pod no longer had it), failed", ["pod", "adapter", "outcome"],
            registry=registry)
        self.counts: Counter[tuple[str, str]] = Counter()  # (pod, outcome) → registrations, for /debug/adapters
        self.reconfigure(config)

    def reconfigure(self, config: ModelsConfig) -> None:
        self.config = config
        self._placement.config = config.lora
        self._pods.loadable = {name: adapter.base_model for name, adapter in config.adapters.items()}

    # The director's loader

    def needed(self, routing: RoutingRequest, pod: Pod) -> bool:
        """Whether ``pod`` must register the request's adapter before it is sent the request."""
        adapter = routing.lora_name
        return adapter is not None and adapter in self.config.adapters and not pod.serves(adapter)

    async def ready(self, routing: RoutingRequest, pod: Pod) -> None:
        """The request's adapter registered on ``pod``: by this request, or by the one already registering it
        there. Raises :class:`AdapterUnavailable` when it cannot be."""
        adapter = routing.lora_name
        assert adapter is not None
        key = (pod.name, adapter)
        task = self._registering.get(key)
        if task is None:
            task = asyncio.create_task(self._register(pod, adapter), name=f"lora-register-{adapter}")
            self._registering[key] = task
            task.add_done_callback(lambda _, key=key: self._registering.pop(key, None))
        await asyncio.shield(task)  # a client that leaves does not cancel the others' registration

    async def _register(self, pod: Pod, adapter: str) -> None:
        spec = self.config.adapters[adapter]
        timeout = self.config.lora.load_timeout_s
        started = self._clock()
        try:
            async with self._http.session.post(
                    f"{pod.url}/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": spec.path},
                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                text = (await resp.text())[:512]
        except TimeoutError:
            self._count(pod, adapter, "timeout")
            raise AdapterUnavailable(f"Pod {pod.name} did not register adapter {adapter} within {timeout:g} s.") \
                from None
        except aiohttp.ClientError as exc:
            self._count(pod, adapter, "failed")
            raise AdapterUnavailable(f"Pod {pod.name} could not be asked to register adapter {adapter}: {exc}") \
                from None
        if resp.status == 200 or (resp.status == 400 and "already been loaded" in text):
            self._count(pod, adapter, "loaded" if resp.status == 200 else "already")
            self._pods.adapter_registered(pod, adapter, spec.base_model, spec.path)
            log.info("adapter %s registered on %s in %.2f s", adapter, pod.name, self._clock() - started)
            return
        self._count(pod, adapter, "failed")
        raise AdapterUnavailable(f"Pod {pod.name} refused to register adapter {adapter} (HTTP {resp.status}): "
                                 f"{text.strip()}")

    def _count(self, pod: Pod, adapter: str, outcome: str) -> None:
        self._registrations.labels(pod.name, adapter, outcome).inc()
        self.counts[(pod.name, outcome)] += 1

    # Unregistering what idles

    async def start(self) -> None:
        if self.config.lora.idle_unload_s > 0:
            self._task = asyncio.create_task(self._run(), name="lora-unload")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        for task in list(self._registering.values()):
            await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            idle = self.config.lora.idle_unload_s
            await asyncio.sleep(min(30.0, idle / 4) if idle > 0 else 30.0)
            if idle > 0:
                try:
                    await self.unload_idle()
                except Exception:  # a bug here must not stop it for good
                    log.exception("unregistering idle adapters failed")

    async def unload_idle(self) -> int:
        """Unregister each managed adapter a pod has not served for ``idle_unload_s``; how many went."""
        now, idle, unloaded = self._clock(), self.config.lora.idle_unload_s, 0
        for pod in self._pods.all():
            for adapter in [a for a in self.config.adapters if pod.serves(a)]:
                last = self._use.last_served(pod.name, adapter)
                if last is None:
                    self._use.seen(pod.name, adapter, now)
                    continue
                if now - last < idle or self._use.running_here(pod.name, adapter) \
                        or adapter in self._placement.running(pod.name) or (pod.name, adapter) in self._registering:
                    continue
                unloaded += await self._unload(pod, adapter)
        return unloaded

    async def _unload(self, pod: Pod, adapter: str) -> int:
        try:
            async with self._http.session.post(f"{pod.url}/v1/unload_lora_adapter", json={"lora_name": adapter},
                                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("unregistering adapter %s from %s failed: %s", adapter, pod.name, exc)
            self._unregistrations.labels(pod.name, adapter, "failed").inc()
            return 0
        if status not in (200, 404):
            self._unregistrations.labels(pod.name, adapter, "failed").inc()
            return 0
        self._unregistrations.labels(pod.name, adapter, "unloaded" if status == 200 else "gone").inc()
        self._pods.adapter_unregistered(pod, adapter)
        log.info("adapter %s unregistered from %s after %g s idle", adapter, pod.name, self.config.lora.idle_unload_s)
        return 1

    def debug(self) -> dict[str, Any]:
        """``/debug/adapters``: per pod, the adapters it lists, which are active, when each was served, the
        registrations in flight and their outcomes so far."""
        pods = {}
        for pod in self._pods.all():
            listed = sorted(m for m in pod.models if m in self.config.adapters or self._pods.base_model(m) != m)
            pods[pod.name] = {
                "listed": listed,
                "active": [a for a in listed if self._placement.active(pod.name, a)],
                "served": self._use.debug(pod.name),
                "registering": sorted(a for p, a in self._registering if p == pod.name),
                "registrations": {o: n for (p, o), n in sorted(self.counts.items()) if p == pod.name},
            }
        return {"adapters": {name: {"path": a.path, "base_model": a.base_model}
                             for name, a in self.config.adapters.items()},
                "lora": {"load_timeout_s": self.config.lora.load_timeout_s,
                         "idle_unload_s": self.config.lora.idle_unload_s,
                         "switch_cost_tokens": self.config.lora.switch_cost_tokens,
                         "load_cost_tokens": self.config.lora.load_cost_tokens},
                "pods": pods}
