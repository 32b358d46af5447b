"""The flow controller: holds requests at the gateway while the fleet is saturated, and dispatches them fairly.

A request whose candidate pods all lack room (:mod:`gateway.flow.saturation`), or that finds others already
waiting, waits here in its flow's queue instead of in a pod's. As room frees up (an answer begins, an attempt
ends: the ledger rings the doorbell; engine metrics and the other workers' requests are re-read every
``TICK_S``, and sooner when a pod's running prefill is due to drain below its threshold) the controller
releases, one at a time, the head of the highest band's least-served flow
(:mod:`gateway.flow.service_counters`; ties: the flow released least recently), within a flow the request with the
earliest deadline (its SLO, else its arrival: first come, first served). The released request is routed
then, among the pods that had room: a held request goes to the best pod when it leaves, not when it came.
The next one is released once it has been dispatched. An idle fleet holds nothing: a request that finds
room and nobody waiting goes on at once (routed among every pod: it may join a queue its prompt does not
fit, where the policy prefers that pod's cached prefix).

Room may depend on the request (its prompt's fit beside a queue, its predicted load): one that waits for
room on some pods keeps those after it on the same candidate pods waiting too, or shorter prompts could
pass it again and again (requests of other pools, even overlapping ones, go on).

A request waits at most its flow's limit, or its SLO allows less; then it is refused (429 with a
Retry-After from the recent dispatch rate), as it is when ``max_queued`` requests already wait. A client
that leaves while held leaves nothing behind: it was never dispatched, charged or counted as served.

Owner: :class:`FlowQueues` owns the requests held in this process, their wait limits, the flows counted and
the recent dispatches; the :class:`FlowController` its queues, the one request released and not yet dispatched,
and the flow-control config in force (replaced on reload). Each worker holds its own; they share the pods'
state (the load table, the engines' metrics), the flows' service counters (the state bus), and the order of
release: a worker releases only when its next request ranks first of all (:mod:`gateway.flow.release_order`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.background import Doorbell, cancel_and_wait
from gateway.config import FlowControlConfig
from gateway.core.errors import ErrorKind, GatewayError
from gateway.flow.flows import OVERFLOW_FAIRNESS_ID, Flow, FlowKey, FlowPolicy
from gateway.flow.metrics import FlowMetrics
from gateway.flow.release_order import Contender, ReleaseOrder, SoleRelease, pool_key
from gateway.flow.saturation import Demand, SaturationDetector
from gateway.flow.service_counters import ANNOUNCE_S, ServiceCounters
from gateway.pods.registry import Pod, PodRegistry

log = logging.getLogger("gateway.flow")

# How often held requests re-check for room without a ring (engine metrics, the other workers' requests).
TICK_S = 0.05
# A released request not dispatched by then (a bug, a stalled step) no longer blocks the next release.
TRANSIT_LIMIT_S = 1.0
# Dispatches remembered for the rate that Retry-After is estimated from.
RATE_WINDOW_S = 30.0
# How often the flows' service counters and the flows counted are swept for idle ones.
SWEEP_S = 60.0


@dataclass(eq=False, slots=True)
class Held:
    """One request waiting here; the future is resolved with the pods that had room when it was released."""

    key: FlowKey  # the flow's key as counted here (past max_flows: its band's overflow flow)
    model: str
    leg: str | None
    demand: Demand
    arrived: float
    give_up_at: float
    seq: int
    future: asyncio.Future[frozenset[str]]
    timer: asyncio.TimerHandle | None = None
    queued: bool = True
    unfit_since: float | None = None  # since when its prompt alone kept it out of a pod with room (at the head)

    def __lt__(self, other: Held) -> bool:  # within a flow: the earliest deadline, then the first to come
        return (self.give_up_at, self.seq) < (other.give_up_at, other.seq)


@dataclass(eq=False, slots=True)
class _FlowQueue:
    key: FlowKey
    heap: list[Held] = field(default_factory=list)
    released_at: float = -math.inf  # when this flow last had a request released (ties go to the older)

    def head(self) -> Held | None:
        heap = self.heap
        while heap and not heap[0].queued:
            heapq.heappop(heap)
        return heap[0] if heap else None


class FlowQueues:
    """The held requests by band and flow; each leaves when released, gone, or refused at its wait limit."""

    def __init__(self, config: FlowControlConfig, counters: ServiceCounters, order: ReleaseOrder,
                 metrics: FlowMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config  # the controller's, replaced on reload
        self._counters = counters
        self._order = order
        self._metrics = metrics
        self._clock = clock
        self._bands: dict[int, dict[FlowKey, _FlowQueue]] = {}
        self.count = 0  # requests held
        self._seq = itertools.count()
        self._flows_seen: set[FlowKey] = set()
        self._dispatches: deque[float] = deque()

    def key_of(self, key: FlowKey) -> FlowKey:
        """The flow's key as counted here: itself, or its band's overflow flow past ``max_flows`` distinct ones."""
        if key not in self._flows_seen:
            if len(self._flows_seen) >= self.config.max_flows:
                return FlowKey(OVERFLOW_FAIRNESS_ID, key.priority)
            self._flows_seen.add(key)
        return key

    def add(self, flow: FlowKey, model: str, leg: str | None, demand: Demand, wait_allowed_s: float) -> Held:
        """A request starts to wait in its flow's queue, ``wait_allowed_s`` at most; 429 when too many wait."""
        key = self.key_of(flow)
        if self.count >= self.config.max_queued:
            self._metrics.outcome(key, "queue_full")
            raise self._refusal("The gateway's queue is full.", "queue_full")
        now = self._clock()
        loop = asyncio.get_running_loop()
        held = Held(key, model, leg, replace(demand, held=True), now, now + wait_allowed_s, next(self._seq),
                    loop.create_future())
        held.timer = loop.call_at(loop.time() + wait_allowed_s, self._expire, held)
        band = self._bands.setdefault(key.priority, {})
        queue = band.get(key)
        if queue is None:
            # The flow starts to wait: no more than ``lift_credit`` of service banked while it did not (the VTC's
            # counter lift, short of level), against the flows waiting here and in the other workers.
            floors = [self._counters.get(k) for k in band]
            if (elsewhere := self._order.floor(key.priority, now)) is not None:
                floors.append(elsewhere)
            if floors:
                self._counters.lift(key, min(floors) - self.config.lift_credit)
            queue = band[key] = _FlowQueue(key)
        heapq.heappush(queue.heap, held)
        self.count += 1
        self._metrics.queued(key, 1)
        return held

    def remove(self, held: Held, released_at: float | None = None) -> None:
        """A held request leaves its flow's queue: released (at ``released_at``: for ties), gone, or refused."""
        held.queued = False
        if held.timer is not None:
            held.timer.cancel()
        key = held.key
        band = self._bands[key.priority]
        queue = band[key]
        if released_at is not None:
            queue.released_at = released_at
        self.count -= 1
        self._metrics.queued(key, -1)
        if not self.count:
            self._order.holding(0, self._clock())
        if queue.head() is None:
            del band[key]
            if not band:
                del self._bands[key.priority]

    def heads(self) -> Iterator[list[Held]]:
        """Each band's next requests (one a flow, least-served first, ties: released longest ago), highest first."""
        served, bands = self._counters.get, self._bands
        for priority in sorted(bands, reverse=True):
            yield [held for queue in sorted(bands[priority].values(), key=lambda q: (served(q.key), q.released_at))
                   if (held := queue.head()) is not None]

    def all(self) -> list[Held]:
        return [h for band in self._bands.values() for q in band.values() for h in q.heap if h.queued]

    def _expire(self, held: Held) -> None:
        if held.future.done():
            return  # cancelled (the client left): its hold takes it out
        self.remove(held)
        self._metrics.outcome(held.key, "queue_timeout")
        held.future.set_exception(self._refusal(
            f"The fleet is saturated; the request waited {self._clock() - held.arrived:.1f} s, its limit.",
            "queue_timeout"))

    def dispatched(self) -> None:
        """A request was sent to a pod (for the rate Retry-After is estimated from)."""
        now = self._clock()
        self._dispatches.append(now)
        while self._dispatches[0] < now - RATE_WINDOW_S:
            self._dispatches.popleft()

    def _refusal(self, reason: str, code: str) -> GatewayError:
        retry = self.retry_after_s()
        return GatewayError(ErrorKind.RATE_LIMITED, f"{reason} Retry after {retry} s.", code=code, retry_after_s=retry)

    def retry_after_s(self) -> int:
        """When a request sent again would likely be served: the requests waiting over the recent rate."""
        now = self._clock()
        dispatches = self._dispatches
        while dispatches and dispatches[0] < now - RATE_WINDOW_S:  # (each refusal of a flood costs O(1), not O(n))
            dispatches.popleft()
        recent = len(dispatches)
        span = min(RATE_WINDOW_S, now - dispatches[0]) if dispatches else 0.0
        rate = recent / span if span > 0 else 0.0
        return max(1, min(3600, math.ceil((self.count + 1) / rate))) if rate > 0 else 1

    def forget_idle(self) -> None:
        """Forgets the service of flows idle long enough, and the flows counted here that neither wait nor have
        any (their metrics' series are the config's tenants and bands: :class:`~gateway.flow.metrics.FlowLabels`)."""
        waiting = {k for band in self._bands.values() for k in band}
        self._counters.forget_idle(lambda k: k in waiting)
        self._flows_seen = {k for k in self._flows_seen if k in waiting or self._counters.get(k)}

    def describe(self, now: float) -> list[dict[str, Any]]:
        """Each flow served lately or waiting: its service, its requests waiting, the oldest one's wait."""
        served = self._counters.snapshot()
        waiting = {k: q for band in self._bands.values() for k, q in band.items()}
        flows = []
        for key in sorted(set(served) | set(waiting), key=lambda k: (-k.priority, k.fairness_id)):
            held = [h for h in waiting[key].heap if h.queued] if key in waiting else []
            flows.append({"fairness_id": key.fairness_id, "priority": key.priority,
                          "service": round(served.get(key, 0.0), 1), "queued": len(held),
                          "oldest_wait_s": round(now - min(h.arrived for h in held), 3) if held else None})
        return flows


