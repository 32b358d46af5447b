"""Keep-warm's parts: the free queue the gateway infers for each pod, the choice of what to refresh, the prompts
it keeps, and the whole tick over real components with a recording refresher."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from bench.metrics_text import keep_warm_spent, prediction_checks
from gateway.config import AuthConfig, HealthConfig, KeepWarmConfig, PlacementConfig, PodConfig
from gateway.http_client import HttpClient
from gateway.kv import free_queue
from gateway.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from gateway.kv.free_queue import FreeQueues
from gateway.kv.hashing import namespace_root, prefix_hashes
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import EngineStats, PendingLoad
from gateway.load.slo_profiles import ProfileStore
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.workflow.keep_warm import Candidate, KeepWarm, PodWarmth, choose_refresh
from gateway.workflow.refresh import KeptPrompt, KeptPrompts, Refresher

# The free queue


def chain_of(path: list[int]) -> list[int]:
    """A prompt of one-token blocks, hashed as the gateway chains them."""
    return prefix_hashes(namespace_root("m"), path, 1)



def test_a_finished_request_joins_the_back_tail_first_and_a_hit_takes_its_blocks_out():
    queues = FreeQueues()
    queues.taken("p", [1, 2, 3])
    queues.returned("p", [1, 2, 3], cached=3)
    # Freed tail first: 3 is evicted first, then 2, then 1.
    assert [queues.ahead("p", b) for b in (3, 2, 1)] == [0, 1, 2]
    queues.taken("p", [10, 11])
    queues.returned("p", [10, 11], cached=2)
    assert queues.ahead("p", 11) == 3 and queues.ahead("p", 10) == 4
    # A request hits 1 and 2: out of the queue while it runs, then at the back, behind 10 and 11.
    queues.taken("p", [1, 2, 20])
    assert queues.ahead("p", 1) is None and queues.ahead("p", 11) == 1
    queues.returned("p", [1, 2, 20], cached=2)  # block 20 never became a full cached block
    assert [queues.ahead("p", b) for b in (3, 11, 10, 2, 1)] == [0, 1, 2, 3, 4] and queues.ahead("p", 20) is None
    assert queues.first_to_go("p", [1, 2]) == (1, 3) and queues.free_blocks("p") == 5


def test_a_block_held_by_two_requests_joins_the_queue_when_both_end():
    queues = FreeQueues()
    queues.taken("p", [1, 2])
    queues.taken("p", [1, 3])
    queues.returned("p", [1, 2], cached=2)
    assert queues.ahead("p", 1) is None and queues.ahead("p", 2) == 0 and queues.held_blocks("p") == 2
    queues.returned("p", [1, 3], cached=2)
    assert [queues.ahead("p", b) for b in (2, 3, 1)] == [0, 1, 2] and queues.held_blocks("p") == 0


def test_evictions_say_whether_the_queue_had_the_engines_order():
    queues = FreeQueues()
    queues.taken("p", [1, 2, 3])
    queues.returned("p", [1, 2, 3], cached=3)
    queues.evicted("p", [3])  # the front: as the engine's LRU says
    queues.evicted("p", [1])  # 2 was ahead of it: the queue missed something
    queues.evicted("p", [99])  # never freed through the gateway
    stats = queues.stats
    assert (stats.evicted_first, stats.evicted_out_of_order, stats.evicted_unknown) == (1, 1, 1)
    assert queues.ahead("p", 2) == 0
    # The pod's cache is cleared while a request runs there: nothing is free and cached, and what the request
    # holds joins the queue when it ends (an engine clears its cache only when nothing runs; a gateway reading
    # a pod's event history meets old clears while requests run).
    queues.taken("p", [40, 41])
    queues.cleared("p", [2, 40])
    assert queues.ahead("p", 2) is None and queues.free_blocks("p") == 0
    queues.returned("p", [40, 41], cached=2)
    assert queues.ahead("p", 41) == 0 and queues.free_blocks("p") == 2
    # The pod leaves: nothing of it is free and cached; a request still running there returns its blocks.
    queues.taken("p", [50])
    queues.dropped("p")
    assert queues.free_blocks("p") == 0
    queues.returned("p", [50], cached=1)
    assert queues.ahead("p", 50) == 0


def test_an_old_clear_read_late_drops_only_the_blocks_stored_before_it():
    # A gateway that starts (or reconnects) reads the pod's buffered events while requests already end: a
    # clear from before it started must not drop what those requests left cached since, whose stores come
    # later in the stream. Seen on real vLLM: keep-warm lost the context it was there to keep.
    queues = FreeQueues()
    index = PrefixIndex(evictions=queues)
    view = index.view("p", 0, "m", 16)
    old_tokens, new_tokens = list(range(100, 132)), list(range(500, 532))
    old, new = (prefix_hashes(namespace_root("m", None), tokens, 16) for tokens in (old_tokens, new_tokens))

    def stored(hashes: list[int], tokens: list[int]) -> BlockStored:
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16)

    index.apply(view, [stored(old, old_tokens)])  # cached before the clear
    queues.taken("p", old)
    queues.returned("p", old, cached=2)
    queues.taken("p", new)  # a request the clear did not see: it ends before the gateway reads the clear
    queues.returned("p", new, cached=2)
    index.apply(view, [AllBlocksCleared(), stored(new, new_tokens)])
    assert [queues.ahead("p", b) for b in old] == [None, None]
    assert queues.first_to_go("p", new) == (1, 0) and queues.free_blocks("p") == 2


@pytest.mark.parametrize("refreshed", [2, 90])
def test_a_cut_that_parts_nothing_any_more_heals(refreshed: int):
    queues = FreeQueues()
    prompt = chain_of([0] * 100)
    queues.taken("p", prompt)
    queues.returned("p", prompt, cached=100)
    # A refresh of a context that the longer prompt continues: the run is cut at its end.
    queues.taken("p", prompt[:refreshed])
    queues.returned("p", prompt[:refreshed], cached=refreshed)
    longer = chain_of([0] * 104)
    queues.taken("p", longer)  # two runs on its way, given back together: one again, the smaller renumbered
    writes = queues.stats.block_writes
    queues.returned("p", longer, cached=104)
    assert queues.stats.block_writes - writes == min(refreshed, 104 - refreshed)
    walked = queues.stats.runs_walked
    queues.taken("p", longer)
    assert queues.stats.runs_walked - walked == 1


def test_a_prompt_that_parts_from_a_long_one_renumbers_the_shorter_side():
    queues = FreeQueues()
    long = chain_of([0] * 1000)
    queues.taken("p", long)
    queues.returned("p", long, cached=1000)
    writes = queues.stats.block_writes
    queues.taken("p", chain_of([0, 0, 1]))  # shares the first two blocks: they leave the run, one block is new
    assert queues.stats.block_writes - writes == 3
    writes = queues.stats.block_writes
    queues.taken("p", chain_of([0] * 998 + [1]))  # parts near the end: the last two blocks are cut off
    assert queues.stats.block_writes - writes == 3
    assert queues.first_to_go("p", long) == (999, 0) and queues.held_blocks("p") == 1000


# Prompts are paths in a small tree of blocks (one token a block): prompts that share a beginning share its
# blocks, as chained hashes make them.
PATHS = st.lists(st.integers(0, 2), min_size=1, max_size=7)
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("take"), PATHS),
    st.tuples(st.just("return"), st.integers(0, 50), st.integers(0, 8)),  # which request, blocks cached
    st.tuples(st.sampled_from(["evict", "clear"]), PATHS, st.integers(0, 6)),  # the block at that depth
    st.tuples(st.just("drop"))), max_size=300)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_the_queue_is_that_of_a_plain_list_of_blocks(operations):
    """The runs keep exactly what a list of blocks in the engine's order, and a count per held block, keep:
    each block's place, the blocks free and held, the first of a prompt's blocks to go, what evictions say."""
    queues, plain, refs, running, seen = FreeQueues(), [], {}, [], []
    expected = free_queue.QueueStats()
    for op in operations:
        if op[0] == "take":
            blocks = chain_of(op[1])
            queues.taken("p", blocks)
            for b in blocks:
                if not refs.get(b) and b in plain:
                    plain.remove(b)
                refs[b] = refs.get(b, 0) + 1
            running.append(blocks)
            seen.append(blocks)
        elif op[0] == "return" and running:
            blocks = running.pop(op[1] % len(running))
            cached = min(op[2], len(blocks))
            queues.returned("p", blocks, cached)
            for i in range(len(blocks) - 1, -1, -1):  # tail first
                refs[blocks[i]] -= 1
                if not refs[blocks[i]]:
                    del refs[blocks[i]]
                    if i < cached and blocks[i] not in plain:
                        plain.append(blocks[i])
        elif op[0] in ("evict", "clear"):
            blocks = chain_of(op[1])
            block = blocks[min(op[2], len(blocks) - 1)]
            if op[0] == "evict":
                queues.evicted("p", [block])
                if not seen:  # a pod no request was routed to has no queue to say anything of
                    pass
                elif block not in plain:
                    expected.evicted_unknown += 1
                elif plain[0] == block:
                    expected.evicted_first += 1
                else:
                    expected.evicted_out_of_order += 1
            else:
                queues.cleared("p", [block])
            if block in plain:  # a held block stays held: its request gives it back
                plain.remove(block)
        elif op[0] == "drop":
            queues.dropped("p")
            plain.clear()
        assert [queues.ahead("p", b) for b in plain] == list(range(len(plain)))
        assert queues.free_blocks("p") == len(plain) and queues.held_blocks("p") == len(refs)
        for blocks in seen[-5:]:
            tail = next((i for i in range(len(blocks) - 1, -1, -1) if blocks[i] in plain), None)
            want = (tail, plain.index(blocks[tail])) if tail is not None else None
            assert queues.first_to_go("p", blocks) == want
            assert all(queues.ahead("p", b) is None for b in blocks if b not in plain)
    stats = queues.stats
    assert (stats.evicted_first, stats.evicted_out_of_order, stats.evicted_unknown) == (
        expected.evicted_first, expected.evicted_out_of_order, expected.evicted_unknown)


# Choosing what to refresh

CONFIG = KeepWarmConfig(lead_s=0.5, min_tokens=100)


def candidate(key: str, due_in: float, blocks: int, margin: int, worth: float = 1000.0) -> Candidate:
    return Candidate(context=key, prompt=None, due_in_s=due_in, comes_back_in_s=due_in,  # type: ignore[arg-type]
                     blocks=blocks, first_to_go=blocks - 1, margin=margin, worth=worth)


def test_the_context_nearest_eviction_among_those_due_back_after_it_is_refreshed():
    # 10 blocks evicted a second: within 0.5 s the pod takes 5 blocks, and a request takes 2 more.
    soon, later, safe = candidate("soon", 2.0, 4, margin=1), candidate("later", 3.0, 4, margin=6), \
        candidate("safe", 1.0, 4, margin=20)
    choice = choose_refresh([later, safe, soon], room=100, rate=10.0, per_request=2.0, config=CONFIG)
    assert choice.refresh is soon and (choice.kept, choice.at_risk) == (3, 2)
    # Due back before the pod gets to it: nothing to do.
    back_first = candidate("back", 0.05, 4, margin=1)
    assert choose_refresh([back_first], room=100, rate=10.0, per_request=0.0, config=CONFIG).refresh is None
    # Nothing evicted yet, but the next request takes more blocks than are left before it.
    assert choose_refresh([soon], room=100, rate=0.0, per_request=3.0, config=CONFIG).refresh is soon
    assert choose_refresh([soon], room=100, rate=0.0, per_request=1.0, config=CONFIG).refresh is None
    # Not worth a refresh (a small prompt, or one that rarely comes back).
    cheap = candidate("cheap", 2.0, 4, margin=1, worth=50.0)
    assert choose_refresh([cheap], room=100, rate=10.0, per_request=0.0, config=CONFIG).refresh is None


def test_only_what_fits_the_room_is_kept_soonest_due_first():
    first, second, third = candidate("a", 1.0, 6, margin=0), candidate("b", 2.0, 6, margin=1), \
        candidate("c", 3.0, 6, margin=2)
    choice = choose_refresh([third, second, first], room=13, rate=10.0, per_request=0.0, config=CONFIG)
    assert choice.kept == 2 and choice.refresh is first
    # The one due last does not fit: refreshing it would only push a kept one out.
    assert choose_refresh([third], room=5, rate=10.0, per_request=0.0, config=CONFIG).refresh is None


def test_a_pods_rate_of_new_blocks_and_what_one_request_may_take_follow_its_requests():
    warmth = PodWarmth()
    warmth.observe(now=10.0)  # first look: a baseline, no rate yet
    assert warmth.rate == 0.0
    for second in range(11, 40):
        warmth.routed(8, max_share=0.5)
        warmth.routed(12, max_share=0.5)
        warmth.observe(now=float(second))
    assert math.isclose(warmth.rate, 20.0, rel_tol=0.01) and warmth.budget == 8.0
    # Requests of 8 and 12 new blocks: the next may take the mean and twice its deviation.
    assert 10 < warmth.per_request < 20


# The prompts kept


def test_a_refresh_that_gave_way_is_counted_as_the_pod_counted_it():
    metrics = GatewayMetrics()
    Refresher(PodRegistry([], HealthConfig()), AuthConfig(), HttpClient(), metrics).cancelled("p", 65, 64)
    spent = keep_warm_spent(generate_latest(metrics.registry).decode())["p"]
    assert (spent.requests, spent.cancelled, spent.prompt_tokens, spent.cached_tokens) == (0, 1, 65, 64)
    assert prediction_checks(generate_latest(metrics.registry).decode())["keep_warm_cancelled"] == 1


def test_prompts_are_kept_within_their_token_bound_and_short_ones_not_at_all():
    prompts = KeptPrompts(min_tokens=10, max_tokens=50)
    prompts.keep("a", "p", "m", list(range(30)))
    prompts.keep("short", "p", "m", list(range(5)))
    prompts.keep("b", "p", "m", list(range(30)))  # past 50 tokens: the least recently kept goes
    assert prompts.contexts() == ["b"] and prompts.tokens == 30
    prompts.keep("b", "q", "m", list(range(40)))  # its next request replaces it
    assert prompts.get("b").pod == "q" and prompts.tokens == 40  # type: ignore[union-attr]


def test_a_refresh_is_the_blocks_and_the_next_token():
    kept = KeptPrompt("p", "m", list(range(100)), 100)
    assert kept.refresh_ids(blocks=3, block_size=16) == list(range(49))
    # A prompt ending on a block boundary: one more token, which no block caches.
    aligned = KeptPrompt("p", "m", list(range(48)), 48)
    assert aligned.refresh_ids(blocks=3, block_size=16) == [*range(48), 47]


# The whole tick


class RecordingRefresher:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, list[int]]] = []
        self.cancels: list[tuple[str, int, int]] = []

    async def refresh(self, pod: str, model: str, ids: list[int]) -> int:
        self.sent.append((pod, model, ids))
        return (len(ids) - 1) // 16 * 16

    def cancelled(self, pod: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.cancels.append((pod, prompt_tokens, cached_tokens))


class SlowRefresher(RecordingRefresher):
    """A refresh the engine is still running: it ends only when released (or cancelled)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def refresh(self, pod: str, model: str, ids: list[int]) -> int:
        self.sent.append((pod, model, ids))
        await self.release.wait()
        return (len(ids) - 1) // 16 * 16


