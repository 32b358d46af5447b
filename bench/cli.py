"""``gateway bench``: the side-by-side router benchmark (plugged into ``gateway`` as :data:`COMMAND`).

Owner: the command line: which traces (generated, saved, or a Mooncake file), which contenders, and the
size of the simulated pods for each trace.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.workloads import (
    GENERATORS,
    PRESETS,
    Trace,
    longest_request_tokens,
    read_trace,
    working_set_tokens,
    write_trace,
)
from gateway.extensions import Command

if TYPE_CHECKING:
    from bench.runner import BenchRunner

DEFAULT_CONTENDERS = {
    "shared-prefix": ["direct", "gateway-round_robin", "gateway-prefix_cache", "gateway-kv_aware", "gateway-slo",
                      "vllm-router-round_robin", "vllm-router-cache_aware", "vllm-router-kv_aware",
                      "sglang-router-cache_aware"],
    "multi-turn": ["direct", "gateway-kv_aware", "vllm-router-cache_aware", "sglang-router-cache_aware"],
    "conversations": ["direct", "gateway-round_robin", "gateway-prefix_cache", "gateway-kv_aware", "smg-cache_aware"],
    "agentic": ["direct", "gateway-kv_aware-no-workflow", "gateway-kv_aware", "vllm-router-cache_aware"],
    "agentic-shared": ["direct", "gateway-round_robin", "gateway-kv_aware-no-workflow", "gateway-kv_aware",
                       "vllm-router-cache_aware", "vllm-router-kv_aware", "sglang-router-cache_aware",
                       "smg-cache_aware"],
    "long-context": ["direct", "gateway-round_robin", "gateway-kv_aware", "vllm-router-cache_aware",
                     "smg-cache_aware"],
    "mooncake": ["direct", "gateway-round_robin", "gateway-kv_aware", "vllm-router-cache_aware", "smg-cache_aware"],
    "overload": ["direct", "gateway-least_request", "gateway-slo"],
    "noisy-neighbor": ["gateway-kv_aware", "gateway-kv_aware-no-flow-control"],
    "priority": ["gateway-kv_aware", "gateway-kv_aware-no-flow-control"],
    "lora": ["direct", "gateway-round_robin", "gateway-least_request", "gateway-kv_aware",
             "gateway-kv_aware-lora-on-demand", "vllm-router-round_robin", "vllm-router-cache_aware",
             "sglang-router-cache_aware", "smg-cache_aware"],
    "fleet-scale": ["direct", "gateway-kv_aware", "gateway-kv_aware-full-scan", "gateway-kv_aware-2-workers",
                    "gateway-kv_aware-4-workers", "smg-cache_aware"],
}
# Flags that only a Mooncake trace takes (their defaults are None: given or not).
MOONCAKE_FLAGS = ("block_tokens", "time_scale", "session_header", "max_output_tokens", "start", "limit")


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--scenario", action="append", choices=sorted(GENERATORS), help="repeatable (default: shared-prefix"
                   " and agentic)")
    b.add_argument("--contender", action="append", help="repeatable; default: a set per scenario")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--scale", type=float, default=1.0, help="multiplies the number of requests")
    b.add_argument("--rate", type=float, help="arrival rate for the scenario (req/s or sessions/s)")
    b.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                   help="a knob of the scenario's generator, repeatable (agentic-shared: workflows, min_stages, "
                        "max_stages, roles, role_words, task_words, tool_words, think_min_s, think_max_s, rate, "
                        "max_tokens)")
    b.add_argument("--preset", metavar="NAME",
                   help="a named set of the scenario's knobs, before any --set (noisy-neighbor: documents, 64 of "
                        "A's clients each sending a new 3,000-word document with 64-token answers)")
    b.add_argument("--working-set-ratio", type=float, metavar="R",
                   help="size the simulated pods' caches so that the trace's peak working set is R times the "
                        "fleet's KV capacity (overrides --num-blocks)")
    b.add_argument("--pods", type=int, default=4, help="simulated pods")
    b.add_argument("--pods-per-process", type=int, default=0, metavar="K",
                   help="simulated pods per process (default: one each up to 16 pods, else spread over the cores)")
    b.add_argument("--num-blocks", type=int, default=600, help="KV blocks per simulated pod")
    b.add_argument("--speed", type=float, default=0.2, help="time factor of the simulated pods")
    b.add_argument("--max-loras", type=int, default=2,
                   help="LoRA adapters in one batch on each simulated pod (vLLM's --max-loras; the lora scenario)")
    b.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    b.add_argument("--trace-format", choices=["bench", "mooncake"], default="bench",
                   help="bench: a trace --save-trace wrote; mooncake: the Mooncake FAST'25 format (timestamp, "
                        "input_length, output_length, hash_ids of 512-token blocks)")
    b.add_argument("--block-tokens", type=int, metavar="N",
                   help="Mooncake: tokens per trace block in the replayed prompts (default 512, the trace's own; "
                        "e.g. 64 to fit small engines, keeping the structure)")
    b.add_argument("--time-scale", type=float, metavar="F",
                   help="Mooncake: multiplies the trace's arrival times and the gaps between turns (default 1; "
                        "0.5: twice as fast). --speed is the simulated pods' compute, not this")
    b.add_argument("--session-header", action="store_true", default=None,
                   help="Mooncake: send each conversation's session id in x-session-id (default: no header, as "
                        "agents that send none)")
    b.add_argument("--max-output-tokens", type=int, metavar="N", help="Mooncake: cap each request's output_length")
    b.add_argument("--start", type=int, metavar="K", help="Mooncake: replay from the K-th request (0-based)")
    b.add_argument("--limit", type=int, metavar="N", help="Mooncake: replay N requests")
    b.add_argument("--save-trace", help="write the generated trace here")
    b.add_argument("--out", default="bench-results")
    b.add_argument("--no-install-peers", dest="install_peers", action="store_false",
                   help="refuse to run when a peer router is not installed yet (default: install each peer its "
                        "row names, pinned, into its own environment under ~/.cache/kv-gateway/peers, once)")
    b.add_argument("--router-logs", metavar="DIR", help="keep each router's output here (<contender>-<n>.log)")
    b.add_argument("--split", metavar="DIR",
                   help="split each request's TTFT (the gateway's steps, dispatch to first byte, the chosen pod's "
                        "requests in flight, the pod's queue time and TTFT) into DIR/<scenario>-<contender>.csv, "
                        "percentiles in the results (the gateway writes its access records for it)")
    b.add_argument("--pod-url", action="append", help="benchmark these existing pods instead of simulated ones")
    b.add_argument("--events", action="append", help="URL=ENDPOINT: KV-event endpoint of an existing pod")
    b.add_argument("--replay", action="append", help="URL=ENDPOINT: KV-event replay endpoint of an existing pod")
    b.add_argument("--model", default="mock-llama", help="the model the requests name (existing pods: theirs)")
    b.add_argument("--tokenizer", help="local tokenizer directory of --model, for the routers that tokenize "
                                       "(default: the simulated pods' own; with --pod-url and none, the gateway "
                                       "asks the pods' /tokenize)")


def scaled_trace(scenario: str, seed: int, scale: float, rate: float | None, knobs: list[str] | None = None,
                 preset: str | None = None):
    gen = GENERATORS[scenario]
    kwargs: dict[str, float] = {}
    counts = {"shared-prefix": "per_group", "multi-turn": "conversations", "conversations": "conversations",
              "agentic": "workflows",
              "agentic-shared": "workflows", "long-context": "sessions", "lora": "requests",
              "fleet-scale": "requests"}
    if scenario in counts:
        default = inspect.signature(gen).parameters[counts[scenario]].default
        kwargs[counts[scenario]] = max(1, round(default * scale))
    if rate is not None:
        kwargs["start_rate" if scenario == "overload" else "rate"] = rate
    if preset is not None:
        presets = PRESETS.get(scenario, {})
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r} for {scenario}; its presets: {', '.join(presets) or 'none'}")
        kwargs.update(presets[preset])
    kwargs.update(parse_knobs(gen, knobs or []))
    return gen(seed=seed, **kwargs)


def parse_knobs(gen: Callable[..., Trace], knobs: list[str]) -> dict[str, float]:
    """``KNOB=VALUE`` strings checked against the generator's own parameters (typed by their defaults)."""
    params = inspect.signature(gen).parameters
    out: dict[str, float] = {}
    for knob in knobs:
        name, _, value = knob.partition("=")
        if name not in params or name == "seed" or not value:
            known = ", ".join(p for p in params if p != "seed")
            raise ValueError(f"unknown knob {knob!r} for {gen.__name__}; its knobs: {known}")
        out[name] = type(params[name].default)(float(value))
    return out


