"""Two settings compared request by request, from the split files of their runs (``agentic_real_pods.py --split``,
one CSV a run, named ``...-seed<N>-<time>.csv``).

    python bench/scripts/compare_splits.py DIR_A DIR_B [--permutations 2000]

Prints, for each setting, TTFT p50 / p90 / p99 pooled over every request of every run, the p90 of each run,
and the time in the gateway; then a permutation test of the pooled p90 over whole runs (runs, not requests,
are what vary together); then how many requests went to a different pod under one setting than under the
other, counted against the pod each run's first request went to (which pod that is is a tie broken at
random, so pod names alone would differ by chance).
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.split import percentile as pct

Run = tuple[int, list[dict[str, str]]]  # (seed, rows)


def runs_in(directory: str) -> list[Run]:
    out = []
    for path in sorted(Path(directory).glob("*.csv")):
        seed = re.search(r"-seed(\d+)-", path.name)
        with open(path, newline="") as f:
            out.append((int(seed.group(1)) if seed else 0, list(csv.DictReader(f))))
    return out


def ttfts(runs: list[Run]) -> list[float]:
    return [float(r["client_ttft_ms"]) for _, rows in runs for r in rows]


def describe(name: str, runs: list[Run]) -> None:
    pooled = ttfts(runs)
    in_gateway = [float(r["gateway_ms"]) for _, rows in runs for r in rows if r.get("gateway_ms")]
    per_run = sorted(round(pct([float(r["client_ttft_ms"]) for r in rows], 0.9)) for _, rows in runs)
    print(f"{name}: {len(runs)} runs, {len(pooled)} requests; TTFT p50 / p90 / p99 {pct(pooled, .5):.1f} / "
          f"{pct(pooled, .9):.1f} / {pct(pooled, .99):.1f} ms pooled; p90 of each run {per_run}")
    if in_gateway:
        print(f"  in the gateway p50 / p90 {pct(in_gateway, .5):.2f} / {pct(in_gateway, .9):.2f} ms")


def p90_permutation(a: list[Run], b: list[Run], rounds: int, rng: random.Random) -> tuple[float, float]:
    observed = pct(ttfts(a), 0.9) - pct(ttfts(b), 0.9)
    together, extreme = a + b, 0
    for _ in range(rounds):
        rng.shuffle(together)
        left, right = together[:len(a)], together[len(a):]
        extreme += abs(pct(ttfts(left), 0.9) - pct(ttfts(right), 0.9)) >= abs(observed)
    return observed, extreme / rounds


def to_first_pod(runs: list[Run]) -> dict[tuple[int, str, str], float]:
    """Per request (seed, session, step): the share of runs that sent it where the run's first request went."""
    sent: dict[tuple[int, str, str], list[bool]] = defaultdict(list)
    for seed, rows in runs:
        first = rows[0]["pod"] if rows else None
        for r in rows:
            sent[(seed, r["session"], r["step"])].append(r["pod"] == first)
    return {key: sum(v) / len(v) for key, v in sent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--permutations", type=int, default=2000)
    args = parser.parse_args()
    a, b = runs_in(args.a), runs_in(args.b)
    if not a or not b:
        parser.error("each directory needs at least one run's CSV")
    describe(args.a, a)
    describe(args.b, b)
    observed, p = p90_permutation(a, b, args.permutations, random.Random(0))
    print(f"pooled p90, {args.a} less {args.b}: {observed:+.1f} ms (permutation over runs: p = {p:.3f})")
    shares_a, shares_b = to_first_pod(a), to_first_pod(b)
    common = shares_a.keys() & shares_b.keys()
    moved = sorted(k for k in common if abs(shares_a[k] - shares_b[k]) >= 0.5)
    print(f"requests whose pod (against each run's first) differs in half the runs or more: {len(moved)} of "
          f"{len(common)}{': ' + ', '.join(map(str, moved[:10])) if moved else ''}")


if __name__ == "__main__":
    main()
