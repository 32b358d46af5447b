"""How long one full garbage collection holds a gateway process: its modules imported, then a local tokenizer
loaded, then both frozen as ``gateway serve`` freezes them once started (gateway.background.freeze_start_up_heap).

    python bench/scripts/gc_pause.py [--tokenizer DIR] [--rust]

Each line: the objects a full collection walks, and the fastest of five collections. ``--rust``: the tokenizer
without tiktoken (``tokenization.fast_bpe: false``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BUNDLED = Path(__file__).resolve().parents[2] / "gateway" / "tokenization" / "bundled"


def full_collection_ms() -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def report(label: str) -> None:
    print(f"{label}: {len(gc.get_objects()):,} objects walked, a full collection {full_collection_ms():.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(BUNDLED), help="a Hugging Face tokenizer's directory")
    parser.add_argument("--rust", action="store_true", help="the Rust tokenizer alone (no tiktoken)")
    args = parser.parse_args()
    import gateway.serve  # noqa: F401  (everything a gateway process imports)
    from gateway.background import freeze_start_up_heap
    from gateway.tokenization.hf import HfTokenizer

    report("gateway imported")
    tokenizer = HfTokenizer(args.tokenizer, fast_bpe=not args.rust)
    report("a local tokenizer loaded")
    freeze_start_up_heap()
    report("frozen, as once started")
    del tokenizer


if __name__ == "__main__":
    main()
