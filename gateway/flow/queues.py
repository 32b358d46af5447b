"""The requests held in this process, one queue per flow, in bands by priority: the flow controller's bookkeeping.

A request waits at most its flow's limit, or its SLO allows less; then it is refused (429 with a
Retry-After from the recent dispatch rate), as it is when ``max_queued`` requests already wait. A client
that leaves while held leaves nothing behind: it was never dispatched, charged or counted as served.

Owner: :class:`FlowQueues` owns the held requests, their flows' queues and wait limits, the flows as
counted here (``max_flows``) and the recent dispatches; the :class:`~gateway.flow.controller.FlowController`
decides which to release and replaces its config on reload.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.config import FlowControlConfig
from gateway.core.errors import ErrorKind, GatewayError
from gateway.flow.flows import OVERFLOW_FAIRNESS_ID, FlowKey
from gateway.flow.metrics import FlowMetrics
from gateway.flow.release_order import ReleaseOrder
from gateway.flow.saturation import Demand
from gateway.flow.service_counters import ServiceCounters

# Dispatches remembered for the rate that Retry-After is estimated from.
RATE_WINDOW_S = 30.0


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
    size: int = 0
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
        if key in self._flows_seen:
            return key
        if len(self._flows_seen) >= self.config.max_flows:
            return FlowKey(OVERFLOW_FAIRNESS_ID, key.priority)
        self._flows_seen.add(key)
        return key

    def add(self, flow: FlowKey, model: str, leg: str | None, demand: Demand, wait_allowed_s: float) -> Held:
        """A request starts to wait in its flow's queue, ``wait_allowed_s`` at most; 429 when too many wait."""
        key = self.key_of(flow)
        if self.count >= self.config.max_queued:
            self._metrics.rejected(key, "queue_full")
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
        queue.size += 1
        self.count += 1
        self._metrics.queued(key, 1)
        return held

    def remove(self, held: Held, released_at: float | None = None) -> None:
        """A held request leaves its flow's queue: released then (ties go to the flow released least recently),
        gone, or refused."""
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
        queue.size -= 1
        if not queue.size:
            del band[key]
            if not band:
                del self._bands[key.priority]

    def heads(self) -> Iterator[Held]:
        """Each flow's next request, in the order of release: the highest band first, then the least-served
        flow, then the one released least recently."""
        served = self._counters.get
        for priority in sorted(self._bands, reverse=True):
            for queue in sorted(self._bands[priority].values(), key=lambda q: (served(q.key), q.released_at)):
                if (held := queue.head()) is not None:
                    yield held

    def all(self) -> list[Held]:
        return [h for band in self._bands.values() for q in band.values() for h in q.heap if h.queued]

    def _expire(self, held: Held) -> None:
        held.timer = None
        if not held.queued or held.future.done():
            return
        self.remove(held)
        self._metrics.rejected(held.key, "queue_timeout")
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
        recent = sum(1 for t in self._dispatches if t >= now - RATE_WINDOW_S)
        span = min(RATE_WINDOW_S, now - self._dispatches[0]) if self._dispatches else 0.0
        rate = recent / span if span > 0 else 0.0
        return max(1, min(3600, math.ceil((self.count + 1) / rate))) if rate > 0 else 1

    def forget_idle(self) -> None:
        """Forgets the service of flows idle long enough, and the flows counted here that neither wait nor have any."""
        waiting = {k for band in self._bands.values() for k in band}
        self._counters.forget_idle(lambda k: k in waiting)
        self._flows_seen = {k for k in self._flows_seen if k in waiting or self._counters.get(k)}

    def describe(self, now: float) -> list[dict[str, Any]]:
        """Each flow served lately or waiting: its service, its requests waiting, the oldest one's wait."""
        served = self._counters.snapshot()
        waiting = {k: q for band in self._bands.values() for k, q in band.items()}
        flows = []
        for key in sorted(set(served) | set(waiting), key=lambda k: (-k.priority, k.fairness_id)):
            queue = waiting.get(key)
            head = queue.head() if queue is not None else None
            flows.append({"fairness_id": key.fairness_id, "priority": key.priority,
                          "service": round(served.get(key, 0.0), 1), "queued": queue.size if queue else 0,
                          "oldest_wait_s": round(now - head.arrived, 3) if head is not None else None})
        return flows