class Fleet:
    """One pod of blocks of 16 tokens: a working set, an index fed the pod's events, its free queue."""

    BS = 16

    def __init__(self, capacity_blocks: int = 9, refresher: RecordingRefresher | None = None,
                 client_due: Callable[[str], bool] = lambda pod: False, **config: float) -> None:
        self.now = 100.0
        self.pods = PodRegistry([PodConfig(url="http://p:1", name="p", models=["m"])], HealthConfig())
        self.pods.get("p").healthy = True  # type: ignore[union-attr]
        self.ledger = InFlightLedger()
        self.working_set = ResumableWorkingSet(PlacementConfig(default_think_s=2.0), self.ledger)
        self.queues = FreeQueues()
        self.index = PrefixIndex(evictions=self.queues)
        self.view = self.index.view("p", 0, "m", self.BS)
        self.load = PendingLoad(ProfileStore(None), self.ledger, default_capacity=8, deployment_of=str)
        self.load.engine["p"] = EngineStats(kv_usage=0.0, stale=False)
        self.refresher = refresher or RecordingRefresher()
        self.metrics = GatewayMetrics()
        self.keep_warm = KeepWarm(KeepWarmConfig(**{"min_tokens": 32, **config}), self.pods, self.working_set,
                                  self.queues, self.index, self.load, self.ledger,
                                  lambda pod: capacity_blocks * self.BS, self.refresher,
                                  self.metrics, clock=lambda: self.now, client_due=client_due)

    def served(self, key: str, tokens: list[int]) -> list[int]:
        """A request of context ``key`` served start to end on the pod, the pipeline's way."""
        hashes = prefix_hashes(namespace_root("m", None), tokens, self.BS)
        self.keep_warm.routed("p", len(hashes))
        self.queues.taken("p", hashes)
        self.keep_warm.dispatched(key, "p", "m", tokens)
        self.index.apply(self.view, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[
            : len(hashes) * self.BS], block_size=self.BS)])
        self.working_set.hold(key, True, "p", self.BS, hashes, len(tokens), self.now)
        self.queues.returned("p", hashes, len(hashes))
        self.working_set.idle(key, self.now)
        return hashes

    def evict(self, hashes: list[int]) -> None:
        self.index.apply(self.view, [BlockRemoved(block_hashes=hashes)])


