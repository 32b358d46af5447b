"""The benchmark's workloads are reproducible, and its runner measures real contenders end to end."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path

import pytest

from bench.cli import cache_blocks_for, mock_token_counter, scaled_trace, size_simulated_pods
from bench.cli import run as run_bench
from bench.mooncake import read_mooncake
from bench.peers import PEERS, env_dir
from bench.report import plot_title, write_results
from bench.runner import CONTENDERS, BenchRunner, Outcome, Result, gateway_version, session_times
from bench.workloads import (
    History,
    Session,
    Step,
    Trace,
    agentic,
    agentic_shared,
    conversations,
    longest_request_tokens,
    multi_turn,
    overload,
    read_trace,
    shared_prefix,
    working_set_tokens,
    write_trace,
)
from gateway.cli import build_parser
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from simulator.engine import MODEL_MAX_LEN
from tests.unit.test_bench_peers import fake_env


def test_generators_are_seeded_and_traces_round_trip(tmp_path):
    for make in (shared_prefix, multi_turn, agentic, agentic_shared, overload):
        a, b, c = make(seed=1), make(seed=1), make(seed=2)
        assert a == b and a != c
        write_trace(a, tmp_path / "t.jsonl")
        assert read_trace(tmp_path / "t.jsonl") == a
    trace = agentic(seed=3, workflows=4)
    for session in trace.sessions:
        assert 5 <= len(session.steps) <= 10
        assert session.steps[-1].headers["x-workflow-complete"] == "true"
        assert len({s.headers["x-workflow-id"] for s in session.steps}) == 1
    groups = shared_prefix(groups=3, per_group=4)
    assert len({s.steps[0].messages[0]["content"] for s in groups.sessions}) == 3 and groups.requests == 12


def test_runner_compares_direct_and_gateway(tmp_path):
    # 5 requests a second: each request's KV events are in before the next of its group is routed, even on a
    # machine 5x slower beside CPU hogs (at 20 a second there, 3 of 12 predictions came short of the pod's hits).
    trace = shared_prefix(seed=0, groups=2, per_group=6, shared_words=300, question_words=20, rate=5)
    runner = BenchRunner(pods=2, num_blocks=400, speed=0.0, progress=False)
    results = [runner.run(CONTENDERS[name], trace) for name in ("direct", "gateway-kv_aware")]
    direct, gateway = results
    assert direct.errors == gateway.errors == 0 and not direct.skipped and not gateway.skipped
    # Same requests, same pods: sending each group where its prefix is cached must win on hits.
    assert gateway.hit_ratio > direct.hit_ratio and gateway.hit_ratio > 0.5
    assert gateway.ttft_p50_ms > 0 and gateway.req_per_s > 0
    # One request a session: its time is that request's, and all of it spent waiting for the answer.
    assert gateway.session_p50_ms == pytest.approx(gateway.e2e_p50_ms) == pytest.approx(gateway.busy_p50_ms)
    # The gateway's own checks of its predictions come back with its result: all exact, no drift.
    assert gateway.extra.get("prediction_exact", 0) >= trace.requests - 2 and not gateway.extra.get("drift")
    # Only the gateway says more of itself; the answers' own usage says what the pods' counters say.
    added = {"client_ttft_ms_mean", "pod_ttft_ms_mean", "added_ttft_ms_mean", "added_ttft_ms_p50",
             "added_ttft_ms_p90", "added_ttft_ms_p99", "added_ttft_matched"}
    assert {k: v for k, v in direct.extra.items() if k not in added} == {
        "client_hit_ratio": pytest.approx(direct.hit_ratio, abs=1e-3), "prompt_tokens": gateway.extra["prompt_tokens"]}
    # What each adds before the first token: the client's mean TTFT less the pods' own (their histograms).
    for r in results:
        assert r.extra["added_ttft_ms_mean"] == pytest.approx(r.extra["client_ttft_ms_mean"]
                                                              - r.extra["pod_ttft_ms_mean"], abs=0.02)
        assert r.extra["client_ttft_ms_mean"] > r.extra["added_ttft_ms_mean"] > 0
        # And per request, matched by the x-request-id each client sent: every answer is matched, and the
        # mean of the differences is the difference of the means.
        assert r.extra["added_ttft_matched"] == 1.0
        assert 0 < r.extra["added_ttft_ms_p50"] <= r.extra["added_ttft_ms_p90"] <= r.extra["added_ttft_ms_p99"]
    assert direct.extra["prompt_tokens"] >= trace.requests * 300  # what the clients sent, as the pods counted
    # The gateway's own split of its time, read from its metrics over the run: its loop's lag, and the median of
    # each step its requests took (no prefill leg: not a disaggregated model).
    taken = ("parse", "tokenize", "prepare", "admit", "route", "dispatch", "connect", "first_byte")
    split = {k: v for k, v in gateway.extra.items() if k.startswith(("loop_lag_", "step_"))}
    assert set(split) == {"loop_lag_ms_p50", "loop_lag_ms_p99", *(f"step_{s}_ms_p50" for s in taken)}
    assert 0 <= split["loop_lag_ms_p50"] <= split["loop_lag_ms_p99"] and all(v >= 0 for v in split.values())
    paths = write_results(results, tmp_path, {"seed": 0})
    saved = json.loads(paths["json"].read_text())
    assert [c["name"] for c in saved["contenders"]] == ["direct", "gateway-kv_aware"]
    assert {"hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "req_per_s", "errors", "policy"} <= \
        set(saved["contenders"][0])
    # Requests per pod come from the pods' own counters, in every output.
    for r in results:
        assert sum(r.pod_requests) == trace.requests and len(r.pod_requests) == 2
        assert r.largest_share == max(r.pod_requests) / trace.requests
    assert saved["contenders"][1]["pod_requests"] == gateway.pod_requests
    csv_row = paths["csv"].read_text().splitlines()[2].split(",")
    assert "/".join(map(str, gateway.pod_requests)) in csv_row
    assert f"| {'/'.join(map(str, gateway.pod_requests))} | {gateway.largest_share:.2f} |" in paths["md"].read_text()
    assert "gateway-kv_aware" in paths["md"].read_text() and paths["plot-shared-prefix"].stat().st_size > 1000
    # What served each row: nothing for direct, the gateway's package at this checkout's commit.
    assert (direct.package, direct.version, direct.command) == (None, None, [])
    assert (gateway.package, gateway.version) == ("kv-gateway", gateway_version())
    assert gateway.command[1:5] == ["-m", "gateway", "serve", "--port"] and "kv_aware" in gateway.command
    assert saved["contenders"][1]["package"] == "kv-gateway" and saved["contenders"][1]["command"] == gateway.command
    assert f"| gateway-kv_aware | kv-gateway {gateway.version} |" in paths["md"].read_text()


def test_every_output_says_which_package_and_version_served_each_row(tmp_path):
    smg = Result("smg-cache_aware", "cache_aware", "agentic-shared", 0, requests=4, pod_requests=[4, 0],
                 package="smg", version="1.13.0", reported_version="smg 1.13.0",
                 command=["/c/peers/smg-1.13.0-py3.11/bin/smg", "launch", "--policy", "cache_aware"])
    sglang = Result("sglang-router-cache_aware", "cache_aware", "agentic-shared", 0, requests=4, pod_requests=[0, 4],
                    package="sglang-router", version="0.3.2", reported_version="sgl-model-gateway 0.3.2",
                    command=["/c/peers/sglang-router-0.3.2-py3.11/bin/smg", "launch"])
    direct = Result("direct", "round_robin", "agentic-shared", 0, requests=4, pod_requests=[2, 2])
    paths = write_results([direct, smg, sglang], tmp_path, {"gateway": "c424e7d"})
    saved = json.loads(paths["json"].read_text())
    assert saved["gateway"] == "c424e7d"
    assert [(c["package"], c["version"], c["reported_version"]) for c in saved["contenders"]] == [
        (None, None, None), ("smg", "1.13.0", "smg 1.13.0"), ("sglang-router", "0.3.2", "sgl-model-gateway 0.3.2")]
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [(r["package"], r["version"]) for r in rows] == [("", ""), ("smg", "1.13.0"), ("sglang-router", "0.3.2")]
    assert rows[1]["command"] == "/c/peers/smg-1.13.0-py3.11/bin/smg launch --policy cache_aware"
    md = paths["md"].read_text()
    assert "| agentic-shared | smg-cache_aware | smg 1.13.0 |" in md and "| agentic-shared | direct | - |" in md
    assert "- sglang-router-cache_aware: sglang-router 0.3.2 (`--version`: sgl-model-gateway 0.3.2): " \
        "`/c/peers/sglang-router-0.3.2-py3.11/bin/smg launch`" in md and "Gateway: kv-gateway c424e7d." in md
    assert plot_title("agentic-shared", [direct, smg, sglang]).endswith("\nsmg 1.13.0, sglang-router 0.3.2")


def bench_command(argv: list[str]) -> int:
    """``gateway bench`` with these arguments, in this process (without the command's logging set-up)."""
    return run_bench(build_parser().parse_args(argv))


def test_a_peer_that_is_not_what_its_row_claims_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """The issue's case: the smg row's script is sglang-router's. The command refuses before any run, with
    or without installing (a complete environment is checked, never silently replaced); the runner,
    given the row on its own, skips it with the same reason."""
    monkeypatch.setenv("KVGW_CACHE_DIR", str(tmp_path / "cache"))
    fake_env(tmp_path / "cache", PEERS["smg"], [("smg", "1.13.0")], says="sgl-model-gateway 0.3.2")
    for flags in ([], ["--no-install-peers"]):
        code = bench_command(["bench", "--scenario", "shared-prefix", "--contender", "direct", "--contender",
                             "smg-cache_aware", "--out", str(tmp_path / "out"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and "refused to run" in err and "prints 'sgl-model-gateway 0.3.2'" in err, err
        assert not (tmp_path / "out").exists()
    # Not installed and not to be installed: refused too, saying how to get it.
    code = bench_command(["bench", "--scenario", "shared-prefix", "--contender", "vllm-router-cache_aware",
                         "--out", str(tmp_path / "out"), "--no-install-peers"])
    assert code == 2 and "vllm-router 0.1.17 is not installed for the bench" in capsys.readouterr().err
    trace = shared_prefix(seed=0, groups=1, per_group=2, shared_words=50, question_words=5, rate=20)
    result = BenchRunner(pods=1, num_blocks=100, speed=0.0, progress=False).run(CONTENDERS["smg-cache_aware"], trace)
    assert result.skipped and result.skipped.startswith(f"refused to run {env_dir(PEERS['smg'])}/bin/smg as smg")
    assert result.package is None and result.requests == trace.requests and not result.pod_requests


@pytest.mark.parametrize("name", ["smg-cache_aware", "sglang-router-cache_aware", "vllm-router-cache_aware"])
def test_installed_peers_start_and_route(name):
    """Each peer from its own environment serves a small trace on simulated pods, and its row says which
    package and version it was (where this machine has them installed: `make bench` installs them)."""
    peer = PEERS[CONTENDERS[name].kind]
    if not (env_dir(peer) / ".complete").exists():
        pytest.skip(f"{peer.label} is not installed here")
    trace = shared_prefix(seed=0, groups=2, per_group=3, shared_words=200, question_words=10, rate=20)
    result = BenchRunner(pods=2, num_blocks=400, speed=0.0, progress=False).run(CONTENDERS[name], trace)
    assert result.skipped is None and result.errors == 0 and sum(result.pod_requests) == trace.requests
    assert (result.package, result.version) == (peer.package, peer.version)
    assert result.command[0] == str(env_dir(peer) / "bin" / peer.script)
    assert result.reported_version == (f"{peer.banner} {peer.version}" if peer.banner else None)


def test_a_session_lasts_from_its_first_request_sent_to_its_last_answer():
    outcomes = [Outcome(200, 0.1, 0.5, sent_at=10.0, session=0, step=0),
                Outcome(200, 0.1, 0.7, sent_at=12.0, session=0, step=1),  # think time between counts
                Outcome(502, sent_at=11.0, session=1, step=0),
                Outcome(200, 0.1, 0.2, sent_at=11.5, session=1, step=1)]
    assert sorted(session_times(outcomes)) == pytest.approx([700.0, 2700.0])


def test_agentic_shared_knobs_and_working_set():
    trace = scaled_trace("agentic-shared", 0, 1.0, None, ["workflows=6", "roles=2", "think_max_s=1", "min_stages=2",
                                                          "max_stages=3"])
    assert len(trace.sessions) == 6 and all(2 <= len(s.steps) <= 3 for s in trace.sessions)
    systems = [s.steps[0].messages[0]["content"] for s in trace.sessions]
    assert len(set(systems)) == 2  # two roles ...
    preamble = systems[0].split("\n")[0]
    assert all(s.startswith(preamble) for s in systems)  # ... behind one shared preamble
    thinks = [step.think_s for s in trace.sessions for step in s.steps[1:]]
    assert all(0.3 <= t <= 1 for t in thinks) and all(s.steps[0].think_s is None for s in trace.sessions)
    with pytest.raises(ValueError, match=r"unknown knob 'nope=1'.*workflows"):
        scaled_trace("agentic-shared", 0, 1.0, None, ["nope=1"])
    # A session holds its context from its first step to its last: A (10 words, then +20 after 1 s) and B
    # (5 words at 0.5 s, +5 at 2.5 s) peak together at 1 s, with 30 + 5 (+ 1 answer token per step).
    def say(n):
        return [{"role": "user", "content": " ".join(["w"] * n)}]
    overlap = Trace("t", 0, [Session("a", 0.0, [Step(say(10), 1), Step(say(20), 1, think_s=1.0)]),
                             Session("b", 0.5, [Step(say(5), 1), Step(say(5), 1, think_s=2.0)])])
    assert working_set_tokens(overlap, lambda ms: sum(len(m["content"].split()) for m in ms)) == 30 + 1 + 5 + 1
    # A's second request carries both user turns, its first answer and its own: 10 + 20 + 1 + 1.
    assert longest_request_tokens(overlap, lambda ms: sum(len(m["content"].split()) for m in ms)) == 32
    # --working-set-ratio 2 over 2 pods of 16-token blocks: the fleet holds half the peak, rounded up.
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR)
    peak_tokens = working_set_tokens(trace, lambda m: len(tokenizer.encode_chat(m)))
    blocks = cache_blocks_for(trace, 2.0, 2, 16)
    assert blocks * 16 * 2 * 2 >= peak_tokens > (blocks - 1) * 16 * 2 * 2
    # A ratio so high that one pod could not hold the longest request: sized for that request instead,
    # as vLLM refuses to start with a cache shorter than its longest request.
    longest = longest_request_tokens(trace, lambda m: len(tokenizer.encode_chat(m)))
    assert cache_blocks_for(trace, 50.0, 2, 16) * 16 >= longest > blocks * 16 * 2 * 2 / 50


def spaced_sessions(n: int, turns: int, words: int) -> Trace:
    """Conversations 50 ms apart whose turns come 150 ms apart: at speed 0 no two requests overlap, so the
    pods see them in the oracle's order."""
    sessions = [Session(f"s{s}", 0.05 * s, [Step([{"role": "user", "content": f"Session {s}, turn {t}: " +
                                                   " ".join(["cache prefix block"] * words)}], 4,
                                                 think_s=None if t == 0 else 0.15) for t in range(turns)])
                for s in range(n)]
    return Trace("spaced", 0, sessions)


def test_oracle_is_what_one_simulated_pod_counts_when_requests_do_not_overlap():
    """On one pod, sticky LRU is that pod: the oracle must reproduce its counters exactly, answers
    included (they are part of later prompts), with room for everything and when the sessions thrash."""
    trace = spaced_sessions(3, 3, 40)
    roomy = BenchRunner(pods=1, num_blocks=2000, speed=0.0, progress=False).run(CONTENDERS["direct"], trace)
    assert roomy.errors == 0 and roomy.hit_ratio > 0.4
    assert roomy.hit_ratio == roomy.infinite == roomy.sticky_lru and roomy.distance == 0
    # 30 blocks of 16 tokens hold one session's context (~350 tokens), not three: LRU keeps less.
    tight = BenchRunner(pods=1, num_blocks=30, speed=0.0, progress=False).run(CONTENDERS["direct"], trace)
    assert tight.errors == 0 and tight.infinite == roomy.infinite
    assert tight.hit_ratio == tight.sticky_lru < tight.infinite
    # Free refreshes that knew which session comes back next would keep more of it, never more than fits.
    assert tight.keep_warm is not None and tight.sticky_lru < tight.keep_warm <= tight.infinite
    assert roomy.keep_warm == roomy.infinite


def mooncake_line(timestamp: int, hash_ids: list[int], input_length: int, output_length: int = 4) -> str:
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
                       "hash_ids": hash_ids})


# Conversation A (0, 2, 5), B (1, 3; sharing A's first two blocks), and two one-off requests sharing a block
# (4, 6). Last blocks are partial except r3's; r0's last block (id 3) is whole in r2.
MOONCAKE_REQUESTS = [
    (0, [1, 2, 3], 3 * 512 - 200), (100, [1, 2, 7], 2 * 512 + 300), (200, [1, 2, 3, 4, 5], 5 * 512 - 100),
    (300, [1, 2, 7, 8], 4 * 512), (400, [9, 10], 2 * 512 - 50), (500, [1, 2, 3, 4, 5, 6, 11], 7 * 512 - 10),
    (600, [9, 12], 1000),
]
MOONCAKE_SESSIONS = [[0, 2, 5], [1, 3], [4], [6]]


def expected_infinite(tokenizer: HfTokenizer, prompts: dict[int, list[dict]], block_tokens: int, bs: int) -> float:
    """The infinite-cache hit ratio from the trace's hash ids alone: a request shares with an earlier one the
    chat header and their common leading blocks (a partial block: as far as both go, and no further)."""
    header = len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": ""}], add_generation_prompt=False),
                                  add_special_tokens=False)) - 1  # all but <|eot_id|>

    def lengths(ids: list[int], input_length: int) -> list[int]:
        last = round((input_length - 512 * (len(ids) - 1)) * block_tokens / 512)
        return [block_tokens] * (len(ids) - 1) + [last]

    hits = queries = 0
    for i, (_, ids, input_length) in enumerate(MOONCAKE_REQUESTS):
        n = len(tokenizer.encode_chat(prompts[i]))
        shared = 0
        for _, earlier, earlier_length in MOONCAKE_REQUESTS[:i]:
            common = 0
            for a, b, la, lb in zip(ids, earlier, lengths(ids, input_length), lengths(earlier, earlier_length),
                                    strict=False):
                if a != b:
                    break
                common += min(la, lb)
                if la != lb or la < block_tokens:
                    break
            shared = max(shared, header + common)
        hits += min(shared, n - 1) // bs * bs
        queries += n
    return hits / queries


