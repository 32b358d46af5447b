"""Two tenants through one gateway, as clients see them: tenant A floods the fleet with long prompts while tenant B
chats, each client sending one streamed request after another. Shared by the flow-control checks on real vLLM
(tests/e2e/test_flow_control.py) and on simulated pods (tests/integration/test_tenancy_crowd.py).

Runs are sized by the answers a quantile is read from, not by seconds: a run lasts at least its seconds, goes on
until B has its answers, and is cut at a cap measured in B's floor (B alone's TTFT p90 plus one of A's prefills,
both measured on the idle fleet through the same gateway), so a slower machine runs longer instead of failing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from bench.tenants import weighted_tokens
from bench.workloads import FAIRNESS_HEADER, text

# An answer whose stream ended before its usage (the pod or the gateway cut it).
INCOMPLETE = 0


@dataclass(frozen=True, slots=True)
class Answer:
    tenant: str
    status: int
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def weighted(self) -> float:
        return weighted_tokens(self.prompt_tokens, self.cached_tokens, self.completion_tokens)


@dataclass(slots=True)
class Run:
    """One run of the tenants through one gateway: every answer, the gateway's flow counts (outcome by
    tenant) and how many requests the pod itself says it finished meanwhile."""

    answers: list[Answer]
    flow_requests: dict[tuple[str, str], float] = field(default_factory=dict)
    pod_finished: float = 0.0

    def of(self, tenant: str) -> list[Answer]:
        return [a for a in self.answers if a.tenant == tenant]

    def answered(self, tenant: str) -> int:
        return sum(a.status == 200 for a in self.of(tenant))

    def ttft(self, tenant: str, q: float) -> float:
        return quantile([a.ttft_s for a in self.of(tenant) if a.status == 200], q)

    def share(self, tenant: str) -> float:
        served = {t: sum(a.weighted for a in self.of(t) if a.status == 200) for t in ("A", "B")}
        total = sum(served.values())
        return served[tenant] / total if total else 0.0


@dataclass(slots=True)
class Idle:
    """The fleet idle, through the gateway: B alone, and A's prompts one at a time (their TTFTs: prefills)."""

    b: Run
    a_prefills_s: list[float]

    def __add__(self, other: Idle) -> Idle:
        return Idle(Run(self.b.answers + other.b.answers), self.a_prefills_s + other.a_prefills_s)

    @property
    def a_prefill_s(self) -> float:
        return statistics.median(self.a_prefills_s)

    @property
    def floor_s(self) -> float:
        """B's floor: B alone's TTFT p90 plus one of A's prefills."""
        return self.b.ttft("B", 0.9) + self.a_prefill_s


@dataclass(slots=True)
class Measured:
    """The idle fleet measured before the flood and after it (the floor from both: on a machine whose other load
    comes and goes, either side alone can catch a quiet or a busy moment), and the flood."""

    before: Idle
    after: Idle
    on: Run
    off: Run | None = None

    @property
    def idle(self) -> Idle:
        return self.before + self.after

    @property
    def floor_s(self) -> float:
        return self.idle.floor_s


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile, as the bench reads its own; NaN when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] if ordered else float("nan")


async def stream_chat(http: aiohttp.ClientSession, url: str, tenant: str, content: str, max_tokens: int,
                      model: str) -> Answer:
    """One streamed chat as ``tenant``; its TTFT is the first event with a choice (vLLM sends its first
    chunk, the role, with the first token)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    sent = time.monotonic()
    ttft, usage = None, None
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={FAIRNESS_HEADER: tenant}) as resp:
        if resp.status != 200:
            await resp.read()
            return Answer(tenant, resp.status)
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.monotonic() - sent
            usage = event.get("usage") or usage
    if ttft is None or usage is None:
        return Answer(tenant, INCOMPLETE)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Answer(tenant, 200, ttft, usage["prompt_tokens"], cached, usage["completion_tokens"])


@dataclass(slots=True)
class Window:
    """While clients send: until ``until``, then on (every tenant: the load stays) while B has fewer than
    ``b_answers`` answers, until ``cap`` at most."""

    until: float
    out: list[Answer]
    b_answers: int = 0
    cap: float = math.inf

    @classmethod
    def of(cls, seconds: float, out: list[Answer], b_answers: int = 0, cap_s: float = math.inf) -> Window:
        now = time.monotonic()
        return cls(now + seconds, out, b_answers, now + max(seconds, cap_s))

    def open(self) -> bool:
        now = time.monotonic()
        answered = sum(a.tenant == "B" and a.status == 200 for a in self.out)
        return now < self.until or (now < self.cap and answered < self.b_answers)


async def chat_client(http: aiohttp.ClientSession, url: str, tenant: str, name: str, words: int, max_tokens: int,
                      window: Window, model: str) -> None:
    """One client sending one request after another while ``window`` is open, each prompt its own: it begins
    with the client's name and count, so no prompt shares a cached block with another."""
    rng = random.Random(name)
    for i in itertools.count():
        if not window.open():
            return
        window.out.append(await stream_chat(http, url, tenant, f"{name} request {i}: {text(rng, words)}",
                                            max_tokens, model))