async def test_a_tick_refreshes_the_thinking_context_the_pod_would_evict_first():
    # A full pod (8 usable blocks, both contexts' 4 each): the next request's 4 new blocks evict a's, at the
    # front of the free queue, then b's. Both are due back in 2 s: a, the nearer eviction, is refreshed.
    fleet = Fleet(capacity_blocks=9)
    context = list(range(1000, 1000 + 4 * 16 + 3))  # 4 full blocks and 3 tokens
    held = fleet.served("workflow:a", context)
    other = fleet.served("workflow:b", list(range(5000, 5000 + 4 * 16)))
    fleet.keep_warm.tick()
    await asyncio.sleep(0)
    assert fleet.refresher.sent == [("p", "m", context[: 4 * 16 + 1])], fleet.keep_warm.debug()
    # Refreshed, its blocks are at the back of the queue, behind b's.
    assert fleet.queues.ahead("p", held[-1]) == 4 and fleet.queues.ahead("p", other[-1]) == 0
    # A pod with room: its next request takes blocks that cache nothing, and nothing is at risk.
    roomy = Fleet(capacity_blocks=20)
    roomy.served("workflow:a", context)
    roomy.keep_warm.tick()
    await asyncio.sleep(0)
    assert not roomy.refresher.sent and roomy.keep_warm.debug()["pods"]["p"]["kept"] == 1


