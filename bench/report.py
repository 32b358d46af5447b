"""Bench output: ``latest.json``, a CSV of every figure, a Markdown table and PNG plots.

Owner: nothing with a lifetime: results to files. Beside each hit ratio stand the trace's references
(``infinite``, ``sticky_lru``, ``keep_warm``: :mod:`bench.oracle`) and the ``distance`` to the sticky
one; beside each contender, what served it: package, version (the gateway's: its commit) and command line.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shlex
from pathlib import Path

from bench.runner import Result
from bench.tenants import tenant_table

COLUMNS = ["scenario", "name", "policy", "hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms",
           "e2e_p90_ms", "e2e_p99_ms", "session_p50_ms", "req_per_s", "errors", "rejected", "requests",
           "pod_requests", "largest_share", "infinite", "sticky_lru", "keep_warm", "distance", "package", "version",
           "reported_version", "command"]


def write_results(results: list[Result], out: Path, meta: dict[str, object]) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) for r in results]
    paths = {"json": out / "latest.json", "csv": out / "latest.csv", "md": out / "latest.md"}
    paths["json"].write_text(json.dumps({**meta, "contenders": rows}, indent=2))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, "skipped"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**row, "pod_requests": per_pod(row["pod_requests"]),
                          "command": shlex.join(row["command"])} for row in rows)
    tenants = [(r.scenario, r.name, r.tenants) for r in results if r.tenants]
    adapters = [r for r in results if "adapter_switches_per_1k" in r.extra]
    paths["md"].write_text(markdown_table(results) + routers_served(results, str(meta.get("gateway", "")))
                           + (f"\nPer tenant:\n\n{tenant_table(tenants)}" if tenants else "")
                           + (f"\nLoRA adapters:\n\n{adapter_table(adapters)}" if adapters else ""))
    paths.update(plots(results, out))
    return paths


def markdown_table(results: list[Result]) -> str:
    lines = ["| scenario | contender | router | hit ratio | infinite | sticky LRU | keep-warm bound | distance "
             "| TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p90 ms | session p50 s | req/s | errors "
             "| requests per pod | largest share |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.scenario} | {r.name} | {router(r)} | skipped: {r.skipped} |" + " |" * 13)
            continue
        lines.append(f"| {r.scenario} | {r.name} | {router(r)} | {r.hit_ratio:.3f} | {ratio(r.infinite)} | "
                     f"{ratio(r.sticky_lru)} | {ratio(r.keep_warm)} | {ratio(r.distance, signed=True)} | "
                     f"{r.ttft_p50_ms:.0f} | {r.ttft_p90_ms:.0f} | "
                     f"{r.ttft_p99_ms:.0f} | {r.e2e_p90_ms:.0f} | {r.session_p50_ms / 1000:.1f} | "
                     f"{r.req_per_s:.2f} | {r.errors} | {per_pod(r.pod_requests)} | {r.largest_share:.2f} |")
    return "\n".join(lines) + "\n"


def adapter_table(results: list[Result]) -> str:
    """Per contender of a LoRA trace: the pods' adapter switches into a batch slot and reads from a path, per
    1,000 requests, beside the bound (each adapter switched in once), the hit ratio and TTFT p90."""
    lines = ["| scenario | contender | adapter switches / 1k | bound | adapter reads / 1k | hit ratio | infinite "
             "| TTFT p90 ms |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        x = r.extra
        lines.append(f"| {r.scenario} | {r.name} | {x['adapter_switches_per_1k']:.0f} | "
                     f"{x['adapter_switches_bound_per_1k']:.0f} | {x['adapter_loads_per_1k']:.0f} | "
                     f"{r.hit_ratio:.3f} | {ratio(r.infinite)} | {r.ttft_p90_ms:.0f} |")
    return "\n".join(lines) + "\n"


def per_pod(requests: list[int]) -> str:
    """Each pod's requests, or, for a fleet of more than 16, how many pods served any and the most one did."""
    if len(requests) <= 16:
        return "/".join(map(str, requests))
    return f"{sum(1 for n in requests if n)} of {len(requests)} pods, at most {max(requests, default=0)}"


def router(result: Result) -> str:
    """What served a row, as the tables print it: ``smg 1.13.0``; ``-`` for requests straight to the pods."""
    return f"{result.package} {result.version}" if result.package else "-"


def routers_served(results: list[Result], gateway: str) -> str:
    """Below the table: the gateway's commit, and each contender's package, version, what its binary said of
    its version, and its command line (the first router's, where it ran several)."""
    lines = ["", f"Gateway: kv-gateway {gateway}.", ""]
    seen: set[str] = set()
    for r in results:
        if r.package and r.name not in seen:
            seen.add(r.name)
            said = f" (`--version`: {r.reported_version})" if r.reported_version else ""
            lines.append(f"- {r.name}: {r.package} {r.version}{said}: `{shlex.join(r.command)}`")
    return "\n".join(lines) + "\n"


def ratio(value: float | None, signed: bool = False) -> str:
    """A hit ratio (or a difference of two) as the tables print it; n/a where there is none."""
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def plots(results: list[Result], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    for scenario in sorted({r.scenario for r in results}):
        rs = [r for r in results if r.scenario == scenario and not r.skipped]
        if not rs:
            continue
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.8))
        names = [r.name for r in rs]
        colors = ["#d62728" if r.name.startswith("gateway") else "#7f7f7f" for r in rs]
        ax1.barh(names, [r.hit_ratio for r in rs], color=colors)
        _references(ax1, rs)
        ax1.set_xlabel("prefix-cache hit ratio (pods' own counters)")
        ax1.set_xlim(0, 1)
        ax2.barh(names, [r.ttft_p90_ms for r in rs], color=colors)
        ax2.set_xlabel("TTFT p90 (ms)")
        ax2.set_yticks([])
        _pod_shares(ax3, rs)
        fig.suptitle(plot_title(scenario, rs))
        fig.tight_layout()
        path = out / f"{scenario}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths[f"plot-{scenario}"] = path
    return paths


def plot_title(scenario: str, results: list[Result]) -> str:
    """A plot's title: the scenario, and each router that served it with its package and version."""
    served = ", ".join(dict.fromkeys(router(r) for r in results if r.package))
    return f"{scenario}: gateway (red) vs direct and peers (grey)\n{served}"


def _pod_shares(ax, results: list[Result]) -> None:
    """Each contender's requests split by pod (stacked), labelled with the busiest pod's share."""
    for row, r in enumerate(results):
        served = sum(r.pod_requests) or 1
        left = 0.0
        for pod, count in enumerate(r.pod_requests):
            ax.barh(row, count / served, left=left, color=f"C{pod % 10}", edgecolor="white")
            left += count / served
        ax.text(1.01, row, f"{r.largest_share:.2f}", va="center", fontsize=8)
    ax.set_xlim(0, 1.12)
    ax.set_yticks([])
    ax.set_xlabel("share of requests per pod (largest share at right)")


def _references(ax, results: list[Result]) -> None:
    """The trace's references on each contender's hit-ratio bar: infinite cache (black), sticky LRU (blue),
    keep-warm bound (green)."""
    for row, r in enumerate(results):
        for value, color, label in ((r.infinite, "black", "infinite cache"), (r.sticky_lru, "C0", "sticky LRU"),
                                    (r.keep_warm, "C2", "keep-warm bound")):
            if value is not None:
                ax.plot([value, value], [row - 0.4, row + 0.4], color=color, linewidth=2,
                        label=None if row else label)
    if any(r.infinite is not None for r in results):
        ax.legend(loc="lower right", fontsize=8)
