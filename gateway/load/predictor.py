"""Output-length prediction from recent history.

Per model and input bucket ``round(log2(input_tokens))``, a histogram of output lengths (log2 buckets)
over a sliding window of time slots. Owner: the output-learning step
(:class:`~gateway.request.observers.OutputLearning`) feeds it the usage of answers that arrived whole; the
load-estimation step (:class:`~gateway.request.steps.LoadEstimation`) reads predictions for admission and
routing.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter, deque
from typing import Literal

ColdStart = Literal["optimistic", "input", "pessimistic"]


def log2_bucket(n: int) -> int:
    return round(math.log2(max(n, 1)))


class OutputLengthPredictor:
    def __init__(self, window_s: float = 240.0, slot_s: float = 10.0, cold_start: ColdStart = "input",
                 max_output: int = 4096, percentile: float | None = None, rng: random.Random | None = None) -> None:
        self.window_s = window_s
        self.slot_s = slot_s
        self.cold_start = cold_start
        self.max_output = max_output
        self.percentile = percentile
        self._rng = rng or random.Random()
        # (slot start, {(model, input bucket): Counter of output buckets}), oldest first.
        self._slots: deque[tuple[float, dict[tuple[str, int], Counter[int]]]] = deque()

    def observe(self, model: str, input_tokens: int, output_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        start = now - now % self.slot_s
        if not self._slots or self._slots[-1][0] != start:
            self._slots.append((start, {}))
        self._expire(now)
        self._slots[-1][1].setdefault((model, log2_bucket(input_tokens)), Counter())[log2_bucket(output_tokens)] += 1

    def _expire(self, now: float) -> None:
        while self._slots and self._slots[0][0] <= now - self.window_s:
            self._slots.popleft()

    def histogram(self, model: str, input_tokens: int, now: float | None = None) -> Counter[int]:
        now = time.monotonic() if now is None else now
        self._expire(now)
        key = (model, log2_bucket(input_tokens))
        total: Counter[int] = Counter()
        for _, buckets in self._slots:
            if key in buckets:
                total.update(buckets[key])
        return total

    def predict(self, model: str, input_tokens: int, max_tokens: int | None = None,
                now: float | None = None) -> int:
        cap = min(max_tokens or self.max_output, self.max_output)
        hist = self.histogram(model, input_tokens, now)
        if not hist:
            cold = {"optimistic": 1, "input": input_tokens, "pessimistic": cap}[self.cold_start]
            return max(1, min(cold, cap))
        buckets = sorted(hist)
        if self.percentile is not None:
            rank, seen = self.percentile / 100 * sum(hist.values()), 0
            chosen = buckets[-1]
            for b in buckets:
                seen += hist[b]
                if seen >= rank:
                    chosen = b
                    break
        else:
            chosen = self._rng.choices(buckets, weights=[hist[b] for b in buckets])[0]
        return max(1, min(2**chosen, cap))
