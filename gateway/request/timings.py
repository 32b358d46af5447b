"""How long each step of a request took: the split of the time the gateway adds before the first byte.

A request's time from the director's start to the pod's first byte is cut into named :class:`Step` s, each
the time between two clock readings the director takes anyway at a step boundary (one reading a boundary;
the pod's answer's headers and first byte are stamped by the edge that relays them). A step taken more than
once (a retry routes and connects again) adds up; a step never reached is NaN and is not observed.

Owners: the director makes one :class:`StepTimes` per request and alone marks it (it reaches the steps
read-only, in :class:`~gateway.request.types.CompletedRequest`); the complete step
:class:`~gateway.request.observers.StepMetrics` owns a :class:`RecentSteps`, the window of recent times
that ``/debug/steps`` reads, and observes the histogram ``gateway_request_step_seconds{step}``.
"""

from __future__ import annotations

import enum
import math
import time
from array import array
from typing import Any


class Step(enum.IntEnum):
    """The steps of a request, in the order it takes them."""

    PARSE = 0  # the body read, decoded from its content-encoding and parsed; the request validated
    TOKENIZE = 1  # the prompt's token ids and block hashes (nothing when the policy needs none)
    PREPARE = 2  # the other prepare steps: the context it continues, its load estimate
    ADMIT = 3  # admission and flow control, a wait in their queue included
    ROUTE = 4  # the plan, then the router: the prefix lookup, filters, scorers, picker
    DISPATCH = 5  # the ledger's count and the dispatch steps (blocks expected, context held), the call built
    PREFILL = 6  # a disaggregated request's prefill leg, every try included
    CONNECT = 7  # the call sent, until the pod's answer's headers (a try that failed before them included)
    FIRST_BYTE = 8  # the answer's headers, until its first byte reached the gateway


STEP_NAMES: tuple[str, ...] = tuple(s.name.lower() for s in Step)
_NOT_REACHED = math.nan


def timed_as(step: object) -> Step:
    """Which step a prepare step's time counts to: its ``timed_as`` where it says one, else prepare."""
    named = getattr(step, "timed_as", Step.PREPARE)
    return named if isinstance(named, Step) else Step.PREPARE


class StepTimes:
    """One request's seconds per :class:`Step` (``seconds[step]``; NaN: not reached). Marked by the
    director alone, on the clock the edges stamp an answer's headers and first byte with."""

    __slots__ = ("_since", "seconds")

    def __init__(self) -> None:
        self.seconds = [_NOT_REACHED] * len(Step)
        self._since = time.monotonic()

    def mark(self, step: Step) -> float:
        """The time since the last mark (or the start) was ``step``'s; returns now."""
        now = time.monotonic()
        self._add(step, now - self._since)
        self._since = now
        return now

    def between(self, step: Step, start: float | None, end: float | None) -> None:
        """``step`` ran from ``start`` to ``end`` (stamped elsewhere, on the same clock); nothing when
        either is unknown."""
        if start is not None and end is not None:
            self._add(step, max(0.0, end - start))

    def _add(self, step: Step, seconds: float) -> None:
        had = self.seconds[step]
        self.seconds[step] = seconds if had != had else had + seconds  # NaN != NaN: first time reached


class RecentSteps:
    """The last ``size`` times of each step, in ring buffers allocated once: what ``/debug/steps`` takes
    percentiles of."""

    def __init__(self, size: int = 1024) -> None:
        self._size = size
        self._buffers = [array("d", bytes(8 * size)) for _ in Step]
        self._seen = [0] * len(Step)

    def add(self, step: int, seconds: float) -> None:
        seen = self._seen[step]
        self._buffers[step][seen % self._size] = seconds
        self._seen[step] = seen + 1

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per step: requests that reached it since the start, and over the window the percentiles and mean
        in milliseconds (none while the window is empty)."""
        out: dict[str, dict[str, Any]] = {}
        for step, name in zip(Step, STEP_NAMES, strict=True):
            seen = self._seen[step]
            window = sorted(self._buffers[step][: min(seen, self._size)])
            row: dict[str, Any] = {"seen": seen, "window": len(window)}
            if window:
                row.update({f"p{q}_ms": round(1000 * quantile(window, q / 100), 3) for q in (50, 90, 99)})
                row["mean_ms"] = round(1000 * sum(window) / len(window), 3)
            out[name] = row
        return out


def quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of sorted values (non-empty)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
