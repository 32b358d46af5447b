"""Whether tokenizing in threads uses more than one core: the HF (Rust) tokenizer's ``encode`` holds the
GIL, ``encode_batch`` releases it. The gateway tokenizes long new text in a worker thread (past
``tokenization.offload_chars``), which only helps the event loop if the GIL is released.

    python bench/scripts/tokenize_threads.py [--threads 2] [--texts 16] [--words 1500]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer


def speedup(encode: Callable[[str], list[int]], texts: list[str], threads: int) -> tuple[float, float]:
    started = time.perf_counter()
    for text in texts:
        encode(text)
    serial = time.perf_counter() - started
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(encode, texts))
        threaded = time.perf_counter() - started
    return serial, threaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--words", type=int, default=1500)
    args = parser.parse_args()
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR)
    backend = tokenizer._backend
    assert backend is not None
    rng = random.Random(0)
    words = "cache prefix router token block engine agent stage latency pod gateway kernel".split()
    texts = [" ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(args.words))
             for _ in range(args.texts)]
    print(f"{args.texts} texts of {len(tokenizer.encode(texts[0]))} tokens, {args.threads} threads")
    tokenizer.encode(texts[0])  # warm up
    for name, encode in (("encode", lambda t: backend.encode(t).ids),
                         ("encode_batch([text]) (the gateway's)", tokenizer.encode)):
        serial, threaded = speedup(encode, texts, args.threads)
        print(f"{name:>38}: serial {serial * 1000:.1f} ms, threaded {threaded * 1000:.1f} ms, "
              f"speedup {serial / threaded:.2f}x")


if __name__ == "__main__":
    main()
