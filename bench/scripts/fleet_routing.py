"""What one kv_aware routing decision costs as the fleet grows, in one process on one core.

    python bench/scripts/fleet_routing.py [--pods 4 100 1000] [--decisions 2000]

Each pod's index view holds what a busy fleet's would (16 system prompts of 20 blocks, each on a few pods;
every pod some conversations of its own), the ledger a few requests in flight per pod; each decision routes a
short chat over one of the system prompts (its token ids given: tokenizing is not what grows with pods). It
prints the median decision time with every pod looked at (``max_candidates 0``) and with the shortlist
(the default, 16), and how often both chose a pod holding the prompt's system prompt (the hit ratio's proxy).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gateway.config import HealthConfig, PodConfig
from gateway.kv.events import BlockStored
from gateway.kv.index import PrefixIndex
from gateway.load.ledger import InFlightLedger
from gateway.plugin_registry import PluginRegistry
from gateway.pods.registry import PodRegistry
from gateway.routing.policy import PolicyContext, RoutingRequest
from gateway.routing.router import Router

BS = 16
SYSTEM_BLOCKS = 20


def fleet(n_pods: int, seed: int = 0) -> tuple[PodRegistry, PrefixIndex, InFlightLedger, list[list[int]]]:
    rng = random.Random(seed)
    pods = PodRegistry([PodConfig(url=f"http://p{i}:1", name=f"pod{i}", models=["m"]) for i in range(n_pods)],
                       HealthConfig())
    for pod in pods.all():
        pod.healthy = True
    index = PrefixIndex(speculative_ttl_s=0)
    ledger = InFlightLedger()
    systems = [[rng.randrange(100, 30000) for _ in range(SYSTEM_BLOCKS * BS)] for _ in range(16)]
    engine_hash = iter(range(1, 10**12))
    for i in range(n_pods):
        view = index.view(f"pod{i}", 0, "m", BS)
        for system in rng.sample(systems, 2) if i < 4 * 16 else ():  # each system prompt on a few pods
            index.apply(view, [BlockStored([next(engine_hash) for _ in range(SYSTEM_BLOCKS)], None, system, BS)])
        for _ in range(5):  # conversations of its own
            tokens = [rng.randrange(100, 30000) for _ in range(30 * BS)]
            index.apply(view, [BlockStored([next(engine_hash) for _ in range(30)], None, tokens, BS)])
        for r in range(rng.randrange(4)):
            ledger.dispatch(f"r{i}-{r}", f"pod{i}", 0.1, "chat")
    return pods, index, ledger, systems


def decisions(n_pods: int, count: int, max_candidates: int) -> tuple[float, float]:
    pods, index, ledger, systems = fleet(n_pods)
    router = Router(pods, PluginRegistry("gateway.policies", "routing policy"), "kv_aware", {},
                    PolicyContext.standalone(pods, index=index, ledger=ledger), max_candidates)
    policy = router.resolve(None)
    rng = random.Random(1)
    times, hits = [], 0
    for i in range(count):
        system = rng.choice(systems)
        ids = [*system, *(rng.randrange(100, 30000) for _ in range(40))]
        request = RoutingRequest(f"q{i}", "m", "chat", base_model="m", token_ids=ids)
        started = time.perf_counter()
        decision = router.route(request, policy)
        times.append(time.perf_counter() - started)
        hits += decision.prefix_tokens >= SYSTEM_BLOCKS * BS
    return statistics.median(times) * 1e6, hits / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, nargs="+", default=[4, 100, 1000])
    parser.add_argument("--decisions", type=int, default=2000)
    args = parser.parse_args()
    print("pods | every pod: us per decision, prompts sent to a holder | shortlist of 16: the same")
    for n in args.pods:
        full_us, full_hits = decisions(n, args.decisions, 0)
        short_us, short_hits = decisions(n, args.decisions, 16)
        print(f"{n} | {full_us:.0f} us, {full_hits:.3f} | {short_us:.0f} us, {short_hits:.3f}")


if __name__ == "__main__":
    main()
