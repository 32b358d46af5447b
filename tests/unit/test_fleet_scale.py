"""A large fleet costs a request the candidates that matter, not every pod: the registry's kept candidates, the
router's shortlist, the health and scrape budgets, flow control's look for room."""

from __future__ import annotations

import random

from gateway.config import HealthConfig, PodConfig
from gateway.kv.events import BlockStored
from gateway.kv.index import PrefixIndex
from gateway.load.ledger import InFlightLedger
from gateway.plugin_registry import PluginRegistry
from gateway.pods.registry import PodRegistry
from gateway.pods.rotation import Rotation
from gateway.routing.policy import PolicyContext, RoutingRequest
from gateway.routing.router import Router
from tests.unit.test_routing import FakeClock

BS = 16


def fleet(n: int, clock: FakeClock | None = None) -> PodRegistry:
    pods = PodRegistry([PodConfig(url=f"http://p{i}:1", name=f"pod{i}", models=["m"]) for i in range(n)],
                       HealthConfig(ejection_base_s=10), **({"clock": clock} if clock else {}))
    for pod in pods.all():
        pod.healthy = True
    return pods


def test_the_candidates_are_kept_until_a_pod_changes_and_an_ejection_ends_on_time():
    clock = FakeClock()
    pods = fleet(3, clock)
    names = lambda: [p.name for p in pods.candidates("m")]  # noqa: E731
    assert names() == ["pod0", "pod1", "pod2"]
    pods.get("pod1").healthy = False
    assert names() == ["pod0", "pod2"]
    pods.report_connect_failure(pods.get("pod2"), "refused")  # ejected for 10 s
    assert names() == ["pod0"]
    clock.now += 10
    assert names() == ["pod0", "pod2"]  # back without anything else changing
    pods.get("pod0").set_models([{"id": "other"}])
    pods.add(PodConfig(url="http://p3:1", name="pod3", models=["m"])).healthy = True
    assert names() == ["pod2", "pod3"] and [p.name for p in pods.candidates("other")] == ["pod0"]
    pods.remove("pod3")
    assert names() == ["pod2"] and names() is not names()  # each caller gets a list of its own


def test_a_rotation_visits_every_pod_within_the_budget_busy_ones_every_round():
    pods = fleet(10).all()
    rotation = Rotation(per_s=8)
    assert rotation.due(pods[:3], round_s=1.0) == pods[:3]  # they fit: all of them, every round
    seen: list[set[str]] = []
    for _ in range(3):
        due = rotation.due(pods, round_s=0.5, first=lambda pod: pod.name == "pod7")
        assert len(due) == 4 and due[0].name == "pod7"  # 8 a second, rounds of half a second
        seen.append({p.name for p in due})
    assert set().union(*seen) == {p.name for p in pods}  # everyone within three rounds
    assert all("pod7" in s for s in seen)
    assert Rotation(per_s=0).due(pods, round_s=0.5) == pods  # no budget: every pod


def kv_fleet(n: int, max_candidates: int) -> tuple[Router, PrefixIndex, InFlightLedger]:
    pods = fleet(n)
    index = PrefixIndex(speculative_ttl_s=0)
    ledger = InFlightLedger()
    for i in range(n):
        index.view(f"pod{i}", 0, "m", BS)
    router = Router(pods, PluginRegistry("gateway.policies", "routing policy"), "kv_aware", {},
                    PolicyContext.standalone(pods, index=index, ledger=ledger), max_candidates)
    return router, index, ledger


