"""What the endpoint picker costs: Envoy alone, Envoy + ``gateway epp``, and ``gateway serve`` (proxy mode)
in front of one simulated pod at speed 0.

    python bench/scripts/epp_overhead.py [--requests 400] [--policy round_robin] [--tokens 1 256 2048]
                                      [--bodies buffered|full_duplex] [--setups envoy envoy+epp gateway ...]

For each setup, requests one at a time over one kept-alive connection: a 4 KB chat request answered with 1
token (not streamed), then streams of 256 and 2,048 tokens with ``stream_options.include_usage``, one at a
time and then ``--concurrency`` (16) at a time. It prints
the median latency and the CPU time per request of each process of the setup (Envoy, the EPP, the gateway),
from the kernel's counters, and checks that the EPP learnt every answer's exact output length (its
``gateway_output_tokens`` histogram). The setups ``envoy+floor`` and ``envoy+floor-grpclib`` put
``bench/scripts/ext_proc_floor.py`` (the same messages, no decisions; on grpc.aio or grpclib) where the EPP
was: the gRPC stack's own share. Compare within one run: everything shares this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.runner import wait_http, wait_tcp
from bench.workloads import overhead_chat
from gateway.epp.envoy_config import BodyModes, bootstrap
from simulator.pod import free_port

IDLE_S = 5.0


def cpu_s(pid: int) -> float:
    """CPU seconds of all a process's threads so far, to the nanosecond (the scheduler's own account;
    ``/proc/PID/stat`` counts 10 ms ticks, too coarse for a millisecond per request)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError):
            total += int(stat.read_text().split()[0])
    return total / 1e9


def body(tokens: int, n: int) -> dict[str, Any]:
    out = overhead_chat("mock-llama", f"Say ok {n}.") | {"max_tokens": tokens}
    if tokens > 1:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


