"""Seeded workload generators and their JSONL trace form.

Owner: the trace types and how a session's prompts are built from them (:class:`History`, the one place
the replay and the oracle both build them).

A trace is a list of sessions. A session is a chain of requests sent one after another (a conversation,
an agentic workflow; a single request for independent prompts): it starts at ``start_s``, each step waits
for the previous answer and ``think_s``, and the previous answer joins the history as an assistant
message, as a real agent's would. A replayed trace whose prompts already hold their context (Mooncake's)
has sessions that do not carry their history: each step's messages are its whole prompt.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

WORDS = ("cache prefix router token block engine agent stage latency pod gpu memory request batch tool plan "
         "result answer context system user model weight layer attention decode prefill schedule queue").split()


class Step(msgspec.Struct):
    # Messages appended to the session's history before this request (its user turn, tool output, ...).
    messages: list[dict[str, Any]]
    max_tokens: int = 16
    headers: dict[str, str] = {}
    # Think time before this step (after the previous answer); none: the session's ``think_s``.
    think_s: float | None = None
    # The model the request names (a LoRA adapter of the trace's); none: the benchmark's ``--model``.
    model: str | None = None


class Session(msgspec.Struct):
    id: str
    start_s: float
    steps: list[Step]
    think_s: float = 0.0
    # False: each step's messages are its whole prompt (earlier steps and answers are not re-sent).
    carry_history: bool = True

    def send_times(self) -> list[float]:
        """When each step is sent if answers took no time: the start, then the think times."""
        t, out = self.start_s, []
        for i, step in enumerate(self.steps):
            if i:
                t += step.think_s if step.think_s is not None else self.think_s
            out.append(t)
        return out


class History:
    """The messages a session sends, request by request. The replay and the oracle both build prompts here,
    so that what the oracle tokenizes is what the pods were sent."""

    def __init__(self, session: Session) -> None:
        self._carry = session.carry_history
        self._messages: list[dict[str, Any]] = []

    def prompt(self, step: Step) -> list[dict[str, Any]]:
        self._messages = [*self._messages, *step.messages] if self._carry else list(step.messages)
        return self._messages

    def answered(self, answer: str) -> None:
        if self._carry:
            self._messages = [*self._messages, {"role": "assistant", "content": answer}]


class Trace(msgspec.Struct):
    scenario: str
    seed: int
    sessions: list[Session]
    # No request is sent after this many seconds of the replay (none: every step of every session is).
    duration_s: float | None = None
    # LoRA adapters of the base model that the steps name (served by every simulated pod).
    adapters: list[str] = []

    @property
    def requests(self) -> int:
        return sum(len(s.steps) for s in self.sessions)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def poisson_starts(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(round(t, 4))
    return out


def shared_prefix(seed: int = 0, groups: int = 8, per_group: int = 24, shared_words: int = 1500,
                  question_words: int = 300, rate: float = 8.0, max_tokens: int = 16) -> Trace:
    """G groups of prompts sharing a long system prompt, each with its own question; Poisson arrivals."""
    rng = random.Random(seed)
    systems = [f"Team {g} handbook. " + text(rng, shared_words) for g in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    sessions = [
        Session(f"q{i}", start, [Step([{"role": "system", "content": systems[g]},
                                       {"role": "user", "content": f"Q{i}: " + text(rng, question_words)}],
                                      max_tokens)])
        for i, (g, start) in enumerate(zip(order, poisson_starts(rng, len(order), rate), strict=True))
    ]
    return Trace("shared-prefix", seed, sessions)


def multi_turn(seed: int = 0, conversations: int = 16, turns: int = 6, first_words: int = 800,
               turn_words: int = 60, rate: float = 2.0, think_s: float = 0.5, max_tokens: int = 32) -> Trace:
    """Conversations whose context grows turn by turn, with think time between turns."""
    rng = random.Random(seed)
    sessions = []
    for c, start in enumerate(poisson_starts(rng, conversations, rate)):
        steps = [Step([{"role": "system", "content": f"Conversation {c}. " + text(rng, first_words)},
                       {"role": "user", "content": text(rng, turn_words)}], max_tokens)]
        steps += [Step([{"role": "user", "content": text(rng, turn_words)}], max_tokens) for _ in range(turns - 1)]
        sessions.append(Session(f"c{c}", start, steps, think_s))
    return Trace("multi-turn", seed, sessions)


def conversations(seed: int = 0, conversations: int = 48, min_turns: int = 1, max_turns: int = 10,
                  single_share: float = 0.15, systems: int = 4, system_words: int = 300, first_words: int = 400,
                  turn_words: int = 60, min_answer: int = 8, max_answer: int = 48, think_min_s: float = 0.5,
                  think_max_s: float = 3.0, rate: float = 2.0) -> Trace:
    """Chat conversations shaped as a multi-turn conversation trace's (Mooncake's): most of several turns
    (``single_share`` of one), their number drawn from ``[2, max_turns]``; each turn re-sends the context so
    far, its answers included, and a new user message (``turn_words`` on average), so contexts grow turn by
    turn; answers are short (``max_tokens`` drawn from ``[min_answer, max_answer]``); a user thinks
    ``[think_min_s, think_max_s]`` between an answer and the next turn, so the conversations' turns
    interleave. Each conversation starts with one of ``systems`` shared system prompts and a long first
    message of its own (a pasted document, ``first_words`` on average); starts are Poisson at ``rate``/s.
    No session header, as chat clients that send none."""
    if not 1 <= min_turns <= max_turns or not 0 <= single_share <= 1 or not 1 <= min_answer <= max_answer \
            or not 0 <= think_min_s <= think_max_s or systems < 1:
        raise ValueError("need 1 <= min_turns <= max_turns, 0 <= single_share <= 1, 1 <= min_answer <= max_answer, "
                         "0 <= think_min_s <= think_max_s and systems >= 1")
    rng = random.Random(seed)
    prompts = [f"Assistant {a}. " + text(rng, system_words) for a in range(systems)]
    out = []
    for c, start in enumerate(poisson_starts(rng, conversations, rate)):
        several = max(min_turns, 2) if max_turns >= 2 else 1
        turns = min_turns if rng.random() < single_share else rng.randint(several, max_turns)
        first = f"Conversation {c}: " + text(rng, rng.randint(first_words // 2, first_words * 3 // 2))
        steps = [Step([{"role": "system", "content": rng.choice(prompts)}, {"role": "user", "content": first}],
                      rng.randint(min_answer, max_answer))]
        for _ in range(1, turns):
            message = text(rng, rng.randint(turn_words // 2, turn_words * 3 // 2))
            steps.append(Step([{"role": "user", "content": message}], rng.randint(min_answer, max_answer),
                              think_s=round(rng.uniform(think_min_s, think_max_s), 3)))
        out.append(Session(f"cv{c}", start, steps))
    return Trace("conversations", seed, out)


def stage_headers(workflow_id: str, stage: int, stages: int) -> dict[str, str]:
    """The workflow headers of stage ``stage`` of ``stages`` (the last one completes the workflow)."""
    headers = {"x-workflow-id": workflow_id, "x-stage-id": f"stage-{stage}"}
    if stage == stages - 1:
        headers["x-workflow-complete"] = "true"
    return headers


def workflow_stages(rng: random.Random, workflows: int, rate: float, min_stages: int, max_stages: int,
                    prefix: str) -> Iterator[tuple[int, float, list[dict[str, str]]]]:
    """Workflows started at Poisson times, each of ``min_stages`` to ``max_stages`` stages: its number, its
    start and each stage's headers (workflow ``<prefix>-<number>``)."""
    for w, start in enumerate(poisson_starts(rng, workflows, rate)):
        n = rng.randint(min_stages, max_stages)
        yield w, start, [stage_headers(f"{prefix}-{w}", s, n) for s in range(n)]


