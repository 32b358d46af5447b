"""Replaying traces in the Mooncake FAST'25 format (kvcache-ai/Mooncake, ``FAST25-release/traces``).

Owner: nothing with a lifetime: a Mooncake JSONL file to a :class:`~bench.workloads.Trace`.

One JSON object per line: ``timestamp`` (ms from the start), ``input_length`` and ``output_length``
(tokens), and ``hash_ids``, the prompt's blocks of 512 tokens: equal ids at the same position mean the same
prefix block. There is no text, so each prompt is built from one fixed chunk of text per hash id (same id,
same chunk), and prefix sharing follows the trace:

- a chunk is ``block_tokens`` words drawn by a generator seeded with the id, each word one token with its
  leading space and without it (a chat template may trim the prompt's first space), so that chunks
  tokenize to the concatenation of their tokens; the last block is partial (``input_length`` mod 512,
  scaled), the start of its id's chunk;
- the prompt is one user message: the chat template puts a fixed header before it and the generation
  prompt after it, which shifts every block by the header's tokens but changes no shared prefix;
- a request whose ``hash_ids`` start with all of an earlier request's is a later turn of that request's
  conversation (the longest such earlier request). A conversation is replayed as a session, its turns in
  order, each after the previous answer and the trace's gap between the two arrivals; any other request
  is a session of one request. A turn's prompt is its own blocks alone (the trace's ids already hold the
  earlier turns and answers): these sessions do not carry their history;
- arrival times (and the gaps) are the trace's, times ``time_scale``; ``output_length`` is the request's
  ``max_tokens``, capped by ``max_output_tokens``.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from pathlib import Path

import msgspec

from bench.workloads import Session, Step, Trace
from gateway.tokenization.hf import HfTokenizer

TRACE_BLOCK_TOKENS = 512
_WORD = re.compile(r" [a-z]{2,}")


class MooncakeRecord(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def single_token_words(tokenizer: HfTokenizer, limit: int = 1024) -> list[str]:
    """Lowercase words (with their leading space) that are one token with that space and one without it,
    in vocabulary order."""
    words: list[str] = []
    for token_id in range(len(tokenizer)):
        word = tokenizer.decode([token_id])
        if (_WORD.fullmatch(word) and tokenizer.encode(word, add_special_tokens=False) == [token_id]
                and len(tokenizer.encode(word[1:], add_special_tokens=False)) == 1):
            words.append(word)
            if len(words) == limit:
                break
    if len(words) < 16:
        raise ValueError(f"tokenizer {tokenizer.path} has {len(words)} single-token words; Mooncake prompts "
                         "need at least 16")
    return words


class BlockText:
    """The text chunk of each hash id: ``block_tokens`` single-token words, the same for the same id."""

    def __init__(self, words: list[str], block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.words = words
        self.block_tokens = block_tokens
        self._chunks: dict[int, list[str]] = {}

    def chunk(self, hash_id: int, tokens: int | None = None) -> str:
        """The id's chunk, or its first ``tokens`` words (a partial last block)."""
        words = self._chunks.get(hash_id)
        if words is None:
            rng = random.Random(hash_id)
            words = self._chunks[hash_id] = [rng.choice(self.words) for _ in range(self.block_tokens)]
        return "".join(words[:tokens])

    def prompt(self, record: MooncakeRecord) -> str:
        *full, last = record.hash_ids
        return "".join(self.chunk(h) for h in full) + self.chunk(last, self._last_block_tokens(record))

    def prompt_tokens(self, record: MooncakeRecord) -> int:
        """How many tokens :meth:`prompt` is, before any chat template."""
        return self.block_tokens * (len(record.hash_ids) - 1) + self._last_block_tokens(record)

    def _last_block_tokens(self, record: MooncakeRecord) -> int:
        partial = record.input_length - TRACE_BLOCK_TOKENS * (len(record.hash_ids) - 1)
        return min(self.block_tokens, max(1, round(partial * self.block_tokens / TRACE_BLOCK_TOKENS)))