@dataclass(frozen=True, slots=True)
class Release:
    """A held request's release: the pods that had room for it, and how long it waited."""

    room: frozenset[str]
    waited_s: float
    held: Held | None = None  # None: it never waited


class FlowController:
    """Decides when a request waits, and which held request goes next and where (its queues hold them)."""

    def __init__(self, config: FlowControlConfig, pods: PodRegistry, detector: SaturationDetector,
                 counters: ServiceCounters, doorbell: Doorbell, metrics: FlowMetrics,
                 order: ReleaseOrder | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = FlowPolicy(config)  # how requests are told into flows, as this config says
        self._pods = pods
        self.detector = detector
        self.counters = counters
        self._doorbell = doorbell
        # Whether this worker's next request goes before the other workers' (one worker: always).
        self._order = order if order is not None else SoleRelease(doorbell)
        self.queues = FlowQueues(config, counters, self._order, metrics, clock)
        self._metrics = metrics
        self._clock = clock
        self._transit: Held | None = None
        self._transit_since = 0.0
        self._look_at: float | None = None  # when a pod's running prefill drains enough to take the next one
        self._has_queued: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._draining = False

    @property
    def queued(self) -> int:
        return self.queues.count

    # Admission

    def room_now(self, pods: list[Pod], demand: Demand) -> frozenset[str] | None:
        """Of a request's candidate ``pods``, those with room for it when nothing waits ahead of it (it goes
        on at once), else None."""
        return None if self._others_first() else self.detector.room_among(pods, demand)

    def goes_now(self, pods: list[Pod], demand: Demand) -> bool:
        """Whether a request goes on at once: nothing waits ahead of it and one of its candidate ``pods`` has
        room (they are looked at until one has: in a large fleet, the first one or two)."""
        if self._others_first():
            return False
        return not pods or self.detector.has_room(pods, demand)

    def _others_first(self) -> bool:
        """Whether requests go before a new one: held here, released and not yet dispatched, or held by another
        worker."""
        return bool(self.queues.count) or self._transit is not None or self._order.others_hold(self._clock())

    async def hold(self, flow: Flow, model: str, leg: str | None, demand: Demand, wait_allowed_s: float) -> Release:
        """Wait until released (the pods with room then), or raise: 429 when it waited too long or too many
        wait, 503 when the gateway shuts down. Cancelled (the client left), it leaves no trace."""
        if self._draining:
            raise _shutting_down()
        held = self.queues.add(flow.key, model, leg, demand, wait_allowed_s)
        if self._has_queued is not None:
            self._has_queued.set()
        self._pump()
        try:
            room = await held.future
        except asyncio.CancelledError:
            if held.queued:
                self.queues.remove(held)
                self._metrics.outcome(held.key, "left")
            self.landed(held)  # released, but gone before it was dispatched
            raise
        return Release(room, self._clock() - held.arrived, held)

    def landed(self, held: Held | None) -> None:
        """The released request was dispatched (or ended without): the next may be released."""
        if held is not None and self._transit is held:
            self._transit = None
            self._order.landed(self.queues.count, self._clock())
            if self.queues.count:
                self._pump()

    def waits_for(self, pod: str) -> bool:
        """Whether a request held here, released and not yet dispatched, or held by another worker may go to
        ``pod`` (keep-warm leaves such a pod's capacity to it)."""
        if self._transit is not None or self._order.others_hold(self._clock()):
            return True
        wanted = {(h.model, h.leg) for h in self.queues.all()}
        return any(pod in {p.name for p in self._pods.candidates(model, leg=leg)}  # type: ignore[arg-type]
                   for model, leg in wanted)

    def _pump(self) -> None:
        """Release the next request that has room, if none is in transit and no other worker's goes first."""
        now = self._clock()
        if self._transit is not None:
            if now - self._transit_since < TRANSIT_LIMIT_S:
                return
            log.warning("flow control: a released request was not dispatched within %g s", TRANSIT_LIMIT_S)
            self._transit = None
        waiting: Contender | None = None  # the first in order that waits for room: what the others must wait for
        waiting_pools: set[int] = set()  # the pods where one waits: who comes after it there waits too
        self._look_at = None
        for band in self.queues.heads():
            for held in band:
                if held.future.done():
                    continue  # cancelled in this turn (the client left): its hold takes it out
                pods = self._pods.candidates(held.model, leg=held.leg)  # type: ignore[arg-type]
                demand = held.demand
                room = self._room_for(held, pods, now)
                if room is None and demand.estimates and self.detector.room_among(
                        pods, replace(demand, estimates={})) is not None:
                    continue  # too large for the room there is (SLO admission): nobody need wait for it
                if room is None and (stagger := self.detector.stagger_only_in(pods, demand)) is not None:
                    self._look_at = min(self._look_at or math.inf, now + stagger)
                    continue  # held only until another pod is halfway through its prefill: never long, others pass
                contender = Contender(held.key.priority, self.counters.get(held.key), held.give_up_at, pool_key(pods))
                if contender.pool in waiting_pools:
                    # A shorter prompt may have room where a long one ahead of it has none (it waits for the
                    # pods' queue to empty): passing it again and again would starve it.
                    continue
                if room is not None:
                    if self._order.claim(contender, True, self.queues.count, now, TRANSIT_LIMIT_S):
                        self._release(held, room, now)
                    return
                waiting_pools.add(contender.pool)
                if waiting is None:
                    waiting = contender
                    drained_in = self.detector.prefill_room_among(pods, demand)
                    if drained_in is not None:
                        self._look_at = min(self._look_at or math.inf, now + drained_in)
        self._order.claim(waiting, False, self.queues.count, now, TRANSIT_LIMIT_S)

    def _release(self, held: Held, room: frozenset[str], now: float) -> None:
        self.queues.remove(held, released_at=now)
        self._transit, self._transit_since = held, now
        self._metrics.waited(held.key, now - held.arrived)
        held.future.set_result(room)

    def _room_for(self, held: Held, pods: list[Pod], now: float) -> frozenset[str] | None:
        """The pods with room for a held request. A prompt that fits no pod's queue (several flows served)
        waits for one to empty, but no longer than ``prefill_fit_wait_s``: a queue of answers that are not
        streamed empties only as they end."""
        demand, detector = held.demand, self.detector
        room = detector.room_among(pods, demand)
        if room is not None or not demand.prompt_tokens:
            return room
        unsized = detector.room_among(pods, replace(demand, prompt_tokens=0, held=False))
        if unsized is None:
            held.unfit_since = None
        elif held.unfit_since is None:
            held.unfit_since = now
        elif now - held.unfit_since >= detector.config.prefill_fit_wait_s:
            return detector.staggered(pods, unsized, demand) or None
        return None

    # Lifetime

    def start(self) -> None:
        self._has_queued = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="flow-control")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        for held in self.queues.all():
            held.future.cancel()

    def drain(self) -> None:
        """Shutting down: what waits is refused at once (503: another replica can take it)."""
        self._draining = True
        for held in self.queues.all():
            if not held.future.done():
                self.queues.remove(held)
                held.future.set_exception(_shutting_down())

    def reconfigure(self, config: FlowControlConfig) -> None:
        """A reloaded config: flows, weights, objectives, limits and thresholds apply from the next decision
        on. Requests already held keep the flow and wait limit they were given when they came."""
        self.config = self.queues.config = config
        self.policy = FlowPolicy(config)
        self.detector.config = config.saturation
        if self.queues.count:
            self._pump()

    async def _run(self) -> None:
        assert self._has_queued is not None
        swept_at = announced_at = self._clock()
        while True:
            if self.queues.count:
                look_in = TICK_S if self._look_at is None else min(TICK_S, max(0.0, self._look_at - self._clock()))
                await self._doorbell.wait(look_in)
                self._pump()
            else:  # nothing held: wake only to sweep (the flows served meanwhile go idle too), and to announce
                self._has_queued.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ANNOUNCE_S if self.counters.shared else SWEEP_S):
                        await self._has_queued.wait()
            if (now := self._clock()) - announced_at >= ANNOUNCE_S:
                announced_at = now
                self.counters.announce_answering()
            if now - swept_at >= SWEEP_S:
                swept_at = now
                self.queues.forget_idle()

    def debug(self) -> dict[str, Any]:
        detector, every = self.detector, self._pods.all()
        return {"queued": self.queues.count, "in_transit": self._transit is not None,
                "flows": self.queues.describe(self._clock()),
                "pods": {p.name: detector.saturated_by(p.name) or "room" for p in every},
                "prefill_queued": {p.name: detector.prefill_queued(p.name) for p in every},
                "retry_after_s": self.queues.retry_after_s()}


def _shutting_down() -> GatewayError:
    return GatewayError(ErrorKind.NO_POD, "The gateway is shutting down; retry the request.", code="draining")

