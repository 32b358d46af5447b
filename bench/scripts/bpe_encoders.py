"""The Rust tokenizer against tiktoken (:mod:`gateway.tokenization.fast_bpe`) on real text: Python's own
documentation (``pydoc_data``) in chunks of ``--chars`` characters, each encoded as routing encodes a piece of new
text (``HfTokenizer.encode_pieces``), back to back and after ``--gap-ms`` of idling (the gateway's loop idles
between most requests, and code that idled runs cold), then one long document (``--long-chars``) as a long first
prompt would be. Both encoders must give the same ids on every chunk, or the script fails.

    python bench/scripts/bpe_encoders.py [--tokenizer DIR] [--chars 450] [--gap-ms 20] [--long-chars 400000]
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import time

from bench.runner import pct
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer


def chunks(size: int) -> list[str]:
    return [topic[i:i + size] for topic in pydoc_data.topics.topics.values() for i in range(0, len(topic), size)]


def timed(tokenizer: HfTokenizer, texts: list[str], gap_s: float) -> list[float]:
    spent = []
    for text in texts:
        if gap_s:
            time.sleep(gap_s)
        started = time.perf_counter()
        tokenizer.encode_pieces([text])
        spent.append((time.perf_counter() - started) * 1e6)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(BUNDLED_TOKENIZER_DIR))
    parser.add_argument("--chars", type=int, default=450)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--long-chars", type=int, default=400_000)
    args = parser.parse_args()
    rust, fast = HfTokenizer(args.tokenizer), HfTokenizer(args.tokenizer, fast_bpe=True)
    if not fast.fast_bpe:
        raise SystemExit(f"{args.tokenizer}: tiktoken does not take this tokenizer (the log says why)")
    texts = chunks(args.chars)
    if rust.encode_pieces(texts) != fast.encode_pieces(texts):
        raise SystemExit("the encoders disagree")
    sample = texts[:: max(1, len(texts) // args.samples)]
    print(f"{len(texts)} chunks of {args.chars} characters, all encoded alike; timing {len(sample)}")
    for gap_s in (0.0, args.gap_ms / 1000):
        for name, tokenizer in (("rust", rust), ("tiktoken", fast)):
            us = timed(tokenizer, sample, gap_s)
            print(f"{name:9} after {gap_s * 1000:4.0f} ms idle: p50 {pct(us, 0.5):6.1f} us, p90 {pct(us, 0.9):6.1f} us")
    document = "".join(pydoc_data.topics.topics.values())[: args.long_chars]
    for name, tokenizer in (("rust", rust), ("tiktoken", fast)):
        best = min(timed(tokenizer, [document], 0.0)[0] for _ in range(3))
        print(f"{name:9} one {len(document):,}-character document ({len(fast.encode_pieces([document])[0]):,} tokens): "
              f"{best / 1000:.1f} ms")


if __name__ == "__main__":
    main()
