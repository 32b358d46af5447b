"""What model rules and key limits cost a request: the gateway's CPU per request with none configured, and
with them, measured side by side and alternated so that drift on a shared machine falls on both.

    python bench/scripts/model_rules_cost.py [--rounds 12] [--requests 40] [--context-words 1200]

Four ``gateway serve`` processes (one worker each, ``kv_aware``) in front of the same two simulated pods
(speed 0: sixteen-token answers at once, streamed, so that the answer's rewriting is measured):

- ``none``: no rules; requests name the pods' model;
- ``alias``: a rule maps a public name to that model; requests name the public name, so each body is
  rewritten for the pod and each streamed event's ``model`` restored;
- ``key``: no rules, requests with an API key (no limits): what a key costs before its limits;
- ``alias+limits``: the alias, and the key with token and concurrency limits (its prompts counted exactly,
  charged, corrected to the engine's usage, its usage tallied).

Each request continues an agent's session (its whole conversation re-sent, plus a tool result), one at a
time over a kept-alive connection. Per round, each process serves ``--requests`` requests in turn; its CPU
(``/proc`` schedstat of its threads) per request is taken; the table gives the median over the rounds and
each configuration's ratio to ``none``: the ratio of the medians, and the median of the per-round ratios
(each configuration against ``none`` in the same round, which cancels most of the machine's drift) with the
standard error of their mean.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
from typing import Any

import msgspec

from bench.runner import stop_processes, wait_http
from bench.workloads import WORDS
from gateway.config import hash_api_key
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from simulator.config import MockPodsConfig
from simulator.launcher import MockPodFleet
from simulator.pod import free_port

MODEL = "mock-llama"
KEY = "sk-bench"


def cpu_seconds(pid: int) -> float:
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def start_gateway(pods: list[str], config: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    path = f"/tmp/kvgw-rules-cost-{port}.json"
    with open(path, "w") as f:
        json.dump({"pods": [{"url": u} for u in pods], "routing": {"policy": "kv_aware"},
                   "tokenization": {"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
                   "logging": {"access_log": False}, **config}, f)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", path, "--port", str(port),
                             "--workers", "1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", 60, proc)
    return proc, url, path


class Agent:
    """A session re-sending its whole conversation each turn, plus a tool result."""

    def __init__(self, seed: int, words: int) -> None:
        self.rng = random.Random(seed)
        self.messages = [{"role": "system", "content": "You are a coding agent. " + self.text(words)}]

    def text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def turn(self, model: str) -> bytes:
        self.messages.append({"role": "user", "content": "Tool result: " + self.text(120)})
        body = {"model": model, "messages": self.messages, "max_tokens": 16, "stream": True,
                "stream_options": {"include_usage": True}}
        self.messages.append({"role": "assistant", "content": "Next step."})
        return msgspec.json.encode(body)


def serve(connection: http.client.HTTPConnection, body: bytes, headers: dict[str, str]) -> None:
    connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
    response = connection.getresponse()
    data = response.read()
    assert response.status == 200 and b"[DONE]" in data, (response.status, data[:200])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=40, help="per process and round")
    parser.add_argument("--context-words", type=int, default=1200, help="the session's system prompt")
    args = parser.parse_args()
    configs = {
        "none": ({}, MODEL, {}),
        "alias": ({"models": {"rules": {"gpt-4o-mini": {"target": MODEL}}}}, "gpt-4o-mini", {}),
        "key": ({"auth": {"keys": [{"hash": hash_api_key(KEY), "name": "team-a"}]}}, MODEL,
                {"authorization": f"Bearer {KEY}"}),
        "alias+limits": ({"models": {"rules": {"gpt-4o-mini": {"target": MODEL}}},
                          "auth": {"keys": [{"hash": hash_api_key(KEY), "name": "team-a"}]},
                          "limits": {"keys": {"team-a": {"input_tokens_per_minute": 10**9,
                                                         "output_tokens_per_minute": 10**9, "max_concurrent": 64}}}},
                         "gpt-4o-mini", {"authorization": f"Bearer {KEY}"}),
    }
    fleet = MockPodFleet(MockPodsConfig(count=2, model=MODEL, num_blocks=60_000, speed=0.0), quiet=True)
    started: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        pods = [p.url for p in fleet.start()]
        gateways = {}
        for name, (config, model, headers) in configs.items():
            proc, url, path = start_gateway(pods, config)
            started.append((proc, path))
            host, port = url.split("//")[1].split(":")
            gateways[name] = (proc, http.client.HTTPConnection(host, int(port), timeout=60), model,
                              {"content-type": "application/json", **headers}, Agent(1, args.context_words))
        for _, connection, model, headers, agent in gateways.values():  # warm: tokenizers, caches
            for _ in range(10):
                serve(connection, agent.turn(model), headers)
        per_request: dict[str, list[float]] = {name: [] for name in gateways}
        for round_ in range(args.rounds):
            order = list(gateways) if round_ % 2 == 0 else list(reversed(gateways))
            for name in order:
                proc, connection, model, headers, _ = gateways[name]
                agent = Agent(1000 + round_, args.context_words)  # a fresh session each round, the same for all
                bodies = [agent.turn(model) for _ in range(args.requests)]
                before = cpu_seconds(proc.pid)
                for body in bodies:
                    serve(connection, body, headers)
                per_request[name].append((cpu_seconds(proc.pid) - before) / args.requests * 1000)
        base = statistics.median(per_request["none"])
        print(f"{'configuration':<16}{'CPU ms/req (median)':>22}{'vs none':>10}{'paired':>10}{'+-':>8}")
        for name, values in per_request.items():
            median = statistics.median(values)
            paired = [v / b for v, b in zip(values, per_request["none"], strict=True)]
            error = statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else 0.0
            print(f"{name:<16}{median:>22.3f}{median / base:>10.3f}{statistics.median(paired):>10.3f}{error:>8.3f}")
        print(json.dumps({name: [round(v, 4) for v in values] for name, values in per_request.items()}))
    finally:
        stop_processes(proc for proc, _ in started)
        for _, path in started:
            os.unlink(path)
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
