"""What applying the pods' KV events alone costs a gateway host: a synthetic firehose from simulated pods (no
requests) into ``gateway serve --workers W``.

    python bench/scripts/kv_firehose.py --pods 1000 --rate 600 --workers 1 2 4 [--ingest-processes 1 2] [--per-worker]

Each pod publishes ``--rate`` block events a second (batches of 16 new blocks and the removal of 16 old ones,
holding ``--hold`` batches: 1,000 pods x 64 x 16 is a million indexed blocks), from a few processes of
simulated pods (``--pods-per-process``). For each gateway configuration, over ``--seconds`` once it applies
no more than the pods offer (the backlog of its start, replay buffers included, cleared; at most ``--warmup``):
the block events the host applied a second, the CPU of all its processes and of those applying events (the
indexers; every worker when each applies every event itself, ``--per-worker``; the one process with one
worker), and the events applied per second of that CPU: per core. The ingest CPU should not grow with the
workers (it does with ``--per-worker``), and grows with ``--ingest-processes`` only as far as the host has
cores for them: run it on a machine with more cores than ingest processes plus the pods' own processes (on a
2-core machine the pods and the gateway share two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgspec

from bench.runner import INDEXER_NAME, process_cpu_s, process_memory_mb, wait_http
from simulator.config import MockPodsConfig
from simulator.launcher import MockPodFleet
from simulator.pod import free_port

APPLIED = tuple(f'gateway_kv_index_blocks_total{{op="{op}"}}' for op in ("blocks_stored", "blocks_removed"))


def applied(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(APPLIED))


def indexed(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/debug/index", timeout=30) as resp:
        info = json.loads(resp.read())
    return {"blocks": info["indexed_blocks"], "memory": info["memory"]}


def caught_up(url: str, offered: float, limit_s: float) -> None:
    """Waits (at most ``limit_s``) until the host applies no more than the pods offer: the replay buffers and the
    events queued while it started are behind it, so what follows is the steady state, not a backlog."""
    deadline = time.monotonic() + limit_s
    before, at = applied(url), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now, t = applied(url), time.monotonic()
        if (now - before) / (t - at) <= 1.05 * offered:
            return
        before, at = now, t


def measure(config_path: str, workers: int, ingest: int, warmup_s: float, seconds: float,
            offered: float) -> dict[str, float]:
    port = free_port()
    env = {**os.environ, "GATEWAY_KV_INDEX__INGEST_PROCESSES": str(ingest), "GATEWAY_LOGGING__ACCESS_LOG": "false"}
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", config_path, "--port", str(port),
           "--workers", str(workers), "--policy", "kv_aware"]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", 300, proc)
        caught_up(url, offered, warmup_s)
        events0, cpu0, ingest0, t0 = applied(url), process_cpu_s(proc.pid), process_cpu_s(proc.pid, INDEXER_NAME), \
            time.monotonic()
        time.sleep(seconds)
        events1, cpu1, ingest1, t1 = applied(url), process_cpu_s(proc.pid), process_cpu_s(proc.pid, INDEXER_NAME), \
            time.monotonic()
        index = indexed(url)
        memory = process_memory_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    elapsed = t1 - t0
    host = (cpu1 - cpu0) / elapsed
    # Who applies events: the indexers; else every worker (each its own subscriber), or the one process.
    ingest_cores = (ingest1 - ingest0) / elapsed if workers > 1 and ingest else host
    rate = (events1 - events0) / elapsed
    return {"events_per_s": rate, "host_cores": host, "ingest_cores": ingest_cores,
            "per_ingest_core": rate / ingest_cores if ingest_cores else 0.0,
            "indexed_blocks": index["blocks"], "gateway_memory_mb": memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=600.0, help="block events a second per pod")
    parser.add_argument("--hold", type=int, default=64, help="batches of 16 blocks each pod holds")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ingest-processes", type=int, nargs="+", default=[1])
    parser.add_argument("--per-worker", action="store_true", help="also each worker applying every event itself")
    parser.add_argument("--pods-per-process", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=30.0, help="at most this long for the backlog to clear")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    fleet = MockPodFleet(MockPodsConfig(count=args.pods, speed=0, synthetic_events=args.rate,
                                        synthetic_hold=args.hold, per_process=args.pods_per_process), quiet=True)
    pods = fleet.start(timeout_s=600)
    # Until a pod has stored ``hold`` batches its removals name blocks it never stored: wait for the steady state.
    time.sleep(args.hold * 2 * 16 / args.rate)
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(msgspec.json.encode({"pods": pods}).decode())
        runs = [(w, i) for w in args.workers for i in (args.ingest_processes if w > 1 else [1])]
        if args.per_worker:
            runs += [(w, 0) for w in args.workers if w > 1]
        print(f"{args.pods} pods x {args.rate:.0f} block events/s offered = {args.pods * args.rate:,.0f}/s; "
              f"{len(fleet.members)} pod processes")
        print("workers | ingest | applied block events/s | host CPU (cores) | ingest CPU (cores) | "
              "events/s per ingest core | indexed blocks | gateway memory (MiB, PSS)")
        for workers, ingest in runs:
            r = measure(f.name, workers, ingest, args.warmup, args.seconds, args.pods * args.rate)
            who = ("in the worker" if workers == 1 else f"{ingest} indexer(s)" if ingest else "every worker")
            print(f"{workers} | {who} | {r['events_per_s']:,.0f} | {r['host_cores']:.2f} | {r['ingest_cores']:.2f} | "
                  f"{r['per_ingest_core']:,.0f} | {r['indexed_blocks']:,} | {r['gateway_memory_mb']:.0f}", flush=True)
    finally:
        fleet.stop()
        os.unlink(f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
