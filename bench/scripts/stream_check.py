"""What checking a pod's stream costs the relay (:class:`gateway.proxy.events.EventCheck`): chunks of 1 to
``--events`` chat-completion events, as a pod's stream arrives when the gateway reads it late (a busy loop finds
many events waiting), each chunk checked whole. Prints the time a chunk and an event, best of ``--rounds``.

    python bench/scripts/stream_check.py [--events 1 10 100 400] [--rounds 5]

Run it from two trees (``PYTHONPATH=TREE``) to compare a change.
"""

from __future__ import annotations

import argparse
import time

from gateway.proxy.events import EventCheck

EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[{"index":0,"delta":{"content":" word"},"finish_reason":null}]}\n\n')


def per_chunk_s(chunk: bytes, rounds: int, budget_s: float = 0.2) -> float:
    best = float("inf")
    for _ in range(rounds):
        started, done = time.perf_counter(), 0
        while time.perf_counter() - started < budget_s:
            assert EventCheck().chunk(chunk) == chunk
            done += 1
        best = min(best, (time.perf_counter() - started) / done)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, nargs="+", default=[1, 10, 100, 400])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for count in args.events:
        seconds = per_chunk_s(EVENT * count, args.rounds)
        print(f"{count:5d} events a chunk: {seconds * 1e6:9.1f} us a chunk, {seconds / count * 1e6:6.2f} us an event")


if __name__ == "__main__":
    main()
