"""What a request costs the gateway as the fleet grows: ``gateway bench --scenario fleet-scale`` at several
fleet sizes, and one table of the figures the fleet-scale targets are about.

    python bench/scripts/fleet_scale.py [--pods 4 100 1000] [--out bench-results/fleet-scale] [-- bench flags]

Each fleet size is one ``gateway bench`` run (its own latest.json/md under ``--out/pods-N``) over the same
trace: 2,000 short chats over 16 system prompts at 100 a second, the simulated pods in two processes at every
size (so that they cost the same whatever the fleet), each contender on fresh pods: the gateway with one,
two and four workers, the gateway looking at every pod (no shortlist: the hit ratio's reference), smg 1.13
(``cache_aware``) where it runs, and the pods without a router (``direct``: what the hops alone add). The
table gives per contender and fleet size: the hit ratio, the TTFT the router added (p50, p99: the client's
less the pod's own, request by request), the router's CPU per request (all its processes, from /proc), its
memory (PSS, all processes), the KV block events the gateway applied a second, and the ratios to its figures
at the smallest fleet.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def run(pods: int, out: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "gateway", "bench", "--scenario", "fleet-scale", "--pods", str(pods),
           "--pods-per-process", str(math.ceil(pods / 2)), "--out", str(out / f"pods-{pods}"), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / f"pods-{pods}" / "latest.json").read_text())["contenders"]


def row(r: dict, pods: int, base: dict) -> str:
    """One contender at one fleet size, with its ratios to ``base`` (its figures at the smallest fleet)."""
    name = r["name"]
    if r.get("skipped"):
        return f"| {name} | {pods} | skipped: {r['skipped'][:80]} | | | | | |"
    x = r["extra"]
    cpu = x.get("cpu_ms_per_req_router")

    def vs(key: str) -> str:
        return f"{x[key] / base[key]:.2f}x" if x.get(key) and base.get(key) else "-"

    return (f"| {name} | {pods} | {r['hit_ratio']:.3f} | {x.get('added_ttft_ms_p50', 0):.2f} / "
            f"{x.get('added_ttft_ms_p99', 0):.2f} | {'-' if cpu is None else f'{cpu:.2f}'} | "
            f"{x.get('router_memory_mb', 0):.0f} | {x.get('kv_block_events_per_s', 0):,.0f} | "
            f"{vs('added_ttft_ms_p50')}, {vs('cpu_ms_per_req_router')} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, nargs="+", default=[4, 100, 1000])
    parser.add_argument("--out", default="bench-results/fleet-scale")
    parser.add_argument("bench", nargs="*", help="more `gateway bench` flags (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    first = args.pods[0]
    print("| contender | pods | hit ratio | added TTFT p50 / p99 ms | CPU ms/req | memory MiB | KV block events/s "
          f"| TTFT p50, CPU vs {first} pods |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base: dict[str, dict] = {}
    for pods in args.pods:  # each size's rows as soon as it is done
        for r in sorted(run(pods, out, args.bench), key=lambda result: result["name"]):
            if pods == first:
                base[r["name"]] = r.get("extra", {})
            print(row(r, pods, base.get(r["name"], {})), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
