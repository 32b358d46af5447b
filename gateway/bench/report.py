"""Bench output: ``latest.json``, a CSV of every figure, a Markdown table and PNG plots."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from gateway.bench.runner import Result

COLUMNS = ["scenario", "name", "policy", "hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms",
           "e2e_p90_ms", "e2e_p99_ms", "req_per_s", "errors", "rejected", "requests"]


def write_results(results: list[Result], out: Path, meta: dict[str, object]) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) for r in results]
    paths = {"json": out / "latest.json", "csv": out / "latest.csv", "md": out / "latest.md"}
    paths["json"].write_text(json.dumps({**meta, "contenders": rows}, indent=2))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, "skipped"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths["md"].write_text(markdown_table(results))
    paths.update(plots(results, out))
    return paths


def markdown_table(results: list[Result]) -> str:
    lines = ["| scenario | contender | hit ratio | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p90 ms | req/s "
             "| errors |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.scenario} | {r.name} | skipped: {r.skipped} | | | | | | |")
            continue
        lines.append(f"| {r.scenario} | {r.name} | {r.hit_ratio:.3f} | {r.ttft_p50_ms:.0f} | {r.ttft_p90_ms:.0f} | "
                     f"{r.ttft_p99_ms:.0f} | {r.e2e_p90_ms:.0f} | {r.req_per_s:.2f} | {r.errors} |")
    return "\n".join(lines) + "\n"


def plots(results: list[Result], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    for scenario in sorted({r.scenario for r in results}):
        rs = [r for r in results if r.scenario == scenario and not r.skipped]
        if not rs:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        names = [r.name for r in rs]
        colors = ["#d62728" if r.name.startswith("gateway") else "#7f7f7f" for r in rs]
        ax1.barh(names, [r.hit_ratio for r in rs], color=colors)
        ax1.set_xlabel("prefix-cache hit ratio (pods' own counters)")
        ax1.set_xlim(0, 1)
        ax2.barh(names, [r.ttft_p90_ms for r in rs], color=colors)
        ax2.set_xlabel("TTFT p90 (ms)")
        ax2.set_yticks([])
        fig.suptitle(f"{scenario}: gateway (red) vs direct and peers (grey)")
        fig.tight_layout()
        path = out / f"{scenario}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths[f"plot-{scenario}"] = path
    return paths
