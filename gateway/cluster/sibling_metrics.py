"""``/metrics`` of a multi-worker gateway: the answering worker asks each sibling for its own exposition
(over the sibling's private Unix socket) and merges them into one.

Counters and histograms are summed. Gauges take the highest value: those that are per pod read state the
workers share (in flight, pending load) or each worker measures alike (KV usage, health), so every worker
reports the same number and summing would count it N times. A sibling that does not answer within the
timeout is left out and counted in ``gateway_workers_unscraped``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.cluster.identity import WorkerIdentity

# ``?worker=self``: this worker's own exposition, not merged (what siblings ask each other for).
OWN_ONLY = "self"
LOWEST_WINS = frozenset({"gateway_shared_state_redis_up"})


async def sibling_expositions(identity: WorkerIdentity, timeout_s: float = 1.0) -> tuple[list[str], int]:
    """The other workers' own expositions, and how many did not answer."""
    async def fetch(index: int) -> str | None:
        connector = aiohttp.UnixConnector(path=identity.http_socket(index))
        try:
            async with aiohttp.ClientSession(connector=connector) as session, session.get(
                    f"http://worker/metrics?worker={OWN_ONLY}",
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    found = await asyncio.gather(*(fetch(i) for i in range(identity.count) if i != identity.index))
    return [text for text in found if text is not None], sum(1 for text in found if text is None)


def merge_expositions(texts: Iterable[str], workers: int, unscraped: int) -> bytes:
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            samples = values.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # per process; a sum of creation times means nothing
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = samples.get(key)
                if old is None:
                    samples[key] = sample.value
                elif merged.type != "gauge":
                    samples[key] = old + sample.value
                elif family.name in LOWEST_WINS:
                    samples[key] = min(old, sample.value)
                else:
                    samples[key] = max(old, sample.value)
    for name, merged in families.items():
        for (sample_name, labels), value in values[name].items():
            merged.add_sample(sample_name, dict(labels), value)
    workers_family = Metric("gateway_workers", "Worker processes of this gateway, and those that did not "
                            "answer this scrape", "gauge")
    workers_family.add_sample("gateway_workers", {}, workers)
    workers_family.add_sample("gateway_workers_unscraped", {}, unscraped)
    families["gateway_workers"] = workers_family
    return generate_latest(_Families(families.values()))  # type: ignore[arg-type]


class _Families:
    """What ``generate_latest`` needs of a registry: metric families to collect."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