def agentic(seed: int = 0, workflows: int = 16, min_stages: int = 5, max_stages: int = 10, context_words: int = 1200,
            increment_words: int = 40, rate: float = 2.0, think_s: float = 0.2, max_tokens: int = 24) -> Trace:
    """Concurrent workflows of 5-10 stages with workflow/stage headers and small increments (tool output)."""
    rng = random.Random(seed)
    sessions = []
    for w, start, stages in workflow_stages(rng, workflows, rate, min_stages, max_stages, f"wf-{seed}"):
        steps = []
        for s, headers in enumerate(stages):
            messages = [{"role": "user", "content": f"Tool output {s}: " + text(rng, increment_words)}]
            if s == 0:
                messages.insert(0, {"role": "system", "content": f"Agent {w} task. " + text(rng, context_words)})
            steps.append(Step(messages, max_tokens, headers))
        sessions.append(Session(f"w{w}", start, steps, think_s))
    return Trace("agentic", seed, sessions)


def agentic_shared(seed: int = 0, workflows: int = 32, min_stages: int = 4, max_stages: int = 8, roles: int = 3,
                   common_words: int = 250, role_words: int = 150, task_words: int = 60, tool_words: int = 100,
                   think_min_s: float = 0.3, think_max_s: float = 2.5, rate: float = 2.0,
                   max_tokens: int = 32) -> Trace:
    """Many concurrent agent workflows over a few shared role prompts: each system prompt is a preamble
    common to every role (the tool definitions) then the role's own text; each stage re-sends the whole
    context plus a tool result, after a think time drawn from ``[think_min_s, think_max_s]``. Whichever
    pod serves the preamble first holds it; a router that follows the shared prefix piles every workflow
    onto that pod, and its cache thrashes while the others idle."""
    if not 1 <= min_stages <= max_stages or roles < 1 or not 0 <= think_min_s <= think_max_s:
        raise ValueError("need 1 <= min_stages <= max_stages, roles >= 1, 0 <= think_min_s <= think_max_s")
    rng = random.Random(seed)
    preamble = "Tools available to every agent: " + text(rng, common_words)
    role_prompts = [f"{preamble}\nYou are agent role {r}. " + text(rng, role_words) for r in range(roles)]
    sessions = []
    for w, start, stages in workflow_stages(rng, workflows, rate, min_stages, max_stages, f"wfs-{seed}"):
        steps = []
        for s, headers in enumerate(stages):
            if s == 0:
                messages = [{"role": "system", "content": role_prompts[w % roles]},
                            {"role": "user", "content": f"Task {w}: " + text(rng, task_words)}]
                think = None
            else:
                messages = [{"role": "user", "content": f"Tool result {s}: " + text(rng, tool_words)}]
                think = round(rng.uniform(think_min_s, think_max_s), 3)
            steps.append(Step(messages, max_tokens, headers, think))
        sessions.append(Session(f"ws{w}", start, steps))
    return Trace("agentic-shared", seed, sessions)