def test_a_shortlist_finds_the_holder_among_a_thousand_pods_and_looks_at_no_more_than_its_limit():
    router, index, ledger = kv_fleet(1000, max_candidates=8)
    policy = router.resolve(None)
    rng = random.Random(3)
    system = [rng.randrange(100, 4000) for _ in range(20 * BS)]
    index.apply(index.view("pod737", 0, "m"), [BlockStored(list(range(1, 21)), None, system, BS)])
    for i in range(30):
        ids = [*system, *(rng.randrange(100, 4000) for _ in range(30))]
        decision = router.route(RoutingRequest(f"q{i}", "m", "chat", base_model="m", token_ids=ids), policy)
        assert decision.pod.name == "pod737" and decision.reason == "cache_hit"
        assert len(decision.scores) <= 8 and "pod737" in decision.scores
    # A prompt nobody holds goes to the least busy of a random sample (the power of d choices).
    for i in range(1000):
        if i % 3:
            ledger.dispatch(f"busy{i}", f"pod{i}", 0.1, "chat")
    chosen = router.route(RoutingRequest("new", "m", "chat", base_model="m", token_ids=list(range(100, 400))), policy)
    # (The sample is random: with two pods in three busy, it holds an idle one 96% of the time.)
    assert chosen.reason == "no_hit_least_loaded" and len(chosen.scores) <= 8
    assert ledger.on_pod(chosen.pod.name) == min(ledger.on_pod(pod) for pod in chosen.scores)


def test_a_pin_and_the_pods_with_room_are_always_on_the_shortlist_and_excluded_pods_never():
    router, _, _ = kv_fleet(200, max_candidates=4)
    policy = router.resolve(None)
    for i in range(20):
        request = RoutingRequest(f"q{i}", "m", "chat", base_model="m", token_ids=list(range(100, 300)),
                                 room=frozenset({"pod5", "pod6"}))
        decision = router.route(request, policy, exclude=frozenset({"pod6"}), pin="pod9", binding=False)
        assert {"pod9", "pod5"} <= set(decision.scores) and "pod6" not in decision.scores
        assert len(decision.scores) <= 4


def test_a_policy_that_only_picks_sees_every_pod():
    pods = fleet(40)
    router = Router(pods, PluginRegistry("gateway.policies", "routing policy"), "round_robin", {},
                    PolicyContext.standalone(pods), 8)
    policy = router.resolve(None)
    assert {router.route(RoutingRequest(f"q{i}", "m", "chat"), policy).pod.name for i in range(40)} == \
        {f"pod{i}" for i in range(40)}


def test_the_shortlist_always_holds_the_longest_cached_prefix_and_hits_as_much_as_looking_at_every_pod():
    """The hit ratio's parity with a full scan: 400 pods, 16 system prompts each whole on two pods and cut short
    on five more, every pod some requests in flight. Request by request, the pods looked at include one with the
    longest run any pod holds; the two routers may trade a block for load differently, so what they chose is
    compared in total."""
    rng = random.Random(11)
    systems = [[rng.randrange(100, 30000) for _ in range(12 * BS)] for _ in range(16)]
    routers = {limit: kv_fleet(400, max_candidates=limit) for limit in (16, 0)}
    every_pod = [f"pod{i}" for i in range(400)]
    for _, index, ledger in routers.values():
        fill, engine_hash = random.Random(5), iter(range(1, 10**9))
        for system in systems:
            for k, pod in enumerate(fill.sample(range(400), 7)):
                blocks = 12 if k < 2 else fill.randrange(1, 12)
                index.apply(index.view(f"pod{pod}", 0, "m"),
                            [BlockStored([next(engine_hash) for _ in range(blocks)], None, system[:blocks * BS], BS)])
        for i in range(400):
            for r in range(fill.randrange(3)):
                ledger.dispatch(f"r{i}-{r}", f"pod{i}", 0.1, "chat")
    chosen: dict[int, int] = {16: 0, 0: 0}
    for i in range(200):
        ids = [*rng.choice(systems)[: rng.randrange(4, 13) * BS], *(rng.randrange(100, 30000) for _ in range(20))]
        for limit, (router, index, _) in routers.items():
            decision = router.route(RoutingRequest(f"q{i}", "m", "chat", base_model="m", token_ids=ids),
                                    router.resolve(None))
            chosen[limit] += decision.prefix_tokens
            if limit:
                held = {pod: m.gpu_tokens for pod, m in index.lookup("m", None, ids, every_pod).items()}
                assert len(decision.scores) <= limit
                assert max(held.get(pod, 0) for pod in decision.scores) == max(held.values()) >= 4 * BS
    assert chosen[16] >= 0.99 * chosen[0]
