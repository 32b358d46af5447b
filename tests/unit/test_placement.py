"""Placement by cost in tokens, through the ``kv_aware`` policy: which pod is chosen, and why."""

from __future__ import annotations

import time

from gateway.config import HealthConfig, PlacementConfig, PodConfig
from gateway.kv.events import BlockStored
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import Dispatch, InFlightLedger
from gateway.plugin_registry import PluginRegistry
from gateway.pods.registry import PodRegistry
from gateway.pods.scraper import parse_engine_metrics
from gateway.routing.policy import PolicyContext, RoutingRequest
from gateway.routing.router import Router

BS = 4
ROLE = list(range(100, 132))  # 8 blocks every workflow starts with


class Fleet:
    def __init__(self, capacity_tokens: dict[str, float], growth_per_stage: float = 0.0,
                 load_weight: float = 0.3, **options: object) -> None:
        self.pods = PodRegistry([PodConfig(url=f"http://{n}:1", name=n, models=["m"]) for n in capacity_tokens],
                                HealthConfig())
        for pod in self.pods.all():
            pod.healthy = True
        self.index = PrefixIndex(speculative_ttl_s=0)
        self.views = {n: self.index.view(n, 0, "m", BS) for n in capacity_tokens}
        self.ledger = InFlightLedger()
        self.ws = ResumableWorkingSet(PlacementConfig(default_stages=4), self.ledger)
        if growth_per_stage:
            self.ws.forecast.growth.add(growth_per_stage)
        context = PolicyContext.standalone(self.pods, index=self.index, working_set=self.ws, ledger=self.ledger,
                                           capacity_of=capacity_tokens.get)
        self.router = Router(self.pods, PluginRegistry("gateway.policies", "routing policy"), "kv_aware",
                             {"kv_aware": {"kv_usage_weight": 0.0, "load_weight": load_weight, **options}}, context)
        self.policy = self.router.resolve(None)
        self.dispatches: dict[str, Dispatch] = {}
        self._engine_hash = 0

    def cache(self, pod: str, tokens: list[int]) -> None:
        """The pod's engine says it cached these tokens (whole blocks)."""
        hashes = []
        for _ in range(len(tokens) // BS):
            self._engine_hash += 1
            hashes.append(self._engine_hash)
        self.index.apply(self.views[pod], [BlockStored(hashes, None, tokens, BS)])

    def route(self, tokens: list[int], key: str, exclude: frozenset[str] = frozenset(),
              request: RoutingRequest | None = None, pin: str | None = None):
        """Route a request of context ``key``, then dispatch it as the pipeline does: counted in the ledger,
        its context held on the chosen pod."""
        request = request or RoutingRequest("r", "m", "chat", token_ids=tokens, base_model="m", context_key=key,
                                            context_keyed=True, hashes=self.index.prompt_hashes("m", None, tokens))
        decision = self.router.route(request, self.policy, exclude, pin)
        pod, hashes = decision.pod.name, request.hashes
        self.dispatches[key] = self.ledger.dispatch("r", pod, 0.1, "chat", context=key)
        self.ws.hold(key, True, pod, BS, hashes.first(BS, hashes.token_count // BS), hashes.token_count,
                     time.monotonic())
        return request, decision

    def finish(self, request: RoutingRequest) -> None:
        """The attempt ended, however it ended."""
        self.ledger.finish(self.dispatches.pop(request.context_key))
        self.ws.idle(request.context_key, time.monotonic())


def own(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_a_new_workflow_leaves_a_full_pod_holding_its_role_prompt():
    fleet = Fleet({"p0": 200.0, "p1": 200.0}, growth_per_stage=40)
    fleet.cache("p0", ROLE + own(1000, 48))
    # A workflow thinking on p0 holds the role prompt and 48 tokens of its own there.
    blocks = fleet.index.prompt_hashes("m", None, ROLE + own(1000, 48)).first(BS, 20)
    fleet.ws.hold("workflow:old", True, "p0", BS, blocks, 80, now=time.monotonic())
    fleet.ws.idle("workflow:old", now=time.monotonic())
    request, decision = fleet.route(ROLE + own(2000, 8), "workflow:new")
    costs = request.placement
    # On p0 the role prompt is a hit (32 tokens), but the new workflow's expected growth (3 more stages of
    # 40 tokens) would push the thinking workflow's blocks out; p1 has room for all of it.
    assert request.prefix_tokens == {"p0": 32, "p1": 0}
    assert costs["p0"].overflow > 0 and costs["p1"].overflow == 0
    assert costs["p0"].total > costs["p1"].total
    assert decision.pod.name == "p1" and decision.reason == "capacity_spread"


def test_with_room_everywhere_the_cached_prefix_wins():
    fleet = Fleet({"p0": 10_000.0, "p1": 10_000.0}, growth_per_stage=40)
    fleet.cache("p0", ROLE)
    request, decision = fleet.route(ROLE + own(2000, 8), "workflow:new")
    assert all(c.overflow == 0 for c in request.placement.values())
    assert decision.pod.name == "p0" and decision.reason == "cache_hit"


def test_unknown_capacity_degrades_to_prefix_affinity():
    fleet = Fleet({"p0": None, "p1": None}, growth_per_stage=400)  # type: ignore[dict-item]
    fleet.cache("p0", ROLE)
    _, decision = fleet.route(ROLE + own(2000, 8), "workflow:new")
    assert decision.pod.name == "p0" and decision.reason == "cache_hit"


def test_a_later_stage_stays_with_its_cache_on_a_full_pod():
    # The cost model alone (the thinking crowd would also make p0 look busier: the load scorer's test).
    fleet = Fleet({"p0": 100.0, "p1": 10_000.0}, growth_per_stage=8, load_weight=0.0)
    context = ROLE + own(3000, 40)
    fleet.cache("p0", context)
    request, first = fleet.route(context, "workflow:w")
    assert first.pod.name == "p0"
    fleet.finish(request)  # the stage ended; the workflow thinks on p0
    # Another workflow fills p0 past its capacity while this one thinks, and thinks too.
    crowd, _ = fleet.route(own(6000, 120), "workflow:crowd", exclude=frozenset({"p1"}))
    fleet.finish(crowd)
    request, decision = fleet.route(context + own(4000, 12), "workflow:w")
    assert request.placement["p0"].overflow > 0
    # Elsewhere it would prefill its whole context again; here only the tool result.
    assert decision.pod.name == "p0" and decision.reason == "cache_hit"
    assert request.placement["p1"].uncached > request.placement["p0"].total


def test_routing_holds_the_context_and_finishing_lets_it_think():
    fleet = Fleet({"p0": 10_000.0, "p1": 10_000.0})
    request, decision = fleet.route(ROLE + own(2000, 8), "session:s")
    held = fleet.ws.context("session:s")
    assert held is not None and held.pod == decision.pod.name
    assert fleet.ws.resumable(decision.pod.name) == (1, 0)
    fleet.finish(request)
    assert fleet.ws.resumable(decision.pod.name) == (1, 1)
    # A pod with a thinking session is busier than an empty one: the next new session goes elsewhere.
    _, other = fleet.route(own(5000, 40), "session:t")
    assert other.pod.name != decision.pod.name


def crowded(balance_slack: int | None) -> Fleet:
    """Both pods' caches full of thinking workflows: three on p0 (which caches the role prompt), one on p1."""
    fleet = Fleet({"p0": 200.0, "p1": 200.0}, load_weight=0.0, balance_slack=balance_slack)
    fleet.cache("p0", ROLE)
    for n, (pod, size) in enumerate([("p0", 40), ("p0", 40), ("p0", 40), ("p1", 220)]):
        away = frozenset({"p1" if pod == "p0" else "p0"})
        request, decision = fleet.route(ROLE + own(10_000 * (n + 1), size), f"workflow:{n}", exclude=away)
        assert decision.pod.name == pod
        fleet.finish(request)
    assert fleet.ws.resumable("p0") == (3, 3) and fleet.ws.resumable("p1") == (1, 1)
    return fleet


def test_under_pressure_a_new_workflow_goes_where_fewer_contexts_wait():
    # By tokens alone p0 is cheaper (its role prompt is a hit and both caches overflow by the rest) ...
    _, alone = crowded(balance_slack=None).route(ROLE + own(2000, 8), "workflow:new")
    assert alone.pod.name == "p0"
    # ... but the three workflows thinking there would lose more meanwhile: with the balance it goes to p1.
    _, balanced = crowded(balance_slack=1).route(ROLE + own(2000, 8), "workflow:new")
    assert balanced.pod.name == "p1"


def test_the_balance_lets_a_continuing_workflow_stay_with_its_cache():
    fleet = crowded(balance_slack=1)
    fleet.cache("p0", ROLE + own(10_000, 40))
    _, decision = fleet.route(ROLE + own(10_000, 40) + own(3000, 8), "workflow:0")
    assert decision.pod.name == "p0" and decision.reason == "cache_hit"


def test_the_balance_lets_a_pinned_workflow_stay_even_after_its_context_lapsed():
    # The working set no longer knows workflow:back (it thought longer than predicted), so it would count as
    # starting; its workflow's pin to p0 (where its cache is) says it continues there.
    _, unpinned = crowded(balance_slack=1).route(ROLE + own(2000, 8), "workflow:back")
    assert unpinned.pod.name == "p1"
    _, pinned = crowded(balance_slack=1).route(ROLE + own(2000, 8), "workflow:back", pin="p0")
    assert pinned.pod.name == "p0" and pinned.unpinned is None


def test_with_room_the_balance_leaves_the_choice_to_the_cache():
    fleet = Fleet({"p0": 10_000.0, "p1": 10_000.0}, load_weight=0.0, balance_slack=0)
    fleet.cache("p0", ROLE)
    for n in range(3):
        request, _ = fleet.route(ROLE + own(10_000 * (n + 1), 8), f"workflow:{n}", exclude=frozenset({"p1"}))
        fleet.finish(request)
    _, decision = fleet.route(ROLE + own(2000, 8), "workflow:new")
    assert decision.pod.name == "p0" and decision.reason == "cache_hit"


def test_vllm_and_sglang_metrics_say_the_capacity():
    vllm = ('vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",'
            'num_gpu_blocks="48",prefix_caching_hash_algo="sha256"} 1.0\n'
            'vllm:request_success_total{engine="0",finished_reason="length"} 7.0\n')
    assert parse_engine_metrics(vllm) == {"kv_capacity_tokens": 48 * 128, "block_size": 128.0,
                                          "requests_finished": 7.0}
    assert parse_engine_metrics('sglang:max_total_num_tokens{model_name="m"} 4096.0\n') == {
        "kv_capacity_tokens": 4096.0}


def test_a_retry_without_the_failed_pod_keeps_its_reason():
    fleet = Fleet({"p0": 200.0, "p1": 200.0, "p2": 200.0}, growth_per_stage=40)
    fleet.cache("p0", ROLE)
    request, first = fleet.route(ROLE + own(2000, 8), "workflow:x")
    assert first.pod.name == "p0"
    fleet.finish(request)  # the attempt failed before the first byte
    _, retry = fleet.route([], "workflow:x", exclude=frozenset({"p0"}), request=request)
    assert retry.pod.name in {"p1", "p2"} and retry.reason == "no_hit_least_loaded"
    assert set(request.placement) == {"p1", "p2"}
