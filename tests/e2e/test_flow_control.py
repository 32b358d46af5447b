"""Flow control on a real vLLM pod: tenant A floods it with long prompts while tenant B chats (issue 34's
noisy neighbor, with fewer requests).

One pod, started with ``--max-model-len 4096`` (the tiny model's ``max_position_embeddings``) so that A's
prompts of about 3,700 tokens cost a clear prefill (~0.08 s on the idle pod, several times B's TTFT). A asks
for few output tokens: here every output token costs a batch step (~0.03 s with 32 requests running), so
32 of them would cost A more than its prefill, and B would wait on decode steps that no gateway order can
shorten (tried with 1,650-token prompts and 32 output tokens: B's p90 1.8 floors with flow control, 6.4
without). With few, A's flood is prefill-bound, the one the issue's floor is about. The gateway runs as its
own process with one worker (see ``WORKERS``), once with flow control on and once off; the clients are this
process's.

B's floor is B alone (through the same gateway, idle pod) plus one of A's prefills on the idle pod: a pod
that gives each step first to the prefill it runs cannot do better for B while A keeps it busy. Both are
measured before the flood and again after it, and pooled, on the machine the suite runs on; the runs are sized
by answers and capped in floors, so a slower machine (or one beside a CPU hog) runs longer, not short of
answers. The table the module prints (``-s``) holds the figures docs/benchmarks.md quotes.

The same flood of distinct documents with longer answers (``DOC_MAX_TOKENS``) runs on the first pod and on a
second one started with ``--scheduling-policy priority``, to which the gateway sends each request's priority
(its band, then its flow's service as it leaves). And the simulated engine's scheduler is checked step for step
against both pods: the same requests, paused and resumed at the same points, give the same KV event batches.

Issue 54's crowd (64 of A's clients, each sending one new document after another, 64-token answers) runs on both
pods as one fleet of two, whose long prefills the gateway staggers (tests/tenant_flood.py holds the clients).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from bench.workloads import text
from gateway.kv.events import AllBlocksCleared, BlockStored, KvEvent
from simulator.engine import EngineLimits, MockEngine, SchedulingPolicy, TimingModel
from simulator.kvcache import PagedKvCache
from tests.conftest import gateway_process
from tests.e2e.conftest import BLOCK_SIZE, MODEL, VllmFleet, VllmPod, running_pods
from tests.e2e.kv_replay import replayed_batches
from tests.e2e.test_keep_warm import reset
from tests.e2e.test_real_vllm import pod_metric, post
from tests.tenant_flood import (
    Answer,
    Crowd,
    Idle,
    Measured,
    Run,
    Window,
    chat_client,
    measure,
    stream_chat,
    summary,
)

MAX_MODEL_LEN = 4096
A_CLIENTS = 32
A_WORDS = 1900  # about 3,700 tokens with this tokenizer: within MAX_MODEL_LEN with A's answer
A_MAX_TOKENS = 4
B_CLIENTS = 2
B_WORDS = 100  # about 200 tokens
B_MAX_TOKENS = 16
# The runs are sized by the answers they read a quantile from, not by seconds: machines of our kind differ
# up to 5x in vLLM CPU speed (A's prefill took 0.13-0.15 s here, 0.79-0.84 s on a slower one, where a flood
# cut at a fixed 36 s left B 16-18 answers). Each run lasts at least its *_S, goes on until it has its
# answers, and is cut at a cap measured in the floor (B alone's p90 plus one of A's prefills, both measured
# first on this machine), so the cap grows with the pod's slowness and the suite's time with it.
ALONE_S = 4.0
ALONE_ANSWERS = 30  # B alone: its p90 is the floor's first term
ALONE_CAP_S = 60.0  # before any floor is known: B alone answered 30 times in 2-3 s here
FLOOD_S = 12.0
B_JOINS_AT_S = 2.0  # B starts once A's first wave has filled the pod
TARGET = 1.5  # B's TTFT p90 beside A, in floors
# B's answers a p90 is read from: the flood goes on (A's clients too) until B has them. B answered 31-60 times
# in FLOOD_S on this machine, but 16 in one CI run. With 30-36 answers the p90 is the 4th slowest of them; 60
# halve what one slow answer moves it (ten runs in a row: docs/flow-isolation.md).
B_ANSWERS = 60
# Without flow control B waits many floors an answer: enough for a p90 that shows it, no more.
B_ANSWERS_WITHOUT = 6
# A flood's cap, in floors: 36 s here (floor ~0.155 s); ~210 s where A's prefill takes 0.8 s. B's 60 answers
# came in 12-24 s here, so the cap only ends a run that would never get them.
FLOOD_CAP_FLOORS = 240
DOC_MAX_TOKENS = 32  # the documents flood: A's answers, longer
REFUSALS = ("queue_full", "queue_timeout", "slo_unreachable")  # gateway_flow_requests_total's 429 outcomes
# One gateway worker. The workers of ``gateway serve`` agree which held request goes next
# (gateway/flow/release_order.py, tested in tests/unit/test_release_order.py), and with two this test passed
# 7 of 8 runs (B 59-60 answered with this code, 29 before the workers agreed). But with two workers on this 2-core
# machine, beside the pod and the clients, B alone's TTFT p90 is 0.07-0.10 s against 0.015 s with one (p50
# 0.012-0.015 s either way), and B's p90 beside A 0.15-0.21 s against 0.11-0.14 s: the floor and the ratio
# both move with it (one run reached 1.81 floors). The ratio is the issue's, so it is measured on one worker.
WORKERS = 1
async def idle_pod(url: str, tag: str) -> Idle:
    """B alone, then three of A's prompts one at a time, on the idle pod."""
    out: list[Answer] = []
    async with aiohttp.ClientSession() as http:
        await stream_chat(http, url, "warmup", f"{tag} warm-up: {text(random.Random(tag), B_WORDS)}", 1, MODEL)
        window = Window.of(ALONE_S, out, ALONE_ANSWERS, ALONE_CAP_S)
        await asyncio.gather(*(chat_client(http, url, "B", f"{tag}-alone-B{c}", B_WORDS, B_MAX_TOKENS, window, MODEL)
                               for c in range(B_CLIENTS)))
        a = [await stream_chat(http, url, "A", f"{tag} idle A{i}: {text(random.Random(f'{tag}{i}'), A_WORDS)}",
                               A_MAX_TOKENS, MODEL) for i in range(3)]
    assert all(answer.status == 200 for answer in a), a
    assert all(3000 < answer.prompt_tokens <= MAX_MODEL_LEN - A_MAX_TOKENS for answer in a), a
    return Idle(Run(out), [answer.ttft_s for answer in a])