def plain_envoy(port: int, admin: int, pod: tuple[str, int]) -> dict[str, Any]:
    """Envoy alone: the same listener and cluster with no ext_proc, Lua or access log."""
    config = bootstrap(listen_port=port, admin_port=admin, epp=("127.0.0.1", 1), pods=[pod],
                       cluster="override_host", access_log=False)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"] = [f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.router"]
    pods = config["static_resources"]["clusters"][1]
    pods.pop("load_balancing_policy")
    return config


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def envoy_process(config: dict[str, Any], directory: Path, admin: int) -> subprocess.Popen[bytes]:
    path = directory / f"envoy-{admin}.yaml"
    path.write_text(yaml.safe_dump(config))
    envoy = str(Path(sys.executable).parent / "envoy")
    proc = spawn([envoy, "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "error"],
                 directory / f"envoy-{admin}.log")
    wait_http(f"http://127.0.0.1:{admin}/ready", 60, proc)
    return proc


@contextmanager
def setup(name: str, pod_url: str, policy: str, directory: Path, bodies: BodyModes = "buffered"
          ) -> Iterator[tuple[str, dict[str, subprocess.Popen[bytes]], str | None]]:
    """(URL requests go to, the processes whose CPU counts, the gateway's metrics URL)."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    host, port = pod_url.removeprefix("http://").split(":")
    env = {**os.environ, "GATEWAY_LOGGING__ACCESS_LOG": "false"}

    def envoy_in_front(grpc_port: int) -> str:
        """Envoy asking the ext_proc server on ``grpc_port``; the URL it listens on."""
        listen, admin = free_port(), free_port()
        procs["envoy"] = envoy_process(bootstrap(listen_port=listen, admin_port=admin, epp=("127.0.0.1", grpc_port),
                                                 pods=[(host, int(port))], cluster="override_host", bodies=bodies),
                                       directory, admin)
        return f"http://127.0.0.1:{listen}"

    try:
        if name == "envoy":
            listen, admin = free_port(), free_port()
            procs["envoy"] = envoy_process(plain_envoy(listen, admin, (host, int(port))), directory, admin)
            yield f"http://127.0.0.1:{listen}", procs, None
        elif name == "envoy+epp":
            http_port, grpc_port = free_port(), free_port()
            procs["epp"] = subprocess.Popen(
                [sys.executable, "-m", "gateway", "epp", "--port", str(http_port), "--grpc-port", str(grpc_port),
                 "--policy", policy, "--pod", pod_url],
                env={**env, "GATEWAY_EPP__ACCESS_LOG": "true"}, stdout=subprocess.DEVNULL,
                stderr=(directory / "epp.log").open("wb"))
            wait_http(f"http://127.0.0.1:{http_port}/readyz", 60, procs["epp"])
            yield envoy_in_front(grpc_port), procs, f"http://127.0.0.1:{http_port}"
        elif name.startswith("envoy+floor"):
            grpc_port = free_port()
            stack = "grpclib" if name.endswith("grpclib") else "grpc_aio"
            procs["floor"] = spawn([sys.executable, str(Path(__file__).with_name("ext_proc_floor.py")),
                                    "--grpc-port", str(grpc_port), "--endpoint", f"{host}:{port}", "--stack", stack],
                                   directory / f"floor-{stack}.log")
            wait_tcp(grpc_port, 30, procs["floor"])
            yield envoy_in_front(grpc_port), procs, None
        else:
            http_port = free_port()
            procs["gateway"] = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--workers", "1", "--port", str(http_port),
                 "--policy", policy, "--pod", pod_url], env=env, stdout=subprocess.DEVNULL,
                stderr=(directory / "gateway.log").open("wb"))
            wait_http(f"http://127.0.0.1:{http_port}/readyz", 60, procs["gateway"])
            yield f"http://127.0.0.1:{http_port}", procs, f"http://127.0.0.1:{http_port}"
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=30)


async def drive(url: str, tokens: int, requests: int, concurrency: int = 1) -> list[float]:
    """Latencies in ms of ``requests`` requests, ``concurrency`` at a time, each client one kept-alive
    connection; each answer read whole."""
    latencies: list[float] = []
    numbers = iter(range(requests))

    async def client() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
            for n in numbers:
                started = time.perf_counter()
                async with http.post(f"{url}/v1/chat/completions", json=body(tokens, n)) as resp:
                    data = await resp.read()
                    assert resp.status == 200, data[:300]
                latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def output_tokens_learnt(metrics_url: str) -> float:
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(r'^gateway_output_tokens_sum\{kind="actual"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def measure(name: str, pod_url: str, policy: str, tokens: list[int], requests: int, directory: Path,
            concurrency: int, stream_requests: int | None, bodies: BodyModes) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with setup(name, pod_url, policy, directory, bodies) as (url, procs, metrics):
        asyncio.run(drive(url, 1, 30))  # warm: connections, tokenizer, caches
        # What each process spends per second with nothing to do (health checks, metric scrapes, timers):
        # the marginal cost of a request is its CPU less this rate over the run's time.
        idle_before = {k: cpu_s(p.pid) for k, p in procs.items()}
        time.sleep(IDLE_S)
        idle = {k: (cpu_s(p.pid) - idle_before[k]) / IDLE_S for k, p in procs.items()}
        passes = (concurrency,) if stream_requests else (1, concurrency)
        for n, parallel in [(t, c) for t in tokens for c in (passes if t > 1 else (1,))]:
            count = requests if n == 1 else stream_requests or max(20 * parallel, requests // (4 if n <= 256 else 16))
            learnt_before = output_tokens_learnt(metrics) if metrics else 0.0
            before = {k: cpu_s(p.pid) for k, p in procs.items()}
            started = time.monotonic()
            latencies = asyncio.run(drive(url, n, count, parallel))
            seconds = time.monotonic() - started
            row: dict[str, float] = {}
            for k, p in procs.items():
                spent = cpu_s(p.pid) - before[k]
                row[f"cpu_ms_{k}"] = round(1000 * spent / count, 3)
                row[f"marginal_cpu_ms_{k}"] = round(1000 * (spent - idle[k] * seconds) / count, 3)
            row["p50_ms"] = round(sorted(latencies)[len(latencies) // 2], 3)
            time.sleep(0.5)  # the gateway sees an answer end just after the client does
            row["requests"] = count
            if metrics:  # the gateway learnt each answer's exact length: it saw every end, usage included
                row["tokens_learnt_per_req"] = round((output_tokens_learnt(metrics) - learnt_before) / count, 2)
            key = f"{n} tokens" + (f", {parallel} at a time" if parallel > 1 else "")
            out[key] = row
            print(f"  {name:<10} {key:>24}: {row}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--bodies", choices=["buffered", "full_duplex"], default="buffered",
                        help="how Envoy hands the EPP the bodies (gateway/epp/envoy_config.py)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 2048])
    parser.add_argument("--setups", nargs="+", default=["envoy", "envoy+epp", "gateway"],
                        choices=["envoy", "envoy+epp", "envoy+floor", "envoy+floor-grpclib", "gateway"])
    parser.add_argument("--stream-requests", type=int,
                        help="streams per length, all ``--concurrency`` at a time (default: a sequential pass too)")
    parser.add_argument("--pod-speed", type=float, default=0.0,
                        help="the simulated pod's time factor (0: answers at once; 1: a real engine's pace)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="streams at a time in a second pass (costs that run per second, not per request, "
                             "such as health checks and gRPC's poller, are then shared)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="epp-overhead-"))
    pod_port = free_port()
    pod = spawn([sys.executable, "-m", "gateway", "mock", "--port", str(pod_port), "--speed", str(args.pod_speed),
                 "--no-events", "--no-replay", "--max-num-seqs", "64", "--default-max-tokens", "1"],
                directory / "pod.log")
    try:
        pod_url = f"http://127.0.0.1:{pod_port}"
        wait_http(f"{pod_url}/health", 60, pod)
        results = {name: measure(name, pod_url, args.policy, args.tokens if name != "envoy" else [1], args.requests,
                                 directory, args.concurrency, args.stream_requests, args.bodies)
                   for name in args.setups}
    finally:
        pod.terminate()
        pod.wait(timeout=30)
    envoy, epp = results.get("envoy", {}).get("1 tokens"), results.get("envoy+epp", {}).get("1 tokens")
    if envoy and epp:
        print(f"added p50 of the EPP over Envoy alone: {epp['p50_ms'] - envoy['p50_ms']:.3f} ms")
    print(json.dumps({"policy": args.policy, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