def test_mooncake_trace_groups_conversations_and_pods_see_its_blocks(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(mooncake_line(t, ids, n) for t, ids, n in MOONCAKE_REQUESTS) + "\n")
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR)
    trace = read_mooncake(path, tokenizer, block_tokens=32, time_scale=2.0, session_header=True, max_output_tokens=3)
    # Grouping: a request extending an earlier one's ids is its conversation's next turn.
    assert [[st.headers["x-session-id"] for st in s.steps] for s in trace.sessions] == \
        [[f"mc{members[0]}"] * len(members) for members in MOONCAKE_SESSIONS]
    assert [s.start_s for s in trace.sessions] == [0.0, 0.2, 0.8, 1.2]  # arrival times, times --time-scale
    assert [st.think_s for st in trace.sessions[0].steps] == [None, 0.4, 0.6]  # the gaps between turns
    assert all(not s.carry_history and st.max_tokens == 3 for s in trace.sessions for st in s.steps)
    # Blocks: each a chunk of 32 one-token words (the last scaled), and prompts share what their ids share.
    first, second = (st.messages[0]["content"] for st in trace.sessions[0].steps[:2])
    assert len(tokenizer.encode(first.lstrip(), add_special_tokens=False)) == 32 * 2 + round(312 * 32 / 512)
    assert second.startswith(first) and len(tokenizer.encode(second.lstrip(), add_special_tokens=False)) == \
        32 * 4 + round(412 * 32 / 512)
    assert read_mooncake(path, tokenizer, block_tokens=32).sessions[0].steps[0].headers == {}

    prompts = {i: step.messages for session, members in zip(trace.sessions, MOONCAKE_SESSIONS, strict=True)
               for i, step in zip(members, session.steps, strict=True)}
    infinite = expected_infinite(tokenizer, prompts, 32, 16)
    # One pod with room for everything, requests one at a time: its own counters are the infinite cache.
    one = BenchRunner(pods=1, num_blocks=1000, speed=0.0, progress=False).run(CONTENDERS["direct"], trace)
    assert one.errors == 0 and sum(one.pod_requests) == 7
    assert one.hit_ratio == pytest.approx(infinite) and one.infinite == pytest.approx(infinite)
    # Two pods: following the shared blocks keeps them; round robin splits the conversations.
    two = BenchRunner(pods=2, num_blocks=1000, speed=0.0, progress=False)
    direct, kv_aware = (two.run(CONTENDERS[name], trace) for name in ("direct", "gateway-kv_aware"))
    assert direct.errors == kv_aware.errors == 0 and direct.infinite == kv_aware.infinite == pytest.approx(infinite)
    assert direct.hit_ratio < kv_aware.hit_ratio
    assert kv_aware.hit_ratio >= kv_aware.sticky_lru - 0.02 and kv_aware.distance is not None


