"""The bench's per-tenant figures: flows told apart, window counts, and weighted-token shares."""

from __future__ import annotations

from bench.runner import Outcome
from bench.tenants import tenant_stats, weighted_tokens
from bench.workloads import noisy_neighbor, priority_bands, tenant_of


def test_a_requests_flow_is_its_tenant_and_the_band_it_names():
    trace = priority_bands(batch_sessions=1, batch_steps=1, interactive_sessions=1, interactive_steps=1)
    assert sorted({tenant_of(s.steps[0]) for s in trace.sessions}) == ["team@0", "team@10"]
    trace = noisy_neighbor(a_sessions=1, a_steps=1, b_sessions=1, b_steps=1)
    assert sorted({tenant_of(s.steps[0]) for s in trace.sessions}) == ["A", "B"]


def test_weighted_tokens_discount_cached_prompt_and_double_output():
    assert weighted_tokens(prompt=1000, cached=500, output=10) == 500 + 500 * 0.1 + 10 * 2


def test_each_tenant_gets_its_counts_latency_window_and_share():
    trace = noisy_neighbor(a_sessions=1, a_steps=2, b_sessions=1, b_steps=2)
    a, b = (next(i for i, s in enumerate(trace.sessions) if s.id.startswith(t)) for t in "AB")
    outcomes = [
        Outcome(200, ttft_s=1.0, e2e_s=2.0, sent_at=0.0, session=a, step=0, prompt_tokens=3000, completion_tokens=10),
        Outcome(429, sent_at=0.5, session=a, step=1),
        Outcome(200, ttft_s=0.1, e2e_s=0.2, sent_at=0.0, session=b, step=0, prompt_tokens=100, cached_tokens=50,
                completion_tokens=10),
        Outcome(200, ttft_s=0.3, e2e_s=0.5, sent_at=9.0, session=b, step=1, prompt_tokens=100, completion_tokens=10),
    ]
    stats = tenant_stats(trace, outcomes, window_s=5.0)
    assert stats["A"]["answered"] == 1 and stats["A"]["rejected"] == 1 and stats["A"]["errors"] == 0
    assert stats["B"]["answered"] == 2 and stats["B"]["answered_in_window"] == 1  # the second ends at 9.5 s
    assert stats["B"]["ttft_p50_ms"] == 300.0 and stats["B"]["ttft_p90_ms"] == 300.0
    a_tokens, b_tokens = 3000 + 20, (50 + 5 + 20) + (100 + 20)
    assert stats["A"]["weighted_tokens"] == a_tokens and stats["B"]["weighted_tokens"] == b_tokens
    assert stats["B"]["token_share"] == round(b_tokens / (a_tokens + b_tokens), 4)
    # Within the window: A's one answer (ended at 2 s) and B's first (0.2 s); B's second ended after it.
    b_in_window = 50 + 5 + 20
    assert stats["B"]["weighted_tokens_in_window"] == b_in_window
    assert stats["B"]["window_token_share"] == round(b_in_window / (a_tokens + b_in_window), 4)
