"""Key and tenant limits: the sliding windows every process shares, the share a partitioned replica keeps,
and which request is refused, why and for how long."""

from __future__ import annotations

import pytest

from gateway.config import LimitsConfig, UsageLimits
from gateway.core.errors import GatewayError
from gateway.core.facts import Fact, ScopeRequests, UsageCharged, UsageSnapshot
from gateway.limits.enforcer import KeyLimits
from gateway.limits.shared import SharedUsage


class Clock:
    def __init__(self, now: float = 6_000_000.0) -> None:  # a minute's start (and a day's 40th minute)
        self.now = now

    def __call__(self) -> float:
        return self.now


def usage(clock: Clock, origin: str = "ra/w0/1", sent: list[Fact] | None = None) -> SharedUsage:
    return SharedUsage(origin, sent.append if sent is not None else lambda fact: None, clock=clock, monotonic=clock)


def test_a_minute_slides_the_previous_one_out_as_it_goes():
    clock = Clock()
    shared = usage(clock)
    shared.charge("key:a", 600, 60)
    assert shared.used("key:a").input_minute == 600 and shared.used("key:a").output_day == 60
    clock.now += 60  # the next minute begins: all of the last one is still inside the last 60 s
    assert shared.used("key:a").input_minute == 600
    clock.now += 15  # a quarter of the way: three quarters of it left
    shared.charge("key:a", 100, 0)
    assert shared.used("key:a").input_minute == pytest.approx(450 + 100)
    clock.now += 60
    assert shared.used("key:a").input_minute == pytest.approx(75)  # 100, a quarter gone
    assert shared.used("key:a").input_day == 700  # the day has it all


def test_every_process_counts_the_others_and_a_snapshot_repairs_a_lost_batch():
    clock, sent = Clock(), []
    one, other = usage(clock, "ra/w0/1", sent=sent), usage(clock, "ra/w1/2")
    one.charge("key:a", 500, 10)
    one.began("key:a")
    for fact in sent[:1]:  # the began is lost in transit
        other.apply_remote("ra/w0/1", fact)
    assert other.used("key:a").input_minute == 500 and other.used("key:a").in_flight == 0
    other.apply_remote("ra/w0/1", one.snapshot())
    assert other.used("key:a").input_minute == 500 and other.used("key:a").in_flight == 1
    other.forget_origin("ra/w0/1")  # gone silent: its requests are not in flight, its tokens stay served
    assert other.used("key:a").in_flight == 0 and other.used("key:a").input_minute == 500
    assert isinstance(sent[0], UsageCharged) and isinstance(sent[1], ScopeRequests)
    assert isinstance(one.snapshot(), UsageSnapshot)