SAMPLE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake-fast25-synthetic.jsonl"


@pytest.mark.skipif(not SAMPLE.exists(), reason=f"no Mooncake sample at {SAMPLE}")
def test_mooncake_sample_slice_replays_within_its_bounds():
    # Its requests reuse prefixes set up earlier in it: near its end, even 40 of them share a third of their blocks.
    trace = read_mooncake(SAMPLE, HfTokenizer(BUNDLED_TOKENIZER_DIR), block_tokens=16, start=3900, limit=40,
                          time_scale=0.3)
    assert trace.requests == 40 and trace.seed == 3900
    runner = BenchRunner(pods=2, num_blocks=3000, speed=0.0, progress=False)
    results = [runner.run(CONTENDERS[name], trace) for name in ("direct", "gateway-kv_aware")]
    for result in results:
        assert result.errors == 0 and sum(result.pod_requests) == 40
        assert result.infinite is not None and result.sticky_lru is not None
        assert result.sticky_lru <= result.infinite and result.hit_ratio <= result.infinite + 0.01
        assert result.infinite > 0.2
    assert results[1].hit_ratio >= results[0].hit_ratio


def test_long_context_sessions_start_large_grow_little_and_size_the_pods():
    trace = scaled_trace("long-context", 0, 1.0, None, ["sessions=2", "min_turns=3", "max_turns=3"])
    count = mock_token_counter()
    for session in trace.sessions:
        history = History(session)
        sizes = []
        for step in session.steps:
            sizes.append(count(history.prompt(step)))
            history.answered("an answer")
        assert 30_000 <= sizes[0] <= 125_000
        assert all(100 <= b - a <= 600 for a, b in itertools.pairwise(sizes))
    args = argparse.Namespace(working_set_ratio=None, num_blocks=600, pods=2)
    runner = BenchRunner(pods=2, progress=False)
    size_simulated_pods(runner, trace, args)
    # One block more than the longest request: vLLM keeps one as its null block.
    assert (runner.num_blocks - 1) * 16 >= longest_request_tokens(trace, count) and runner.max_model_len is None
    # Contexts past the model's 128k: the simulated pods take them (as a longer-context model would).
    huge = scaled_trace("long-context", 0, 1.0, None, ["sessions=1", "max_turns=2", "min_turns=2",
                                                       "min_context_words=70000", "max_context_words=70000"])
    size_simulated_pods(runner, huge, args)
    assert runner.max_model_len is not None and runner.max_model_len > MODEL_MAX_LEN
    assert (runner.num_blocks - 1) * 16 >= runner.max_model_len


