"""``prefix``: the share of the prompt cached on each pod, from the request's prefix match."""

from __future__ import annotations

import msgspec

from gateway.plugin_api import NO_NEEDS, Needs, PluginSpec, Pod, PolicyContext, RoutingRequest
from plugins.routing.preparers.prefix_match import PrefixMatcher

# The defaults every cache-aware scorer and policy shares, written once here.
# An offloaded block (CPU tier) counts this much of a GPU one.
OFFLOAD_WEIGHT = 0.5
# Approximate matches (untokenizable requests, a pod whose event stream broke) count this much.
APPROXIMATE_WEIGHT = 0.7


class PrefixScorer:
    """Share of the prompt cached on each pod, from the request's prefix match."""

    name = "prefix"
    needs: Needs = NO_NEEDS  # its matcher, given where it is built (``build`` here, the placement scorer)

    def __init__(self, *, offload_weight: float = OFFLOAD_WEIGHT, approximate_weight: float = APPROXIMATE_WEIGHT
                 ) -> None:
        self._offload_weight = offload_weight
        self._approximate_weight = approximate_weight

    def score(self, request: RoutingRequest, pods: list[Pod]) -> list[float]:
        match = request.prefix
        if match is None:
            return [0.0] * len(pods)
        if match.precise:
            n = len(request.token_ids or ())
            out = []
            for pod in pods:
                m = match.pods[pod.name]
                tokens = m.gpu_tokens + self._offload_weight * m.offload_tokens
                out.append(tokens / n * (self._approximate_weight if m.approximate else 1.0))
            return out
        return [match.chars[p.name] / len(match.text) * self._approximate_weight for p in pods]


def prefix_parts(context: PolicyContext, *, precise: bool = True, offload_weight: float = OFFLOAD_WEIGHT,
                 approximate_weight: float = APPROXIMATE_WEIGHT) -> tuple[PrefixMatcher, PrefixScorer]:
    """The matcher and scorer every cache-aware scorer builds the same way, on the gateway's indexes."""
    matcher = PrefixMatcher(context.index if precise else None, context.approximate, context.metrics.lookup_seconds)
    return matcher, PrefixScorer(offload_weight=offload_weight, approximate_weight=approximate_weight)


class PrefixOptions(msgspec.Struct, forbid_unknown_fields=True):
    offload_weight: float = OFFLOAD_WEIGHT
    approximate_weight: float = APPROXIMATE_WEIGHT
    # True: match the prompt's tokens against the pods' KV events (the prompt is tokenized first);
    # false: its text against the gateway's own routing history.
    precise: bool = True


def build(context: PolicyContext, o: PrefixOptions) -> PrefixScorer:
    matcher, scorer = prefix_parts(context, precise=o.precise, offload_weight=o.offload_weight,
                                   approximate_weight=o.approximate_weight)
    scorer.needs = Needs(preparers=(matcher,), tokens=o.precise)
    return scorer


PLUGIN = PluginSpec(PrefixOptions, build)