async def flood(url: str, pod_url: str, tag: str, floor_s: float, b_answers: int = B_ANSWERS,
                a_max_tokens: int = A_MAX_TOKENS) -> Run:
    """A's clients from the start, B's from ``B_JOINS_AT_S``, none sending after ``FLOOD_S`` once B has
    ``b_answers`` answers, nor after ``FLOOD_CAP_FLOORS`` floors."""
    out: list[Answer] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        finished = await pod_metric(http, pod_url, "vllm:request_success_total")
        window = Window.of(FLOOD_S, out, b_answers, FLOOD_CAP_FLOORS * floor_s)

        async def b_side() -> None:
            await asyncio.sleep(B_JOINS_AT_S)
            await asyncio.gather(*(chat_client(http, url, "B", f"{tag}-B{c}", B_WORDS, B_MAX_TOKENS, window, MODEL)
                                   for c in range(B_CLIENTS)))

        await asyncio.gather(b_side(), *(chat_client(http, url, "A", f"{tag}-A{c}", A_WORDS, a_max_tokens, window,
                                                     MODEL) for c in range(A_CLIENTS)))
        finished = await pod_metric(http, pod_url, "vllm:request_success_total") - finished
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    return Run(out, flow_requests(metrics), finished)


def flow_requests(metrics: str) -> dict[tuple[str, str], float]:
    """``gateway_flow_requests_total`` by (fairness id, outcome), every band together."""
    counts: dict[tuple[str, str], float] = {}
    for labels, value in re.findall(r"^gateway_flow_requests_total\{(.*)\} (\S+)$", metrics, re.MULTILINE):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = (label["fairness_id"], label["outcome"])
        counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def gateway_config(path: Path, pod: VllmPod, model_dir: str, flow_control: bool, scheduling: str = "fcfs") -> str:
    path.write_text(json.dumps({"pods": [{**pod.gateway_config(), "scheduling": scheduling}],
                                "server": {"workers": WORKERS},
                                "tokenization": {"models": {MODEL: {"path": model_dir}}},
                                # Named, so that the flow metrics count them apart (any other id is "other").
                                "flow_control": {"enabled": flow_control, "tenants": {"A": {}, "B": {}}}}))
    return str(path)