def long_context(seed: int = 0, sessions: int = 3, min_turns: int = 4, max_turns: int = 8, system_words: int = 4000,
                 min_context_words: int = 16000, max_context_words: int = 63000, tool_words: int = 150,
                 think_min_s: float = 1.0, think_max_s: float = 4.0, rate: float = 0.5,
                 max_tokens: int = 32) -> Trace:
    """A few long-running coding-agent sessions. Each starts with a large context, a system prompt all of
    them share (the agent's instructions and tools) then the files of its own repository, of
    ``min_context_words``-``max_context_words`` words in all (the simulated pods' tokenizer takes ~1.9
    tokens a word: 30k-120k tokens; Llama 3's about one). Each later turn adds a tool call and its result
    (~``tool_words``: a few hundred tokens) after a think time. No session header, as the agents that send
    none: a router must recognise each conversation by its prompt. Sent anywhere but where its context is
    cached, a turn prefills that whole context again."""
    if not 1 <= min_turns <= max_turns or not 0 <= think_min_s <= think_max_s \
            or not system_words < min_context_words <= max_context_words:
        raise ValueError("need 1 <= min_turns <= max_turns, 0 <= think_min_s <= think_max_s and "
                         "system_words < min_context_words <= max_context_words")
    rng = random.Random(seed)
    system = "You are a coding agent. Instructions and tools: " + text(rng, system_words)
    out = []
    for s, start in enumerate(poisson_starts(rng, sessions, rate)):
        repository = f"Repository {s}, every file:\n" + text(rng, rng.randint(min_context_words, max_context_words)
                                                                - system_words)
        steps = [Step([{"role": "system", "content": system}, {"role": "user", "content": repository}], max_tokens)]
        for turn in range(1, rng.randint(min_turns, max_turns)):
            result = f"Tool call {turn}: read_file(src/part_{turn}.py)\nResult:\n" + text(rng, tool_words)
            steps.append(Step([{"role": "user", "content": result}], max_tokens,
                              think_s=round(rng.uniform(think_min_s, think_max_s), 3)))
        out.append(Session(f"lc{s}", start, steps))
    return Trace("long-context", seed, out)


