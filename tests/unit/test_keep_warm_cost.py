"""What keep-warm's bookkeeping costs a request: the work done for what the request adds, not for its
context. A conversation grows by the same few hundred tokens a turn at a short context and at a long one;
the work one turn costs (keep-warm's recency step at dispatch and finish and a tick, beside the pod's
events into the index and the working set's hold) is counted in lines of the gateway's own code run, in
blocks written to the free queue's map and in runs walked, never in time."""

from __future__ import annotations

import sys
import time
from array import array
from pathlib import Path

import gateway
from gateway.config import HealthConfig, KeepWarmConfig, PlacementConfig, PodConfig
from gateway.kv.events import BlockStored
from gateway.kv.free_queue import FreeQueues
from gateway.kv.hashing import PromptHashes, namespace_root
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.load.pending import EngineStats, PendingLoad
from gateway.load.slo_profiles import ProfileStore
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.proxy.outcome import Ending, RelayOutcome
from gateway.request.context_steps import CacheRecency
from gateway.routing.policy import Decision, Policy, PrefixMatch, RoutingRequest
from gateway.workflow.keep_warm import KeepWarm
from tests.unit.test_keep_warm import RecordingRefresher
from tests.unit.test_pipeline import attempt_of, client_request

BS = 16
TURN_TOKENS = 320  # 20 new blocks a turn
GATEWAY = str(Path(gateway.__file__).parent)


class Conversation:
    """One context on one pod through the real recency step, the pod's events into the index, and ticks."""

    def __init__(self) -> None:
        self.pods = PodRegistry([PodConfig(url="http://p0:1", name="p0", models=["m"])], HealthConfig())
        self.pods.get("p0").healthy = True  # type: ignore[union-attr]
        self.ledger = InFlightLedger()
        self.working_set = ResumableWorkingSet(PlacementConfig(), self.ledger)
        self.queues = FreeQueues()
        self.index = PrefixIndex(evictions=self.queues)
        self.view = self.index.view("p0", 0, "m", BS)
        load = PendingLoad(ProfileStore(None), self.ledger, default_capacity=8, deployment_of=str)
        load.engine["p0"] = EngineStats(kv_usage=0.0, stale=False)
        self.keep_warm = KeepWarm(KeepWarmConfig(), self.pods, self.working_set, self.queues, self.index, load,
                                  self.ledger, lambda pod: 1_000_000 * BS, RecordingRefresher(), GatewayMetrics())
        self.recency = CacheRecency(self.index, self.queues, self.keep_warm, self.working_set)
        self.ids = array("I")
        self.hashes: PromptHashes | None = None
        self.stored = 0  # blocks the pod's events have stored
        self.turns = 0

    def turn(self) -> None:
        """The next request: the conversation so far and TURN_TOKENS more, dispatched, served, finished."""
        earlier, shared = self.hashes, len(self.ids)
        self.ids.extend(range(self.turns * TURN_TOKENS + 7, (self.turns + 1) * TURN_TOKENS + 7))
        self.turns += 1
        hashes = self.hashes = PromptHashes(namespace_root("m"), self.ids, earlier, shared)
        request = client_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
        routing = RoutingRequest(request.id, "m", "chat", request.parsed, base_model="m", token_ids=self.ids,
                                 hashes=hashes, context_key="workflow:w", context_keyed=True)
        routing.prefix = PrefixMatch(True, hashes, self.index.lookup("m", None, hashes, ["p0"]))
        attempt = attempt_of(request, routing, "p0", self.pods, self.ledger)
        attempt = type(attempt)(attempt.request, Policy("kv_aware", picker=None),  # type: ignore[arg-type]
                                routing, attempt.plan, Decision(self.pods.get("p0"), "kv_aware", "cache_hit"),
                                attempt.dispatch, 0, attempt.routing_started, {})
        self.recency.dispatched(attempt)
        blocks = hashes.full(BS)
        self.working_set.hold("workflow:w", True, "p0", BS, blocks, len(self.ids), time.monotonic())
        new = blocks[self.stored:]  # the pod stores the blocks it computed, chained to what it held
        self.index.apply(self.view, [BlockStored(
            block_hashes=new, parent_block_hash=blocks[self.stored - 1] if self.stored else None,
            token_ids=list(self.ids[self.stored * BS: len(blocks) * BS]), block_size=BS)])
        self.stored = len(blocks)
        self.ledger.finish(attempt.dispatch)
        self.recency.attempt_finished(attempt, RelayOutcome(200, Ending.COMPLETE))
        self.working_set.idle("workflow:w", time.monotonic())
        self.keep_warm.tick()

    def grow_to(self, tokens: int) -> None:
        while len(self.ids) < tokens:
            self.turn()


def work_of_one_turn(conversation: Conversation) -> tuple[int, int, int]:
    """Lines of the gateway's code run, blocks written to the free queue's map and runs walked, in one turn."""
    stats = conversation.queues.stats
    writes, walked, lines = stats.block_writes, stats.runs_walked, 0

    def count(frame, event, arg):
        nonlocal lines
        if event == "line" and frame.f_code.co_filename.startswith(GATEWAY):
            lines += 1
        return count

    sys.settrace(count)
    try:
        conversation.turn()
    finally:
        sys.settrace(None)
    return lines, stats.block_writes - writes, stats.runs_walked - walked


def test_a_continuing_request_costs_what_it_adds_not_its_context():
    short, long = Conversation(), Conversation()
    short.grow_to(2_000)
    long.grow_to(128_000)
    assert long.queues.free_blocks("p0") == len(long.hashes.full(BS))  # type: ignore[union-attr]
    short_work, long_work = work_of_one_turn(short), work_of_one_turn(long)
    print(f"one turn of {TURN_TOKENS} tokens at 2k and 128k: (lines, block writes, runs walked) {short_work} "
          f"{long_work}")
    # The context grew 64 times: the blocks written are the new ones at both, the runs walked the same, and
    # the lines run grow only with the bisections over the longer prompt (log2 of its blocks).
    assert short_work[1] == long_work[1] <= TURN_TOKENS // BS + 1
    assert short_work[2] == long_work[2] <= 2
    assert long_work[0] <= 1.5 * short_work[0]
    # The whole context is one run, free between its requests: what keep-warm refreshes from.
    assert long.queues.first_to_go("p0", long.hashes.full(BS)) == (len(long.hashes.full(BS)) - 1, 0)  # type: ignore[union-attr]