async def test_a_refresh_in_flight_gives_way_to_a_client_request_routed_to_its_pod():
    fleet = Fleet(capacity_blocks=9, refresher=SlowRefresher())
    held = fleet.served("workflow:a", list(range(1000, 1000 + 4 * 16 + 3)))
    other = fleet.served("workflow:b", list(range(5000, 5000 + 4 * 16)))
    fleet.keep_warm.tick()
    await asyncio.sleep(0)
    assert len(fleet.refresher.sent) == 1 and fleet.queues.ahead("p", held[-1]) is None  # out while it runs
    fleet.ledger.dispatch("client", "p", 0.1, "chat")
    fleet.keep_warm.routed("p", 4)  # a client request is dispatched there: the refresh is cancelled
    await asyncio.sleep(0)
    pod = fleet.keep_warm.debug()["pods"]["p"]
    assert (pod["cancelled"], pod["refreshes"]) == (1, 0) and fleet.keep_warm._warmth["p"].refresh is None
    assert fleet.refresher.cancels == [("p", 4 * 16 + 1, 4 * 16)]  # counted as the engine counted it
    # The engine had it running: its blocks went to the back when it was aborted, as a refresh's do.
    assert fleet.queues.ahead("p", held[-1]) == 4 and fleet.queues.ahead("p", other[-1]) == 0
    fleet.keep_warm.routed("p", 4)  # nothing in flight: nothing to cancel
    assert fleet.keep_warm.debug()["pods"]["p"]["cancelled"] == 1