def working_set_tokens(trace: Trace, count_tokens: Any, answer_tokens: bool = True) -> int:
    """The trace's peak working set: the most context tokens its live sessions hold at one moment, on a
    timeline of start times and think times alone (service time left out). ``count_tokens`` maps a
    message list to its token count."""
    points: list[tuple[float, int]] = []  # (time, change in live tokens)
    for session in trace.sessions:
        history: list[dict[str, Any]] = []
        held = 0
        times = session.send_times()
        for t, step in zip(times, session.steps, strict=True):
            history = (history if session.carry_history else []) + step.messages
            tokens = count_tokens(history) + (step.max_tokens if answer_tokens else 0)
            points.append((t, tokens - held))
            held = tokens
        points.append((times[-1] + 1e-6, -held))
    live = peak = 0
    for _, change in sorted(points):
        live += change
        peak = max(peak, live)
    return peak


def longest_request_tokens(trace: Trace, count_tokens: Any) -> int:
    """An upper bound on the trace's longest request as the replay sends it: the history so far, each
    earlier answer at its full ``max_tokens`` (with its chat-template wrapping), and this step's answer."""
    longest = 0
    for session in trace.sessions:
        history = History(session)
        answers = 0
        for step in session.steps:
            answers = (answers if session.carry_history else 0) + step.max_tokens
            longest = max(longest, count_tokens(history.prompt(step)) + answers)
            history.answered("")
    return longest


def overload(seed: int = 0, start_rate: float = 4.0, end_rate: float = 40.0, seconds: float = 20.0,
             prompt_words: int = 400, ttft_ms: int = 1000, max_tokens: int = 32) -> Trace:
    """A rate ramp past capacity; every request carries a TTFT SLO."""
    rng = random.Random(seed)
    sessions, t, i = [], 0.0, 0
    while t < seconds:
        rate = start_rate + (end_rate - start_rate) * t / seconds
        t += rng.expovariate(rate)
        sessions.append(Session(f"o{i}", round(t, 4), [Step(
            [{"role": "user", "content": f"{i}: " + text(rng, prompt_words)}], max_tokens,
            {"x-slo-ttft-ms": str(ttft_ms)})]))
        i += 1
    return Trace("overload", seed, sessions)


FAIRNESS_HEADER = "x-gateway-inference-fairness-id"

