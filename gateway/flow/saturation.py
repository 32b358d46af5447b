"""Saturation: whether a pod has room for one more request now.

A pod is saturated while any of these holds (``flow_control.saturation``):

- ``prefill``: the prompt tokens sent to it (by every worker of this gateway) that it has yet to prefill
  reach ``prefill_tokens``: those of the requests it has not begun to answer, less what its measured rate
  got through since it last made progress (the in-flight ledger counts both). A pod that prefills
  first-come first-served makes the next request wait for all of them; keeping this queue under about one
  prompt is what lets a later, more urgent request start soon. While one flow alone is served, the running
  prefill is also counted down, which sends the next prompt before it ends so that a chunked-prefill engine
  runs full steps; while several are, a newcomer would wait behind that prompt too, and fairness goes first.
  While several are, a prompt also joins a pod's queue only where both fit in ``prefill_tokens``, or where the queue
  is empty: a chunked-prefill engine (vLLM: ``max_num_batched_tokens``) gives each step first to the prefills it
  runs, then packs its waiting prompts first come, first served, so a short prompt sent just before a long one would
  wait for the long one's first chunk too. With ``join_beside_prefill`` (off by default: measured, it made B wait
  longer), a request released after waiting (routed among the pods with room then) needs less: that its prompt fits
  the pod's next step beside the running prefill's rest as counted down, so a short one rides in the step of the
  running prompt's last chunk. The controller bounds the wait for an empty queue (``prefill_fit_wait_s``): an answer
  that is not streamed counts as queued until it ends. A pod that orders its waiting requests by priority
  (``scheduling: priority``) is held to the same rules: its engine lets the least-served flow's request pass those
  waiting there (each carries its flow's priority, :func:`gateway.flow.flows.engine_priority`) but not the prefill
  it runs, so letting more wait there (tried: the count-down whoever is served) keeps its steps full at the cost of
  the newcomer's first token;
- ``engine_waiting``: the engine's own queue (vLLM's ``num_requests_waiting``) reaches ``engine_waiting``:
  it has no room in its running batch (other gateways' requests count there too);
- ``kv_usage``: the engine's KV-cache usage reaches ``kv_usage``;
- ``in_flight``: the gateway's requests in flight on it reach ``in_flight`` (when set);
- ``load``: with SLO admission on, the request's predicted load (GPU profiles) would take it past full.

Engine metrics older than ``stale_after_s`` (a scrape failing, or scraping off) are not read: the
gateway's own counts decide. The Gateway API Inference Extension's utilization detector reads the same
engine signals (queue depth 5, KV usage 0.8 by default); its concurrency detector the gateway's own counts.

Owner: nothing of its own: it reads the ledger, the engine stats the scraper writes and the pending load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.config import SaturationConfig
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import Estimate, PendingLoad
from gateway.pods.registry import Pod


@dataclass(frozen=True, slots=True)
class Demand:
    """What a request asks of a pod, as its room is judged: its kind, its prompt's length in tokens (before any
    cached: where it goes is not known yet), its predicted cost on each candidate pod (SLO admission), and
    whether it was held (then routed among the pods with room for it: its prompt may join beside a running
    one's last chunk)."""

    kind: str = "chat"
    prompt_tokens: int = 0
    estimates: dict[str, Estimate] = field(default_factory=dict)
    held: bool = False


NO_DEMAND = Demand()  # whether a pod has room at all


class SaturationDetector:
    def __init__(self, config: SaturationConfig, ledger: InFlightLedger, load: PendingLoad, slo_admission: bool,
                 flow_control: bool = True, active_flows: Callable[[float], int] = lambda now: 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._ledger = ledger
        self._load = load
        self._slo_admission = slo_admission
        # Off (SLO admission alone): only the predicted load says a pod is full.
        self._flow_control = flow_control
        self._active_flows = active_flows  # flows served lately: the count-down runs while there is one
        self._clock = clock

    def saturated_by(self, pod: str, demand: Demand = NO_DEMAND) -> str | None:
        """Why ``pod`` has no room for a request (of this demand), or None when it has."""
        config = self.config
        estimate = demand.estimates.get(pod)
        if not self._flow_control:
            return "load" if estimate is not None and not self._load.fits(pod, estimate, demand.kind) else None
        if self._prefill_full(pod, demand):
            return "prefill"
        stats = self._load.engine.get(pod)
        if stats is not None and not stats.stale and self._clock() - stats.scraped_at <= config.stale_after_s:
            if stats.waiting >= config.engine_waiting:
                return "engine_waiting"
            if stats.kv_usage >= config.kv_usage:
                return "kv_usage"
        if config.in_flight is not None and self._ledger.on_pod(pod) >= config.in_flight:
            return "in_flight"
        if self._slo_admission and estimate is not None and not self._load.fits(pod, estimate, demand.kind):
            return "load"
        return None

    def room_among(self, pods: Sequence[Pod], demand: Demand = NO_DEMAND) -> frozenset[str] | None:
        """Of a request's candidate ``pods``, those with room for it, else None."""
        if not pods:
            return frozenset()  # nothing to wait for: routing says there is no pod
        room = frozenset(p.name for p in pods if self.saturated_by(p.name, demand) is None)
        return self.staggered(pods, room, demand) or None

    def has_room(self, pods: Sequence[Pod], demand: Demand = NO_DEMAND) -> bool:
        """Whether one of ``pods`` has room for the request (looked at until one has, unless it must stagger)."""
        if self._staggers(pods, demand):
            return self.room_among(pods, demand) is not None
        return any(self.saturated_by(p.name, demand) is None for p in pods)

    def staggered(self, pods: Sequence[Pod], room: frozenset[str], demand: Demand) -> frozenset[str]:
        """Of the pods with ``room`` for a long prompt, those where it may start now: while several flows are
        served, a prompt that takes more than one step starts on a pod only while another of its candidate pods
        has at most half as much prefill work left (none, or a rate not measured yet, counts as none). The
        pods' long prefills then end at staggered times, so a newcomer of another flow finds one pod about to
        take it, not every pod at the start of a long prefill (docs/flow-isolation.md#a-crowd-of-documents)."""
        if not room or not self._staggers(pods, demand):
            return room
        now, ledger, half = self._clock(), self._ledger, demand.prompt_tokens / 2
        near = [p.name for p in pods
                if ledger.prefill_rate(p.name) is None or ledger.prefill_remaining(p.name, now) <= half]
        # A pod may start it where some other pod is near its turn (two near: any of the pods with room).
        return room if len(near) > 1 else room - set(near) if near else frozenset()

    def stagger_in(self, pods: Sequence[Pod], demand: Demand) -> float | None:
        """Seconds until another candidate pod's prefill work is down to half the (long) prompt's, when the stagger
        holds it (None: it does not, or not before an answer begins). A pod already there is the one with room."""
        if not self._staggers(pods, demand):
            return None
        now, half = self._clock(), demand.prompt_tokens / 2
        return min((wait for p in pods if (wait := self._ledger.prefill_below_in(p.name, half, now))), default=None)

    def stagger_only_in(self, pods: Sequence[Pod], demand: Demand) -> float | None:
        """When the stagger alone holds a long prompt (a pod has room for it otherwise), the seconds until it may
        let it start; else None."""
        wait = self.stagger_in(pods, demand)
        return wait if wait is not None and any(self.saturated_by(p.name, demand) is None for p in pods) else None

    def _staggers(self, pods: Sequence[Pod], demand: Demand) -> bool:
        return (self.config.stagger_prefills and len(pods) > 1 and demand.prompt_tokens > self.config.prefill_tokens
                and not self._counting_down())

    def prefill_queued(self, pod: str) -> int:
        """Prompt tokens sent to ``pod`` that it has not begun answering: what a prompt must fit beside."""
        return self._ledger.prefill_backlog(pod)

    def _prefill_full(self, pod: str, demand: Demand) -> bool:
        limit = self.config.prefill_tokens
        ledger = self._ledger
        backlog = ledger.prefill_backlog(pod)
        if not backlog:
            return False
        if self._counting_down():
            return backlog >= limit and ledger.prefill_remaining(pod, self._clock()) >= limit
        # Several flows, first come first served: the prompt must fit beside what is ahead of it.
        joins = demand.held and self.config.join_beside_prefill
        ahead = ledger.prefill_remaining(pod, self._clock()) if joins else backlog
        return ahead >= limit or ahead + demand.prompt_tokens > limit

    def prefill_room_in(self, pod: str, demand: Demand = NO_DEMAND) -> float | None:
        """Seconds until the pod's prefill work has drained enough to take the request (None: not before an
        answer begins): when to look again without a ring."""
        limit = self.config.prefill_tokens
        if not self._counting_down():
            limit -= demand.prompt_tokens
            if not (demand.held and self.config.join_beside_prefill) or limit <= 0:
                return None
        return self._ledger.prefill_below_in(pod, limit, self._clock())

    def prefill_room_among(self, pods: Sequence[Pod], demand: Demand) -> float | None:
        """Of ``pods`` without room for the request, the soonest one whose prefill drains enough to take it (or,
        for a long prompt the stagger holds, lets it start)."""
        waits = [wait for p in pods if self.saturated_by(p.name, demand) == "prefill"
                 and (wait := self.prefill_room_in(p.name, demand)) is not None]
        if (stagger := self.stagger_in(pods, demand)) is not None:
            waits.append(stagger)
        return min(waits, default=None)

    def _counting_down(self) -> bool:
        return self._active_flows(self._clock()) <= 1
