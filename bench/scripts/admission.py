"""SLO admission under overload: the same Poisson load through the gateway with admission off and on.

    python bench/scripts/admission.py [--rate 80] [--seconds 15] [--ttft-ms 500]

Two simulated pods (speed 1) behind the gateway; every request carries ``x-slo-ttft-ms``. Reports the
TTFT p50/p90 of answered requests and the share rejected with 429.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import aiohttp

from bench.runner import wait_http
from simulator.pod import free_port


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, ttft_ms: float) -> tuple[int, float]:
    body = {"model": "mock-llama", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": f"{rng.random()} " + "load test " * 200}]}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": str(ttft_ms)}) as r:
        if r.status != 200:
            await r.read()
            return r.status, 0.0
        ttft = None
        async for chunk in r.content.iter_any():
            if ttft is None and b'"content":"' in chunk.replace(b'"content":""', b""):
                ttft = time.perf_counter() - started
        return 200, ttft or 0.0


async def drive(url: str, rate: float, seconds: float, ttft_ms: float) -> dict[str, float]:
    rng = random.Random(0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            tasks.append(asyncio.create_task(one(session, url, rng, ttft_ms)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    ok = sorted(t for s, t in results if s == 200)
    rejected = sum(1 for s, _ in results if s == 429)
    return {"requests": len(results), "answered": len(ok), "rejected_share": rejected / len(results),
            "ttft_p50_ms": statistics.median(ok) * 1000 if ok else 0.0,
            "ttft_p90_ms": ok[int(0.9 * (len(ok) - 1))] * 1000 if ok else 0.0,
            "other_errors": sum(1 for s, _ in results if s not in (200, 429))}


def run(admission: bool, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--mock-pods", "2", "--mock-speed", "1", "--port", str(port),
           "--policy", "least_request"]
    env = {"GATEWAY_LOGGING__ACCESS_LOG": "false", "GATEWAY_LOAD__DEFAULT_CAPACITY": str(args.capacity),
           "GATEWAY_ADMISSION__ENABLED": str(admission).lower(), "GATEWAY_ADMISSION__MAX_QUEUE_WAIT_S": "0.3"}
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        return asyncio.run(drive(f"http://127.0.0.1:{port}", args.rate, args.seconds, args.ttft_ms))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=80)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--ttft-ms", type=float, default=500)
    parser.add_argument("--capacity", type=int, default=12, help="requests in flight per pod at capacity")
    args = parser.parse_args()
    results = {"admission_off": run(False, args), "admission_on": run(True, args)}
    for name, r in results.items():
        print(f"{name:<14} requests {r['requests']:>5.0f}  TTFT p50 {r['ttft_p50_ms']:>7.0f} ms  "
              f"p90 {r['ttft_p90_ms']:>7.0f} ms  429 share {r['rejected_share']:.0%}  other errors "
              f"{r['other_errors']:.0f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
