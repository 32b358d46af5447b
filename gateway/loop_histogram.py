"""A histogram family observed from the event loop's thread alone, exported as any other on scrape.

prometheus_client's ``Histogram.observe`` checks each call, takes a lock for the sum and another for the bucket
it finds by walking the bounds: a few thousand instructions. The gateway times every step of every request and
every routing part of every decision, besides each request's duration, TTFT, tokenizing and prefix lookup (25
observations a ``kv_aware`` request): the parts' timings alone were 5% of a request's instructions (callgrind:
docs/benchmarks.md#kits-and-plugins-against-the-assembly-they-replaced). Here an observation is a bisection and
two additions, with no lock: only the loop observes. The scrape, written on a thread, copies each child's counts
in one step, so its buckets and count agree; its sum may miss an observation made meanwhile.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class LoopHistogramChild:
    """One label set's buckets: ``counts[i]`` observations fell in bucket ``i`` (the last: above every bound)."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1  # the first bound >= amount: Prometheus' ``le``
        self.sum += amount


class LoopHistogram:
    """A histogram family with labels, observed on the event loop (see the module's docs)."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(sorted(float(b) for b in buckets if b != math.inf))
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogramChild:
        """The child of these label values (look it up once and keep it: the lookup costs more than observing)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, given {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = LoopHistogramChild(self._bounds)
        return child

    def observe(self, amount: float) -> None:
        """An observation of a family without labels."""
        self.labels().observe(amount)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        upper = [*(floatToGoString(b) for b in self._bounds), "+Inf"]
        for values, child in list(self._children.items()):
            counts, total = child.counts[:], child.sum
            cumulative, buckets = 0, []
            for bound, count in zip(upper, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(values), buckets, total)
        yield family
