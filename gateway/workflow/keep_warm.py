"""Keep-warm: a cache action unmodified engines honour. A refresh (:mod:`gateway.workflow.refresh`) puts a
thinking context's cached blocks back at the most recently used end of its pod's free queue, so that the
pod's LRU evicts something else first.

The gateway knows what no engine knows: which contexts will come back, when (their learnt think time), and
how likely. Each tick, per pod (:func:`choose_refresh`):

1. the thinking contexts it could refresh (their prompt kept, worth ``min_tokens``), soonest due back
   first, are *kept* while their blocks fit ``capacity_share`` of the pod's free blocks; the others are let
   go (refreshing more than fits would only turn the queue over);
2. a kept context whose first block to go (:mod:`gateway.kv.free_queue`) the pod would evict within
   ``lead_s``, at the rate its requests take new blocks (or by its next request), before the context is due
   back, is refreshed, if the tokens a miss would cost, times the chance it comes back, are worth
   ``min_tokens``;
3. only on idle capacity: never while the pod says requests wait, nor while more than ``max_in_flight`` of
   the gateway's requests run there (none, by default), nor while flow control holds a request that may
   go there; one refresh at a time per pod, and within ``max_share`` refreshes per request routed there;
4. never in a client's way: a refresh still running when a client request is routed to its pod (and the
   pod is no longer idle capacity by ``max_in_flight``) is cancelled. The engine aborts a request whose
   connection closes and frees its blocks as any request's, to the back of its free queue: a refresh the
   engine had scheduled has made its touch already (on an idle pod it is scheduled in the next engine
   step), so its blocks count as refreshed.

Owner: :class:`KeepWarm` owns each pod's refresh budget and rate of new blocks, the prompts kept, and its
refreshes in flight. It reads the working set (contexts, their think time and return chance), the free
queues, the prefix index (cached blocks), the engines' stats and the in-flight ledger; it writes the free queues
only for its own refreshes. A refresh is no client request: it is not in the ledger, the request metrics
or the learning; ``/debug/placement`` shows what keep-warm does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.background import cancel_and_wait
from gateway.config import KeepWarmConfig
from gateway.kv.contexts import Context, RunningMean
from gateway.kv.free_queue import FreeQueues
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import PendingLoad
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.workflow.metrics import WorkflowMetrics
from gateway.workflow.refresh import KeptPrompt, KeptPrompts, Refresher, RefreshFailed

log = logging.getLogger("gateway.workflow.keep_warm")

RATE_TIME_CONSTANT_S = 2.0  # how fast a pod's rate of new blocks follows what it does
PER_REQUEST_SMOOTHING = 0.2
BUDGET_CAP = 8.0  # refreshes a pod's budget may save up


@dataclass(slots=True)
class Candidate:
    """A thinking context keep-warm could refresh, as one tick sees it."""

    context: Context
    prompt: KeptPrompt
    due_in_s: float  # until it is expected back (negative: overdue)
    comes_back_in_s: float  # until it is expected back, or (overdue) until its resumable window ends
    blocks: int  # those only it holds among the pod's resumable contexts (what keeping it costs)
    first_to_go: int  # its block the pod evicts first
    margin: int  # blocks the pod may take before it evicts that one (free ones caching nothing, then those ahead)
    worth: float  # the prompt tokens a miss would recompute, times the chance it comes back


@dataclass(slots=True)
class Choice:
    refresh: Candidate | None
    kept: int
    at_risk: int


def choose_refresh(candidates: list[Candidate], room: int, rate: float, per_request: float,
                   config: KeepWarmConfig) -> Choice:
    """The context to refresh on one pod now, if any.

    Soonest due back first, contexts are kept while their blocks fit ``room``; of those kept, the ones at
    risk are those whose first block to go the pod would evict within ``lead_s``, taking new blocks at
    ``rate`` a second (or by its next request, which takes ``per_request``), before they come back, and that
    are worth ``min_tokens``. The one nearest eviction is refreshed."""
    kept: list[Candidate] = []
    used = 0
    for c in sorted(candidates, key=lambda c: c.due_in_s):
        if used + c.blocks <= room:
            kept.append(c)
            used += c.blocks
    at_risk = [c for c in kept if c.margin <= rate * config.lead_s + per_request
               and c.margin < rate * max(0.0, c.comes_back_in_s) + per_request and c.worth >= config.min_tokens]
    return Choice(min(at_risk, key=lambda c: c.margin, default=None), len(kept), len(at_risk))


@dataclass(slots=True)
class PodWarmth:
    """Keep-warm's view of one pod."""

    budget: float = 1.0  # refreshes it may send now
    taken: int = 0  # new blocks the requests routed here have taken, in all
    taken_seen: int = 0
    rate: float = 0.0  # new blocks taken per second (smoothed)
    rate_at: float | None = None
    # New blocks a request routed here takes: their running mean and mean deviation, and what the next request
    # may take (the mean plus twice the deviation: a large one is what evicts).
    new_blocks: RunningMean = field(default_factory=lambda: RunningMean(PER_REQUEST_SMOOTHING))
    new_blocks_deviation: RunningMean = field(default_factory=lambda: RunningMean(PER_REQUEST_SMOOTHING))

    @property
    def per_request(self) -> float:
        return self.new_blocks.get(0.0) + 2 * self.new_blocks_deviation.get(0.0)
    refresh: asyncio.Task[None] | None = None  # the one in flight
    refreshes: int = 0
    failures: int = 0
    cancelled: int = 0  # gave way to a client request
    kept: int = 0  # at the last tick: contexts kept,
    let_go: int = 0  # those it could have kept but that did not fit,
    at_risk: int = 0  # kept ones due to be evicted before they come back,
    nearest: int | None = None  # and the fewest blocks the pod could take before evicting one of theirs

    def routed(self, new_blocks: int, max_share: float) -> None:
        """A request was routed here, where it takes ``new_blocks`` blocks."""
        self.budget = min(BUDGET_CAP, self.budget + max_share)
        self.taken += new_blocks
        self.new_blocks_deviation.add(abs(new_blocks - self.new_blocks.get(new_blocks)))
        self.new_blocks.add(new_blocks)

    def observe(self, now: float) -> None:
        """Follow the rate at which the pod takes new blocks."""
        if self.rate_at is None:
            self.rate_at, self.taken_seen = now, self.taken
            return
        dt = now - self.rate_at
        if dt <= 0:
            return
        self.rate += (1.0 - math.exp(-dt / RATE_TIME_CONSTANT_S)) * ((self.taken - self.taken_seen) / dt - self.rate)
        self.rate_at, self.taken_seen = now, self.taken


