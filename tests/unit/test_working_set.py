"""The resumable working set: protection windows from each context's own think time, distinct blocks,
growth forecasts, anonymous continuations, release and lapse."""

from __future__ import annotations

import random

import pytest

from gateway.config import PlacementConfig, load_config
from gateway.kv.contexts import Context, shared_blocks
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import Dispatch, InFlightLedger

BS = 16


class Requests:
    """A working set driven as the request pipeline drives it: a request is counted in the ledger, then its
    context held; when it ends, the ledger forgets it, then its context is idled."""

    def __init__(self, **overrides: float) -> None:
        self.ledger = InFlightLedger()
        self.ws = ResumableWorkingSet(PlacementConfig(**{"default_think_s": 1.0, "protect_margin": 2.0,
                                                         "min_protect_s": 0.5, "default_stages": 4, **overrides}),
                                      self.ledger)
        self._running: dict[str, list[Dispatch]] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.ws, name)

    def hold(self, key: str | None, pod: str, block_size: int, hashes: list[int], tokens: int, now: float) -> Context:
        """A request of ``key`` (None: whatever conversation its prompt continues) dispatched to ``pod``."""
        keyed = key is not None
        if key is None:
            continued = self.ws.continued(hashes)
            key = continued.key if continued is not None else self.ws.anonymous_key()
        self._running.setdefault(key, []).append(self.ledger.dispatch("r", pod, 0.1, "chat", context=key))
        return self.ws.hold(key, keyed, pod, block_size, hashes, tokens, now)

    def idle(self, context: Context, now: float) -> None:
        """That request ended."""
        self.ledger.finish(self._running[context.key].pop())
        self.ws.idle(context.key, now)


def ws(**overrides: float) -> Requests:
    return Requests(**overrides)


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


