"""``gateway bench``: the side-by-side router benchmark."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gateway.bench.workloads import GENERATORS, read_trace, write_trace

DEFAULT_CONTENDERS = {
    "shared-prefix": ["direct", "gateway-round_robin", "gateway-prefix_cache", "gateway-kv_aware", "gateway-slo",
                      "vllm-router-round_robin", "vllm-router-cache_aware", "vllm-router-kv_aware",
                      "sglang-router-cache_aware"],
    "multi-turn": ["direct", "gateway-kv_aware", "vllm-router-cache_aware", "sglang-router-cache_aware"],
    "agentic": ["direct", "gateway-kv_aware-no-workflow", "gateway-kv_aware", "vllm-router-cache_aware"],
    "overload": ["direct", "gateway-least_request", "gateway-slo"],
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="replay a workload through each router, side by side")
    b.add_argument("--scenario", action="append", choices=sorted(GENERATORS), help="repeatable (default: shared-prefix"
                   " and agentic)")
    b.add_argument("--contender", action="append", help="repeatable; default: a set per scenario")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--scale", type=float, default=1.0, help="multiplies the number of requests")
    b.add_argument("--rate", type=float, help="arrival rate for the scenario (req/s or sessions/s)")
    b.add_argument("--pods", type=int, default=4, help="simulated pods")
    b.add_argument("--num-blocks", type=int, default=600, help="KV blocks per simulated pod")
    b.add_argument("--speed", type=float, default=0.2, help="time factor of the simulated pods")
    b.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    b.add_argument("--save-trace", help="write the generated trace here")
    b.add_argument("--out", default="bench-results")
    b.add_argument("--pod-url", action="append", help="benchmark these existing pods instead of simulated ones")
    b.add_argument("--events", action="append", help="URL=ENDPOINT: KV-event endpoint of an existing pod")


def scaled_trace(scenario: str, seed: int, scale: float, rate: float | None):
    gen = GENERATORS[scenario]
    kwargs: dict[str, float] = {}
    counts = {"shared-prefix": "per_group", "multi-turn": "conversations", "agentic": "workflows"}
    defaults = {"per_group": 24, "conversations": 16, "workflows": 16}
    if scenario in counts:
        kwargs[counts[scenario]] = max(1, round(defaults[counts[scenario]] * scale))
    if rate is not None:
        kwargs["start_rate" if scenario == "overload" else "rate"] = rate
    return gen(seed=seed, **kwargs)


def run(args: argparse.Namespace) -> int:
    from gateway.bench.report import write_results
    from gateway.bench.runner import CONTENDERS, BenchRunner
    from gateway.config import PodConfig

    existing = None
    if args.pod_url:
        events = dict(e.split("=", 1) for e in (args.events or []))
        existing = [PodConfig(url=u, name=f"pod{i}", kv_events=events.get(u)) for i, u in enumerate(args.pod_url)]
    runner = BenchRunner(pods=args.pods, num_blocks=args.num_blocks, speed=args.speed, existing_pods=existing)
    results = []
    started = time.time()
    for scenario in args.scenario or ["shared-prefix", "agentic"]:
        trace = read_trace(args.trace) if args.trace else scaled_trace(scenario, args.seed, args.scale, args.rate)
        if args.save_trace:
            write_trace(trace, args.save_trace)
        names = args.contender or DEFAULT_CONTENDERS[trace.scenario]
        unknown = [n for n in names if n not in CONTENDERS]
        if unknown:
            print(f"gateway bench: unknown contender(s) {unknown}; known: {sorted(CONTENDERS)}", file=sys.stderr)
            return 2
        print(f"{trace.scenario}: {trace.requests} requests, seed {trace.seed}", file=sys.stderr)
        for name in names:
            result = runner.run(CONTENDERS[name], trace)
            results.append(result)
            if result.skipped:
                print(f"  {name}: skipped ({result.skipped})", file=sys.stderr)
    meta = {"seed": args.seed, "pods": args.pods, "num_blocks": args.num_blocks, "speed": args.speed,
            "seconds": round(time.time() - started, 1)}
    paths = write_results(results, Path(args.out), meta)
    print(paths["md"].read_text())
    print(json.dumps({k: str(v) for k, v in paths.items()}), file=sys.stderr)
    return 0