class KeepWarm:
    def __init__(self, config: KeepWarmConfig, pods: PodRegistry, working_set: ResumableWorkingSet,
                 queues: FreeQueues, index: PrefixIndex, load: PendingLoad, ledger: InFlightLedger,
                 capacity_of: Callable[[str], float | None], refresher: Refresher, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 client_due: Callable[[str], bool] = lambda pod: False) -> None:
        """``client_due``: whether a client request held at the gateway (flow control) may go to the pod."""
        self.config = config
        self._pods = pods
        self._working_set = working_set
        self._queues = queues
        self._index = index
        self._load = load
        self._ledger = ledger
        self._capacity_of = capacity_of
        self._refresher = refresher
        self._metrics = metrics.owned(WorkflowMetrics)
        self._clock = clock
        self._client_due = client_due
        self.prompts = KeptPrompts(config.min_tokens, config.max_prompt_tokens)
        self._warmth: dict[str, PodWarmth] = {}
        self._refreshed: set[str] = set()  # contexts refreshed since their last request
        self.returns = {"kept": 0, "lost": 0}  # refreshed contexts that came back and found their blocks, or not
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    # The request path's side (the recency step)

    def routed(self, pod: str, new_blocks: int) -> None:
        """A request was routed to ``pod`` (the ledger counts it there), where it takes ``new_blocks`` blocks:
        its refresh budget grows, and a refresh running there gives way once the pod is no longer idle
        capacity (more than ``max_in_flight`` of the gateway's requests)."""
        warmth = self._warmth.setdefault(pod, PodWarmth())
        warmth.routed(new_blocks, self.config.max_share)
        if warmth.refresh is not None and self._ledger.on_pod(pod) > self.config.max_in_flight:
            warmth.refresh.cancel()

    def dispatched(self, context: str, pod: str, model: str, ids: Sequence[int]) -> None:
        """A request of the context went to ``pod`` with this prompt: it is what a refresh builds on now."""
        self.prompts.keep(context, pod, model, ids)

    def came_back(self, context: str, pod: str, cached_tokens: int, expected_tokens: int) -> None:
        """A context that was refreshed while it thought sent its next request to ``pod``, which holds
        ``cached_tokens`` of the ``expected_tokens`` it left there."""
        if context not in self._refreshed:
            return
        self._refreshed.discard(context)
        outcome = "kept" if cached_tokens >= expected_tokens else "lost"
        log.debug("keep-warm: %s came back to %s: %d of %d tokens cached (%s)", context, pod, cached_tokens,
                  expected_tokens, outcome)
        self.returns[outcome] += 1
        self._metrics.keep_warm_returns.labels(outcome).inc()

    # Lifecycle

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="keep-warm")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        for task in list(self._inflight):
            await cancel_and_wait(task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.tick()
            except Exception:  # a bug here must not end keep-warm for good
                log.exception("keep-warm tick failed")

    # Deciding

    def tick(self) -> None:
        now = self._clock()
        for warmth in self._warmth.values():
            warmth.observe(now)
        by_pod: dict[str, list[Candidate]] = {}
        uncached_free: dict[str, int] = {}
        for key in self.prompts.contexts():
            prompt = self.prompts.get(key)
            if prompt is None:
                continue
            if prompt.pod not in uncached_free:
                uncached_free[prompt.pod] = self._uncached_free(prompt.pod)
            candidate = self._candidate(key, prompt, uncached_free[prompt.pod], now)
            if candidate is not None:
                by_pod.setdefault(prompt.pod, []).append(candidate)
        for pod, candidates in by_pod.items():
            warmth = self._warmth.setdefault(pod, PodWarmth())
            choice = choose_refresh(candidates, self._room(pod), warmth.rate, warmth.per_request, self.config)
            warmth.kept, warmth.let_go, warmth.at_risk = choice.kept, len(candidates) - choice.kept, choice.at_risk
            warmth.nearest = min(c.margin for c in candidates)
            if choice.refresh is not None and self._may_send(pod, warmth):
                self._send(pod, warmth, choice.refresh)

    def _candidate(self, key: str, prompt: KeptPrompt, uncached_free: int, now: float) -> Candidate | None:
        ctx = self._working_set.context(key)
        if ctx is None:  # lapsed, released or forgotten: nothing comes back to keep
            self.prompts.drop(key)
            self._refreshed.discard(key)
            return None
        if ctx.pod != prompt.pod or not ctx.thinking or not ctx.hashes:
            return None
        found = self._queues.first_to_go(ctx.pod, ctx.hashes)
        if found is None:  # none of its blocks is free: in use by another request, or gone already
            return None
        first, ahead = found
        due_in = self._working_set.forecast.expected_return(ctx) - now
        worth = self._working_set.return_chance(ctx) * (first + 1) * ctx.block_size
        return Candidate(ctx, prompt, due_in, due_in if due_in > 0 else ctx.protected_until - now,
                         self._working_set.demand.exclusive_blocks_of(ctx), first, uncached_free + ahead, worth)

    def _blocks(self, pod: str) -> tuple[float, float]:
        """The pod's usable blocks and those its running requests hold (0, 0: its size is unknown)."""
        capacity = self._capacity_of(pod)
        block_size = self._index.block_size(pod)
        if not capacity or not block_size:
            return 0.0, 0.0
        usable = capacity / block_size - 1  # vLLM keeps one as its null block
        stats = self._load.engine.get(pod)
        return usable, stats.kv_usage * usable if stats is not None and not stats.stale else 0.0

    def _room(self, pod: str) -> int:
        """Blocks of ``pod`` that kept contexts may take: ``capacity_share`` of those no request holds."""
        usable, in_use = self._blocks(pod)
        return int(self.config.capacity_share * max(0.0, usable - in_use))

    def _uncached_free(self, pod: str) -> int:
        """Free blocks of ``pod`` that cache nothing, which the pod takes before any cached one: all but those
        its events say are cached, and a partial block per request running there."""
        usable, _ = self._blocks(pod)
        return max(0, int(usable) - self._index.gpu_blocks(pod) - self._ledger.on_pod(pod))

    def _may_send(self, pod: str, warmth: PodWarmth) -> bool:
        if warmth.refresh is not None or warmth.budget < 1 or self._ledger.on_pod(pod) > self.config.max_in_flight:
            return False
        if self._client_due(pod):  # a client request waits for room: it goes first
            return False
        stats = self._load.engine.get(pod)
        if stats is not None and stats.waiting > 0:  # only idle capacity: nothing may wait behind a refresh
            return False
        target = self._pods.get(pod)
        return target is not None and target.available(self._clock())

    # Refreshing

    def _send(self, pod: str, warmth: PodWarmth, c: Candidate) -> None:
        log.debug("keep-warm: refresh %s on %s: %d blocks before its block %d goes, at %.1f blocks/s; due in %.2f s, "
                  "kept %d of %d", c.context.key, pod, c.margin, c.first_to_go, warmth.rate, c.due_in_s, warmth.kept,
                  warmth.kept + warmth.let_go)
        warmth.budget -= 1
        self._refreshed.add(c.context.key)
        task = warmth.refresh = asyncio.create_task(self._refresh(pod, warmth, c), name=f"keep-warm-{pod}")
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _refresh(self, pod: str, warmth: PodWarmth, c: Candidate) -> None:
        """One refresh; meanwhile its blocks are out of the pod's free queue, as they are in the engine."""
        block_size = c.context.block_size
        blocks = c.context.hashes[: c.first_to_go + 1]
        self._queues.taken(pod, blocks)
        cached = 0
        ids = c.prompt.refresh_ids(len(blocks), block_size)
        try:
            cached = await self._refresher.refresh(pod, c.prompt.model, ids)
            warmth.refreshes += 1
        except asyncio.CancelledError:  # a client request came for the pod: the engine aborts the refresh
            cached = len(blocks) * block_size  # scheduled already on an idle pod: its blocks went to the back
            warmth.cancelled += 1
            self._refresher.cancelled(pod, len(ids), cached)
            log.debug("keep-warm: refresh of %s on %s gave way to a client request", c.context.key, pod)
            raise
        except RefreshFailed as exc:
            warmth.failures += 1
            log.info("keep-warm: refresh on %s failed: %s", pod, exc)
        except Exception:  # a bug here must fail this refresh only
            warmth.failures += 1
            log.exception("keep-warm: refresh on %s failed", pod)
        finally:
            self._queues.returned(pod, blocks, cached // block_size)
            warmth.refresh = None

    # Observing

    def debug(self) -> dict[str, Any]:
        stats = self._queues.stats
        return {
            "enabled": True, "prompts": len(self.prompts), "prompt_tokens": self.prompts.tokens,
            "returns": dict(self.returns),
            "free_queues": {"evicted_first": stats.evicted_first, "evicted_out_of_order": stats.evicted_out_of_order,
                            "evicted_unknown": stats.evicted_unknown},
            "pods": {pod: {"new_blocks_per_s": round(w.rate, 2), "blocks_per_request": round(w.per_request, 2),
                           "budget": round(w.budget, 2), "refreshes": w.refreshes, "failures": w.failures,
                           "cancelled": w.cancelled,
                           "kept": w.kept, "let_go": w.let_go, "at_risk": w.at_risk, "nearest_margin_blocks": w.nearest,
                           "free_blocks_seen": self._queues.free_blocks(pod),
                           "uncached_free_blocks": self._uncached_free(pod)}
                     for pod, w in self._warmth.items()},
        }