# The overhead scripts' request (bench/scripts/proxy_overhead.py, epp_overhead.py, instructions.py): a 4 KB system
# prompt and a short question, one token answered, so that what is measured is the gateway's work, not a pod's.
OVERHEAD_SYSTEM = ("The gateway routes each request to the pod holding its prefix. " * 60)[:3900]


def overhead_chat(model: str, question: str = "Say ok.") -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "messages": [{"role": "system", "content": OVERHEAD_SYSTEM},
                                                          {"role": "user", "content": question}]}


def tenant_of(step: Step) -> str:
    """The flow a request is sent as: its fairness id, and ``@band`` when it names a priority (``x-priority``);
    "" when it names no fairness id."""
    tenant = step.headers.get(FAIRNESS_HEADER, "")
    band = step.headers.get("x-priority")
    return f"{tenant}@{band}" if tenant and band is not None else tenant


def _flood(rng: random.Random, name: str, sessions: int, steps: int, words: int, max_tokens: int,
           headers: dict[str, str]) -> list[Session]:
    """``sessions`` clients sending one request after another, each a prompt of its own: the request's id
    comes first, so no prompt shares a cached block with another; the words after it are one text."""
    body = text(rng, words)
    return [Session(f"{name}{s}", 0.0, [Step([{"role": "user", "content": f"{name} request {s}-{i}: {body}"}],
                                             max_tokens, dict(headers)) for i in range(steps)],
                    carry_history=False)
            for s in range(sessions)]


def noisy_neighbor(seed: int = 0, a_sessions: int = 64, a_steps: int = 4, a_words: int = 3000, a_max_tokens: int = 32,
                   b_sessions: int = 2, b_steps: int = 400, b_words: int = 100, b_max_tokens: int = 32,
                   duration_s: float = 15.0) -> Trace:
    """Two tenants share the fleet: A floods it (``a_sessions`` clients, each sending long prompts one after
    another), B chats (``b_sessions`` clients, short prompts one after another). Each request names its
    tenant in ``x-gateway-inference-fairness-id``. No request is sent after ``duration_s``. With either
    side's sessions at 0: the other alone."""
    rng = random.Random(seed)
    sessions = (_flood(rng, "A", a_sessions, a_steps, a_words, a_max_tokens, {FAIRNESS_HEADER: "A"})
                + _flood(rng, "B", b_sessions, b_steps, b_words, b_max_tokens, {FAIRNESS_HEADER: "B"}))
    return Trace("noisy-neighbor", seed, sessions, duration_s)


