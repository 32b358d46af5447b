"""The resumable working set: protection windows from each context's own think time, distinct blocks,
growth forecasts, anonymous continuations, release and lapse."""

from __future__ import annotations

import pytest

from gateway.config import PlacementConfig
from gateway.kv.working_set import ResumableWorkingSet

BS = 16


def ws(**overrides: float) -> ResumableWorkingSet:
    return ResumableWorkingSet(PlacementConfig(**{"default_think_s": 1.0, "protect_margin": 2.0,
                                                  "min_protect_s": 0.5, "default_stages": 4, **overrides}))


def test_a_context_is_resumable_while_running_and_for_its_predicted_think_time():
    s = ws()
    ctx = s.hold("workflow:a", "p0", BS, [1, 2, 3], 48, now=0.0)
    assert s.demand_tokens("p0", now=100.0) == 3 * BS  # in flight: never lapses
    s.idle(ctx, now=10.0)
    assert s.resumable("p0") == (1, 1)
    assert s.demand_tokens("p0", now=11.9) == 3 * BS  # default think 1 s x margin 2
    assert s.demand_tokens("p0", now=12.1) == 0
    assert s.context("workflow:a") is None and s.lapsed == 1 and s.resumable("p0") == (0, 0)


def test_protection_follows_the_contexts_own_think_time():
    s = ws()
    ctx = s.hold("workflow:a", "p0", BS, [1], 16, now=0.0)
    s.idle(ctx, now=1.0)  # no history yet: default 1 s x margin 2
    ctx = s.hold("workflow:a", "p0", BS, [1, 2], 32, now=1.5)  # it came back after 0.5 s
    assert ctx.stages == 2 and ctx.think.value == 0.5
    s.idle(ctx, now=2.0)
    assert s.demand_tokens("p0", now=2.9) == 2 * BS + 32  # 0.5 s x 2 now, not the default 2 s; +growth
    assert s.demand_tokens("p0", now=3.1) == 0


def test_shared_blocks_count_once_and_a_release_keeps_the_others():
    s = ws()
    a = s.hold("workflow:a", "p0", BS, [1, 2, 3, 4], 64, now=0.0)
    s.hold("workflow:b", "p0", BS, [1, 2, 5], 48, now=0.0)
    assert s.demand_tokens("p0", now=0.0) == 5 * BS
    # The request being placed leaves out its own exclusive blocks (3, 4), not the shared ones.
    assert s.demand_tokens("p0", now=0.0, exclude=a) == 3 * BS
    assert s.others_on("p0", "workflow:a", now=0.0) and not s.others_on("p1", "workflow:a", now=0.0)
    assert s.release("workflow:b")
    assert s.demand_tokens("p0", now=0.0) == 4 * BS and not s.others_on("p0", "workflow:a", now=0.0)


def test_a_stage_on_another_pod_moves_the_context():
    s = ws()
    ctx = s.hold("session:x", "p0", BS, [1, 2], 32, now=0.0)
    s.idle(ctx, now=0.1)
    moved = s.hold("session:x", "p1", BS, [1, 2, 3], 48, now=0.2)
    # Its blocks, and the growth it still expects (16 tokens a stage, 2 of 4 stages left), are on p1 only.
    assert moved.expected_growth == 32
    assert s.demand_tokens("p0", now=0.2) == 0 and s.demand_tokens("p1", now=0.2) == 3 * BS + 32
    assert s.resumable("p0") == (0, 0) and s.resumable("p1") == (1, 0)


def test_growth_is_forecast_from_increments_and_completed_stage_counts():
    s = ws(default_stages=4)
    assert s.forecast.expected_growth(None, keyed=True, stages_done=1) == 0  # nothing seen yet
    ctx = s.hold("workflow:a", "p0", BS, [1] * 0, 100, now=0.0)
    s.idle(ctx, now=0.1)
    ctx = s.hold("workflow:a", "p0", BS, [], 300, now=0.2)  # +200 tokens per stage
    assert ctx.growth.value == 200
    # 4 stages expected, 2 done: 2 more of 200 each, counted in the pod's demand.
    assert ctx.expected_growth == 400 and s.demand_tokens("p0", now=0.2) == 400
    assert s.forecast.expected_growth(None, keyed=True, stages_done=1) == 600  # a new workflow: 3 more stages
    assert s.forecast.expected_growth(None, keyed=False, stages_done=1) == 0  # a one-off request grows nothing
    s.idle(ctx, now=0.3)
    s.release("workflow:a", completed=True)  # it had 2 stages in all: the forecast learns it
    assert s.forecast.stages.value == 2
    assert s.forecast.expected_growth(None, keyed=True, stages_done=1) == 200


def test_an_anonymous_conversation_is_recognised_by_its_prefix():
    s = ws()
    first = s.hold(None, "p0", BS, [1, 2, 3], 48, now=0.0)
    s.idle(first, now=0.5)
    assert s.context(None, [1, 2, 3, 4, 5]) is first  # the next turn extends the last prompt
    assert s.context(None, [1, 2, 9]) is None  # a sibling that shares a prefix is someone else
    again = s.hold(None, "p0", BS, [1, 2, 3, 4, 5], 80, now=1.0)
    assert again is first and again.stages == 2 and not again.keyed
    assert s.resumable("p0") == (0, 0)  # anonymous contexts are demand, not load


def test_idle_contexts_oldest_first_and_the_bound():
    s = ws(max_contexts=2, default_think_s=100.0)  # nothing lapses here: only the bound forgets
    for i, key in enumerate(("workflow:old", "workflow:new")):
        s.idle(s.hold(key, "p0", BS, [i], 16, now=float(i)), now=float(i) + 0.1)
    busy = s.hold("workflow:busy", "p0", BS, [7], 16, now=3.0)
    assert [c.key for c in s.idle_on("p0")] == ["workflow:new"]  # "old" went over the bound
    assert s.size == 2 and busy.in_flight == 1
    # The newcomer is never the one forgotten, and the pod's counts follow what is live.
    assert s.context("workflow:busy") is busy and s.lapsed == 0 and s.evicted == 1
    assert s.resumable("p0") == (2, 1) and s.demand_tokens("p0", now=3.0) == 2 * BS


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="protect"):
        PlacementConfig(protect_margin=0)
