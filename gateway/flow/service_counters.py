"""The service each flow has received, as the Virtual Token Counter counts it (Sheng et al., OSDI '24).

A flow's counter grows by the weighted tokens its requests are served, divided by the flow's weight:
prompt tokens (those the engine found cached at a discount) when a request is dispatched, then its output
tokens; the counter is corrected to what the engine reported when the request ends. While the fleet is
saturated the least-served flow of the highest band goes next. A flow that was not waiting and starts to
(it was idle, or kept up) has its counter *lifted* to the least counter among the flows waiting in its
band, so that it cannot bank service it did not ask for and then starve the others; this is what makes the
scheduler fair and work-conserving at once (the paper's bound: two backlogged flows' service differs by at
most about twice a request's worth). The lift stops ``flow_control.lift_credit`` short of that counter: level
with it, a tenant that keeps up (its few requests come back one at a time) would go after a flood's next
request each time it waits, and where a pod prefills one long prompt at a time that is a whole prefill more
for its second request; the credit bounds what it takes first.

Owner: the :class:`ServiceCounters` own the counters: the flow-control step charges them, the flow
controller lifts them, and the charges and lifts of the other workers and replicas arrive over the state
bus (:meth:`ServiceCounters.apply_remote`); they also say how many flows were served lately
(:meth:`ServiceCounters.active_flows`): charged in the last few seconds, or with an answer under way (the
flow-control step says when one starts and ends here; :meth:`ServiceCounters.announce_answering` tells the others
every ``ANNOUNCE_S``). Counters of flows unheard of for ``idle_s`` are forgotten (as the
sweeps see it: a change is dated by the first sweep after it, to keep clocks off the request path; a
flow that comes back is lifted when it has to wait). :class:`WorkflowFlows` remembers the flow each
workflow began with, for its later stages.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from gateway.core.facts import Publish, ServiceCharged, ServiceLifted, WorkflowFlow, unshared
from gateway.flow.flows import FlowKey
from gateway.lru import LruCache

ACTIVE_S = 2.0  # a flow charged within about this long (this window or the last) is active
ANNOUNCE_S = ACTIVE_S / 2  # how often the flows answered here are told to the others, while there are any
ANNOUNCED_FLOWS = 2  # how many of them: what the count-down reads is whether more than one flow is served


class ServiceCounters:
    def __init__(self, publish: Publish = unshared, idle_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._served: dict[FlowKey, float] = {}
        self._seen: dict[FlowKey, float] = {}  # when each counter last changed, as of the last sweep
        self._touched: set[FlowKey] = set()  # counters changed since the last sweep (cheaper than a clock)
        self._charged_now: set[FlowKey] = set()  # flows charged in this activity window, and in the last one
        self._charged_before: set[FlowKey] = set()
        self._window_at: float | None = None
        self._answering: dict[FlowKey, int] = {}  # this process's attempts under way, by flow
        self._publish = publish
        self._shared = publish is not unshared  # with nobody to tell, no fact is made per charge
        self._idle_s = idle_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._served)

    def get(self, key: FlowKey) -> float:
        return self._served.get(key, 0.0)

    def charge(self, key: FlowKey, amount: float) -> None:
        """``amount`` more weighted service (negative: a correction once the engine said what it served)."""
        if amount:
            self._add(key, amount)
            if self._shared:
                self._publish(ServiceCharged(key.fairness_id, key.priority, amount))

    def lift(self, key: FlowKey, floor: float) -> None:
        """The flow starts to wait: its counter becomes at least ``floor``."""
        if self._served.get(key, 0.0) < floor:
            self._served[key] = floor
            self._touched.add(key)
            self._publish(ServiceLifted(key.fairness_id, key.priority, floor))

    def apply_remote(self, origin: str, fact: ServiceCharged | ServiceLifted) -> None:
        key = FlowKey(fact.fairness_id, fact.priority)
        if isinstance(fact, ServiceCharged):
            self._add(key, fact.amount)
        elif self._served.get(key, 0.0) < fact.floor:
            self._served[key] = fact.floor
            self._touched.add(key)

    def forget_idle(self, keep: Callable[[FlowKey], bool]) -> int:
        """Forget the counters of flows unheard of for ``idle_s``, except those ``keep`` names; how many."""
        now = self._clock()
        for key in self._touched:
            self._seen[key] = now
        self._touched.clear()
        cutoff = now - self._idle_s
        gone = [k for k, seen in self._seen.items() if seen < cutoff and not keep(k)]
        for key in gone:
            del self._served[key], self._seen[key]
        return len(gone)

    def answering(self, key: FlowKey) -> None:
        """An attempt of ``key`` was sent to a pod: the flow is served until it ends (:meth:`answered`)."""
        self._answering[key] = self._answering.get(key, 0) + 1

    def answered(self, key: FlowKey) -> None:
        left = self._answering.get(key, 0) - 1
        if left > 0:
            self._answering[key] = left
        else:
            self._answering.pop(key, None)

    def announce_answering(self) -> None:
        """Tell the other workers and replicas (a charge of nothing: "served just now") of up to ``ANNOUNCED_FLOWS``
        flows answered here, so that theirs count them served while the answers last."""
        if self._shared:
            for key in itertools.islice(self._answering, ANNOUNCED_FLOWS):
                self._publish(ServiceCharged(key.fairness_id, key.priority, 0.0))

    @property
    def shared(self) -> bool:
        """Whether other workers or replicas hear of this process's charges."""
        return self._shared

    def active_flows(self, now: float) -> int:
        """Flows charged within the last ``ACTIVE_S`` or so (here or, through the bus, elsewhere), and those with
        an answer under way here. A tenant that chats is charged as each request is sent and as it ends; where its
        answers take longer than the window (a slower engine: 16 tokens beside a flood took 3-5 s on vLLM 5x
        slower), it would drop out between the two, and the pod would count down the next flood prompt ahead of
        its next request."""
        if self._window_at is None:
            self._window_at = now
        elif now - self._window_at >= ACTIVE_S:  # (after a long quiet, its flows may have been charged just now)
            self._charged_before, self._charged_now, self._window_at = self._charged_now, set(), now
        return len(self._charged_now | self._charged_before | self._answering.keys())

    def tag(self, key: FlowKey, credit: float = 0.0) -> float:
        """``key``'s service as the tag of a request it sends now: its counter, lifted to the least counter of its
        band's flows served lately less ``credit`` when it is not one of them (no more service banked while it was
        idle, as the counter of a flow that starts to wait is lifted). Requests ordered by their tags go
        least-served flow first, and in the order each flow sent them (start-time fair queueing)."""
        served = self._served
        mine = served.get(key, 0.0)
        lately = self._charged_now | self._charged_before
        if key in lately:
            return mine
        floor = min((served.get(k, 0.0) for k in lately if k.priority == key.priority), default=None)
        return mine if floor is None else max(mine, floor - credit)

    def snapshot(self) -> dict[FlowKey, float]:
        return dict(self._served)

    def _add(self, key: FlowKey, amount: float) -> None:
        served = self._served
        served[key] = served.get(key, 0.0) + amount
        self._touched.add(key)
        self._charged_now.add(key)


class WorkflowFlows:
    """The flow each workflow began with, which its later stages inherit (bounded: the least recently used
    workflows are forgotten first). Owner: the flow-control step, and the bus for other processes' ones."""

    def __init__(self, capacity: int = 100_000, publish: Publish = unshared) -> None:
        self._flows: LruCache[str, FlowKey] = LruCache(capacity)
        self._publish = publish

    def get(self, workflow: str) -> FlowKey | None:
        return self._flows.touch(workflow)

    def began(self, workflow: str, key: FlowKey) -> None:
        """The workflow's first request was of flow ``key`` (a later one does not change it)."""
        if workflow not in self._flows:
            self._flows.put(workflow, key)
            self._publish(WorkflowFlow(workflow, key.fairness_id, key.priority))

    def apply_remote(self, origin: str, fact: WorkflowFlow) -> None:
        if fact.workflow not in self._flows:
            self._flows.put(fact.workflow, FlowKey(fact.fairness_id, fact.priority))