TokenCounter = Callable[[list[dict[str, Any]]], int]


def mock_token_counter() -> TokenCounter:
    """The simulated pods' token count of a chat prompt."""
    from bench.oracle import ChatEncoder
    from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer

    encoder = ChatEncoder(HfTokenizer(BUNDLED_TOKENIZER_DIR))
    return lambda messages: len(encoder.chat(messages))


def longest_tokens_for(trace: Trace, count: TokenCounter) -> int:
    # An answer re-tokenized from its text may take a few more tokens than were generated.
    return math.ceil(longest_request_tokens(trace, count) * 1.05)


def cache_blocks_for(trace: Trace, ratio: float, pods: int, block_size: int, count: TokenCounter | None = None) -> int:
    """KV blocks per simulated pod such that the trace's peak working set is ``ratio`` times the fleet's,
    and never fewer than its longest request needs: vLLM refuses to start with a cache that cannot hold
    one request of its longest length, so a pod that refuses a request for its size is no real fleet (one
    block more: vLLM's null block)."""
    count = count or mock_token_counter()
    by_ratio = math.ceil(working_set_tokens(trace, count) / block_size / ratio / pods)
    return max(16, by_ratio, math.ceil(longest_tokens_for(trace, count) / block_size) + 1)


def size_simulated_pods(runner: BenchRunner, trace: Trace, args: argparse.Namespace) -> None:
    """Blocks per pod (``--num-blocks``, or by ``--working-set-ratio``) and context length (the model's) enough
    for the trace's longest request, as a real fleet serving it would have."""
    from simulator.engine import MODEL_MAX_LEN

    count = mock_token_counter()
    longest = longest_tokens_for(trace, count)
    if args.working_set_ratio:
        runner.num_blocks = cache_blocks_for(trace, args.working_set_ratio, args.pods, runner.block_size, count)
    else:
        runner.num_blocks = max(args.num_blocks, math.ceil(longest / runner.block_size) + 1)  # + the null block
    runner.max_model_len = longest if longest > MODEL_MAX_LEN else None


