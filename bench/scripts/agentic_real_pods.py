"""Agentic traffic over two small real vLLM pods (CPU): the gateway's contenders, several seeds, the oracle.

    E2E_VLLM_PYTHON=$(tools/vllm-env.sh)/bin/python E2E_MODEL_DIR=<the e2e suite's tiny model> \\
        python bench/scripts/agentic_real_pods.py --contender gateway-kv_aware \\
        --contender gateway-kv_aware-no-workflow --seed 3 --seed 4 --seed 5 [--think 1 4] [--blocks 48] \\
        [--workload shared-prefix] [--split DIR]

Two pods, each on a core of its own, with ``--blocks`` KV blocks of 128 tokens (one is vLLM's null block),
take the e2e suite's agentic trace (``agentic_shared``: 30 workflows of 4-5 stages over two role prompts
sharing a preamble, a tool result per stage, ``--think`` seconds between stages): its working set is about
twice what the pods hold. Every contender runs on the same pods, reset between runs. One JSON line per
run: the pods' own hit ratio (keep-warm refreshes taken out), the oracle's sticky-LRU and keep-warm
bounds, TTFT, a workflow's time from its first request to its last answer (session), requests per pod,
and what keep-warm spent. ``tests/e2e/run.sh`` shows how the environment and the model are made.

``--split DIR``: each request's TTFT split and chosen pod (bench.split) in ``DIR/<scenario>-<contender>-seed<N>-
<time>.csv``, one file a run, so that runs of two settings can be compared request by request.

``--workload shared-prefix``: instead, one-request sessions in 8 groups of 12 sharing a long system prompt
(700 words, a question of 100 each, 6 a second), the shared-prefix traffic of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.runner import CONTENDERS, BenchRunner
from bench.workloads import Trace, agentic_shared, shared_prefix
from gateway.config import PodConfig
from tests.e2e.conftest import MODEL, VllmPod

# The router's own CPU time per request and tokenize step, beside what keep-warm did.
EXTRAS = ("cpu_ms_per_req_router", "step_tokenize_ms_p50", "prompt_tokens", "keep_warm_refreshes",
          "keep_warm_cancelled", "keep_warm_computed_tokens", "keep_warm_kept", "keep_warm_lost",
          "lost_evicted_while_thinking")


def workload(args: argparse.Namespace, seed: int) -> Trace:
    if args.workload == "shared-prefix":
        return shared_prefix(seed=seed, groups=8, per_group=12, shared_words=700, question_words=100, rate=6.0)
    return agentic_shared(seed=seed, workflows=args.workflows, min_stages=args.stages[0], max_stages=args.stages[1],
                          roles=2, common_words=220, role_words=80, task_words=40, tool_words=100,
                          think_min_s=args.think[0], think_max_s=args.think[1], rate=3.0, max_tokens=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contender", action="append", choices=sorted(CONTENDERS), required=True)
    parser.add_argument("--seed", action="append", type=int, required=True)
    parser.add_argument("--think", nargs=2, type=float, default=(1.0, 4.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--blocks", type=int, default=48, help="KV blocks per pod (vLLM's null block included)")
    parser.add_argument("--workflows", type=int, default=30)
    parser.add_argument("--stages", nargs=2, type=int, default=(4, 5), metavar=("MIN", "MAX"))
    parser.add_argument("--workload", choices=("agentic", "shared-prefix"), default="agentic")
    parser.add_argument("--split", metavar="DIR", help="write each request's TTFT split and pod here")
    args = parser.parse_args()
    python, model_dir = os.environ.get("E2E_VLLM_PYTHON"), os.environ.get("E2E_MODEL_DIR")
    if not python or not model_dir:
        parser.error("set E2E_VLLM_PYTHON and E2E_MODEL_DIR (tests/e2e/run.sh says how they are made)")
    run_dir = Path(tempfile.mkdtemp(prefix="agentic-real-"))
    pidfile = run_dir / "pids"
    pidfile.touch()
    pods = [VllmPod(f"pod{i}", python, model_dir, run_dir, pidfile, ("--num-gpu-blocks-override", str(args.blocks)),
                    str(i % (os.cpu_count() or 1))) for i in range(2)]
    try:
        for pod in pods:
            pod.start()
        for pod in pods:
            pod.wait_ready()
        configs = [PodConfig(url=p.url, name=p.name, kv_events=f"tcp://127.0.0.1:{p.events_port}",
                             kv_replay=f"tcp://127.0.0.1:{p.replay_port}") for p in pods]
        runner = BenchRunner(model=MODEL, tokenizer=model_dir, existing_pods=configs, progress=False,
                             router_logs=str(run_dir / "routers"), split_dir=args.split)
        for seed in args.seed:
            trace = workload(args, seed)
            for name in args.contender:
                r = runner.run(CONTENDERS[name], trace)
                if args.split:  # the runner names its file by scenario and contender: keep each run's
                    written = Path(args.split) / f"{r.scenario}-{r.name}.csv"
                    written.rename(written.with_name(f"{written.stem}-seed{seed}-{time.strftime('%H%M%S')}.csv"))
                print(json.dumps({
                    "seed": seed, "contender": name, "hit_ratio": round(r.hit_ratio, 4), "skipped": r.skipped,
                    "sticky_lru": r.sticky_lru and round(r.sticky_lru, 4), "keep_warm_bound": r.keep_warm and
                    round(r.keep_warm, 4), "infinite": r.infinite and round(r.infinite, 4),
                    "ttft_p50_ms": round(r.ttft_p50_ms), "ttft_p90_ms": round(r.ttft_p90_ms),
                    "session_p50_s": round(r.session_p50_ms / 1000, 2),
                    "busy_p50_s": round(r.busy_p50_ms / 1000, 3), "requests_per_pod": r.pod_requests,
                    "errors": r.errors, **{k: r.extra[k] for k in EXTRAS if k in r.extra}}), flush=True)
    finally:
        for pod in pods:
            pod.stop()


if __name__ == "__main__":
    main()
