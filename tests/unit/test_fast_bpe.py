"""tiktoken's encoder stands in for the Rust tokenizer only where it gives the same ids."""

from __future__ import annotations

import json
import logging
import pydoc_data.topics
import random

import pytest

from gateway.config import ModelTokenizerConfig
from gateway.tokenization.fast_bpe import ByteLevelBpe, UnsupportedTokenizer
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from tests.unit.test_tokenization import (
    BYTE_LEVEL,
    LLAMA3_SPLIT,
    make_service,
    merge_letters_with_spaces_first,
    tokenizer_with,
)

# Characters of every class a pre-tokenizer tells apart, for random text.
ALPHABET = [*"abcdefXYZ'\u20190123456789 .,;:!?-_()[]{}\"#\t\n\r", "  ", "\u00a0", "é", "e\u0301", "東京", "🙂", "ß"]


def real_text() -> list[str]:
    """Python's own documentation, in 450-character chunks: text no one wrote for this tokenizer."""
    topics = list(pydoc_data.topics.topics.values())
    return [topic[i:i + 450] for topic in topics[:60] for i in range(0, len(topic), 450)]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def variant(tmp_path, change) -> HfTokenizer:
    """The bundled tokenizer with its tokenizer.json changed by ``change``, fast path asked for."""
    return tokenizer_with(tmp_path, change, fast_bpe=True)


def assert_same_ids(tokenizer: HfTokenizer, texts: list[str]) -> None:
    reference = HfTokenizer(tokenizer.path)
    assert not reference.fast_bpe  # off unless asked: the simulated pods tokenize as vLLM does
    assert tokenizer.encode_pieces(texts) == reference.encode_pieces(texts)


def test_the_bundled_tokenizer_encodes_through_tiktoken_with_the_rust_tokenizers_ids():
    tokenizer = HfTokenizer(BUNDLED_TOKENIZER_DIR, fast_bpe=True)
    assert tokenizer.fast_bpe
    rng = random.Random(3)
    texts = real_text() + [random_text(rng, rng.randint(1, 300)) for _ in range(400)] + ["", " ", "\n\n\n", "  x"]
    assert len(texts) > 1000
    assert_same_ids(tokenizer, texts)


def set_pre_tokenizer(pre_tokenizer: dict):
    def change(spec: dict) -> None:
        spec["pre_tokenizer"] = pre_tokenizer
    return change


@pytest.mark.parametrize("pre_tokenizer", [
    # Llama 3's and Qwen's shape: a regex split, then bytes.
    {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}, BYTE_LEVEL]},
    # A pattern that leaves leading whitespace unmatched: the tokenizer keeps it as a pre-token of its own.
    {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\S+\s*"}, "behavior": "Isolated", "invert": False}, BYTE_LEVEL]},
])
def test_a_regex_split_before_bytes_is_taken_with_the_same_ids(tmp_path, pre_tokenizer):
    tokenizer = variant(tmp_path, set_pre_tokenizer(pre_tokenizer))
    assert tokenizer.fast_bpe
    rng = random.Random(5)
    assert_same_ids(tokenizer, real_text() + [random_text(rng, rng.randint(1, 200)) for _ in range(300)])


def test_nfc_is_applied_first_as_the_tokenizer_does(tmp_path):
    tokenizer = variant(tmp_path, lambda spec: spec.update(normalizer={"type": "NFC"}))
    assert tokenizer.fast_bpe
    texts = ["cafe\u0301 naïve", "A\u030a ring", "\u1e9b\u0323 x"]
    assert_same_ids(tokenizer, texts)
    assert tokenizer.encode_pieces(["cafe\u0301"]) == tokenizer.encode_pieces(["café"])


def add_unbuilt_token(spec: dict) -> None:
    """A word in the vocabulary that no merge builds: tiktoken takes the word whole, the merges cannot."""
    spec["model"]["vocab"]["zqx"] = len(spec["model"]["vocab"])


def put_merges_before_their_rank(spec: dict) -> None:
    """Merges of a letter with the space after it applied first, but ranked last (ids after every other)."""
    merge_letters_with_spaces_first(spec)
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\S+\s*"}, "behavior": "Isolated", "invert": False}, BYTE_LEVEL]}


@pytest.mark.parametrize(("change", "why", "text"), [
    (set_pre_tokenizer({"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}),
     "pre-tokenizer Metaspace", None),
    (set_pre_tokenizer({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\w*"}, "behavior": "Isolated", "invert": False}, BYTE_LEVEL]}),
     "matches empty text", None),
    (lambda spec: spec.update(normalizer={"type": "Lowercase"}), "normalizer Lowercase", None),
    (lambda spec: spec["model"].update(byte_fallback=True), "options tiktoken has not", None),
    (put_merges_before_their_rank, "do not rank each token after its parts", "the cat sat on the mat "),
    (add_unbuilt_token, None, "zqx"),  # the structure passes; the vocabulary probe catches it
])
def test_a_tokenizer_tiktoken_would_encode_otherwise_keeps_the_rust_tokenizer(tmp_path, caplog, change, why, text):
    caplog.set_level(logging.INFO, "gateway.tokenization")
    tokenizer = variant(tmp_path, change)
    assert not tokenizer.fast_bpe
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    if why is not None:
        assert why in caplog.text
        with pytest.raises(UnsupportedTokenizer, match=why):
            ByteLevelBpe(spec)
    else:
        assert "tiktoken's ids differ on probes" in caplog.text
    if text is not None:  # the refusal mattered: taken anyway, the ids would differ
        forced = ByteLevelBpe(spec) if why is None else None
        if forced is None:
            merges = spec["model"]["merges"]
            spec["model"]["merges"] = []  # past the structural check, to show what it guards
            forced = ByteLevelBpe(spec)
            spec["model"]["merges"] = merges
        assert forced.encode(text) != tokenizer.encode_pieces([text])[0]


async def test_the_gateways_local_tokenizers_use_it_unless_configured_off():
    models = {"m": ModelTokenizerConfig(path=str(BUNDLED_TOKENIZER_DIR))}
    assert make_service(models)._local["m"].tokenizer.fast_bpe
    assert not make_service(models, fast_bpe=False)._local["m"].tokenizer.fast_bpe