def load_trace(args: argparse.Namespace, scenario: str | None, tokenizer: str | None) -> Trace:
    """The generated trace of ``scenario``, or the one in ``--trace`` (a saved one, or a Mooncake file)."""
    if scenario is not None:
        return scaled_trace(scenario, args.seed, args.scale, args.rate, args.set, args.preset)
    if args.trace_format == "bench":
        return read_trace(args.trace)
    from bench.mooncake import TRACE_BLOCK_TOKENS, read_mooncake
    from gateway.tokenization.hf import HfTokenizer

    if tokenizer is None:
        raise ValueError("a Mooncake trace needs --tokenizer (its prompts are words of one token each)")
    return read_mooncake(args.trace, HfTokenizer(tokenizer), block_tokens=args.block_tokens or TRACE_BLOCK_TOKENS,
                         start=args.start or 0, limit=args.limit, time_scale=args.time_scale or 1.0,
                         session_header=bool(args.session_header), max_output_tokens=args.max_output_tokens)


def time_split(extra: dict[str, float]) -> str:
    """The TTFT a contender added and, for the gateway, its own split of it, as one line ("" when none)."""
    parts = []
    if "added_ttft_ms_p50" in extra:
        parts.append("added TTFT p50/p90/p99 " + "/".join(f"{extra[f'added_ttft_ms_{q}']:.2f}"
                                                         for q in ("p50", "p90", "p99")) + " ms")
    if "loop_lag_ms_p50" in extra:
        parts.append(f"loop lag p50/p99 {extra['loop_lag_ms_p50']:.2f}/{extra.get('loop_lag_ms_p99', 0.0):.2f} ms")
    steps = [(k.removeprefix("step_").removesuffix("_ms_p50"), v) for k, v in extra.items()
             if k.startswith("step_") and k.endswith("_ms_p50")]
    if steps:
        parts.append("step p50s " + ", ".join(f"{name} {v:.3f}" for name, v in steps) + " ms")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    from bench.peers import PeerMissing, PeerRefused
    from bench.report import ratio, write_results
    from bench.runner import CONTENDERS, BenchRunner, gateway_version, prepare_peers
    from bench.split import split_line
    from gateway.config import PodConfig
    from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR

    misplaced = [f"--{f.replace('_', '-')}" for f in MOONCAKE_FLAGS if getattr(args, f) is not None]
    if misplaced and not (args.trace and args.trace_format == "mooncake"):
        print(f"gateway bench: {', '.join(misplaced)} only with --trace FILE --trace-format mooncake", file=sys.stderr)
        return 2
    existing = None
    tokenizer = args.tokenizer or (None if args.pod_url else str(BUNDLED_TOKENIZER_DIR))
    if args.pod_url:
        events = dict(e.split("=", 1) for e in (args.events or []))
        replay = dict(e.split("=", 1) for e in (args.replay or []))
        existing = [PodConfig(url=u, name=f"pod{i}", kv_events=events.get(u), kv_replay=replay.get(u))
                    for i, u in enumerate(args.pod_url)]
    runs: list[tuple[Trace, list[str]]] = []
    for scenario in [None] if args.trace else args.scenario or ["shared-prefix", "agentic"]:
        try:
            trace = load_trace(args, scenario, tokenizer)
        except (ValueError, OSError) as exc:
            print(f"gateway bench: {exc}", file=sys.stderr)
            return 2
        runs.append((trace, args.contender or DEFAULT_CONTENDERS[trace.scenario]))
    unknown = sorted({n for _, names in runs for n in names if n not in CONTENDERS})
    if unknown:
        print(f"gateway bench: unknown contender(s) {unknown}; known: {sorted(CONTENDERS)}", file=sys.stderr)
        return 2
    try:  # before any run: a wrong peer binary must not cost a whole bench first
        peers = prepare_peers([CONTENDERS[n] for _, names in runs for n in names], args.install_peers)
    except (PeerMissing, PeerRefused) as exc:
        print(f"gateway bench: {exc}", file=sys.stderr)
        return 2
    for peer in peers.values():
        print(f"peer {peer.package} {peer.version}: {peer.path} ({peer.reported or 'no --version'})",
              file=sys.stderr)
    runner = BenchRunner(pods=args.pods, num_blocks=args.num_blocks, speed=args.speed, model=args.model,
                         tokenizer=tokenizer, existing_pods=existing, router_logs=args.router_logs, peers=peers,
                         max_loras=args.max_loras, pods_per_process=args.pods_per_process, split_dir=args.split)
    results = []
    started = time.time()
    for trace, names in runs:
        if args.save_trace:
            write_trace(trace, args.save_trace)
        if not existing:
            size_simulated_pods(runner, trace, args)
        conversations = sum(1 for s in trace.sessions if len(s.steps) > 1)
        print(f"{trace.scenario}: {trace.requests} requests in {len(trace.sessions)} sessions ({conversations} of "
              f"several requests), seed {trace.seed}, {runner.num_blocks} KV blocks per pod", file=sys.stderr)
        for name in names:
            result = runner.run(CONTENDERS[name], trace)
            results.append(result)
            if result.skipped:
                print(f"  {name}: skipped ({result.skipped})", file=sys.stderr)
            else:
                print(f"  {name}: hit ratio {result.hit_ratio:.3f} (sticky LRU {ratio(result.sticky_lru)}, keep-warm "
                      f"bound {ratio(result.keep_warm)}, infinite {ratio(result.infinite)}), TTFT p50/p90/p99 "
                      f"{result.ttft_p50_ms:.1f}/{result.ttft_p90_ms:.1f}/{result.ttft_p99_ms:.1f} ms, per pod "
                      f"{'/'.join(map(str, result.pod_requests))}, {result.errors} errors", file=sys.stderr)
                if (split := time_split(result.extra)):
                    print(f"    {split}", file=sys.stderr)
                if (split := split_line(result.extra)):
                    print(f"    {split}", file=sys.stderr)
                if "adapter_switches_per_1k" in result.extra:
                    x = result.extra
                    print(f"    adapter switches {x['adapter_switches_per_1k']:.0f} per 1,000 requests (bound "
                          f"{x['adapter_switches_bound_per_1k']:.0f}), loads {x['adapter_loads_per_1k']:.0f}",
                          file=sys.stderr)
                for tenant, s in result.tenants.items():
                    print(f"    tenant {tenant}: TTFT p90 {s['ttft_p90_ms']:.0f} ms, {s['answered_in_window']:.0f} "
                          f"answered in the window, token share {s['token_share']:.3f}", file=sys.stderr)
    meta = {"gateway": gateway_version(), "seed": args.seed, "pods": args.pods,
            "pods_per_process": args.pods_per_process, "num_blocks": runner.num_blocks,
            "speed": args.speed,
            "working_set_ratio": args.working_set_ratio, "knobs": args.set, "preset": args.preset,
            "trace": args.trace,
            "trace_format": args.trace_format, **{f: getattr(args, f) for f in MOONCAKE_FLAGS},
            "seconds": round(time.time() - started, 1)}
    paths = write_results(results, Path(args.out), meta)
    print(paths["md"].read_text())
    print(json.dumps({k: str(v) for k, v in paths.items()}), file=sys.stderr)
    return 0


COMMAND = Command(help="replay a workload through each router, side by side", add_arguments=add_arguments, run=run)
