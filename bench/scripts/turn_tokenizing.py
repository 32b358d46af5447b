"""What tokenizing a conversation's turns costs kv_aware, away from the noise of a loaded machine: the
``conversations`` scenario's prompts (its answers stood in by text of the scenario's words, as long as the mock
pods' answers), each tokenized for routing as the gateway does it (:meth:`LocalTokenizer.chat`, the bundled
tokenizer, the conversation's earlier turn remembered), the whole replay ``--rounds`` times on fresh caches. A
request's cost is its fastest round (what it costs when nothing else takes the core), first turns and next
turns apart.

    python bench/scripts/turn_tokenizing.py [--conversations 120] [--rounds 7] [--fast-bpe]

``--fast-bpe``: text encoded through tiktoken, as the gateway does with ``tokenization.fast_bpe: true``.

Run it from two trees alternated (``PYTHONPATH=TREE``) to compare a change; one tree's runs differ by up to 20%
on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import msgspec

from bench.runner import pct
from bench.workloads import History, conversations, text
from gateway.config import TokenizationConfig
from gateway.core.inference_api import InferenceRequest
from gateway.kv.hashing import PromptHashes
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from gateway.tokenization.local import LocalTokenizer


def requests(count: int) -> list[InferenceRequest]:
    """The scenario's chat requests in each conversation's order, decoded as the gateway decodes them."""
    rng = random.Random(1)
    out = []
    for session in conversations(seed=0, conversations=count, rate=6).sessions:
        history = History(session)
        for step in session.steps:
            body = msgspec.json.encode({"model": "m", "messages": history.prompt(step)})
            out.append(msgspec.json.decode(body, type=InferenceRequest))
            history.answered(text(rng, step.max_tokens // 2))
    return out


async def replay(tokenizer: HfTokenizer, reqs: list[InferenceRequest], fastest: list[float]) -> None:
    local = LocalTokenizer(tokenizer, TokenizationConfig())
    for i, req in enumerate(reqs):
        assert req.messages is not None
        started = time.perf_counter()
        tokens = await local.chat(req.messages, req, None)
        fastest[i] = min(fastest[i], time.perf_counter() - started)
        local.remember(tokens, PromptHashes(0, tokens.ids))  # hashed lazily: never here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--fast-bpe", action="store_true")
    args = parser.parse_args()
    reqs = requests(args.conversations)
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR, fast_bpe=args.fast_bpe)
    fastest = [float("inf")] * len(reqs)
    for _ in range(args.rounds):
        asyncio.run(replay(tokenizer, reqs, fastest))
    for name, first in (("first turns", True), ("next turns", False)):
        us = [t * 1e6 for t, r in zip(fastest, reqs, strict=True) if (len(r.messages or ()) == 2) == first]
        print(f"{name}: {len(us)}, p50 {pct(us, 0.5):.0f} us, p90 {pct(us, 0.9):.0f} us")


if __name__ == "__main__":
    main()
