"""Token limits held by several gateway processes: tokens served per wall-clock minute against the limit.

    python bench/scripts/token_limits.py [--replicas 2] [--workers 2] [--limit 60000] [--minutes 2] [--clients 24]

``--replicas`` ``gateway serve --workers N`` processes share one Redis (each replica's workers share through
their own link) in front of two simulated pods (speed 0). One API key has ``input_tokens_per_minute:
--limit``; ``--clients`` clients send it chat requests (~250-token prompts) spread over the replicas, as
fast as they are answered, a refused one retrying after 50 ms, for the current minute's rest and
``--minutes`` full minutes more. The table gives, per full wall-clock minute, the prompt tokens served (the
engine's own count, as the answers report it) and their ratio to the limit; and what was refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter

import aiohttp

from bench.runner import start_redis_server, stop_processes, wait_http
from bench.workloads import WORDS
from gateway.config import hash_api_key
from simulator.config import MockPodsConfig
from simulator.launcher import MockPodFleet
from simulator.pod import free_port

KEY = "sk-limited"


def start_replica(pods: list[str], redis_url: str, workers: int, limit: int) -> tuple[subprocess.Popen[bytes], str,
                                                                                       str]:
    port = free_port()
    path = f"/tmp/kvgw-token-limits-{port}.json"
    with open(path, "w") as f:
        json.dump({"pods": [{"url": u} for u in pods], "logging": {"access_log": False},
                   "auth": {"keys": [{"hash": hash_api_key(KEY), "name": "limited"}]},
                   "limits": {"keys": {"limited": {"input_tokens_per_minute": limit}}},
                   "shared_state": {"redis_url": redis_url}}, f)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", path, "--port", str(port),
                             "--workers", str(workers)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", 90, proc)
    return proc, url, path


async def flood(urls: list[str], clients: int, until: float) -> tuple[Counter[int], Counter[str]]:
    served: Counter[int] = Counter()  # wall-clock minute → prompt tokens
    outcomes: Counter[str] = Counter()
    rng = random.Random(0)

    async def client(n: int, http: aiohttp.ClientSession) -> None:
        url, i = urls[n % len(urls)], 0
        while time.time() < until:
            text = " ".join(rng.choice(WORDS) for _ in range(200))
            body = {"model": "mock-llama", "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"{n}-{i} {text}"}]}
            async with http.post(f"{url}/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {KEY}"}) as resp:
                answer = await resp.json()
                if resp.status == 200:
                    served[int(time.time() // 60)] += answer["usage"]["prompt_tokens"]
                    outcomes["served"] += 1
                else:
                    outcomes[f"{resp.status} {answer.get('error', {}).get('code')}"] += 1
                    await asyncio.sleep(0.05)
            i += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(n, http) for n in range(clients)))
    return served, outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=60_000)
    parser.add_argument("--minutes", type=int, default=2)
    parser.add_argument("--clients", type=int, default=24)
    args = parser.parse_args()
    redis_port = free_port()
    redis = start_redis_server("redis-server", redis_port)
    fleet = MockPodsConfig(count=2, speed=0.0, num_blocks=20_000)
    pods = MockPodFleet(fleet, quiet=True)
    replicas: list[tuple[subprocess.Popen[bytes], str, str]] = []
    try:
        urls = [p.url for p in pods.start()]
        for _ in range(args.replicas):
            replicas.append(start_replica(urls, f"redis://127.0.0.1:{redis_port}/0", args.workers, args.limit))
        time.sleep(3)  # the processes hear each other (heartbeats)
        first_full = int(time.time() // 60) + 1
        until = (first_full + args.minutes) * 60.0
        served, outcomes = asyncio.run(flood([url for _, url, _ in replicas], args.clients, until))
        print(f"{args.replicas} replicas x {args.workers} workers, limit {args.limit} input tokens per minute")
        print(f"{'minute':>8}{'tokens served':>16}{'/ limit':>10}")
        for minute in range(first_full, first_full + args.minutes):
            print(f"{minute - first_full + 1:>8}{served[minute]:>16}{served[minute] / args.limit:>10.3f}")
        print(json.dumps({"per_minute": [served[m] for m in range(first_full, first_full + args.minutes)],
                          "limit": args.limit, "outcomes": dict(outcomes)}))
    finally:
        stop_processes((proc for proc, _, _ in replicas), timeout_s=15)
        for _, _, path in replicas:
            os.unlink(path)
        pods.stop()
        redis.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