def priority_bands(seed: int = 0, batch_sessions: int = 64, batch_steps: int = 4, batch_words: int = 3000,
                   batch_max_tokens: int = 32, interactive_sessions: int = 2, interactive_steps: int = 400,
                   interactive_words: int = 100, interactive_max_tokens: int = 32, interactive_priority: int = 10,
                   duration_s: float = 15.0) -> Trace:
    """One tenant, two bands: a batch flow floods the fleet at priority 0 while an interactive flow chats at
    ``interactive_priority`` (``x-priority``); the same shapes as ``noisy-neighbor``."""
    rng = random.Random(seed)
    sessions = (_flood(rng, "batch", batch_sessions, batch_steps, batch_words, batch_max_tokens,
                       {FAIRNESS_HEADER: "team", "x-priority": "0"})
                + _flood(rng, "interactive", interactive_sessions, interactive_steps, interactive_words,
                         interactive_max_tokens, {FAIRNESS_HEADER: "team", "x-priority": str(interactive_priority)}))
    return Trace("priority", seed, sessions, duration_s)


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Popularity of ``n`` items ranked 1..n, Zipf with this exponent (summing to 1)."""
    raw = [1.0 / (rank ** exponent) for rank in range(1, n + 1)]
    return [w / sum(raw) for w in raw]


def lora(seed: int = 0, requests: int = 480, adapters: int = 8, zipf: float = 1.0, preamble_words: int = 300,
         adapter_words: int = 250, question_words: int = 40, rate: float = 12.0, max_tokens: int = 16) -> Trace:
    """Requests for ``adapters`` LoRA adapters of one base model, their popularity Zipf(``zipf``) (the first
    takes 37% of the requests with 8 adapters at 1.0), Poisson arrivals. Each request is its adapter's
    system prompt (a preamble every adapter shares, the product's documentation, then the adapter's own
    instructions) and a question of its own. An engine caches an adapter's prompts for that adapter only and
    runs ``max_loras`` adapters in one batch: a router that ignores adapters spreads each over every pod (each
    pod caches and switches between all of them); one that follows the text's prefix sees the shared preamble
    cached where no other adapter can use it."""
    rng = random.Random(seed)
    preamble = "Product documentation: " + text(rng, preamble_words)
    names = [f"lora-{a}" for a in range(adapters)]
    systems = {name: f"{preamble}\nYou are {name}. " + text(rng, adapter_words) for name in names}
    chosen = rng.choices(names, zipf_weights(adapters, zipf), k=requests)
    sessions = [Session(f"l{i}", start, [Step([{"role": "system", "content": systems[name]},
                                               {"role": "user", "content": f"Q{i}: " + text(rng, question_words)}],
                                              max_tokens, model=name)])
                for i, (name, start) in enumerate(zip(chosen, poisson_starts(rng, requests, rate), strict=True))]
    return Trace("lora", seed, sessions, adapters=names)


def fleet_scale(seed: int = 0, requests: int = 2000, systems: int = 16, system_words: int = 300,
                question_words: int = 20, rate: float = 100.0, max_tokens: int = 4) -> Trace:
    """Short chats over a few shared system prompts at a steady rate: what a request costs the router as the
    fleet grows (``--pods``), at the same request rate whatever the fleet (``bench/scripts/fleet_scale.py`` runs
    it at 4, 100 and 1,000 pods)."""
    rng = random.Random(seed)
    prompts = [f"Assistant {g}. " + text(rng, system_words) for g in range(systems)]
    sessions = [
        Session(f"f{i}", start, [Step([{"role": "system", "content": rng.choice(prompts)},
                                       {"role": "user", "content": f"Q{i}: " + text(rng, question_words)}],
                                      max_tokens)])
        for i, start in enumerate(poisson_starts(rng, requests, rate))
    ]
    return Trace("fleet-scale", seed, sessions)


GENERATORS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "conversations": conversations,
              "agentic": agentic,
              "agentic-shared": agentic_shared, "long-context": long_context, "overload": overload,
              "noisy-neighbor": noisy_neighbor, "priority": priority_bands, "lora": lora,
              "fleet-scale": fleet_scale}


# Named sets of a scenario's knobs (``gateway bench --preset``), applied before any ``--set``.
PRESETS: dict[str, dict[str, dict[str, float]]] = {
    # A crowd of documents: each of A's 64 clients sends one new 3,000-word document (64-token answers) while B's
    # two clients chat with 16-token answers: the flood issue 54 measured B's floor against
    # (docs/flow-isolation.md#a-crowd-of-documents).
    "noisy-neighbor": {"documents": {"a_steps": 1, "a_max_tokens": 64, "b_max_tokens": 16}},
}


def write_trace(trace: Trace, path: str | Path) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.encode({"scenario": trace.scenario, "seed": trace.seed,
                                     "duration_s": trace.duration_s, "adapters": trace.adapters}) + b"\n")
        for session in trace.sessions:
            f.write(msgspec.json.encode(session) + b"\n")


def read_trace(path: str | Path) -> Trace:
    lines = Path(path).read_bytes().splitlines()
    head = msgspec.json.decode(lines[0])
    sessions = [msgspec.json.decode(line, type=Session) for line in lines[1:] if line.strip()]
    return Trace(head["scenario"], head["seed"], sessions, head.get("duration_s"), head.get("adapters") or [])
