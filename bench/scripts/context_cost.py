"""What precise routing costs as contexts grow: the router's CPU per request and the latency it adds, at
agent-sized contexts, for sessions that continue and for prompts that are all new.

    python bench/scripts/context_cost.py [--contexts 2000 8000 32000 128000] [--peers] [--turns 12]

For each context length: a session first grows to that many tokens (not measured), then sends ``--turns``
more requests, each adding a ~300-token tool result, one at a time over one connection, as an agent does
(``continuing``); then ``--turns`` prompts of that length that share nothing (``new``). Two simulated pods
at speed 0 answer at once with one token, so what is measured is the router: its own CPU time per request
(from ``/proc``, steadier than wall time on a shared machine) and its median latency above the same
requests sent straight to a pod. Contenders: the gateway's ``kv_aware`` and, with ``--peers``, smg and
vllm-router ``cache_aware`` and vllm-router ``kv_aware`` (each installed into its own environment on first use).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time
import urllib.parse
from typing import Any

import msgspec

from bench.runner import CONTENDERS, BenchRunner, prepare_peers
from bench.workloads import WORDS
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer

PEERS = ("smg-cache_aware", "vllm-router-cache_aware", "vllm-router-kv_aware")
TOOL_RESULT_WORDS = 240  # ~300 tokens


def cpu_seconds(pid: int) -> float:
    """Time the process's threads have spent on a CPU, in nanoseconds from the scheduler (``/proc``'s
    tick counts are too coarse for a few milliseconds a request)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def tree_cpu_seconds(pid: int) -> float:
    """The process and every live descendant (``serve --workers N`` does the work in its workers)."""
    total, pending = 0.0, [pid]
    while pending:
        p = pending.pop()
        try:
            total += cpu_seconds(p)
            children = open(f"/proc/{p}/task/{p}/children").read().split()
        except OSError:
            continue
        pending += [int(c) for c in children]
    return total


def words_for(tokenizer: HfTokenizer, tokens: int) -> int:
    sample = " ".join(WORDS * 20)
    per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / (len(WORDS) * 20)
    return max(1, int(tokens / per_word))


class Client:
    """One kept-alive connection per server, as an agent's SDK keeps one: what is measured is each
    request, not a TCP handshake per request."""

    def __init__(self) -> None:
        self._connections: dict[str, http.client.HTTPConnection] = {}

    def post(self, url: str, body: dict[str, Any]) -> float:
        """Send one chat request; its wall time."""
        data = msgspec.json.encode(body)
        connection = self._connections.get(url)
        if connection is None:
            host, port = urllib.parse.urlsplit(url).netloc.split(":")
            connection = self._connections[url] = http.client.HTTPConnection(host, int(port), timeout=600)
        started = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body=data, headers={"content-type": "application/json"})
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
        return time.perf_counter() - started

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()


class Session:
    """A conversation that grows by one tool result per request, as an agent's does."""

    def __init__(self, rng: random.Random, model: str, words: int) -> None:
        self.rng, self.model = rng, model
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a coding agent. Tools: read, edit, run. " + self.text(400)},
            {"role": "user", "content": "Fix the failing test. " + self.text(60)}]
        while sum(len(m["content"].split()) for m in self.messages) < words:
            self.turn()

    def text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def turn(self) -> dict[str, Any]:
        self.messages += [{"role": "assistant", "content": "Running the tool. " + self.text(20)},
                          {"role": "user", "content": "Tool result: " + self.text(TOOL_RESULT_WORDS)}]
        return self.body()

    def body(self) -> dict[str, Any]:
        """This turn's request (its own copy of the messages: the session goes on growing)."""
        return {"model": self.model, "messages": list(self.messages), "max_tokens": 1}


def measure(client: Client, router: str, pod: str, pid: int, bodies: list[dict[str, Any]]) -> dict[str, float]:
    """Each body through the router, then straight to the pod: CPU per request, added latency."""
    cpu0 = tree_cpu_seconds(pid)
    through = [client.post(router, b) for b in bodies]
    cpu = tree_cpu_seconds(pid) - cpu0
    direct = [client.post(pod, b) for b in bodies]
    added = statistics.median(t - d for t, d in zip(through, direct, strict=True))
    return {"cpu_ms_per_req": round(cpu / len(bodies) * 1000, 2), "added_ms_p50": round(added * 1000, 2),
            "router_ms_p50": round(statistics.median(through) * 1000, 2)}


def run(contender_name: str, contexts: list[int], turns: int, tokenizer: HfTokenizer, warm: int
        ) -> dict[str, dict[str, float] | str]:
    longest = max(contexts) + 4096
    results: dict[str, dict[str, float] | str] = {}
    client = Client()
    try:
        runner = BenchRunner(pods=2, num_blocks=2 * longest // 16, speed=0.0, progress=False,
                             max_model_len=longest * 2, peers=prepare_peers([CONTENDERS[contender_name]], True))
        with runner.serving(CONTENDERS[contender_name]) as (routers, pods):
            assert routers
            router, pid = routers[0], runner.router_processes[0].pid
            for tokens in contexts:
                rng = random.Random(tokens)
                words = words_for(tokenizer, tokens)
                session = Session(rng, runner.model, words)
                for _ in range(warm):  # the context is seen (and cached) before it is measured
                    client.post(router, session.turn())
                results[f"{tokens} continuing"] = measure(client, router, pods[0].url, pid,
                                                          [session.turn() for _ in range(turns)])
                new = [Session(random.Random(tokens * 1000 + i), runner.model, words).body()
                       for i in range(max(2, turns // 3))]
                results[f"{tokens} new"] = measure(client, router, pods[0].url, pid, new)
                print(f"  {contender_name} {tokens}: {results[f'{tokens} continuing']} | {results[f'{tokens} new']}",
                      file=sys.stderr, flush=True)
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        return {"skipped": str(exc)}
    finally:
        client.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2000, 8000, 32000, 128000])
    parser.add_argument("--turns", type=int, default=12, help="measured requests per context length")
    parser.add_argument("--warm", type=int, default=3, help="requests of the session before measuring")
    parser.add_argument("--peers", action="store_true", help="also smg and vllm-router")
    parser.add_argument("--contender", action="append", help="instead of the defaults (repeatable)")
    args = parser.parse_args()
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR)
    names = args.contender or ["gateway-kv_aware", *(PEERS if args.peers else ())]
    table = {name: run(name, args.contexts, args.turns, tokenizer, args.warm) for name in names}
    print(f"{'contender':<28}{'context':>9}{'mix':>12}{'CPU ms/req':>12}{'added ms p50':>14}")
    for name, rows in table.items():
        if "skipped" in rows:
            print(f"{name:<28} skipped: {rows['skipped']}")
            continue
        for key, r in rows.items():
            tokens, mix = key.split()
            print(f"{name:<28}{tokens:>9}{mix:>12}{r['cpu_ms_per_req']:>12.2f}{r['added_ms_p50']:>14.2f}")
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
