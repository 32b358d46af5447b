"""SLO admission: before routing, ADMIT, QUEUE or REJECT each request from predicted load.

Owner: the :class:`AdmissionController` owns its wait queue. It reads pending load and profiles; it
never changes them (the proxy dispatches admitted requests).

- ADMIT when some candidate pod can take the request without going past capacity (embeddings also
  within their share of the pod, so an embedding burst cannot starve chat) and, if a profile says so,
  can meet its TTFT target.
- QUEUE otherwise, in a bounded queue ordered by deadline (the least SLO slack first), woken as requests
  finish; a request never waits past its deadline: ``min(max_queue_wait_s, TTFT target - expected TTFT)``.
- REJECT with 429, an OpenAI error body and ``Retry-After`` from the predicted drain time, when the queue
  is full, the deadline passes, or no pod can ever meet the SLO.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass, field

from gateway.backends.registry import Pod
from gateway.background import cancel_and_wait
from gateway.config import AdmissionConfig
from gateway.core.errors import ErrorKind, GatewayError, bad_request
from gateway.load.pending import Estimate, PendingLoad
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.admission")


@dataclass(slots=True)
class Slo:
    ttft_s: float | None = None
    e2e_s: float | None = None
    priority: int = 0


@dataclass(slots=True)
class AdmissionTicket:
    """What admission decided, for the proxy and telemetry."""

    estimates: dict[str, Estimate]
    waited_s: float = 0.0
    outcome: str = "admitted"


@dataclass(order=True)
class _Waiter:
    deadline: float
    priority: int
    seq: int
    future: asyncio.Future[None] = field(compare=False)


class AdmissionController:
    def __init__(self, config: AdmissionConfig, load: PendingLoad, metrics: GatewayMetrics) -> None:
        self.config = config
        self._load = load
        self._metrics = metrics
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._ticker: asyncio.Task[None] | None = None
        self._draining = False

    @property
    def queued(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        if self.config.enabled:
            self._ticker = asyncio.create_task(self._tick(), name="admission-ticker")

    async def stop(self) -> None:
        await cancel_and_wait(self._ticker)
        for waiter in self._queue:
            if not waiter.future.done():
                waiter.future.cancel()

    def slo_for(self, model: str, ttft_ms: str | None, e2e_ms: str | None, priority: str | None) -> Slo:
        defaults = self.config.slo_defaults.get(model)
        try:
            ttft = float(ttft_ms) / 1000 if ttft_ms else (defaults.ttft_ms / 1000 if defaults and defaults.ttft_ms
                                                           else None)
            e2e = float(e2e_ms) / 1000 if e2e_ms else (defaults.e2e_ms / 1000 if defaults and defaults.e2e_ms
                                                        else None)
            prio = int(priority) if priority else 0
        except ValueError:
            raise bad_request("x-slo-ttft-ms and x-slo-e2e-ms must be numbers, x-priority an integer.",
                              code="invalid_slo_header") from None
        if (ttft is not None and ttft <= 0) or (e2e is not None and e2e <= 0):
            raise bad_request("SLO targets must be positive.", code="invalid_slo_header")
        return Slo(ttft, e2e, prio)

    async def admit(self, pods: list[Pod], kind: str, estimates: dict[str, Estimate], slo: Slo) -> AdmissionTicket:
        ticket = AdmissionTicket(estimates)
        if not self.config.enabled or not pods:
            return ticket
        meetable = [p for p in pods if self._can_meet(estimates[p.name], slo)]
        if not meetable:
            raise self._reject(pods, estimates, "slo_unreachable")
        if self._fits(meetable, kind, estimates):
            self._metrics.admission.labels("admitted", "capacity").inc()
            return ticket
        if self._draining:
            raise _shutting_down()
        if len(self._queue) >= self.config.queue_size:
            raise self._reject(meetable, estimates, "queue_full")
        started = time.monotonic()
        deadline = started + self._max_wait(meetable, estimates, slo)
        # Lower priority numbers wait behind higher ones at equal deadlines.
        waiter = _Waiter(deadline, -slo.priority, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._queue, waiter)
        self._metrics.admission.labels("queued", "capacity").inc()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._reject(meetable, estimates, "queue_timeout")
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.future), remaining)
                except TimeoutError:
                    continue
                if self._draining:  # woken by a release just before the drain: refused all the same
                    raise _shutting_down()
                if self._fits(meetable, kind, estimates):
                    ticket.waited_s = time.monotonic() - started
                    ticket.outcome = "admitted_after_queue"
                    self._metrics.admission.labels("admitted", "after_queue").inc()
                    return ticket
                waiter.future = asyncio.get_running_loop().create_future()
                heapq.heappush(self._queue, waiter)
        finally:
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)
                heapq.heapify(self._queue)

    def drain(self) -> None:
        """The gateway is shutting down: it waits for the requests in flight, not for those still queued,
        which are refused at once (another replica can take them)."""
        self._draining = True
        for waiter in self._queue:
            if not waiter.future.done():
                waiter.future.set_exception(_shutting_down())

    def release(self) -> None:
        """A request finished: let the waiter with the least slack re-check."""
        while self._queue:
            waiter = heapq.heappop(self._queue)
            if not waiter.future.done():
                waiter.future.set_result(None)
                return

    async def _tick(self) -> None:
        # Capacity also frees without a release (a profile refresh, an engine draining its queue).
        while True:
            await asyncio.sleep(0.1)
            if self._queue:
                self.release()

    def _fits(self, pods: list[Pod], kind: str, estimates: dict[str, Estimate]) -> bool:
        return any(self._load.fits(p.name, estimates[p.name], kind) for p in pods)

    @staticmethod
    def _can_meet(estimate: Estimate, slo: Slo) -> bool:
        if not math.isfinite(estimate.consumption):
            return False
        if slo.ttft_s is not None and estimate.ttft_s is not None and estimate.ttft_s > slo.ttft_s:
            return False
        return not (slo.e2e_s is not None and estimate.e2e_s is not None and estimate.e2e_s > slo.e2e_s)

    def _max_wait(self, pods: list[Pod], estimates: dict[str, Estimate], slo: Slo) -> float:
        wait = self.config.max_queue_wait_s
        if slo.ttft_s is not None:
            expected = min((estimates[p.name].ttft_s or 0.0) for p in pods)
            wait = min(wait, max(0.0, slo.ttft_s - expected))
        return wait

    def _reject(self, pods: list[Pod], estimates: dict[str, Estimate], reason: str) -> GatewayError:
        self._metrics.admission.labels("rejected", reason).inc()
        retry_after = max(1, math.ceil(min(self._drain(p, estimates[p.name]) for p in pods)))
        messages = {
            "slo_unreachable": "No pod can serve this request within its SLO.",
            "queue_full": "The gateway is at capacity and its wait queue is full.",
            "queue_timeout": "The gateway is at capacity; the request could not start within its SLO.",
        }
        return GatewayError(ErrorKind.RATE_LIMITED, f"{messages[reason]} Retry after {retry_after} s.", code=reason,
                            retry_after_s=retry_after)

    def _drain(self, pod: Pod, estimate: Estimate) -> float:
        excess = self._load.load(pod.name) + min(estimate.consumption, 1.0) - 1.0
        return self._load.drain_seconds(pod.name, max(excess, 0.0), estimate.e2e_s or self.config.typical_e2e_s)


def _shutting_down() -> GatewayError:
    return GatewayError(ErrorKind.NO_POD, "The gateway is shutting down; retry the request.", code="draining")
