"""Exact, cached tokenization of rendered chat prompts, segment by segment.

A tokenizer matches its added tokens (``<|eot_id|>``, role markers, ...) before anything else and
tokenizes the text between them independently. So a rendered prompt's tokens are the concatenation of
each segment's tokens and the added tokens' ids, and each segment (a system prompt, an earlier turn)
can be cached by its text: a conversation that grows by one message costs one new segment.

Owner: a :class:`SegmentEncoder` owns its LRU of segment encodings. Exactness is checked at start-up
(:meth:`SegmentEncoder.self_check`); a tokenizer for which it does not hold is encoded whole.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable

from gateway.lru import LruCache
from gateway.tokenization.hf import HfTokenizer

# Conversations that exercise what segmenting could get wrong: leading spaces, newlines, unicode,
# digits, text hugging the added tokens.
_PROBES = [
    [{"role": "system", "content": "  You are helpful.\n\n"}, {"role": "user", "content": "Hi there!  "}],
    [{"role": "user", "content": "naïve café — 東京 ✓ 12345 x=y+1"}, {"role": "assistant", "content": "\nOK\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}, {"role": "user", "content": "c\t"}],
]


class SegmentEncoder:
    def __init__(self, tokenizer: HfTokenizer, max_segments: int = 50_000) -> None:
        self._tok = tokenizer
        self._added = tokenizer.added_tokens()
        # Longest first, so a token that is a prefix of another never wins the match.
        names = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self._cache: LruCache[str, array[int]] = LruCache(max_segments)
        self.hits = 0
        self.misses = 0
        self.exact = tokenizer.added_tokens_split_cleanly() and self._split is not None

    def split(self, text: str) -> list[str]:
        """Text and added tokens alternating: even items are text (maybe empty), odd ones added tokens."""
        assert self._split is not None
        return self._split.split(text)

    def encode(self, text: str | list[str], encode_segment: Callable[[str], list[int]] | None = None) -> array[int]:
        """Token ids of a rendered chat prompt (no special tokens added beyond those in the text);
        ``text`` may come already :meth:`split`. As packed arrays, segments and prompts alike: joining
        a long prompt's cached segments copies bytes, not a hundred thousand int objects."""
        if not self.exact:
            assert isinstance(text, str)
            return array("I", self._tok.encode(text, add_special_tokens=False))
        out = array("I")
        for i, piece in enumerate(self.split(text) if isinstance(text, str) else text):
            if i % 2:  # odd pieces are the added tokens themselves
                out.append(self._added[piece])
            elif piece:
                out.extend(self.segment(piece, encode_segment))
        return out

    def uncached(self, pieces: list[str]) -> list[str]:
        """The text segments among :meth:`split` ``pieces`` not yet in the cache."""
        return [p for i, p in enumerate(pieces) if not i % 2 and p and p not in self._cache]

    def segment(self, piece: str, encode_segment: Callable[[str], list[int]] | None = None) -> array[int]:
        ids = self._cache.touch(piece)
        if ids is None:
            self.misses += 1
            ids = array("I", (encode_segment or self._encode_plain)(piece))
            self._cache.put(piece, ids)
        else:
            self.hits += 1
        return ids

    def remember(self, piece: str, ids: list[int]) -> None:
        self._cache.put(piece, array("I", ids))

    def _encode_plain(self, piece: str) -> list[int]:
        return self._tok.encode(piece, add_special_tokens=False)

    def self_check(self) -> bool:
        """Compare segmented and whole tokenization on probe conversations; disable segmenting if off."""
        if not self.exact:
            return False
        for messages in _PROBES:
            try:
                text = self._tok.render_chat(messages)
            except Exception:  # a template that rejects a probe (e.g. no system role) proves nothing
                continue
            if self.encode(text).tolist() != self._tok.encode(text, add_special_tokens=False):
                self.exact = False
                self._cache.clear()
                return False
        return True
