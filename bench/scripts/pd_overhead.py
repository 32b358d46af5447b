"""What the gateway adds when it splits a request into a prefill leg and a decode leg: simulated pods at
speed 0 (no simulated compute), one client, one request at a time.

    python bench/scripts/pd_overhead.py [--requests 300] [--connector nixl|shared_storage] [--policy kv_aware]

For each request (16 prompts of ~1,000 tokens in turn, interleaved A B C D, D C B A so that drift hits
every way alike):

- ``legs``: the client runs the two legs itself, as the gateway does them (the prefill leg to the prefill
  pod, then the decode leg to the decode pod): the legs' own time;
- ``split``: the same request through a gateway that splits it (``uncached_token_threshold: 0``);
- ``direct`` and ``whole``: the request straight to the decode pod, and through a gateway that serves it
  whole there: what the gateway adds to a request it does not split, for comparison.

The split's added latency is ``split - legs``, request by request (median and p90), and what each
gateway spent per request is its CPU time (steadier than latency on a shared machine: a hop's latency
includes waiting for a core). Every process shares this machine: compare the numbers of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import aiohttp
import orjson

from bench.runner import wait_http
from gateway.config import PodConfig
from gateway.request.disaggregation import NIXL_PREFILL_PARAMS
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from simulator.config import MockPodsConfig
from simulator.launcher import MockPodFleet
from simulator.pod import free_port

MODEL = "mock-llama"


def prompts(n: int = 16) -> list[bytes]:
    words = "cache prefix router token block engine agent stage latency pod gateway kernel".split()
    return [orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": f"Prompt {i}. " + " ".join(words[(i * 7 + j) % len(words)] for j in range(900))},
        {"role": "user", "content": "Say ok."}]}) for i in range(n)]


def start_gateway(pods: list[PodConfig], policy: str, connector: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--policy", policy, "--workers", "1"]
    for p in pods:
        cmd += ["--pod", f"{p.url},events={p.kv_events},replay={p.kv_replay},name={p.name},role={p.role}"]
    env = {**os.environ, "GATEWAY_LOGGING__ACCESS_LOG": "false", "GATEWAY_DISAGGREGATION__CONNECTOR": connector,
           "GATEWAY_DISAGGREGATION__UNCACHED_TOKEN_THRESHOLD": "0",
           "GATEWAY_TOKENIZATION__MODELS": json.dumps({MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}})}
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", 60, proc)
    return proc, url


async def post(http: aiohttp.ClientSession, url: str, body: bytes) -> dict:
    async with http.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        data = await resp.read()
        assert resp.status == 200, data
        return orjson.loads(data)


async def legs(http: aiohttp.ClientSession, prefill: str, decode: str, body: bytes, nixl: bool) -> None:
    """The two legs as the gateway runs them (the prefill body built the same way)."""
    request = orjson.loads(body)
    leg = {**request, "stream": False, "max_tokens": 1, "max_completion_tokens": 1}
    if nixl:
        leg["kv_transfer_params"] = NIXL_PREFILL_PARAMS
    answer = await post(http, f"{prefill}/v1/chat/completions", orjson.dumps(leg))
    if nixl:
        body = orjson.dumps({**request, "kv_transfer_params": answer["kv_transfer_params"]})
    await post(http, f"{decode}/v1/chat/completions", body)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(args: argparse.Namespace, prefill: str, decode: str, split: str, whole: str) -> dict[str, list]:
    nixl = args.connector == "nixl"
    bodies = prompts()
    ways = {
        "legs": lambda b: legs(http, prefill, decode, b, nixl),
        "split": lambda b: post(http, f"{split}/v1/chat/completions", b),
        "direct": lambda b: post(http, f"{decode}/v1/chat/completions", b),
        "whole": lambda b: post(http, f"{whole}/v1/chat/completions", b),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as http:
        for i in range(args.warmup + args.requests):
            order = list(ways) if i % 2 == 0 else list(reversed(ways))
            for name in order:
                started = time.perf_counter()
                await ways[name](bodies[i % len(bodies)])
                if i >= args.warmup:
                    times[name].append((time.perf_counter() - started) * 1000)
    return times


def summary(times: dict[str, list[float]]) -> dict[str, float]:
    def p90(values: list[float]) -> float:
        return sorted(values)[int(0.9 * (len(values) - 1))]

    added = [s - leg for s, leg in zip(times["split"], times["legs"], strict=True)]
    whole = [w - d for w, d in zip(times["whole"], times["direct"], strict=True)]
    out = {f"{name}_p50_ms": statistics.median(values) for name, values in times.items()}
    out.update({"split_added_p50_ms": statistics.median(added), "split_added_p90_ms": p90(added),
                "whole_added_p50_ms": statistics.median(whole), "whole_added_p90_ms": p90(whole)})
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--connector", choices=["nixl", "shared_storage"], default="nixl")
    parser.add_argument("--policy", default="kv_aware")
    args = parser.parse_args()
    fleet = MockPodFleet(MockPodsConfig(count=2, speed=0, prefill_pods=1, connector=args.connector), quiet=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        prefill, decode = fleet.start()
        split_proc, split = start_gateway([prefill, decode], args.policy, args.connector)
        procs.append(split_proc)
        whole_pod = PodConfig(url=decode.url, name=decode.name, kv_events=decode.kv_events,
                              kv_replay=decode.kv_replay)
        whole_proc, whole = start_gateway([whole_pod], args.policy, args.connector)
        procs.append(whole_proc)
        cpu_before = [cpu_seconds(p.pid) for p in procs]
        times = asyncio.run(measure(args, prefill.url, decode.url, split, whole))
        requests = args.requests + args.warmup
        cpu = {f"{name}_gateway_cpu_us": round((cpu_seconds(p.pid) - before) / requests * 1e6)
               for name, p, before in zip(("split", "whole"), procs, cpu_before, strict=True)}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        fleet.stop()
    print(json.dumps({"requests": args.requests, "connector": args.connector, "policy": args.policy,
                      **summary(times), **cpu}, indent=2))


if __name__ == "__main__":
    main()