@dataclass(frozen=True, slots=True)
class Crowd:
    """Who sends what: A's clients and their documents, B's clients and their chats, and how a run is sized."""

    model: str
    a_clients: int
    a_words: int
    a_max_tokens: int
    b_clients: int = 2
    b_words: int = 100
    b_max_tokens: int = 16
    alone_s: float = 4.0  # B alone: at least this long, until it has ``alone_answers``, ``alone_cap_s`` at most
    alone_answers: int = 30
    alone_cap_s: float = 60.0
    flood_s: float = 12.0  # the flood: at least this long, until B has its answers, ``cap_floors`` at most
    b_joins_at_s: float = 2.0  # B starts once A's first wave has filled the fleet
    b_answers: int = 60
    cap_floors: float = 240.0


async def idle_fleet(url: str, tag: str, crowd: Crowd) -> Idle:
    """B alone, then three of A's prompts one at a time, on the idle fleet."""
    out: list[Answer] = []
    async with aiohttp.ClientSession() as http:
        await stream_chat(http, url, "warmup", f"{tag} warm-up: {text(random.Random(tag), crowd.b_words)}", 1,
                          crowd.model)
        window = Window.of(crowd.alone_s, out, crowd.alone_answers, crowd.alone_cap_s)
        await asyncio.gather(*(chat_client(http, url, "B", f"{tag}-alone-B{c}", crowd.b_words, crowd.b_max_tokens,
                                           window, crowd.model) for c in range(crowd.b_clients)))
        a = [await stream_chat(http, url, "A", f"{tag} idle A{i}: {text(random.Random(f'{tag}{i}'), crowd.a_words)}",
                               crowd.a_max_tokens, crowd.model) for i in range(3)]
    assert all(answer.status == 200 for answer in a), a
    return Idle(Run(out), [answer.ttft_s for answer in a])


async def flood(url: str, tag: str, crowd: Crowd, floor_s: float) -> Run:
    """A's clients from the start, B's from ``b_joins_at_s``, none sending after ``flood_s`` once B has its
    answers, nor after ``cap_floors`` floors."""
    out: list[Answer] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        window = Window.of(crowd.flood_s, out, crowd.b_answers, crowd.cap_floors * floor_s)

        async def b_side() -> None:
            await asyncio.sleep(crowd.b_joins_at_s)
            await asyncio.gather(*(chat_client(http, url, "B", f"{tag}-B{c}", crowd.b_words, crowd.b_max_tokens,
                                               window, crowd.model) for c in range(crowd.b_clients)))

        await asyncio.gather(b_side(), *(chat_client(http, url, "A", f"{tag}-A{c}", crowd.a_words, crowd.a_max_tokens,
                                                     window, crowd.model) for c in range(crowd.a_clients)))
    return Run(out)


def measure(url: str, tag: str, crowd: Crowd) -> Measured:
    """The idle fleet, the flood, and the idle fleet again, through the gateway at ``url``."""
    before = asyncio.run(idle_fleet(url, tag, crowd))
    on = asyncio.run(flood(url, tag, crowd, before.floor_s))
    after = asyncio.run(idle_fleet(url, f"{tag}-after", crowd))
    return Measured(before, after, on)


def summary(m: Measured) -> str:
    """One line: B's floor, how it was made, and B's and A's figures beside each other."""
    on = m.on
    return (f"B's floor {m.floor_s:.3f} s = B alone p90 {m.idle.b.ttft('B', 0.9):.3f} s + one A prefill "
            f"{m.idle.a_prefill_s:.3f} s (before {m.before.floor_s:.3f} s, after {m.after.floor_s:.3f} s); "
            f"B beside A: TTFT p50 {on.ttft('B', 0.5):.3f} s, p90 {on.ttft('B', 0.9):.3f} s = "
            f"{on.ttft('B', 0.9) / m.floor_s:.2f} floors, {on.answered('B')} answered; A {on.answered('A')} "
            f"answered, TTFT p90 {on.ttft('A', 0.9):.3f} s; statuses {sorted({a.status for a in on.answers})}")