def test_conversations_grow_turn_by_turn_and_each_request_time_is_split(tmp_path):
    trace = conversations(seed=1, conversations=6, max_turns=4, think_min_s=0.0, think_max_s=0.05, rate=20)
    assert trace == conversations(seed=1, conversations=6, max_turns=4, think_min_s=0.0, think_max_s=0.05, rate=20)
    assert trace != conversations(seed=2, conversations=6, max_turns=4, think_min_s=0.0, think_max_s=0.05, rate=20)
    several = [s for s in trace.sessions if len(s.steps) > 1]
    assert len(several) >= 4 and all(s.carry_history for s in trace.sessions)  # each turn re-sends the context
    assert all(8 <= step.max_tokens <= 48 for s in trace.sessions for step in s.steps)  # short answers
    assert all(step.think_s is not None for s in several for step in s.steps[1:])
    runner = BenchRunner(pods=2, num_blocks=400, speed=0.0, progress=False, split_dir=str(tmp_path))
    result = runner.run(CONTENDERS["gateway-kv_aware"], trace)
    assert result.errors == 0 and not result.skipped
    with open(tmp_path / "conversations-gateway-kv_aware.csv") as f:
        table = list(csv.DictReader(f))
    # Every answered request is one row, joined with the gateway's access record and its pod's own account.
    assert len(table) == trace.requests
    for row in table:
        steps = [float(row[f"{s}_ms"]) for s in ("parse", "tokenize", "prepare", "admit", "route", "dispatch")]
        assert float(row["gateway_ms"]) == pytest.approx(sum(steps), abs=0.01)
        assert row["pod"].startswith("mock-") and int(row["pod_in_flight"]) >= 0
        assert 0 <= float(row["pod_queue_ms"]) <= float(row["pod_ttft_ms"]) < float(row["client_ttft_ms"])
    later = [r for r in table if r["step"] != "0"]
    assert later and all(r["reason"] == "cache_hit" for r in later)  # a returning turn finds its context
    assert {"split_gateway_ms_p50", "split_pod_queue_ms_p90", "split_pod_in_flight_mean"} <= set(result.extra)
