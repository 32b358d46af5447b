"""A model rule's target whose pods all die mid-run: what its requests became.

    python bench/scripts/fallback_kill.py [--requests 600] [--clients 32] [--kill-after 0.4]

Simulated pods as processes (speed 1): two serve ``stable``, one ``fallback``. The gateway
(``serve --workers 1``) maps ``chat`` to ``stable`` with ``fallback`` after it. ``--clients`` clients send
``--requests`` streamed chat requests in all; once ``--kill-after`` of them were answered, both ``stable``
pods are SIGKILLed at once. Each request ends as: answered whole by ``stable`` or by ``fallback``; cut after
its stream had begun (its pod died under it: the client got an error event); or lost (an error status before
any byte: the number the fallback is there to keep at 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import aiohttp

from bench.runner import wait_http
from simulator.config import MockPodsConfig
from simulator.launcher import MockPodFleet
from simulator.pod import free_port


async def run(url: str, requests: int, clients: int, kill_after: float, kill) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    answered = 0
    killed = False
    queue = iter(range(requests))

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal answered, killed
        for i in queue:
            body = {"model": "chat", "max_tokens": 32, "stream": True,
                    "messages": [{"role": "user", "content": f"Request {i}: tell me about the weather."}]}
            started = False
            try:
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        outcomes[f"lost ({resp.status})"] += 1
                        continue
                    target = resp.headers.get("x-gateway-model", "?")
                    text = b""
                    async for chunk in resp.content.iter_any():
                        started = True
                        text += chunk
                    outcomes["cut after its stream began" if b'"error"' in text or b"[DONE]" not in text
                             else f"answered by {target}"] += 1
            except aiohttp.ClientError:
                outcomes["cut after its stream began" if started else "lost (connection)"] += 1
            answered += 1
            if not killed and answered >= kill_after * requests:
                killed = True
                kill()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--kill-after", type=float, default=0.4)
    args = parser.parse_args()
    stable = MockPodFleet(MockPodsConfig(count=2, model="stable", speed=1.0), quiet=True)
    fallback = MockPodFleet(MockPodsConfig(count=1, model="fallback", speed=1.0), quiet=True)
    gateway = None
    path = f"/tmp/kvgw-fallback-{os.getpid()}.json"
    try:
        pods = [*stable.start(), *fallback.start()]
        with open(path, "w") as f:
            json.dump({"pods": [{"url": p.url, "name": f"pod{i}"} for i, p in enumerate(pods)],
                       "logging": {"access_log": False}, "health": {"interval_s": 0.5},
                       "models": {"rules": {"chat": {"target": "stable", "fallbacks": ["fallback"]}}}}, f)
        port = free_port()
        gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", path, "--port",
                                    str(port), "--workers", "1"], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/readyz", 60, gateway)
        time.sleep(1)

        def kill() -> None:
            for member in stable.members:
                os.kill(member.process.pid, signal.SIGKILL)

        outcomes = asyncio.run(run(url, args.requests, args.clients, args.kill_after, kill))
        lost = sum(n for name, n in outcomes.items() if name.startswith("lost"))
        for name, n in sorted(outcomes.items()):
            print(f"{name:<32}{n:>6}")
        print(f"{'lost before streaming':<32}{lost:>6}")
        print(json.dumps({"outcomes": dict(outcomes), "lost": lost}))
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=15)
        stable.stop()
        fallback.stop()
        if os.path.exists(path):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