def test_a_grown_prompt_recounts_only_its_new_blocks_and_the_counts_stay_exact():
    """A context held again on the same pod keeps the blocks its prompts share (found by their chained
    hashes) and recounts the rest: growing, rewriting its tail, moving, sharing blocks with others."""
    rng = random.Random(7)

    def chained(tokens: list[int]) -> list[int]:
        return [hash(tuple(tokens[: (i + 1) * 4])) for i in range(len(tokens) // 4)]

    s = ws(max_contexts=1000)
    prompts: dict[str, list[int]] = {}
    where: dict[str, str] = {}
    for _ in range(400):
        key = f"workflow:{rng.randrange(6)}"
        tokens = prompts.get(key, [rng.randrange(3) for _ in range(8)])  # a few shared openings
        if rng.random() < 0.2:
            tokens = tokens[: rng.randrange(len(tokens) + 1)]  # the tail rewritten
        tokens = tokens + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        prompts[key], where[key] = tokens, rng.choice(["p0", "p0", "p1"])
        s.idle(s.hold(key, where[key], BS, chained(tokens), len(tokens), now=0.0), now=0.0)
        for pod in ("p0", "p1"):
            expected = {h for k, t in prompts.items() if where[k] == pod for h in chained(t)}
            assert s.debug([pod], lambda _: None, now=0.0)["pods"][pod]["distinct_blocks"] == len(expected)
            for k in (k for k in prompts if where[k] == pod):  # a context's exclusive share, by bisection
                others = {h for o, t in prompts.items() if where[o] == pod and o != k for h in chained(t)}
                exclusive = sum(1 for h in chained(prompts[k]) if h not in others)
                ctx = s.context(k)
                assert s.demand_tokens(pod, 0.0, exclude=ctx) == pytest.approx(
                    s.demand_tokens(pod, 0.0) - exclusive * BS - ctx.expected_growth)
    for key in prompts:
        assert s.release(key)
    assert all(s.debug([pod], lambda _: None, now=0)["pods"][pod]["distinct_blocks"] == 0 for pod in ("p0", "p1"))


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
    assert s.continued([1, 2, 3, 4, 5]) is first  # the next turn extends the last prompt
    assert s.continued([1, 2, 9]) is None  # a sibling that shares a prefix is someone else
    again = s.hold(None, "p0", BS, [1, 2, 3, 4, 5], 80, now=1.0)
    assert again is first and again.stages == 2 and not again.keyed
    assert s.resumable("p0") == (0, 0)  # anonymous contexts are demand, not load


def test_idle_contexts_oldest_first_and_the_bound():
    s = ws(max_contexts=2, default_think_s=100.0)  # nothing lapses here: only the bound forgets
    for i, key in enumerate(("workflow:old", "workflow:new")):
        s.idle(s.hold(key, "p0", BS, [i], 16, now=float(i)), now=float(i) + 0.1)
    busy = s.hold("workflow:busy", "p0", BS, [7], 16, now=3.0)
    assert [c.key for c in s.idle_on("p0")] == ["workflow:new"]  # "old" went over the bound
    assert s.size == 2 and s.ledger.of_context(busy.key) == 1
    # The newcomer is never the one forgotten, and the pod's counts follow what is live.
    assert s.context("workflow:busy") is busy and s.lapsed == 0 and s.evicted == 1
    assert s.resumable("p0") == (2, 1) and s.demand_tokens("p0", now=3.0) == 2 * BS


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="protect"):  # a declared constraint, checked as the config is read
        load_config(overrides={"placement": {"protect_margin": 0}}, environ={})


def test_shared_blocks_is_the_common_prefix_of_chained_hashes():
    assert shared_blocks([1, 2, 3], [1, 2, 3, 4]) == 3
    assert shared_blocks([1, 2, 3, 4], [1, 2]) == 2
    assert shared_blocks([1, 2, 3], [1, 9, 10]) == 1
    assert shared_blocks([1], [2]) == 0 and shared_blocks([], [1]) == 0


def test_the_ledger_is_the_one_count_a_context_runs_until_its_last_request_ends():
    s = ws()
    first = s.hold("workflow:a", "p0", BS, [1], 16, now=0.0)
    s.hold("workflow:a", "p0", BS, [1, 2], 32, now=0.5)  # a second request of it, in parallel
    s.idle(first, now=1.0)
    assert s.ledger.of_context(first.key) == 1 and not first.thinking and s.resumable("p0") == (1, 0)
    s.idle(first, now=2.0)
    assert s.ledger.of_context(first.key) == 0 and first.thinking and first.last_finish == 2.0
    assert s.resumable("p0") == (1, 1)


def test_a_request_elsewhere_keeps_a_context_running_until_its_process_is_gone():
    from gateway.core.facts import OwnersChanged

    s = ws()
    ctx = s.hold("workflow:a", "p0", BS, [1], 16, now=0.0)
    s.ledger.apply_remote("replica-b/w0/1", OwnersChanged([["context", "workflow:a"]], 1))
    s.idle(ctx, now=1.0)
    assert not ctx.thinking  # the other replica's request still runs
    s.ledger.forget_origin("replica-b/w0/1")  # it went silent: its requests no longer count
    s.settle(now=7.0)
    assert ctx.thinking and ctx.last_finish == 7.0 and s.resumable("p0") == (1, 1)


def test_a_thinking_context_does_not_lapse_while_a_request_of_it_runs_elsewhere():
    from gateway.core.facts import OwnersChanged

    s = ws()
    ctx = s.hold("workflow:a", "p0", BS, [1], 16, now=0.0)
    s.idle(ctx, now=1.0)
    assert ctx.thinking
    # Another replica (whose contexts are not shared with this one) sends the workflow's next stage.
    s.ledger.apply_remote("replica-b/w0/1", OwnersChanged([["context", "workflow:a"]], 1))
    s.lapse(now=1000.0)
    assert s.context("workflow:a") is ctx and s.lapsed == 0  # kept: it is not done
    s.ledger.apply_remote("replica-b/w0/1", OwnersChanged([["context", "workflow:a"]], -1))
    s.lapse(now=1000.0 + ctx.protected_until)
    assert s.context("workflow:a") is None and s.lapsed == 1
