"""The steps that keep placement's state true: which context a request continues (prepare), that context
held on its pod while the request runs and thinking after it (dispatch, finish), and the blocks the chosen
pod will now hold (dispatch).

None of them decides anything: the policy reads what they keep (:mod:`plugins.routing.preparers.placement`,
:mod:`plugins.routing.preparers.prefix_match`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gateway.auth import owner_tag
from gateway.core.retention import declared_retention_s
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.contexts import Context, shared_blocks
from gateway.kv.free_queue import FreeQueues
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.proxy.outcome import RelayOutcome
from gateway.request.types import Attempt, ClientRequest
from gateway.routing.policy import Policy, RoutingRequest
from gateway.workflow.context import ContextSignals
from gateway.workflow.keep_warm import KeepWarm


class ContextResolution:
    """prepare: the context the request continues (``routing.context_key``): the workflow or session it
    names, else, for a tokenized prompt, the live conversation whose last prompt it extends (looked for
    first where the conversation's earlier prompt ended, when tokenization reused one) or a new one."""

    def __init__(self, pods: PodRegistry, index: PrefixIndex, working_set: ResumableWorkingSet,
                 signals: ContextSignals) -> None:
        self._pods = pods
        self._index = index
        self._working_set = working_set
        self._signals = signals

    def prepare(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> None:
        routing.retention_s = declared_retention_s(request.parsed)
        keyed = self._signals.context_key(request.headers, request.parsed, owner_tag(request.key))
        if keyed is not None:
            routing.context_key, routing.context_keyed = keyed, True
            return
        hashes = routing.hashes
        if hashes is None:
            return
        pods = self._pods.candidates(routing.model, leg=routing.leg)
        block_size = next((bs for p in pods if (bs := self._index.block_size(p.name))), None)
        if block_size is None:  # no pod's events have said how they cut prompts: nothing can be held
            return
        # Looked for first where the earlier prompt ended (its own last block: a next turn routed on its
        # earlier prompt's head may not reach it).
        blocks = routing.continued.full(block_size) if routing.continued is not None else hashes.full(block_size)
        continued = self._working_set.continued(blocks, len(blocks) - 1 if routing.continued is not None else None)
        routing.context_key = continued.key if continued is not None else self._working_set.anonymous_key()


class PlacementMetrics:
    """Placement's families, on the gateway's registry (:meth:`GatewayMetrics.owned`). Producers:
    :class:`PlacementLosses` (the tokens lost) and :class:`RoomForNewContexts` (the holds, as admission
    outcomes)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lost_tokens = Counter(
            "gateway_placement_lost_tokens",
            "Prompt tokens a request could have found cached and did not, by cause (evicted while its context "
            "thought, moved from its cache, a new context placed off the best prefix)", ["cause"],
            registry=registry)
        self.admission = Counter(
            "gateway_admission", "Admission outcomes by reason", ["outcome", "reason"], registry=registry,
        )


class PlacementLosses:
    """Where cache hits were lost, by cause, as each decision saw them: the tokens a request could have
    found cached and did not (``/debug/placement``, ``gateway_placement_lost_tokens_total``).

    - ``evicted_while_thinking``: a context came back to its pod and part of its last prompt was gone;
    - ``moved_from_its_cache``: a context was sent away from the pod holding more of its prompt;
    - ``new_off_best_prefix``: a new context was placed where less of its prompt was cached than on the
      best pod (a shared prompt copied to a pod with room, or a balance decision).

    Owner: the context placement step."""

    CAUSES = ("evicted_while_thinking", "moved_from_its_cache", "new_off_best_prefix")

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.requests = {cause: 0 for cause in self.CAUSES}
        self.tokens = {cause: 0 for cause in self.CAUSES}
        self.decisions = 0
        self.cached_tokens = 0  # found cached on the chosen pod, in all
        lost_tokens = metrics.owned(PlacementMetrics).lost_tokens
        self._metric = {cause: lost_tokens.labels(cause) for cause in self.CAUSES}

    def record(self, attempt: Attempt, context: Context | None, block_size: int) -> None:
        routing, pod = attempt.routing, attempt.decision.pod.name
        match = routing.prefix
        if match is None or not match.precise:
            return
        hit = match.pods[pod].gpu_tokens if pod in match.pods else 0
        self.decisions += 1
        self.cached_tokens += hit
        if context is None:
            best = max((m.gpu_tokens for m in match.pods.values()), default=0)
            self._lost("new_off_best_prefix", best - hit)
        elif context.pod == pod:
            self._lost("evicted_while_thinking", len(context.hashes) * block_size - hit)
        elif context.pod in match.pods:
            self._lost("moved_from_its_cache", match.pods[context.pod].gpu_tokens - hit)

    def _lost(self, cause: str, tokens: int) -> None:
        if tokens > 0:
            self.requests[cause] += 1
            self.tokens[cause] += tokens
            self._metric[cause].inc(tokens)

    def debug(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "cached_tokens": self.cached_tokens,
                "lost": {cause: {"requests": self.requests[cause], "tokens": self.tokens[cause]}
                         for cause in self.CAUSES}}


def _grown_from(attempt: Attempt) -> int | None:
    """The head's tokens, for an attempt dispatched on its prompt's head whose whole prompt is known now."""
    return attempt.head_tokens if not attempt.routing.untokenized_tokens else None


class ContextPlacement:
    """dispatch: the request's context is resumable on the chosen pod from now on (its prompt's full
    blocks there), and what its placement lost is counted; finish: when its last request ends, it starts
    thinking. A request dispatched on its prompt's head (the rest tokenized when its attempt ends:
    :class:`~gateway.request.steps.PromptTokenization`) holds its context with the head, and with the whole
    prompt once it is known, before the context starts thinking."""

    def __init__(self, index: PrefixIndex, working_set: ResumableWorkingSet, losses: PlacementLosses,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        self._working_set = working_set
        self._losses = losses
        self._clock = clock

    def dispatched(self, attempt: Attempt) -> None:
        routing, pod = attempt.routing, attempt.decision.pod.name
        block_size = self._index.block_size(pod)
        hashes = routing.hashes
        if routing.context_key is None or hashes is None or block_size is None:
            return
        if attempt.number == 0:  # a retry's losses are the failed pod's, not placement's
            self._losses.record(attempt, self._working_set.context(routing.context_key), block_size)
        self._working_set.hold(routing.context_key, routing.context_keyed, pod, block_size,
                               hashes.full(block_size), hashes.token_count + routing.untokenized_tokens,
                               self._clock(), routing.retention_s)

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        routing = attempt.routing
        if routing.context_key is None:
            return
        block_size, hashes = self._index.block_size(attempt.decision.pod.name), routing.hashes
        if _grown_from(attempt) is not None and hashes is not None and block_size:
            self._working_set.grew(routing.context_key, attempt.decision.pod.name, block_size,
                                   hashes.full(block_size), hashes.token_count)
        self._working_set.idle(routing.context_key, self._clock())


class CacheRecency:
    """dispatch and finish: what keep-warm needs to know of every request (:mod:`gateway.workflow.keep_warm`).
    A request takes its prompt's blocks out of its pod's free queue while it runs and returns them when it
    ends (:mod:`gateway.kv.free_queue`); a context's prompt is kept to refresh it from; each request adds to
    its pod's refresh budget; and a refreshed context that comes back is checked for its blocks."""

    def __init__(self, index: PrefixIndex, queues: FreeQueues, keep_warm: KeepWarm,
                 working_set: ResumableWorkingSet) -> None:
        self._index = index
        self._queues = queues
        self._keep_warm = keep_warm
        self._working_set = working_set

    def dispatched(self, attempt: Attempt) -> None:
        routing, pod = attempt.routing, attempt.decision.pod.name
        blocks = self._blocks(routing, pod)
        if blocks is None:
            self._keep_warm.routed(pod, 0)
            return
        held = routing.prefix.pods.get(pod) if routing.prefix is not None else None
        found = held.gpu_tokens - held.speculative_tokens if held is not None else 0
        self._keep_warm.routed(pod, len(blocks) - found // (self._index.block_size(pod) or 1))
        self._queues.taken(pod, blocks)
        key = routing.context_key
        if key is None or routing.token_ids is None:
            return
        context = self._working_set.context(key)
        if context is not None and context.pod == pod:  # what it left there that this prompt could use
            self._keep_warm.came_back(key, pod, found, shared_blocks(context.hashes, blocks) * context.block_size)
        self._keep_warm.dispatched(key, pod, routing.model, routing.token_ids)

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        routing, pod = attempt.routing, attempt.decision.pod.name
        blocks = self._blocks(routing, pod)
        if blocks is None or routing.hashes is None:
            return
        held = self._index.lookup(routing.base_model or routing.model, routing.lora_name, routing.hashes, [pod])[pod]
        block_size = self._index.block_size(pod) or 1
        usable = routing.hashes.usable(block_size)
        cached = len(blocks) if held.gpu_tokens // block_size >= usable else held.gpu_tokens // block_size
        if (head := _grown_from(attempt)) is not None:
            # It took its head's blocks and held the whole prompt's: taken as a whole (the head once more), the
            # head's second hold let go, so that all of them go back together below, as one request's.
            taken = head // block_size
            self._queues.taken(pod, blocks)
            self._queues.returned(pod, blocks[:taken], min(cached, taken))
            if routing.context_key is not None and routing.token_ids is not None:
                self._keep_warm.dispatched(routing.context_key, pod, routing.model, routing.token_ids)
        self._queues.returned(pod, blocks, cached)

    def _blocks(self, routing: RoutingRequest, pod: str) -> list[int] | None:
        """The request's prompt's full blocks as the pod cuts them (None: not tokenized, or no block size)."""
        block_size = self._index.block_size(pod)
        hashes = routing.hashes
        if hashes is None or not block_size:
            return None
        return hashes.full(block_size)


class RoutedPrefix:
    """dispatch: the chosen pod will hold this prompt's blocks: speculative in the precise index until the
    pod's events confirm them, or recorded in the approximate (text) history. finish: a prompt routed on its
    head that the pod answered: the rest of its blocks, now that they are known."""

    def __init__(self, index: PrefixIndex, approximate: ApproximatePrefixIndex) -> None:
        self._index = index
        self._approximate = approximate

    def dispatched(self, attempt: Attempt) -> None:
        match, routing, pod = attempt.routing.prefix, attempt.routing, attempt.decision.pod.name
        if match is None:
            return
        if match.precise and match.hashes is not None:
            held = match.pods.get(pod)
            confirmed = held.gpu_tokens - held.speculative_tokens if held is not None else 0
            self._index.expect(pod, routing.base_model or routing.model, routing.lora_name, match.hashes,
                               confirmed_tokens=confirmed)
        elif match.text:
            self._approximate.record(match.text, pod)

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        routing = attempt.routing
        if (head := _grown_from(attempt)) is not None and routing.hashes is not None and outcome.complete:
            self._index.expect(attempt.decision.pod.name, routing.base_model or routing.model, routing.lora_name,
                               routing.hashes, confirmed_tokens=head)


class RoomForNewContexts:
    """admit: a workflow or session that *starts* while every candidate pod's resumable demand already fills
    its KV cache waits, up to ``placement.hold_new_s``, for room (a context lapsing, completing or moving
    on), rather than evicting contexts that are due back; one that continues never waits. It returns
    nothing: it only delays (the wait shows in the request's TTFT; each hold is counted in
    ``gateway_admission_total{outcome="held"}``)."""

    POLL_S = 0.05

    def __init__(self, pods: PodRegistry, working_set: ResumableWorkingSet, capacity_of: Callable[[str], float | None],
                 hold_s: float, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._pods = pods
        self._working_set = working_set
        self._capacity_of = capacity_of
        self._hold_s = hold_s
        self._waited = metrics.owned(PlacementMetrics).admission.labels("held", "no_room_for_new_context")
        self._clock = clock

    def admit(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> Awaitable[None] | None:
        if not self._hold_s or not self._working_set.starting(routing.context_key, routing.context_keyed):
            return None
        return self._wait(routing) if not self._room(routing) else None

    async def _wait(self, routing: RoutingRequest) -> None:
        self._waited.inc()
        # Polled: room opens when a context lapses, which is a clock passing, not an event anyone sends.
        for _ in range(max(1, round(self._hold_s / self.POLL_S))):
            await asyncio.sleep(self.POLL_S)
            if self._room(routing):
                return

    def _room(self, routing: RoutingRequest) -> bool:
        now, prompt = self._clock(), len(routing.token_ids) if routing.token_ids else 0
        return any(not self._working_set.fills(pod.name, self._capacity_of(pod.name), now, prompt)
                   for pod in self._pods.candidates(routing.model, leg=routing.leg))
