"""Byte-level BPE through tiktoken's encoder, for the text between a rendered prompt's added tokens.

Why: routing tokenizes each request's new text (a conversation's next turn, a first turn's question) before it
is routed. The Rust ``tokenizers`` builds a whole ``Encoding`` per call (each token's string, type ids,
masks); tiktoken's core returns the ids alone, in about a third of the time on real text, warm or cold
(docs/benchmarks.md, "Tokenizing through tiktoken").

When: only where tiktoken computes the same function as the model's tokenizer (vLLM tokenizes with the
latter; a routing prefix that differs by one token misses every block after it):

- the model is BPE over bytes (``ByteLevel``): no dropout, byte fallback, word prefix or suffix, every byte
  a token;
- no normalizer, or Unicode NFC (applied here first, as the tokenizer does);
- the pre-tokenizer splits by one regex: ``ByteLevel``'s own (GPT-2's), or a ``Split`` (isolated matches,
  not inverted) before a ``ByteLevel`` that does not split again (Llama 3's, Qwen 2's). Text no match covers
  is a pre-token of its own there; here a last alternative matches it;
- merges rank each token after its parts and come in the order of what they make: tiktoken merges by the
  rank of the result, the tokenizer by the merge's place in its list;
- on probe text and on the vocabulary itself (each token alone as a word: tiktoken takes a word that is a
  token whole, so the merges must build it), both give the same ids (:func:`agrees`).

Anything else keeps the Rust tokenizer, and the reason is logged. Owner: each :class:`~gateway.tokenization.
hf.HfTokenizer` built with ``fast_bpe`` owns its :class:`ByteLevelBpe`; the simulated pods never use one
(they tokenize as vLLM does, so that a difference would show as a missed prediction).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

import regex

# GPT-2's pre-tokenizer pattern: what ``ByteLevel(use_regex=True)`` splits by.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Text that exercises what a pre-tokenizer regex or the merges could treat apart: contractions, digits,
# punctuation runs, whitespace of each kind and length, unicode letters, marks, CJK, emoji, code.
# Unicode's spaces and separators are there each alone and in runs: regex engines disagree most on what \s is.
PROBE_TEXT = ("It's 12345 naïve cafe\u0301s — 東京 ✓!  Two  spaces,\ttab\t\n\nnew lines:\r\n x=y+1; I'LL "
              "we'd they're def f(a, b):\n    return a  +  b  # 'quoted' ½ ² 🙂🎉 ...  END\u00a0\u2003 \n "
              "a\x0bb\x0cc\x1cd\x1fe\u0085f\u1680g\u180eh\u2028i\u2029j\u202fk\u205fl\u3000m\ufeffn\u200bo "
              "\u00a0\u00a0x \u3000\u3000y\u2028\u2028z ") * 2


class UnsupportedTokenizer(Exception):
    """The tokenizer is not one tiktoken computes the same ids for (the message says why)."""


def _bytes_to_unicode() -> dict[str, int]:
    """ByteLevel's alphabet: the printable character standing for each byte (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _bytes_to_unicode()


def sequence_steps(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A tokenizer component's steps as tokenizer.json lists them: a ``Sequence``'s (under ``key``:
    ``normalizers``, ``pretokenizers``), else the component alone; none without one."""
    if not component:
        return []
    return component.get(key, []) if component.get("type") == "Sequence" else [component]


class ByteLevelBpe:
    """Text with no added token in it, encoded without special tokens (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], name: str = "tokenizer") -> None:
        import tiktoken  # imported by who tokenizes locally only

        self._nfc = _normalizer(spec.get("normalizer"))
        pattern = _pattern(spec.get("pre_tokenizer"))
        model = spec.get("model") or {}
        ranks = _ranks(model, {t["content"] for t in spec.get("added_tokens") or []})
        # A last alternative for text no match covers: the tokenizer keeps it as one pre-token.
        covering = f"{pattern}|(?:(?!{pattern})[\\s\\S])+"
        self._encoding = tiktoken.Encoding(name, pat_str=covering, mergeable_ranks=ranks, special_tokens={})
        self._encode = self._encoding.encode_ordinary

    def encode(self, text: str) -> list[int]:
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        return self._encode(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]


def _normalizer(normalizer: dict[str, Any] | None) -> bool:
    """Whether to apply NFC first."""
    kinds = [step.get("type") for step in sequence_steps(normalizer, "normalizers")]
    if kinds in ([], ["NFC"]):
        return bool(kinds)
    raise UnsupportedTokenizer(f"normalizer {' + '.join(map(str, kinds))}")


def _pattern(pre: dict[str, Any] | None) -> str:
    steps = sequence_steps(pre, "pretokenizers")
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"]:
        split, level = steps
        source = (split.get("pattern") or {}).get("Regex")
        if source and split.get("behavior") == "Isolated" and not split.get("invert") \
                and not level.get("use_regex", True) and not level.get("add_prefix_space"):
            if any(m.end() == m.start() for m in regex.finditer(source, PROBE_TEXT + "\n")):
                raise UnsupportedTokenizer("a pre-tokenizer regex that matches empty text")
            return str(source)
    raise UnsupportedTokenizer(f"pre-tokenizer {' + '.join(map(str, kinds)) or 'none'}")


def _ranks(model: dict[str, Any], added: set[str]) -> dict[bytes, int]:
    """Each token's bytes and id, once the merges are shown to rank tokens as tiktoken does."""
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise UnsupportedTokenizer(f"model {model.get('type')} with options tiktoken has not")
    vocab: dict[str, int] = model.get("vocab") or {}
    try:
        ranks = {bytes(_BYTE_OF_CHAR[c] for c in token): i for token, i in vocab.items() if token not in added}
    except KeyError:
        raise UnsupportedTokenizer("a token outside the byte-level alphabet") from None
    if len(ranks) != len(vocab) - len(added & vocab.keys()) or not all(bytes([b]) in ranks for b in range(256)):
        raise UnsupportedTokenizer("not every byte is a token, or two tokens have the same bytes")
    made = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        result = vocab.get(left + right)
        if result is None or result < made or result <= max(vocab[left], vocab[right]):
            raise UnsupportedTokenizer("merges that do not rank each token after its parts, in order")
        made = result
    return ranks


def vocabulary_probe(spec: dict[str, Any]) -> str:
    """The vocabulary as text, one token a line (those whose bytes are text and hold no added token)."""
    added = [t["content"] for t in spec.get("added_tokens") or []]
    words = []
    for token in (spec.get("model") or {}).get("vocab") or {}:
        try:
            word = bytes(_BYTE_OF_CHAR[c] for c in token).decode()
        except (KeyError, UnicodeDecodeError):
            continue
        if not any(a in word for a in added):
            words.append(word)
    return "\n".join(words)


def agrees(fast: ByteLevelBpe, reference: Callable[[list[str]], list[list[int]]], spec: dict[str, Any]) -> bool:
    """Whether both encode the probe text, its pieces and the vocabulary alike."""
    texts = [PROBE_TEXT, *PROBE_TEXT.split(" "), vocabulary_probe(spec)]
    return fast.encode_many(texts) == reference(texts)
