"""Usage per API key, tenant and public model: requests, input, cached input and output tokens, from the
engine's own usage in each answer (``gateway_usage_requests_total``, ``gateway_usage_tokens_total{kind}``,
and ``/debug/usage``).

Owner: :class:`UsageTally` owns this process's tallies (plain counts, read when metrics are scraped, so that
a request costs no metric lock); ``/metrics`` sums every worker's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

TOKEN_KINDS = ("input", "cached_input", "output")


class UsageTally:
    def __init__(self, registry: CollectorRegistry) -> None:
        # (key, tenant, model) → [requests, input, cached input, output]
        self._tallies: dict[tuple[str, str, str], list[int]] = {}
        registry.register(self)

    def add(self, key: str, tenant: str, model: str, input_tokens: int, cached_tokens: int,
            output_tokens: int) -> None:
        tally = self._tallies.get((key, tenant, model))
        if tally is None:
            tally = self._tallies[(key, tenant, model)] = [0, 0, 0, 0]
        tally[0] += 1
        tally[1] += input_tokens
        tally[2] += cached_tokens
        tally[3] += output_tokens

    def collect(self) -> Iterator[CounterMetricFamily]:
        requests = CounterMetricFamily("gateway_usage_requests", "Requests by API key (its name; - for none), "
                                       "its tenant and the public model asked for", labels=["key", "tenant", "model"])
        tokens = CounterMetricFamily("gateway_usage_tokens", "Tokens by API key, tenant, public model and kind: "
                                     "input (the prompt, cached included), cached_input, output; from the engine's "
                                     "usage", labels=["key", "tenant", "model", "kind"])
        for labels, tally in list(self._tallies.items()):
            requests.add_metric(list(labels), tally[0])
            for kind, value in zip(TOKEN_KINDS, tally[1:], strict=True):
                tokens.add_metric([*labels, kind], value)
        yield requests
        yield tokens

    def debug(self) -> list[dict[str, Any]]:
        return [{"key": key, "tenant": tenant, "model": model, "requests": t[0], "input_tokens": t[1],
                 "cached_input_tokens": t[2], "output_tokens": t[3]}
                for (key, tenant, model), t in sorted(self._tallies.items())]