async def test_a_refresh_beside_requests_a_pod_batches_anyway_goes_on():
    # max_in_flight 2: a pod that batches many requests takes a refresh beside two of them at no cost.
    fleet = Fleet(capacity_blocks=9, refresher=SlowRefresher(), max_in_flight=2)
    fleet.served("workflow:a", list(range(1000, 1000 + 4 * 16 + 3)))
    fleet.served("workflow:b", list(range(5000, 5000 + 4 * 16)))
    fleet.keep_warm.tick()
    await asyncio.sleep(0)
    for n in range(3):
        fleet.ledger.dispatch(f"client-{n}", "p", 0.1, "chat")
        fleet.keep_warm.routed("p", 4)
        await asyncio.sleep(0)
        assert fleet.keep_warm.debug()["pods"]["p"]["cancelled"] == (1 if n == 2 else 0)


async def test_no_refresh_starts_on_a_pod_flow_control_holds_a_request_for():
    due = {"p"}
    fleet = Fleet(capacity_blocks=9, client_due=due.__contains__)
    fleet.served("workflow:a", list(range(1000, 1000 + 4 * 16 + 3)))
    fleet.served("workflow:b", list(range(5000, 5000 + 4 * 16)))
    fleet.keep_warm.tick()
    await asyncio.sleep(0)
    assert not fleet.refresher.sent and fleet.keep_warm.debug()["pods"]["p"]["at_risk"] == 1
    due.clear()  # the held request was dispatched and ended
    fleet.keep_warm.tick()
    await asyncio.sleep(0)
    assert len(fleet.refresher.sent) == 1


