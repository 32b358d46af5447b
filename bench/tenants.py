"""Per-tenant figures of a replay whose requests name their tenant (``x-gateway-inference-fairness-id``),
one line per flow (a tenant's requests that name a priority band are told apart by it, ``team@10``):
each one's latency, what it got done within the trace's window, and its share of the tokens served,
weighted as flow control weighs them (the Virtual Token Counter's: an output token twice a prompt token, a
cached prompt token a tenth; :class:`gateway.config.TokenWeightsConfig`).

Owner: nothing with a lifetime: figures from a replay's outcomes, measured on the client.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

from bench.workloads import Trace, tenant_of
from gateway.config import TokenWeightsConfig


class Outcome(Protocol):
    """What this module reads of one replayed request (the runner's ``Outcome``, without importing it)."""

    session: int
    step: int
    status: int
    sent_at: float
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int | None  # None where the answer does not say: counted as none cached
    completion_tokens: int

WEIGHTS = TokenWeightsConfig()


def weighted_tokens(prompt: int, cached: int, output: int, weights: TokenWeightsConfig = WEIGHTS) -> float:
    return (prompt - cached) * weights.input + cached * weights.cached_input + output * weights.output


def tenant_stats(trace: Trace, outcomes: list[Outcome], window_s: float) -> dict[str, dict[str, float]]:
    """Per tenant: requests sent, answered and refused (429); TTFT p50/p90 of the answered ones; requests
    answered within ``window_s`` of the first request and their rate; tokens served (prompt, cached,
    output) and the tenant's share of all weighted tokens, over the whole run and within the window (while
    every tenant still sends: the share that fairness is judged by). Empty when no request names a tenant."""
    by_tenant: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        tenant = tenant_of(trace.sessions[o.session].steps[o.step])
        if tenant:
            by_tenant[tenant].append(o)
    if not by_tenant or not outcomes:
        return {}
    start = min(o.sent_at for o in outcomes)
    stats: dict[str, dict[str, float]] = {}
    for tenant, mine in sorted(by_tenant.items()):
        ok = [o for o in mine if o.status == 200]
        ttft = sorted(o.ttft_s * 1000 for o in ok)
        ended_in_window = [o for o in ok if o.sent_at + o.e2e_s - start <= window_s]
        in_window = len(ended_in_window)
        stats[tenant] = {
            "sent": len(mine), "answered": len(ok), "rejected": sum(1 for o in mine if o.status == 429),
            "errors": sum(1 for o in mine if o.status not in (200, 429)),
            "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p90_ms": _pct(ttft, 0.9),
            "answered_in_window": in_window, "req_per_s_in_window": round(in_window / window_s, 3) if window_s else 0.0,
            "prompt_tokens": sum(o.prompt_tokens for o in ok), "cached_tokens": sum(o.cached_tokens or 0 for o in ok),
            "output_tokens": sum(o.completion_tokens for o in ok),
            "weighted_tokens": round(sum(map(_weighted, ok)), 1),
            "weighted_tokens_in_window": round(sum(map(_weighted, ended_in_window)), 1),
        }
    for field, share in (("weighted_tokens", "token_share"), ("weighted_tokens_in_window", "window_token_share")):
        total = sum(s[field] for s in stats.values())
        for s in stats.values():
            s[share] = round(s[field] / total, 4) if total else 0.0
    return stats


def _weighted(o: Outcome) -> float:
    return weighted_tokens(o.prompt_tokens, o.cached_tokens or 0, o.completion_tokens)


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` as the runner reads its own, 0 when there are none."""
    if not values:
        return 0.0
    return round(values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))], 1)


def tenant_table(rows: list[tuple[str, str, dict[str, dict[str, float]]]]) -> str:
    """A Markdown table, one line per (scenario, contender, tenant)."""
    lines = ["| scenario | contender | tenant | sent | answered | 429 | TTFT p50 ms | TTFT p90 ms | answered in window "
             "| weighted tokens | share | share in window |", "|---|---|---" + "|---:" * 9 + "|"]
    for scenario, contender, tenants in rows:
        for tenant, s in tenants.items():
            lines.append(f"| {scenario} | {contender} | {tenant} | {s['sent']:.0f} | {s['answered']:.0f} | "
                         f"{s['rejected']:.0f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} | "
                         f"{s['answered_in_window']:.0f} | {s['weighted_tokens']:.0f} | {s['token_share']:.3f} | "
                         f"{s['window_token_share']:.3f} |")
    return "\n".join(lines) + "\n"
