"""The resumable working set: per pod, the KV blocks that live contexts will ask for again.

Owner: the :class:`ResumableWorkingSet` owns every :class:`Context`, through its pieces the per-pod block
counts placement weighs (:class:`~gateway.kv.pod_demand.PodDemands`) and the anonymous conversations
(:class:`~gateway.kv.contexts.Conversations`). The request pipeline holds a context when one of its requests
is dispatched and idles it when the attempt ends; the workflow executor releases a workflow's context when
it completes, is flushed or pressure lets it go. Everyone else reads. How many of a context's requests are
in flight is the in-flight ledger's count, here and on the other workers and replicas; the working set keeps
none of its own.

A *context* is what one client keeps coming back with: a workflow (``x-workflow-id``), a session
(``x-session-id``, ``prompt_cache_key``, ``user``) or, with neither, a conversation recognised by its
prompt extending the last prompt of a live anonymous context. While one of its requests runs and, after
that, for its predicted think time (``margin`` times its own average gap between stages, or the average
of all contexts before it has one), its blocks count as *resumable* on its pod: evicting them means
recomputing them when it comes back. Past that window it lapses, and its blocks are as cheap to evict
as any other cached block.

With several workers or replicas, each keeps its own working set and tells the others every hold, idle
and release (the sink it is built with; it applies theirs in :meth:`ResumableWorkingSet.apply_remote`), so that
every process weighs the contexts all of them placed; anonymous contexts are named after the process that
first saw them, so that the names never clash.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import Any

from gateway.config import PlacementConfig
from gateway.core.facts import ContextHeld, ContextIdled, ContextReleased, Publish, unshared
from gateway.kv.contexts import Context, ContextForecast, Conversations, shared_blocks
from gateway.kv.pod_demand import PodDemands
from gateway.load.ledger import InFlightLedger


class ResumableWorkingSet:
    def __init__(self, config: PlacementConfig, ledger: InFlightLedger, publish: Publish = unshared,
                 anonymous_prefix: str = "anon-") -> None:
        self.config = config
        self._ledger = ledger
        self._publish = publish
        self._contexts: dict[str, Context] = {}
        self._running: set[str] = set()  # contexts not yet idled since their last hold
        self.demand = PodDemands()
        self._conversations = Conversations(anonymous_prefix)
        self._expiry: list[tuple[float, int, str]] = []  # (protected_until, version, key)
        self.forecast = ContextForecast(self.config)
        self.lapsed = 0
        self.released = 0
        self.evicted = 0  # forgotten to stay within max_contexts

    # Reads

    def context(self, key: str) -> Context | None:
        """The live context named ``key``."""
        return self._contexts.get(key)

    def continued(self, hashes: list[int], hint: int | None = None) -> Context | None:
        """The live anonymous context whose last prompt the prompt of these block hashes extends: looked
        for at block ``hint`` first (where the conversation's earlier prompt ended), then from the end."""
        key = self._conversations.continued(hashes, hint)
        return self._contexts.get(key) if key is not None else None

    def anonymous_key(self) -> str:
        """A new name for a conversation no live context continues."""
        return self._conversations.new_key()

    def demand_tokens(self, pod: str, now: float, exclude: Context | None = None) -> float:
        """Tokens the resumable contexts on ``pod`` hold or are expected to grow to, ``exclude``'s own
        share left out (it is the request being placed)."""
        self.lapse(now)
        live = exclude is not None and exclude.pod == pod and exclude.key in self._contexts
        return self.demand.tokens(pod, exclude if live else None)

    def starting(self, key: str | None, keyed: bool) -> bool:
        """Whether a request of this context would start a workflow or session (none of that name is live)."""
        return keyed and key is not None and key not in self._contexts

    def fills(self, pod: str, capacity: float | None, now: float, extra_tokens: float = 0.0) -> bool:
        """Whether the resumable demand on ``pod``, plus ``extra_tokens``, fills its ``capacity`` (unknown:
        never)."""
        return bool(capacity) and self.demand_tokens(pod, now) + extra_tokens >= capacity

    def others_on(self, pod: str, key: str, now: float) -> bool:
        """Whether a context other than ``key`` is resumable on ``pod`` (a global flush would hurt it)."""
        self.lapse(now)
        return self.demand.others_on(pod, self._contexts.get(key))

    def return_chance(self, ctx: Context) -> float:
        return self.forecast.return_chance(ctx)

    def resumable(self, pod: str) -> tuple[int, int]:
        """Keyed contexts resumable on ``pod``: (all, those between requests)."""
        return self.demand.resumable(pod)

    def idle_on(self, pod: str) -> list[Context]:
        """Keyed contexts between requests on ``pod``, the one idle longest first."""
        found = [c for c in self._contexts.values() if c.pod == pod and c.keyed and c.thinking]
        return sorted(found, key=lambda c: c.last_finish or 0.0)

    def debug(self, pods: list[str], capacity_of: Callable[[str], float | None], now: float) -> dict[str, Any]:
        """What placement weighs, per pod, and the forecasts it learnt (for ``/debug/placement``)."""
        self.lapse(now)
        per_pod = {pod: {"capacity_tokens": capacity_of(pod), **self.demand.debug(pod)} for pod in pods}
        return {"pods": per_pod, "contexts": self.size, "lapsed": self.lapsed, "released": self.released,
                "evicted": self.evicted, "forecast": self.forecast.debug()}

    @property
    def size(self) -> int:
        """Live contexts (not ``__len__``: an empty working set must not be falsy)."""
        return len(self._contexts)

    # Writes

    def hold(self, key: str, keyed: bool, pod: str, block_size: int, hashes: list[int], prompt_tokens: int,
             now: float, retention_s: float | None = None) -> Context:
        """One of the context's requests was dispatched to ``pod`` with a prompt of these blocks (and its
        client declared it will reuse them for ``retention_s``)."""
        self.lapse(now)
        fact = ContextHeld(key, keyed, pod, block_size, hashes, prompt_tokens, retention_s)
        self._publish(fact)
        return self._hold(fact, now)

    def grew(self, key: str, pod: str, block_size: int, hashes: list[int], prompt_tokens: int) -> None:
        """The request that holds the context on ``pod`` was held with its prompt's head: these are the whole
        prompt's blocks (the same hold: nothing learnt, no stage counted). A context gone, or held since
        elsewhere, keeps what it has."""
        ctx = self._contexts.get(key)
        if ctx is not None and ctx.pod == pod:
            fact = ContextHeld(key, ctx.keyed, pod, block_size, hashes, prompt_tokens, ctx.retention_s, grown=True)
            self._publish(fact)
            self._grow(fact)

    def _grow(self, fact: ContextHeld) -> None:
        ctx = self._contexts.get(fact.key)
        if ctx is None or ctx.pod != fact.pod:
            return
        kept = shared_blocks(ctx.hashes, fact.hashes)
        self._unplace(ctx, kept)
        ctx.block_size, ctx.prompt_tokens, ctx.hashes = fact.block_size, fact.prompt_tokens, fact.hashes
        self._place(ctx, kept)

    def _hold(self, fact: ContextHeld, now: float) -> Context:
        key, keyed, pod, hashes, prompt_tokens = fact.key, fact.keyed, fact.pod, fact.hashes, fact.prompt_tokens
        kept = 0  # leading blocks still counted for this context: its prompt usually grew on the same pod
        ctx = self._contexts.get(key)
        if ctx is None:
            self._make_room()
            ctx = Context(key, pod, fact.block_size, [], prompt_tokens, keyed, *self.forecast.new_means(), stages=0)
            self._contexts[key] = ctx
        else:
            self.forecast.returned(ctx, prompt_tokens, now)
            if ctx.pod == pod:
                kept = shared_blocks(ctx.hashes, hashes)
            self._unplace(ctx, kept)
        ctx.pod, ctx.block_size, ctx.prompt_tokens, ctx.hashes = pod, fact.block_size, prompt_tokens, hashes
        ctx.retention_s = fact.retention_s
        ctx.stages += 1
        ctx.protected_until = math.inf
        ctx.version += 1
        self._running.add(key)
        ctx.expected_growth = self.forecast.expected_growth(ctx, ctx.keyed, ctx.stages)
        self._place(ctx, kept)
        return ctx

    def idle(self, key: str, now: float) -> None:
        """An attempt of the context ended: once none of its requests is in flight (the ledger), it stays
        resumable for its predicted think time."""
        if key in self._running:
            self._publish(ContextIdled(key))
            self._idle(self._contexts[key], now)

    def _idle(self, context: Context, now: float) -> None:
        if self._ledger.of_context(context.key):
            return  # another of its requests still runs (here or elsewhere): it idles when that one ends
        self._running.discard(context.key)
        context.last_finish = now
        context.protected_until = now + self._resumable_s(context)
        context.version += 1
        heapq.heappush(self._expiry, (context.protected_until, context.version, context.key))
        self.demand.idled(context)

    def settle(self, now: float) -> None:
        """Idle the contexts whose requests the ledger no longer counts but whose end never arrived (a
        worker or replica went silent, a batch was lost)."""
        for key in [k for k in self._running if not self._ledger.of_context(k)]:
            self._idle(self._contexts[key], now)

    def release(self, key: str, *, completed: bool = False) -> bool:
        """Forget a context (its workflow completed or was flushed); a completed one teaches how many
        stages contexts have."""
        if released := self._release(key, completed):
            self._publish(ContextReleased(key, completed))
        return released

    def apply_remote(self, origin: str, fact: ContextHeld | ContextIdled | ContextReleased) -> None:
        """Another worker or replica held, idled or released a context."""
        now = time.monotonic()
        self.lapse(now)
        if isinstance(fact, ContextHeld):
            if fact.grown:
                self._grow(fact)
            else:
                self._hold(fact, now)
        elif isinstance(fact, ContextIdled):
            if fact.key in self._running:
                self._idle(self._contexts[fact.key], now)
        else:
            self._release(fact.key, fact.completed)

    def _release(self, key: str, completed: bool) -> bool:
        if (ctx := self._forget(key)) is None:
            return False
        if completed:
            self.forecast.completed(ctx)
        self.released += 1
        return True

    def forget_pod(self, pod: str) -> None:
        for key in [k for k, c in self._contexts.items() if c.pod == pod]:
            self._forget(key)
        self.demand.forget(pod)

    def _resumable_s(self, ctx: Context) -> float:
        """How long a context that stopped stays resumable: its predicted think time's protection, or the
        retention its client declared if longer."""
        return max(self.forecast.protection_s(ctx), ctx.retention_s or 0.0)

    def lapse(self, now: float) -> None:
        """Drop the contexts whose protection ran out."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, version, key = heapq.heappop(heap)
            ctx = self._contexts.get(key)
            if ctx is None or ctx.version != version:
                continue
            if self._ledger.of_context(key):  # a request of it runs elsewhere: it is not done thinking
                ctx.protected_until = now + self._resumable_s(ctx)
                heapq.heappush(heap, (ctx.protected_until, version, key))
                continue
            self._forget(key)
            self.forecast.lapsed(ctx)
            self.lapsed += 1

    # Bookkeeping

    def _forget(self, key: str) -> Context | None:
        ctx = self._contexts.pop(key, None)
        if ctx is not None:
            self._unplace(ctx)
            self._running.discard(key)
        return ctx

    def _place(self, ctx: Context, kept: int = 0) -> None:
        """Count ``ctx`` on its pod (its first ``kept`` blocks are counted already) and its conversation."""
        self.demand.place(ctx, kept)
        self._conversations.placed(ctx)

    def _unplace(self, ctx: Context, kept: int = 0) -> None:
        self.demand.unplace(ctx, kept)
        self._conversations.unplaced(ctx)

    def _make_room(self) -> None:
        """Before a new context joins a full set, forget the idle one that finished longest ago (every
        idle context has finished a request; one in flight is never forgotten)."""
        if len(self._contexts) < self.config.max_contexts:
            return
        idle = [c for c in self._contexts.values() if c.thinking]
        if idle:
            self._forget(min(idle, key=lambda c: c.last_finish or 0.0).key)
            self.evicted += 1
