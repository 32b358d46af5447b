"""How long the gateway's event loop stalls while it catches up on warm pods' KV events.

    python bench/scripts/catch_up.py [--pods 8] [--blocks 20000] [--blocks-per-batch 16]

A helper process plays ``--pods`` engines whose caches are already warm: each has published
``--blocks`` blocks (in batches of ``--blocks-per-batch``) and keeps them in its replay buffer, as a
vLLM pod does. This process subscribes to all of them at once, as a gateway starting beside them does,
and measures the event loop's lag (how late a 1 ms timer fires) until every view has caught up. A
request arriving during catch-up waits at least that long.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from gateway.background import LoopShare
from gateway.kv.events import BlockStored
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriber import KvEventSubscriber
from simulator.pod import free_ports
from simulator.publisher import KvEventPublisher

BLOCK_SIZE = 16


async def serve_publishers(ports: list[int], blocks: int, per_batch: int) -> None:
    publishers = []
    for i in range(0, len(ports), 2):
        pub = KvEventPublisher(f"tcp://127.0.0.1:{ports[i]}", f"tcp://127.0.0.1:{ports[i + 1]}",
                               buffer_steps=blocks // per_batch + 1)
        pub.start()
        parent = None
        for b in range(0, blocks, per_batch):
            hashes = [i * 10**9 + b + k for k in range(per_batch)]
            tokens = [(b + k) % 30_000 for k in range(per_batch * BLOCK_SIZE)]
            pub.publish([BlockStored(hashes, parent, tokens, BLOCK_SIZE)])
            parent = hashes[-1]
        publishers.append(pub)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure(ports: list[int], batches: int) -> dict[str, float]:
    index = PrefixIndex()
    share = LoopShare()  # as the gateway's KV-event service shares one among its subscribers
    subs: list[KvEventSubscriber] = []
    caught_up_all = asyncio.Event()

    def check(_stats: object) -> None:
        if all(sub.view.last_seq >= batches - 1 for sub in subs):
            caught_up_all.set()

    for i in range(0, len(ports), 2):
        view = index.view(f"pod{i // 2}", 0, "m", BLOCK_SIZE)
        subs.append(KvEventSubscriber(index, view, f"tcp://127.0.0.1:{ports[i]}", f"tcp://127.0.0.1:{ports[i + 1]}",
                                      replay_timeout_s=10.0, loop_share=share, on_batch=check))
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - before - 0.001)

    tick = asyncio.create_task(ticker())
    started = time.perf_counter()
    for sub in subs:
        sub.start()
    await caught_up_all.wait()
    caught_up = time.perf_counter() - started
    done.set()
    await tick
    for sub in subs:
        await sub.stop()
    lags.sort()
    return {"catch_up_s": round(caught_up, 3), "max_lag_ms": round(lags[-1] * 1000, 2),
            "p99_lag_ms": round(lags[int(len(lags) * 0.99)] * 1000, 2),
            "median_lag_ms": round(statistics.median(lags) * 1000, 3), "indexed_blocks": index.size()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--blocks-per-batch", type=int, default=16)
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the helper process: comma-separated ports
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_publishers([int(p) for p in args.serve.split(",")], args.blocks, args.blocks_per_batch))
        return 0
    ports = free_ports(2 * args.pods)
    helper = subprocess.Popen([sys.executable, __file__, "--serve", ",".join(map(str, ports)),
                               "--blocks", str(args.blocks), "--blocks-per-batch", str(args.blocks_per_batch)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout is not None and helper.stdout.readline().strip() == "ready"
        batches = -(-args.blocks // args.blocks_per_batch)
        result = asyncio.run(measure(ports, batches))
    finally:
        helper.terminate()
        helper.wait(timeout=10)
    print(f"{args.pods} pods x {args.blocks} blocks: caught up in {result['catch_up_s']} s; event-loop lag "
          f"max {result['max_lag_ms']} ms, p99 {result['p99_lag_ms']} ms, median {result['median_lag_ms']} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
