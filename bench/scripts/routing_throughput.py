"""How many requests per second a router can route precisely when every prompt must be looked at.

    python bench/scripts/routing_throughput.py [--workers 1 2] [--peers] [--pods 8] [--connections 64]

Simulated pods at speed 0 (they answer at once) behind each router; wrk sends ~2k-token chat prompts
(``--prompt-words``) with one answer token, in two mixes:

- ``shared``: one of 16 fixed system prompts and a new question each time (the routers' caches and
  tokenizers meet the same long prefixes again);
- ``new``: every prompt new from its first word (everything must be tokenized or hashed afresh).

Contenders: the gateway's ``kv_aware`` at each ``--workers`` count and, with ``--peers``, smg and
vllm-router ``cache_aware`` and vllm-router ``kv_aware`` (each installed into its own environment on first use).
The pods, the load generator and the router share this machine: compare the contenders of one run, and give the
router most of the cores on a machine with many (``taskset``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import msgspec
from proxy_overhead import run_wrk  # this folder is on the path when a benchmark runs

from bench.peers import PeerMissing, PeerRefused
from bench.runner import CONTENDERS, BenchRunner, Contender, prepare_peers
from bench.workloads import WORDS

SYSTEM_PROMPTS = 16
PEERS = ("smg-cache_aware", "vllm-router-cache_aware", "vllm-router-kv_aware")


def wrk_script(path: Path, model: str, mix: str, prompt_words: int, question_words: int = 30) -> None:
    """A wrk script that builds each request's body: a system prompt (one of the fixed ones, or new words)
    and a new question."""
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(prompt_words)) for _ in range(SYSTEM_PROMPTS)]
    lua_list = ", ".join(json.dumps(p) for p in prompts)
    path.write_text(f"""
local prompts = {{ {lua_list} }}
local words = {{ {", ".join(json.dumps(w) for w in WORDS)} }}
local counter = 1
function setup(thread) thread:set("id", counter); counter = counter + 1 end
function init(args) math.randomseed(os.time() * 1000 + id) end
local function text(n)
  local parts = {{}}
  for i = 1, n do parts[i] = words[math.random(#words)] end
  return table.concat(parts, " ")
end
request = function()
  local system = {"prompts[math.random(#prompts)]" if mix == "shared" else f"text({prompt_words})"}
  local body = '{{"model":"{model}","max_tokens":1,"messages":[{{"role":"system","content":"' .. system ..
    '"}},{{"role":"user","content":"' .. text({question_words}) .. '"}}]}}'
  return wrk.format("POST", "/v1/chat/completions", {{["Content-Type"] = "application/json"}}, body)
end
""")


def contenders(workers: list[int], peers: bool) -> list[Contender]:
    kv_aware = CONTENDERS["gateway-kv_aware"]
    found = [msgspec.structs.replace(kv_aware, name=f"gateway-kv_aware-w{n}", workers=n) for n in workers]
    return found + ([CONTENDERS[name] for name in PEERS] if peers else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="gateway worker counts (default 1)")
    parser.add_argument("--peers", action="store_true", help="also smg and vllm-router")
    parser.add_argument("--mix", choices=("shared", "new"), nargs="+", default=["shared", "new"])
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--prompt-words", type=int, default=1000, help="~2 tokens each")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk is missing: `make install` installs it", file=sys.stderr)
        return 2
    chosen = contenders(args.workers, args.peers)
    try:
        peers = prepare_peers(chosen, install=True)
    except (PeerMissing, PeerRefused) as exc:
        print(exc, file=sys.stderr)
        return 2
    runner = BenchRunner(pods=args.pods, num_blocks=8000, speed=0.0, progress=False, peers=peers)
    results: dict[str, dict[str, float | str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for contender in chosen:
            try:
                with runner.serving(contender) as (routers, _pods):
                    assert routers
                    for mix in args.mix:
                        script = Path(tmp) / f"{mix}.lua"
                        wrk_script(script, runner.model, mix, args.prompt_words)
                        run_wrk(routers[0], args.connections, 2, script, threads=2)  # warm-up: caches, pools, workers
                        results[f"{contender.name} {mix}"] = run_wrk(routers[0], args.connections, args.duration,
                                                                     script, threads=2)
            except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
                results[contender.name] = {"skipped": str(exc)}
    print(f"{'run':<36}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'non-2xx':>9}")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<36} skipped: {r['skipped']}")
        else:
            print(f"{name:<36}{r['req_per_s']:>10.0f}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}{r['non_2xx']:>9}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
