"""Prefix-index and routing-decision speed, in one process on one core.

    python bench/scripts/kv_index.py

Reports: event ingest (msgpack decode + apply) in blocks/s; lookup time of a 2,048-token prompt against
16 pods; memory per (pod, block) at 1 million blocks; and a kv_aware routing decision including the
tokenization of a ~2,000-token chat prompt, when every message is new and when only the last is.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from gateway.config import HealthConfig, ModelTokenizerConfig, PodConfig, TokenizationConfig
from gateway.core.inference_api import InferenceRequest
from gateway.http_client import HttpClient
from gateway.kv.events import BlockStored, Encoding, EventBatch, encode_batch
from gateway.kv.index import PrefixIndex
from gateway.load.ledger import InFlightLedger
from gateway.metrics import GatewayMetrics
from gateway.plugin_registry import PluginRegistry
from gateway.pods.registry import PodRegistry
from gateway.routing.policy import PolicyContext, RoutingRequest
from gateway.routing.router import Router
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from gateway.tokenization.tokenizers import TokenizationService

BS = 16


def batches(n_batches: int, blocks_per_batch: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out, engine_hash = [], 1
    for _ in range(n_batches):
        tokens = [rng.randrange(4096) for _ in range(blocks_per_batch * BS)]
        hashes = list(range(engine_hash, engine_hash + blocks_per_batch))
        engine_hash += blocks_per_batch
        out.append(encode_batch(EventBatch(0.0, [BlockStored(hashes, None, tokens, BS)], 0), Encoding.CURRENT))
    return out


def ingest() -> float:
    payloads = batches(2_000, 16)
    index = PrefixIndex()
    view = index.view("p", 0, "m", BS)
    started = time.perf_counter()
    for payload in payloads:
        index.apply_payload(view, payload)  # as the subscribers do: decoded natively
    return 2_000 * 16 / (time.perf_counter() - started)


def lookup_us() -> float:
    rng = random.Random(1)
    prompt = [rng.randrange(4096) for _ in range(2048)]
    index = PrefixIndex()
    for p in range(16):
        view = index.view(f"pod{p}", 0, "m", BS)
        held = prompt[: rng.randrange(0, 2048) // BS * BS]  # each pod holds a different share
        if held:
            index.apply(view, [BlockStored(list(range(1, len(held) // BS + 1)), None, held, BS)])
    pods = [f"pod{p}" for p in range(16)]
    times = []
    for _ in range(500):
        t = time.perf_counter()
        index.lookup("m", None, prompt, pods)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def memory_per_block() -> float:
    """Bytes of the block index's tables and its writer's own maps per (pod, block) held: every block distinct,
    the costliest case (a block many pods hold has one entry of its own and one small one per pod)."""
    n_pods, per_pod = 8, 125_000
    index = PrefixIndex()
    for p in range(n_pods):
        view = index.view(f"pod{p}", 0, "m", BS)
        for payload in batches(per_pod // 50, 50, seed=p):
            index.apply_payload(view, payload)
    memory = index.memory()
    return (memory["tables"] + memory["private"]) / index.size()


async def decisions() -> tuple[float, float]:
    rng = random.Random(2)
    words = "the gateway routes each request to the pod holding its prefix blocks for agents".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    pods = PodRegistry([PodConfig(url=f"http://p{i}:1", name=f"pod{i}", models=["m"]) for i in range(16)],
                       HealthConfig())
    for pod in pods.all():
        pod.healthy = True
    metrics = GatewayMetrics()
    tokens = TokenizationService(
        TokenizationConfig(models={"m": ModelTokenizerConfig(path=str(BUNDLED_TOKENIZER_DIR))}, offload_chars=10**9),
        pods, metrics, HttpClient(), InFlightLedger())
    tokens.load()
    index = PrefixIndex(speculative_ttl_s=0)
    for i in range(16):
        index.view(f"pod{i}", 0, "m", BS)
    router = Router(pods, PluginRegistry("gateway.policies", "routing policy"), "kv_aware", {},
                    PolicyContext.standalone(pods, index=index, metrics=metrics))
    policy = router.resolve(None)

    engine_hash = iter(range(1, 10**9))

    async def decide(messages: list[dict]) -> float:
        req = InferenceRequest(model="m", messages=messages)
        t = time.perf_counter()
        rr = RoutingRequest("r", "m", "chat", req, base_model="m")
        rr.token_ids = (await tokens.tokenize("m", "chat", req)).ids
        decision = router.route(rr, policy)
        elapsed = time.perf_counter() - t
        # The pod's events then announce the prompt's blocks: the next turn finds them all.
        ids = rr.token_ids[: len(rr.token_ids) // BS * BS]
        view = index.view(decision.pod.name, 0, "m", BS)
        index.apply(view, [BlockStored([next(engine_hash) for _ in range(len(ids) // BS)], None, ids, BS)])
        return elapsed

    all_new, last_new = [], []
    for _ in range(40):
        convo = [{"role": "system", "content": text(850)}]
        convo += [{"role": "user" if i % 2 == 0 else "assistant", "content": text(60)} for i in range(9)]
        all_new.append(await decide(convo))
        convo.append({"role": "user", "content": text(30)})
        last_new.append(await decide(convo))
    last = await tokens.tokenize("m", "chat", InferenceRequest(model="m", messages=convo))
    hits = index.lookup("m", None, last.ids, [f"pod{i}" for i in range(16)])
    assert max(m.gpu_tokens for m in hits.values()) > 1500  # the last conversation was found cached
    return statistics.median(all_new) * 1e3, statistics.median(last_new) * 1e3


def main() -> None:
    print(f"ingest: {ingest():,.0f} blocks/s (decode + apply, one core)")
    print(f"lookup: {lookup_us():.0f} us median (2,048-token prompt, 16 pods)")
    print(f"memory: {memory_per_block():.0f} bytes per (pod, block) at 1,000,000 blocks")
    every, last = asyncio.run(decisions())
    print(f"routing decision with tokenization (~2,000-token chat, 16 pods): p50 {every:.2f} ms all new, "
          f"{last:.3f} ms only the last message new")


if __name__ == "__main__":
    main()