def read_records(path: str | Path, start: int = 0, limit: int | None = None) -> list[MooncakeRecord]:
    """Requests ``start`` to ``start + limit`` of the file (in its order, which is by arrival), checked."""
    records = []
    lines = Path(path).read_bytes().splitlines()
    end = len(lines) if limit is None else start + limit
    for number, line in enumerate(lines[start:end], start + 1):
        if not line.strip():
            continue
        try:
            record = msgspec.json.decode(line, type=MooncakeRecord)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{number}: not a Mooncake request: {exc}") from None
        if record.input_length < 1 or len(record.hash_ids) != -(-record.input_length // TRACE_BLOCK_TOKENS):
            raise ValueError(f"{path}:{number}: {len(record.hash_ids)} hash_ids for input_length "
                             f"{record.input_length} (blocks of {TRACE_BLOCK_TOKENS} tokens)")
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no requests in lines {start + 1}-{end}")
    return records


def conversations(records: list[MooncakeRecord]) -> list[list[int]]:
    """Request indices grouped by conversation, each in order, conversations by their first request: a
    request whose ``hash_ids`` start with all of an earlier one's joins that one's conversation (the longest
    such; equal lists included)."""
    children: dict[tuple[int, int], int] = {}  # (prefix node, next hash id) -> node
    ends_at: dict[int, int] = {}  # node -> the latest request whose ids end there
    first_of: list[int] = []  # each request's conversation, by its first request
    for i, record in enumerate(records):
        node, extends = 0, None
        for hash_id in record.hash_ids:
            node = children.setdefault((node, hash_id), len(children) + 1)
            extends = ends_at.get(node, extends)
        first_of.append(i if extends is None else first_of[extends])
        ends_at[node] = i
    grouped: dict[int, list[int]] = defaultdict(list)
    for i, first in enumerate(first_of):
        grouped[first].append(i)
    return list(grouped.values())


def read_mooncake(path: str | Path, tokenizer: HfTokenizer, *, block_tokens: int = TRACE_BLOCK_TOKENS,
                  start: int = 0, limit: int | None = None, time_scale: float = 1.0, session_header: bool = False,
                  max_output_tokens: int | None = None) -> Trace:
    """A Mooncake trace (or the slice ``start``, ``limit`` of it) as sessions the bench replays."""
    if time_scale < 0:
        raise ValueError("the time scale must not be negative")
    records = read_records(path, start, limit)
    text = BlockText(single_token_words(tokenizer), block_tokens)
    _check_concatenation(text, records[0], tokenizer)
    t0 = records[0].timestamp
    sessions = []
    for members in conversations(records):
        session_id = f"mc{start + members[0]}"
        steps = []
        for k, i in enumerate(members):
            record = records[i]
            think = (record.timestamp - records[members[k - 1]].timestamp) * time_scale / 1000 if k else None
            max_tokens = max(1, min(record.output_length, max_output_tokens or record.output_length))
            steps.append(Step([{"role": "user", "content": text.prompt(record)}], max_tokens,
                              {"x-session-id": session_id} if session_header else {}, think))
        start_s = (records[members[0]].timestamp - t0) * time_scale / 1000
        sessions.append(Session(session_id, round(start_s, 4), steps, carry_history=False))
    return Trace("mooncake", start, sessions)  # no seed: the slice's first request stands in its place


def _check_concatenation(text: BlockText, record: MooncakeRecord, tokenizer: HfTokenizer) -> None:
    """The words split as promised in this tokenizer: a prompt is as many tokens as its chunks' words."""
    prompt = text.prompt(record)
    found = len(tokenizer.encode(prompt.lstrip(" "), add_special_tokens=False))
    if found != text.prompt_tokens(record):
        raise ValueError(f"tokenizer {tokenizer.path} makes {found} tokens of a {text.prompt_tokens(record)}-word "
                         "Mooncake prompt: its words do not tokenize one by one")
