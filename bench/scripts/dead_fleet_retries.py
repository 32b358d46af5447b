"""What SDK clients cost a gateway whose fleet is down: gateway requests per call.

    python bench/scripts/dead_fleet_retries.py [--clients 10] [--seconds 20]

One ``gateway serve`` process (one worker) in front of one pod that nothing answers (its port is closed), health
checks every 0.5 s. ``--clients`` official SDK clients, half OpenAI's and half Anthropic's, at their default
``max_retries``, each calling in a loop for ``--seconds``. Prints the calls begun, the gateway's requests
(``gateway_requests_total``) and their ratio: 1 + retries a call, so 3 if the SDKs spent all their retries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import anthropic
import openai

from bench.metrics_text import sample_sum
from bench.runner import stop_processes, wait_http
from simulator.pod import free_port

MESSAGES = [{"role": "user", "content": "hi"}]


def start_gateway() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    path = f"/tmp/kvgw-dead-fleet-{port}.json"
    with open(path, "w") as f:
        json.dump({"pods": [{"url": f"http://127.0.0.1:{free_port()}", "models": ["m"]}],
                   "health": {"interval_s": 0.5}, "server": {"workers": 1}}, f)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", path, "--port", str(port)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", 90, proc)
    return proc, url


async def gateway_requests(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return int(sample_sum(text, "gateway_requests_total", model="m"))


async def call_in_a_loop(n: int, url: str, until: float) -> int:
    """Calls begun by one client until ``until``; each ends in the SDK's error once its retries are spent."""
    calls = 0
    if n % 2:
        client = anthropic.AsyncAnthropic(base_url=url, api_key="none")
        call = lambda: client.messages.create(model="m", max_tokens=5, messages=MESSAGES)  # noqa: E731
    else:
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        call = lambda: oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5)  # noqa: E731
    while time.monotonic() < until:
        calls += 1
        try:
            await call()
        except (openai.APIError, anthropic.APIError):
            pass
    return calls


async def main(clients: int, seconds: float) -> None:
    proc, url = start_gateway()
    try:
        before = await gateway_requests(url)
        until = time.monotonic() + seconds
        calls = sum(await asyncio.gather(*(call_in_a_loop(n, url, until) for n in range(clients))))
        sent = await gateway_requests(url) - before
        print(f"{clients} clients, {seconds:.0f} s: {calls} calls, {sent} gateway requests, "
              f"{sent / max(1, calls):.2f} a call")
    finally:
        stop_processes([proc])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(main(args.clients, args.seconds))