def test_a_replica_cut_off_from_the_others_enforces_its_share_on_its_own_use():
    clock = Clock()
    cut = [False]
    shared = SharedUsage("ra/w0/1", partitioned=lambda: cut[0], clock=clock, monotonic=clock)
    shared.apply_remote("rb/w0/9", UsageCharged("key:a", int(clock.now // 60), 900, 0))  # the other replica
    shared.apply_remote("ra/w1/3", UsageCharged("key:a", int(clock.now // 60), 100, 0))  # a sibling worker
    assert shared.share() == 1.0 and shared.used("key:a").input_minute == 1000
    cut[0] = True
    assert shared.share() == 0.5  # two replicas were seen; the link is down
    assert shared.used("key:a").input_minute == 100  # its own replica's use only


def test_a_charge_stays_unconfirmed_as_long_as_the_others_take_to_hear_of_one():
    """Charges count as unconfirmed for ``confirm_s`` (50 ms), or twice the longest the others' charges took
    to arrive over the last 5 s, at most 2 s; a charge that does not say when it was sent teaches nothing."""
    clock, sent = Clock(), []
    one, other = usage(clock, "ra/w0/1", sent=sent), usage(clock, "ra/w1/2")
    minute = int(clock.now // 60)
    assert one.confirm_window_s() == 0.05
    one.apply_remote("ra/w1/2", UsageCharged("key:a", minute, 10, 0))  # an older peer: no time sent
    assert one.confirm_window_s() == 0.05
    one.apply_remote("ra/w1/2", UsageCharged("key:a", minute, 10, 0, clock.now - 0.3))  # heard 0.3 s late
    one.apply_remote("ra/w1/2", UsageCharged("key:a", minute, 10, 0, clock.now - 0.1))
    assert one.confirm_window_s() == pytest.approx(0.6)
    one.charge("key:a", 500, 0)
    clock.now += 0.1
    other.apply_remote("ra/w0/1", sent[-1])  # what this process sends says when: the others learn from it
    assert isinstance(sent[-1], UsageCharged) and other.confirm_window_s() == pytest.approx(0.2)
    clock.now += 0.4
    assert one.used("key:a").unconfirmed_input == 500  # the others may still not know it
    clock.now += 0.2
    assert one.used("key:a").unconfirmed_input == 0
    clock.now += 5  # the late ones are out of the window: back to the floor
    assert one.confirm_window_s() == 0.05
    one.apply_remote("ra/w1/2", UsageCharged("key:a", minute, 10, 0, clock.now - 30))  # a clock far off
    assert one.confirm_window_s() == 2.0


def test_a_stall_of_the_loop_keeps_what_was_charged_before_it_unconfirmed():
    """A paused machine pauses every process: what this one charged just before is no better known to the
    others after 1.5 s of standing still, so its window grows by the stall while the stall is recent."""
    clock, stall = Clock(), [0.0]
    one = SharedUsage("ra/w0/1", clock=clock, monotonic=clock, stalled=lambda within_s: stall[0])
    one.charge("key:a", 500, 0, requests=1)
    clock.now += 1.5  # the loop stood still: nothing was sent or heard meanwhile
    stall[0] = 1.5
    assert one.confirm_window_s() == pytest.approx(1.55)
    used = one.used("key:a")
    assert (used.unconfirmed_input, used.unconfirmed_requests) == (500, 1)
    stall[0] = 0.0  # the stall is out of the window: the charges have had their time
    used = one.used("key:a")
    assert (used.unconfirmed_input, used.unconfirmed_requests) == (0, 0)


def limits(keys=None, tenants=None, tenant_of=lambda key: "team", clock=None, cut=None):
    clock = clock or Clock()
    config = LimitsConfig(keys={k: UsageLimits(**v) for k, v in (keys or {}).items()},
                          tenants={t: UsageLimits(**v) for t, v in (tenants or {}).items()})
    shared = SharedUsage("ra/w0/1", partitioned=lambda: bool(cut and cut[0]), clock=clock, monotonic=clock)
    return KeyLimits(config, shared, tenant_of), clock


def refused(limiter: KeyLimits, key: str, prompt: int, output: int = 0) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        limiter.admit(key, prompt, output)
    return caught.value


def test_input_tokens_per_minute_refuse_what_would_pass_the_limit_until_it_slides_out():
    limiter, clock = limits({"alice": {"input_tokens_per_minute": 1000}})
    first = limiter.admit("alice", 700, 0)
    assert first is not None and first.scopes == ("key:alice",)
    error = refused(limiter, "alice", 400)
    # 100 over, all in this minute: it stays whole to the minute's end, then 100 of 700 slide out in 9 s.
    assert error.code == "token_limit_exceeded" and error.retry_after_s == 69
    assert limiter.admit("alice", 300, 0) is not None  # exactly up to it
    clock.now += 60 + 30  # half of that minute left in the window: 500
    assert limiter.admit("alice", 500, 0) is not None
    assert refused(limiter, "alice", 1).code == "token_limit_exceeded"
    assert limiter.admit("bob", 10**6, 0) is None  # no limits for bob


def test_an_empty_window_takes_one_request_of_any_size():
    limiter, _ = limits({"alice": {"input_tokens_per_minute": 100}})
    assert limiter.admit("alice", 5000, 0) is not None
    assert refused(limiter, "alice", 1).retry_after_s == 119  # the next minute, and all but 99 of its slide


def test_output_is_charged_what_may_be_generated_then_what_was():
    limiter, _ = limits({"alice": {"output_tokens_per_minute": 100}})
    admission = limiter.admit("alice", 10, 100)
    assert refused(limiter, "alice", 10).code == "token_limit_exceeded"  # its max_tokens, reserved
    limiter.finish(admission, 10, 20)  # it generated 20
    assert limiter.admit("alice", 10, 50) is not None and limiter.usage.used("key:alice").output_minute == 70


def test_concurrency_per_key_and_per_tenant():
    tenants = {"alice": "team", "bob": "team", "carol": "other"}
    limiter, _ = limits({"alice": {"max_concurrent": 2}}, {"team": {"max_concurrent": 3}},
                        tenant_of=tenants.__getitem__)
    held = [limiter.admit("alice", 1, 1), limiter.admit("alice", 1, 1)]
    assert refused(limiter, "alice", 1).code == "concurrency_limit_exceeded"
    held.append(limiter.admit("bob", 1, 1))
    error = refused(limiter, "bob", 1)
    assert "tenant team" in error.message and error.retry_after_s == 1
    assert limiter.admit("carol", 1, 1) is None
    limiter.finish(held[0], 1, 1)
    assert limiter.admit("bob", 1, 1) is not None


def test_a_partitioned_replica_holds_half_of_each_limit():
    cut = [False]
    limiter, _ = limits({"alice": {"input_tokens_per_minute": 1000, "max_concurrent": 4}}, cut=cut)
    limiter.usage.apply_remote("rb/w0/9", ScopeRequests("key:bob", 1))  # another replica is heard
    first = limiter.admit("alice", 1, 0)
    assert first is not None and limiter.usage.share() == 1.0
    limiter.finish(first, 1, 0)
    cut[0] = True  # then no more
    assert limiter.admit("alice", 399, 0) is not None
    assert refused(limiter, "alice", 200).code == "token_limit_exceeded"  # 600 > 500
    limiter.admit("alice", 100, 0)
    assert refused(limiter, "alice", 0).code == "concurrency_limit_exceeded"  # 2 of its 4 at once


def test_a_request_that_ends_in_the_next_minute_takes_its_charge_back_from_the_minute_it_was_made_in():
    """Charged its max_tokens at 50 s into a minute, it generated 10 by 10 s into the next: the window holds
    10, not the next minute's share of a correction for tokens the previous minute no longer weighs in full
    (a negative use the key could then spend again)."""
    limiter, clock = limits({"alice": {"output_tokens_per_minute": 1000}})
    clock.now += 50
    admission = limiter.admit("alice", 10, 1000)
    clock.now += 20
    limiter.finish(admission, 10, 10)
    assert limiter.usage.used("key:alice").output_minute == pytest.approx(10)
    clock.now += 30
    assert limiter.usage.used("key:alice").output_minute == pytest.approx(10)
    limiter.admit("alice", 10, 1000)
    assert refused(limiter, "alice", 10).code == "token_limit_exceeded"  # 1010 of 1000 held


def test_a_request_that_ends_in_the_next_day_is_not_a_credit_on_it():
    limiter, clock = limits({"alice": {"output_tokens_per_day": 5000}})
    clock.now = (clock.now // 86_400 + 1) * 86_400 - 5  # 5 s before midnight
    admission = limiter.admit("alice", 10, 4000)
    clock.now += 10
    limiter.finish(admission, 10, 100)
    clock.now += 43_200  # half of the next day gone
    assert limiter.usage.used("key:alice").output_day == pytest.approx(100)


def test_a_request_rate_under_one_a_minute_lets_one_request_through_then_asks_to_wait_its_interval():
    """A key's own ``requests_per_minute`` (auth) is its key scope's request limit, kept under the key's name
    or, without one, under the start of its digest."""
    from gateway.config import ApiKeyConfig, hash_api_key
    from gateway.limits.enforcer import limited_name

    unnamed = ApiKeyConfig(hash=hash_api_key("sk-slow"), requests_per_minute=0.5)
    name = limited_name(unnamed)
    assert name.startswith("#") and name == limited_name(ApiKeyConfig(hash=hash_api_key("sk-slow")))
    clock = Clock()
    limiter = KeyLimits(LimitsConfig(), usage(clock), lambda key: key, {name: 0.5})
    assert limiter.admit(name, 10, 10) is not None  # one request: this one may go
    error = refused(limiter, name, 10)
    assert error.code == "rate_limit_exceeded" and 60 <= error.retry_after_s <= 120
    assert "0.5 requests per minute" in error.message
    clock.now += 120
    assert limiter.admit(name, 10, 10) is not None  # slid out


def test_requests_per_minute_hold_across_processes_and_a_config_limit_wins_over_the_keys_own():
    clock, sent = Clock(), []
    one = KeyLimits(LimitsConfig(keys={"alice": UsageLimits(requests_per_minute=10)},
                                 tenants={"team": UsageLimits(requests_per_minute=15)}),
                    usage(clock, "ra/w0/1", sent), lambda key: "team", {"alice": 1000, "bob": 1000})
    other = usage(clock, "rb/w0/2")
    for _ in range(10):
        one.admit("alice", 1, 1)
        clock.now += 1  # each confirmed before the next
    error = refused(one, "alice", 1)
    assert error.code == "rate_limit_exceeded" and "10 requests per minute" in error.message
    for _ in range(5):
        one.admit("bob", 1, 1)
    assert "tenant team" in refused(one, "bob", 1).message  # 15 of the tenant's
    for fact in sent:
        other.apply_remote("ra/w0/1", fact)
    assert other.used("key:alice").requests_minute == 10 and other.used("tenant:team").requests_minute == 15
    other.apply_remote("ra/w0/1", one.usage.snapshot())  # a snapshot carries the requests too
    assert other.used("key:alice").requests_minute == 10


def test_requests_begun_lately_take_at_most_this_process_s_part_of_the_rate():
    limiter, _ = limits({"alice": {"requests_per_minute": 20}})
    limiter.usage.apply_remote("ra/w1/2", ScopeRequests("key:x", 1))  # a sibling shares the limit
    for _ in range(10):
        limiter.admit("alice", 1, 1)  # all within the window the sibling may not have heard of
    assert refused(limiter, "alice", 1).code == "rate_limit_exceeded"


def test_a_client_sending_one_request_at_a_time_is_never_refused_for_concurrency():
    """Requests that ended are in flight nowhere, however recently they began (counting them refused 45 of a
    sequential client's 100 requests on two workers)."""
    limiter, _ = limits({"alice": {"max_concurrent": 4}})
    for sibling in ("ra/w1/2", "rb/w0/3", "rb/w1/4"):
        limiter.usage.apply_remote(sibling, ScopeRequests("key:x", 1))
    for _ in range(100):
        admission = limiter.admit("alice", 1, 1)  # all within the confirmation window
        limiter.finish(admission, 1, 1)
    held = [limiter.admit("alice", 1, 1)]
    assert refused(limiter, "alice", 1).code == "concurrency_limit_exceeded"  # its part of 4 over 4 processes
    limiter.finish(held[0], 1, 1)
    assert limiter.admit("alice", 1, 1) is not None


@pytest.mark.parametrize("into_s, earlier, now",
                         [(10, 0, 700), (40, 900, 500), (50, 600, 700), (5, 950, 0), (30, 0, 5000)])
def test_retry_after_is_when_the_request_fits(into_s, earlier, now):
    """The previous minute's use slides out by the current minute's end, the current one's only after it: a
    client that waits its Retry-After is let in, and not a second sooner."""
    limiter, clock = limits({"alice": {"input_tokens_per_minute": 1000}})
    clock.now -= 60
    if earlier:
        limiter.admit("alice", earlier, 0)
    clock.now += 60 + into_s
    if now:
        limiter.admit("alice", now, 0)
    start = clock.now
    wait = refused(limiter, "alice", 400).retry_after_s
    clock.now = start + wait - 1.01
    assert refused(limiter, "alice", 400).code == "token_limit_exceeded"
    clock.now = start + wait
    assert limiter.admit("alice", 400, 0) is not None