@pytest.fixture(scope="module")
def flow_pods(model_dir: str) -> Iterator[VllmFleet]:
    """One pod first come, first served and one by priority, each on a core of its own. Given after the
    suite's own --max-model-len 2048, this one counts."""
    long = ("--max-model-len", str(MAX_MODEL_LEN))
    yield from running_pods(model_dir, [("flow", long, {}),
                                        ("flow-priority", (*long, "--scheduling-policy", "priority"), {})])


@pytest.fixture(scope="module")
def flow_pod(flow_pods: VllmFleet) -> VllmPod:
    return flow_pods[0]


@pytest.fixture(scope="module")
def measured(flow_pod: VllmPod, model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Measured:
    """B alone and one of A's prefills on the idle pod, then the flood, through a gateway with flow control
    on, then through one with it off; the table printed."""
    configs = tmp_path_factory.mktemp("flow-control")
    with gateway_process("--config", gateway_config(configs / "on.json", flow_pod, model_dir, True)) as gw:
        before = asyncio.run(idle_pod(gw.url, "on"))
        on = asyncio.run(flood(gw.url, flow_pod.url, "on", before.floor_s))
        after = asyncio.run(idle_pod(gw.url, "on-after"))
    with gateway_process("--config", gateway_config(configs / "off.json", flow_pod, model_dir, False)) as gw:
        off = asyncio.run(flood(gw.url, flow_pod.url, "off", before.floor_s, b_answers=B_ANSWERS_WITHOUT))
    result = Measured(before, after, on, off)
    print(table(result))
    return result


@pytest.fixture(scope="module", params=["fcfs", "priority"])
def documents(request: pytest.FixtureRequest, flow_pods: VllmFleet, model_dir: str,
              tmp_path_factory: pytest.TempPathFactory) -> Measured:
    """A's flood of distinct documents with longer answers, B chatting, through a gateway with flow control on,
    on the pod that serves first come, first served and on the one that serves by priority (told so)."""
    scheduling = request.param
    pod = flow_pods[0 if scheduling == "fcfs" else 1]
    config = gateway_config(tmp_path_factory.mktemp("documents") / f"{scheduling}.json", pod, model_dir, True,
                            scheduling)
    with gateway_process("--config", config) as gw:
        before = asyncio.run(idle_pod(gw.url, f"doc-{scheduling}"))
        on = asyncio.run(flood(gw.url, pod.url, f"doc-{scheduling}", before.floor_s, a_max_tokens=DOC_MAX_TOKENS))
        after = asyncio.run(idle_pod(gw.url, f"doc-{scheduling}-after"))
    result = Measured(before, after, on)
    print(f"\ndocuments, {DOC_MAX_TOKENS}-token answers, scheduling {scheduling}:" + table(result))
    return result


# The crowd of issue 54 (``gateway bench --scenario noisy-neighbor --preset documents``) on both pods as one
# fleet of two: 64 of A's clients each sending one new document after another, as long as this model takes
# (A_WORDS: its context is 4,096 tokens, not the simulator's 3,000 words), with 64-token answers.
CROWD = Crowd(MODEL, a_clients=64, a_words=A_WORDS, a_max_tokens=64, b_clients=B_CLIENTS, b_words=B_WORDS,
              b_max_tokens=B_MAX_TOKENS, alone_s=ALONE_S, alone_answers=ALONE_ANSWERS, alone_cap_s=ALONE_CAP_S,
              flood_s=FLOOD_S, b_joins_at_s=B_JOINS_AT_S, b_answers=B_ANSWERS, cap_floors=FLOOD_CAP_FLOORS)


@pytest.fixture(scope="module")
def crowd(flow_pods: VllmFleet, model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Measured:
    """The crowd of documents on the two pods (one serving first come, first served, one by priority), through a
    gateway with flow control on: the pods' long prefills staggered (gateway/flow/saturation.py)."""
    config = tmp_path_factory.mktemp("crowd") / "gateway.json"
    config.write_text(json.dumps({
        "pods": [{**flow_pods[0].gateway_config(), "scheduling": "fcfs"},
                 {**flow_pods[1].gateway_config(), "scheduling": "priority"}],
        "server": {"workers": WORKERS}, "tokenization": {"models": {MODEL: {"path": model_dir}}}}))
    with gateway_process("--config", str(config)) as gw:
        result = measure(gw.url, "crowd", CROWD)
    print("\ncrowd of documents, 2 pods: " + summary(result))
    return result


# On these two pods, which share two cores with the gateway and the 66 clients, neither B's median nor its p90
# tells the stagger on from off in every run: B's p50 was 0.10-0.29 floors with it in twelve runs of this test
# alone and 0.51 once in a full suite, 0.57-0.75 without (three runs); its p90 0.67-2.25 floors with it, 1.22-1.81
# without, set by spells where the pods slow down for everyone (B alone on the idle fleet took 0.2-1.1 s in a pod
# at times, against 0.05 s). The stagger's effect, B's p90 within 1.5 floors and its median within one, is
# asserted on the simulated pods (tests/integration/test_tenancy_crowd.py), whose steps are timed; here the crowd
# runs on real vLLM to its end and B's p90 is bounded at 3 floors: B never waits behind several documents
# (docs/flow-isolation.md#a-crowd-of-documents).
CROWD_P90_FLOORS = 3.0


def test_b_never_waits_behind_several_documents_beside_a_crowd_of_documents_on_two_pods(crowd: Measured):
    assert crowd.on.answered("B") >= B_ANSWERS, ("too few of B's requests to read a p90", summary(crowd))
    assert {a.status for a in crowd.on.answers} <= {200, 429}, summary(crowd)
    assert crowd.on.ttft("B", 0.9) <= CROWD_P90_FLOORS * crowd.floor_s, summary(crowd)


def table(m: Measured) -> str:
    runs = [("alone, before", m.before.b, "B"), ("alone, after", m.after.b, "B"), ("flow control on", m.on, "BA")]
    without = ""
    if m.off is not None:
        runs.append(("flow control off", m.off, "BA"))
        without = f", {m.off.ttft('B', 0.9) / m.floor_s:.2f} without"
    lines = [f"\nB's floor {m.floor_s:.3f} s = B alone p90 {m.idle.b.ttft('B', 0.9):.3f} s + one A prefill "
             f"{m.idle.a_prefill_s:.3f} s (before the flood {m.before.floor_s:.3f} s, after {m.after.floor_s:.3f} s)"
             f"; target B p90 <= {TARGET * m.floor_s:.3f} s; B p90 beside A "
             f"{m.on.ttft('B', 0.9) / m.floor_s:.2f} floors with flow control{without}",
             "| run | tenant | sent | answered | 429 | TTFT p50 s | TTFT p90 s | weighted tokens share |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, run, tenants in runs:
        for tenant in tenants:
            mine = run.of(tenant)
            answered = sum(a.status == 200 for a in mine)
            refused = sum(a.status == 429 for a in mine)
            lines.append(f"| {name} | {tenant} | {len(mine)} | {answered} | {refused} | {run.ttft(tenant, 0.5):.3f} "
                         f"| {run.ttft(tenant, 0.9):.3f} | {run.share(tenant):.3f} |")
    return "\n".join(lines)


def test_flow_control_keeps_b_within_its_floor_beside_a_flood(measured: Measured):
    b_p90 = measured.on.ttft("B", 0.9)
    assert sum(a.status == 200 for a in measured.on.of("B")) >= B_ANSWERS, "too few of B's requests to read a p90"
    assert b_p90 <= TARGET * measured.floor_s, (b_p90, measured.floor_s, table(measured))


def test_flow_control_keeps_b_within_its_floor_beside_a_flood_of_documents_with_longer_answers(documents: Measured):
    b_p90 = documents.on.ttft("B", 0.9)
    assert sum(a.status == 200 for a in documents.on.of("B")) >= B_ANSWERS, "too few of B's requests to read a p90"
    assert {a.status for a in documents.on.answers} <= {200, 429}, table(documents)
    assert b_p90 <= TARGET * documents.floor_s, (b_p90, documents.floor_s, table(documents))


def test_without_flow_control_b_waits_behind_a_flood(measured: Measured):
    """The other side of the check above: without flow control A's prompts queue in the pod ahead of B's,
    so the target is not met on this pod by itself."""
    assert measured.off is not None
    off, on = measured.off.ttft("B", 0.9), measured.on.ttft("B", 0.9)
    assert off > TARGET * measured.floor_s and off > on, (off, on, table(measured))


def test_b_is_always_answered_and_a_answered_or_refused(measured: Measured):
    assert measured.off is not None
    for run in (measured.idle.b, measured.on, measured.off):
        assert {a.status for a in run.of("B")} == {200}, table(measured)
        assert {a.status for a in run.of("A")} <= {200, 429}, table(measured)
    for run in (measured.on, measured.off):
        # Every answer is the pod's: it finished as many requests as were answered, none more.
        assert run.pod_finished == sum(a.status == 200 for a in run.answers), (run.pod_finished, table(measured))


def test_flow_control_held_a_at_the_gateway_while_the_pod_was_saturated(measured: Measured):
    assert measured.off is not None
    on, off = measured.on.flow_requests, measured.off.flow_requests
    # Each of B's requests counted in B's flow (its header), A's held while the pod was saturated, and
    # each of A's refusals one of flow control's.
    b_sent = len(measured.before.b.of("B") + measured.on.of("B"))  # (B alone after the flood: metrics read before)
    assert sum(v for (tenant, _), v in on.items() if tenant == "B") == b_sent
    assert on.get(("A", "after_wait"), 0) > 0, on
    refused = sum(v for (tenant, outcome), v in on.items() if tenant == "A" and outcome in REFUSALS)
    assert refused == sum(a.status == 429 for a in measured.on.of("A")), on
    assert not off, off  # flow control off: no request went through it


# The simulated engine's scheduler against the real one: the same requests, the pod paused while they arrive
# (vLLM's dev-mode ``/pause?mode=keep`` and ``/resume``) so that each wave reaches the engine at once and in
# order, then resumed; the second wave arrives while the first wave's prefills are still running. Every step
# that caches a block publishes one KV event batch, so the batches are the steps, each block named by its
# request and place.


@dataclass(frozen=True, slots=True)
class Sent:
    name: str
    tokens: list[int]
    priority: int = 0
    in_body: bool = False  # the priority as the body's field, not the X-Vllm-Priority header


# The first wave takes 6 steps of ~0.035 s on this pod: paused this long after it was resumed (give or take
# the step under way), the second wave comes while its prefills still run.
PAUSE_AFTER_S = 0.03


def scheduler_waves(seed: int) -> list[list[Sent]]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(100, 4000) for _ in range(n)]  # noqa: E731
    # Lengths of whole blocks plus a little: every step caches a block, so every step publishes a batch.
    first = [Sent(f"long{i}", ids(3700)) for i in range(3)]
    second = [Sent("late-low", ids(300), 5), Sent("urgent", ids(260), -5), Sent("doc", ids(1500)),
              Sent("body-urgent", ids(400), -3, in_body=True), Sent("chat", ids(200))]
    return [first, second]


def step_blocks(batches: list[list[KvEvent]], sent: list[Sent]) -> list[list[tuple[str, int]]]:
    """Each batch's stored blocks as (request, block index), in the order stored."""
    owner = {tuple(s.tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]): (s.name, i)
             for s in sent for i in range(len(s.tokens) // BLOCK_SIZE)}
    steps = []
    for batch in batches:
        blocks = [owner[tuple(e.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])]
                  for e in batch if isinstance(e, BlockStored) for i in range(len(e.block_hashes))]
        if blocks:
            steps.append(blocks)
    return steps


async def real_steps(pod: VllmPod, waves: list[list[Sent]]) -> tuple[list[list[tuple[str, int]]], int]:
    """The steps the pod took, and how many of them came before the second wave."""
    replay = f"tcp://127.0.0.1:{pod.replay_port}"
    sent = [s for wave in waves for s in wave]
    pause = f"{pod.url}/pause?mode=keep&clear_cache=false"  # (vLLM 0.32 resets the prefix cache unless told not to)
    async with aiohttp.ClientSession() as http:
        await complete(http, pod.url, Sent("warm-up", scheduler_waves(seed=99)[0][0].tokens))  # a fresh pod's first
        await reset(http, pod.url)  # steps are slow
        await post(http, pause, {})
        calls, before = [], 0
        for i, wave in enumerate(waves):
            if i:
                await asyncio.sleep(PAUSE_AFTER_S)
                await post(http, pause, {})
                seen = -1
                while seen != before:  # until the step under way has published its batch
                    seen = before
                    await asyncio.sleep(0.2)
                    before = len(since_last_clear_batches(await replayed_batches(replay)))
            for s in wave:
                calls.append(asyncio.create_task(complete(http, pod.url, s)))
                await asyncio.sleep(0.05)  # each reaches the engine before the next
            await post(http, f"{pod.url}/resume", {})
        await asyncio.gather(*calls)
        batches = since_last_clear_batches(await replayed_batches(replay))
    return step_blocks(batches, sent), before


async def complete(http: aiohttp.ClientSession, url: str, sent: Sent) -> None:
    body: dict[str, object] = {"model": MODEL, "prompt": sent.tokens, "max_tokens": 1, "ignore_eos": True}
    headers = {}
    if sent.in_body:
        body["priority"] = sent.priority
    elif sent.priority:
        headers["X-Vllm-Priority"] = str(sent.priority)
    answer, _ = await post(http, f"{url}/v1/completions", body, headers)
    assert answer["usage"]["prompt_tokens"] == len(sent.tokens)


def since_last_clear_batches(batches: list[list[KvEvent]]) -> list[list[KvEvent]]:
    """The batches after the cache was last cleared (the clear leaves with the next step's batch)."""
    for i in range(len(batches) - 1, -1, -1):
        cleared = [j for j, e in enumerate(batches[i]) if isinstance(e, AllBlocksCleared)]
        if cleared:
            rest = batches[i][cleared[-1] + 1:]
            return ([rest] if rest else []) + batches[i + 1:]
    return batches


def simulated_steps(waves: list[list[Sent]], policy: SchedulingPolicy, before: int) -> list[list[tuple[str, int]]]:
    """The simulated engine's steps for the same waves, the second submitted after ``before`` batches."""
    batches: list[list[KvEvent]] = []
    engine = MockEngine(PagedKvCache(4096, BLOCK_SIZE), [7], batches.append, TimingModel(speed=0.0),
                        EngineLimits(max_model_len=MAX_MODEL_LEN, scheduling_policy=policy))
    for i, wave in enumerate(waves):
        for s in wave:
            engine.submit(s.tokens, 1, s.name, priority=s.priority)
        while (i == len(waves) - 1 or len(batches) < before) and engine.step_now():
            pass
    return step_blocks(batches, [s for wave in waves for s in wave])


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_the_simulated_engine_schedules_the_steps_a_real_pod_schedules(flow_pods: VllmFleet,
                                                                             policy: SchedulingPolicy):
    pod = flow_pods[0 if policy == "fcfs" else 1]
    waves = scheduler_waves(seed=3)
    real, before = await real_steps(pod, waves)
    first_wave_steps = sum(1 for step in real if any(name.startswith("long") for name, _ in step))
    assert before < first_wave_steps, "the second wave must come while the first's prefills still run"
    simulated = simulated_steps(waves, policy, before)
    assert simulated == real, (before, real, simulated)
    order = [name for step in real for name, i in step if i == 0 and not name.startswith("long")]
    if policy == "priority":  # header or body, lower first; the running prefill before them all
        assert order == ["urgent", "body-urgent", "doc", "chat", "late-low"], order
    else:
        assert order == ["late-low", "urgent", "doc", "body-urgent", "chat"], order