async def test_no_refresh_while_the_pod_is_busy_or_the_budget_is_spent():
    fleet = Fleet(max_share=0.0)
    fleet.served("workflow:a", list(range(1000, 1000 + 4 * 16 + 3)))
    fleet.keep_warm.tick()
    busy = fleet.ledger.dispatch("r", "p", 0.1, "chat")
    for _ in range(10):
        fleet.now += 0.1
        fleet.keep_warm._warmth["p"].rate = 100.0
        fleet.keep_warm.tick()
    await asyncio.sleep(0)
    assert not fleet.refresher.sent and fleet.keep_warm.debug()["pods"]["p"]["at_risk"] == 1
    fleet.ledger.finish(busy)
    fleet.load.engine["p"] = EngineStats(waiting=2.0, stale=False)  # requests wait inside the engine
    fleet.keep_warm.tick()
    await asyncio.sleep(0)
    assert not fleet.refresher.sent
    fleet.load.engine["p"] = EngineStats(stale=False)
    fleet.keep_warm.tick()  # idle now: the one refresh the starting budget allows
    fleet.keep_warm.tick()
    await asyncio.sleep(0)
    assert len(fleet.refresher.sent) == 1


def test_a_context_comes_back_as_often_as_contexts_of_its_kind_do():
    ledger = InFlightLedger()
    ws = ResumableWorkingSet(PlacementConfig(default_stages=4, min_protect_s=0.1, max_protect_s=5.0), ledger)
    first = ws.hold("workflow:a", True, "p", 16, [1, 2], 32, 0.0)
    assert ws.return_chance(first) == 0.75  # before any came back: a workflow of 4 stages
    ws.idle("workflow:a", 1.0)
    ws.hold("workflow:a", True, "p", 16, [1, 2, 3], 48, 2.0)  # came back
    ws.idle("workflow:a", 3.0)
    ws.release("workflow:a", completed=True)  # done: did not come back
    ws.hold("anon-1", False, "p", 16, [7], 16, 4.0)
    ws.idle("anon-1", 4.0)
    ws.lapse(10.0)  # thought past its window
    again = ws.hold("workflow:b", True, "p", 16, [1], 16, 11.0)
    # Keyed: one came back (1), then completed (0), the mean moving slowly (0.05 a context).
    assert math.isclose(ws.return_chance(again), 0.95)
    assert ws.forecast.returns[False].value == 0.0  # the recognised conversation lapsed


def test_the_free_queue_keeps_its_order_over_thousands_of_runs():
    queues = FreeQueues()
    for block in range(3000):
        queues.taken("p", [block])
        queues.returned("p", [block], 1)
    queues.evicted("p", range(1500))
    assert queues.free_blocks("p") == 1500 and queues.ahead("p", 1500) == 0 and queues.ahead("p", 2999) == 1499
    for block in range(3000, 5000):
        queues.taken("p", [block])
        queues.returned("p", [block], 1)
    assert queues.ahead("p", 4999) == 3499 and queues.ahead("p", 1500) == 0
