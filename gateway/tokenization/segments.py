"""Exact, cached tokenization of rendered chat prompts, segment by segment.

A tokenizer matches its added tokens (``<|eot_id|>``, role markers, ...) before anything else and
tokenizes the text between them independently. So a rendered prompt's tokens are the concatenation of
each segment's tokens and the added tokens' ids, and each segment (a system prompt, an earlier turn)
can be cached by its text: a conversation that grows by one message costs one new segment.

A long segment is cut further, into pieces of about ``piece_chars`` characters, each cut before a space
that follows a non-space, where the tokenizers that allow it (:meth:`HfTokenizer.cuts_at_spaces`) begin
a new pre-token anyway. A cut depends only on the text before it, so prompts that share a prefix (one
long document or system message under different questions, a trace's shared blocks) share its pieces,
and only the pieces from the first difference on are tokenized.

Owner: a :class:`SegmentEncoder` owns its LRU of piece encodings. Exactness is checked at start-up
(:meth:`SegmentEncoder.self_check`), cuts and segments apart; a tokenizer for which neither holds is
encoded whole.
"""

from __future__ import annotations

import re
from array import array

from gateway.lru import LruCache
from gateway.tokenization.hf import HfTokenizer

# Conversations that exercise what segmenting could get wrong: leading spaces, newlines, unicode,
# digits, text hugging the added tokens.
_PROBES = [
    [{"role": "system", "content": "  You are helpful.\n\n"}, {"role": "user", "content": "Hi there!  "}],
    [{"role": "user", "content": "naïve café — 東京 ✓ 12345 x=y+1"}, {"role": "assistant", "content": "\nOK\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}, {"role": "user", "content": "c\t"}],
]
# Text whose cuts meet every kind of neighbour: letters, digits, punctuation, runs of spaces, tabs and
# newlines, contractions, unicode letters and combining marks, numbers that are not digits, emoji, code.
_CUT_PROBE = ("It's 12345 naïve cafe\u0301s — 東京 ✓!  Two  spaces,\ttab\t\n\nnew lines:  x=y+1; "
              "def f(a, b):\n    return a  +  b  # 'quoted' we'll see ½ ²  🙂 emoji  ...  END ") * 3
_SPACE_AFTER_NON_SPACE = re.compile(r"(?<=\S) ")


def cut_at_spaces(text: str, size: int) -> list[str]:
    """``text`` in pieces, each cut at the first space after a non-space at least ``size`` characters past
    the piece's start (text with no such space stays whole)."""
    pieces = []
    start = 0
    while len(text) - start > size and (cut := _SPACE_AFTER_NON_SPACE.search(text, start + size)) is not None:
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


class SegmentEncoder:
    def __init__(self, tokenizer: HfTokenizer, max_segments: int = 50_000, piece_chars: int = 512) -> None:
        self._tok = tokenizer
        self._added = tokenizer.added_tokens()
        # Longest first, so a token that is a prefix of another never wins the match.
        names = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self._cache: LruCache[str, array[int]] = LruCache(max_segments)
        self.hits = 0
        self.misses = 0
        self.exact = tokenizer.added_tokens_split_cleanly() and self._split is not None
        # 0: segments stay whole.
        self._piece_chars = piece_chars if self.exact and piece_chars > 0 and tokenizer.cuts_at_spaces() else 0

    def split(self, text: str) -> list[str]:
        """Text and added tokens alternating: even items are text (maybe empty), odd ones added tokens."""
        assert self._split is not None
        return self._split.split(text)

    def layout(self, text: str) -> list[str | int]:
        """A rendered prompt as it is cached: the ids of its added tokens (ints) between its text, each
        segment whole or, when long and cuts are exact, in pieces (strs)."""
        out: list[str | int] = []
        for i, segment in enumerate(self.split(text)):
            if i % 2:  # odd items are the added tokens themselves
                out.append(self._added[segment])
            elif len(segment) > self._piece_chars > 0:
                out.extend(cut_at_spaces(segment, self._piece_chars))
            elif segment:
                out.append(segment)
        return out

    def encode(self, text: str | list[str | int]) -> array[int]:
        """Token ids of a rendered chat prompt (no special tokens added beyond those in the text);
        ``text`` may come already laid out (:meth:`layout`). As packed arrays, pieces and prompts alike:
        joining a long prompt's cached pieces copies bytes, not a hundred thousand int objects."""
        if not self.exact:
            assert isinstance(text, str)
            return array("I", self._tok.encode(text, add_special_tokens=False))
        out = array("I")
        for item in self.layout(text) if isinstance(text, str) else text:
            if isinstance(item, int):
                out.append(item)
            else:
                out.extend(self.piece(item))
        return out

    @property
    def cuts(self) -> bool:
        """Whether long segments are cut into pieces."""
        return self._piece_chars > 0

    def uncached(self, layout: list[str | int]) -> list[str]:
        """The pieces of a :meth:`layout` that are not in the cache yet."""
        return [item for item in layout if isinstance(item, str) and item not in self._cache]

    def piece(self, text: str) -> array[int]:
        ids = self._cache.touch(text)
        if ids is None:
            self.misses += 1
            ids = array("I", self._tok.encode_pieces([text])[0])
            self._cache.put(text, ids)
        else:
            self.hits += 1
        return ids

    def remember(self, piece: str, ids: list[int]) -> None:
        self._cache.put(piece, array("I", ids))

    def self_check(self) -> bool:
        """Compare segmented and whole tokenization on probe conversations; disable segmenting if off (and
        only cutting, if only cuts are off)."""
        if not self.exact:
            return False
        if self._piece_chars and not self._cuts_are_exact():
            self._piece_chars = 0
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

    def _cuts_are_exact(self) -> bool:
        whole = self._tok.encode(_CUT_PROBE, add_special_tokens=False)
        for size in (1, 7, 40):
            pieces = cut_at_spaces(_CUT_PROBE, size)
            if [i for ids in self._tok.encode_pieces(pieces) for i in ids] != whole:
                return False
        return True
