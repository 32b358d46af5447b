"""What one request routed by another gateway process costs every process that learns of it.

    python bench/scripts/replication.py [--workflows 50] [--stages 4] [--prompt-words 1500]

A gateway worker (``kv_aware``, workflows, sessions, contexts and speculative blocks all shared) serves
agentic workflows over simulated pods: each workflow's stages grow one conversation over a long role
prompt. The state-bus datagrams it sends its sibling are captured off the sibling's socket, then applied
to a second gateway, as that sibling would apply them, timing the decoding and each kind of fact. With
``N`` workers or replicas serving ``R`` requests per second in all, each process applies the facts of
``R * (N - 1) / N`` of them: the per-request cost printed here times that is the share of a core the
state bus takes from each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from gateway.app import Assembly, build_app, build_gateway
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.wire import DECODER
from gateway.config import load_config
from gateway.load.shared_table import SharedLoadTable
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from simulator.pod import MockPod, MockPodConfig

MODEL = "mock-llama"
WORDS = "agent tool result plan review file change test build deploy cache block".split()


def gateway_kits(pods: list[dict[str, Any]], identity: WorkerIdentity) -> Assembly:
    SharedLoadTable.create(identity.load_table, identity.count).close()
    config = load_config(overrides={
        "pods": pods, "routing": {"policy": "kv_aware"},
        "tokenization": {"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
        "shared_state": {"share": ["workflows", "sessions", "contexts", "speculative"]},
    }, environ={})
    return build_gateway(config, identity=identity)


async def capture(pods: list[dict[str, Any]], run_dir: str, workflows: int, stages: int, prompt_words: int
                  ) -> tuple[list[bytes], int]:
    """Serve the workflows through worker 0 of 2 and return what it sent worker 1, and the requests."""
    sender = WorkerIdentity("r", 0, 2, run_dir)
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    sink.bind(sender.bus_socket(1))
    sink.setblocking(False)
    runner = web.AppRunner(build_app(gateway_kits(pods, sender)), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    datagrams: list[bytes] = []
    requests = 0
    try:
        async with aiohttp.ClientSession() as http:
            async def workflow(w: int) -> None:
                nonlocal requests
                role = " ".join(WORDS[(w % 4 + i) % len(WORDS)] for i in range(prompt_words))
                history: list[dict[str, str]] = [{"role": "system", "content": role}]
                for s in range(stages):
                    history.append({"role": "user", "content": f"workflow {w} stage {s}: " + " ".join(
                        WORDS[(w + s + i) % len(WORDS)] for i in range(60))})
                    body = {"model": MODEL, "messages": history, "max_tokens": 16}
                    headers = {"x-workflow-id": f"wf-{w}", "x-stage-id": f"s{s}"}
                    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
                        payload = await resp.json()
                        assert resp.status == 200, payload
                    history.append(payload["choices"][0]["message"])
                    requests += 1
                    drain(sink, datagrams)
            for start in range(0, workflows, 8):
                await asyncio.gather(*(workflow(w) for w in range(start, min(workflows, start + 8))))
        await asyncio.sleep(0.05)  # the last flush
        drain(sink, datagrams)
    finally:
        await runner.cleanup()
        sink.close()
    return datagrams, requests


def drain(sink: socket.socket, into: list[bytes]) -> None:
    while True:
        try:
            into.append(sink.recv(1 << 20))
        except BlockingIOError:
            return


def apply_all(pods: list[dict[str, Any]], run_dir: str, datagrams: list[bytes]) -> dict[str, float]:
    """Apply the captured batches to a fresh worker 1; nanoseconds spent decoding and per kind of fact."""
    bus = gateway_kits(pods, WorkerIdentity("r", 1, 2, run_dir)).shared.bus
    spent: Counter[str] = Counter()
    def timed(handler: Any, name: str) -> Any:
        def run(origin: str, fact: Any) -> None:
            t0 = time.perf_counter_ns()
            handler(origin, fact)
            spent[name] += time.perf_counter_ns() - t0
        return run

    for kind, handlers in list(bus._handlers.items()):
        bus._handlers[kind] = [timed(handler, kind.__name__) for handler in handlers]
    t0 = time.perf_counter_ns()
    for data in datagrams:
        DECODER.decode(data)
    spent["decode"] = time.perf_counter_ns() - t0
    t0 = time.perf_counter_ns()
    for data in datagrams:
        bus._received(data, False)  # decodes again, then applies
    spent["total"] = time.perf_counter_ns() - t0
    return dict(spent)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflows", type=int, default=50)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=1500)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR)
    mock_pods = [MockPod(MockPodConfig(speed=0.0, num_blocks=4000), tokenizer=tokenizer) for _ in range(4)]
    for pod in mock_pods:
        await pod.start()
    pods = [{"url": p.pod_config().url, "name": f"pod{i}", "kv_events": p.pod_config().kv_events}
            for i, p in enumerate(mock_pods)]
    run_dirs = [tempfile.mkdtemp(prefix="gw-", dir="/tmp") for _ in range(args.repeat + 1)]
    try:
        datagrams, requests = await capture(pods, run_dirs[0], args.workflows, args.stages, args.prompt_words)
        runs = [apply_all(pods, d, datagrams) for d in run_dirs[1:]]
    finally:
        for pod in mock_pods:
            await pod.stop()
        for d in run_dirs:
            shutil.rmtree(d, ignore_errors=True)
    facts = Counter(type(f).__name__ for data in datagrams for f in DECODER.decode(data).facts)
    per_request_us = {name: round(statistics.median(r.get(name, 0) for r in runs) / requests / 1000, 2)
                      for name in sorted(set().union(*runs), key=lambda n: -runs[0].get(n, 0))}
    print(json.dumps({
        "requests": requests,
        "bytes_per_request": round(sum(map(len, datagrams)) / requests),
        "facts_per_request": {k: round(v / requests, 2) for k, v in facts.most_common()},
        "apply_us_per_request": per_request_us,
    }, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
