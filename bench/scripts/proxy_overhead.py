"""What the gateway adds to a request: wrk against a trivial backend, direct vs through the gateway.

    python bench/scripts/proxy_overhead.py [--duration 10] [--policy round_robin] [--workers 1 2]
                                        [--flow-control on off]

A 4 KB non-streaming chat request; 1 connection (added latency) and 16 connections (throughput), and
the gateway's CPU time per request (all its processes). ``--workers 1 2`` measures a gateway of each
size in the same run (``gateway_w<N>_c<connections>``) and prints the throughput ratio.
``--flow-control on off`` measures a gateway with flow control on and one with it off (each of the first
``--workers``), in the order on, off, off, on (``gateway_fc_<on|off>_c<connections>``: the mean of its two
runs), and prints the CPU ratio; with one pod at 1 connection nothing is held. ``--key-limits``: every
request carries an API key with a request rate, token limits and ``max_concurrent`` (its key's and its
tenant's), none of them reached. All processes
share this machine, so compare the ratios of one run, not numbers across machines; to compare two
versions, alternate them (A B B A) and compare the CPU per request.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.peers import PEERS, install_peer
from bench.runner import wait_http
from bench.workloads import overhead_chat
from simulator.pod import free_ports

HERE = Path(__file__).resolve().parent


BENCH_KEY = "sk-bench"
# A key with every limit a request is checked against, none of them reached in a run.
KEY_LIMITS_CONFIG = {
    "auth": {"keys": [{"hash": "", "name": "bench",
                       "requests_per_minute": 10**9}]},
    "flow_control": {"keys": {"bench": "bench-team"}},
    "limits": {"keys": {"bench": {"input_tokens_per_minute": 10**12, "output_tokens_per_minute": 10**12,
                                  "max_concurrent": 10**6}},
               "tenants": {"bench-team": {"input_tokens_per_day": 10**15, "max_concurrent": 10**6}}},
}


def wrk_script(path: Path, key: str | None = None) -> None:
    body = json.dumps(overhead_chat("bench"))
    auth = f'wrk.headers["Authorization"] = "Bearer {key}"\n' if key else ""
    path.write_text(f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\n'
                    'wrk.headers["Content-Type"] = "application/json"\n' + auth)


def key_limits_config(path: Path) -> Path:
    """The config file of ``--key-limits``: the bench key, hashed, with its limits."""
    import hashlib

    config = json.loads(json.dumps(KEY_LIMITS_CONFIG))
    config["auth"]["keys"][0]["hash"] = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
    path.write_text(json.dumps(config))
    return path


def parse_wrk(output: str) -> dict[str, float]:
    def ms(value: str) -> float:
        number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", value).groups()
        return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", output, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    return {"req_per_s": rps, "p50_ms": ms(pct["50"]), "p99_ms": ms(pct["99"]),
            "non_2xx": int(errors.group(1)) if errors else 0}


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time so far of a process and its children (Linux): a multi-worker gateway
    is a supervisor and its workers."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            own_pid, rest = stat.read_text().split(" ", 1)
        except OSError:
            continue  # exited meanwhile
        fields = rest.rsplit(")", 1)[1].split()
        if int(own_pid) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def run_wrk(url: str, connections: int, duration: int, script: Path, pid: int | None = None,
            threads: int = 1) -> dict[str, float]:
    """wrk's numbers; with ``pid``, also that process's CPU time per request (less noisy than req/s on a
    shared machine: it does not depend on how much CPU the process was given)."""
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script),
           f"{url}/v1/chat/completions"]
    cpu_before = cpu_seconds(pid) if pid else 0.0
    output = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    result = parse_wrk(output)
    if pid:
        requests = int(re.search(r"(\d+) requests in", output).group(1))
        result["cpu_us_per_req"] = round((cpu_seconds(pid) - cpu_before) / max(1, requests) * 1e6, 1)
    return result


def gateway_variants(args: argparse.Namespace) -> dict[str, tuple[int, list[str]]]:
    """The gateways to measure: name → (workers, environment settings)."""
    if args.flow_control:
        return {f"gateway_fc_{state}": (args.workers[0], [f"GATEWAY_FLOW_CONTROL__ENABLED={state == 'on'}"])
                for state in args.flow_control}
    if len(args.workers) == 1:
        return {"gateway": (args.workers[0], [])}
    return {f"gateway_w{workers}": (workers, []) for workers in args.workers}


def mean_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each of wrk's numbers over runs of one setup."""
    return {key: round(sum(run[key] for run in runs) / len(runs), 3) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--workers", type=int, nargs="+", default=[1],
                        help="gateway worker counts to measure, each in the same run (default 1)")
    parser.add_argument("--access-log", action="store_true", help="keep the per-request access log on")
    parser.add_argument("--flow-control", nargs="+", choices=["on", "off"],
                        help="measure a gateway with flow control on and/or off instead of one per --workers")
    parser.add_argument("--key-limits", action="store_true",
                        help="every request with an API key that has a rate, token and concurrency limits")
    parser.add_argument("--peers", action="store_true",
                        help="also measure vllm-router round_robin and cache_aware (installed into its own "
                             "environment on first use)")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk is missing: `make install` installs it", file=sys.stderr)
        return 2
    variants = gateway_variants(args)
    backend_port, *ports = free_ports(5 + len(variants))
    gateway_ports, peer_ports = ports[:len(variants)], ports[len(variants):]
    procs = [subprocess.Popen([sys.executable, str(HERE / "trivial_backend.py"), str(backend_port)])]
    env_log = [] if args.access_log else ["GATEWAY_LOGGING__ACCESS_LOG=false"]
    config_dir = tempfile.TemporaryDirectory()
    config = (["--config", str(key_limits_config(Path(config_dir.name) / "limits.json"))]
              if args.key_limits else [])
    gateways: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    for (name, (workers, env)), port in zip(variants.items(), gateway_ports, strict=True):
        command = ["env", *env_log, *env, sys.executable, "-m", "gateway", "serve", "--port", str(port),
                   "--workers", str(workers), "--policy", args.policy, "--pod", f"http://127.0.0.1:{backend_port}",
                   *config]
        gateways[name] = (f"http://127.0.0.1:{port}", subprocess.Popen(command, stderr=subprocess.DEVNULL))
    procs += [proc for _, proc in gateways.values()]
    wait_http(f"http://127.0.0.1:{backend_port}/health")  # the peers give up on a worker not up yet
    peers: dict[str, str] = {}
    if args.peers:
        router = install_peer(PEERS["vllm-router"]).path
        for policy, port, metrics_port in zip(("round_robin", "cache_aware"), peer_ports[:2], peer_ports[2:],
                                              strict=True):
            procs.append(subprocess.Popen([router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                                           "--worker-urls", f"http://127.0.0.1:{backend_port}", "--log-level",
                                           "warning", "--prometheus-port", str(metrics_port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            peers[f"vllm-router-{policy}"] = f"http://127.0.0.1:{port}"
    try:
        direct = f"http://127.0.0.1:{backend_port}"
        wait_http(f"{direct}/health")
        for url, _ in gateways.values():
            wait_http(f"{url}/readyz")
        for url in peers.values():
            wait_http(f"{url}/v1/models")
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "post.lua"
            wrk_script(script, BENCH_KEY if args.key_limits else None)
            for url, _ in gateways.values():
                run_wrk(url, 16, 2, script)  # warm-up: connection pools, caches, every worker
            results = {}
            for connections in (1, 16):
                results[f"direct_c{connections}"] = run_wrk(direct, connections, args.duration, script)
                order = list(gateways)
                if args.flow_control:  # on, off, off, on: a drift of the machine falls on both alike
                    order += order[::-1]
                runs: dict[str, list[dict[str, float]]] = {}
                for name in order:
                    url, proc = gateways[name]
                    runs.setdefault(name, []).append(run_wrk(url, connections, args.duration, script, proc.pid))
                for name, measured in runs.items():
                    results[f"{name}_c{connections}"] = mean_run(measured)
                for name, url in peers.items():
                    results[f"{name}_c{connections}"] = run_wrk(url, connections, args.duration, script)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        config_dir.cleanup()
    print(f"{'run':<30}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'non-2xx':>9}")
    for name, r in results.items():
        print(f"{name:<30}{r['req_per_s']:>10.0f}{r['p50_ms']:>10.3f}{r['p99_ms']:>10.3f}{r['non_2xx']:>9}")
    for name in gateways:
        added = results[f"{name}_c1"]["p50_ms"] - results["direct_c1"]["p50_ms"]
        c1, c16 = results[f"{name}_c1"], results[f"{name}_c16"]
        print(f"{name}: added p50 at 1 connection {added:.3f} ms, {c1['cpu_us_per_req']} µs CPU each; at 16 "
              f"connections {c16['req_per_s']:.0f} req/s, {c16['cpu_us_per_req']} µs CPU each")
    if args.flow_control and len(gateways) == 2:
        for connections in (1, 16):
            on, off = results[f"gateway_fc_on_c{connections}"], results[f"gateway_fc_off_c{connections}"]
            print(f"flow control on / off at {connections} connection(s): "
                  f"{on['cpu_us_per_req'] / off['cpu_us_per_req']:.3f}x CPU per request")
    elif len(gateways) > 1:
        first, *others = args.workers
        for workers in others:
            ratio = results[f"gateway_w{workers}_c16"]["req_per_s"] / results[f"gateway_w{first}_c16"]["req_per_s"]
            print(f"{workers} workers / {first}: {ratio:.2f}x req/s at 16 connections")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
