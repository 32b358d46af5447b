"""Tokenization for routing is exactly the engine's: segment caching proven against whole-prompt
tokenization, completions with special tokens, remote mode, and visible fallbacks."""

from __future__ import annotations

import json
import logging
import random
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gateway.config import HealthConfig, ModelTokenizerConfig, TokenizationConfig
from gateway.core.inference_api import InferenceRequest
from gateway.http_client import HttpClient
from gateway.kv.hashing import PromptHashes
from gateway.load.ledger import InFlightLedger
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from gateway.tokenization.local import LocalTokenizer
from gateway.tokenization.segments import SegmentEncoder, cut_at_spaces
from gateway.tokenization.tokenizers import TokenizationService

WORDS = ["the", "gateway", " routes", "naïve", "東京", "  ", "\n", "\n\n", "\t", "x=1;", "<|eot_id|>", "🙂",
         "<|start_header_id|>", "Ünïcödé", "12345", " ", ".", "KV-cache", "'quoted'", "<|", "|>"]


def random_conversation(rng: random.Random) -> list[dict]:
    roles = ["system"] if rng.random() < 0.5 else []
    roles += ["user", "assistant"] * rng.randint(1, 4)
    if rng.random() < 0.5:
        roles.append("user")
    return [{"role": r, "content": "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))} for r in roles]


def test_segmented_tokenization_equals_whole_prompt(tokenizer):
    encoder = SegmentEncoder(tokenizer)
    assert encoder.self_check() and encoder.exact
    rng = random.Random(1234)
    for _ in range(300):
        text = tokenizer.render_chat(random_conversation(rng))
        assert encoder.encode(text).tolist() == tokenizer.encode(text, add_special_tokens=False), text
    assert encoder.hits > 1000  # roles and repeated segments come from the cache


def test_growing_conversation_reuses_cached_segments(tokenizer):
    encoder = SegmentEncoder(tokenizer)
    messages = [{"role": "system", "content": "You are a careful assistant. " * 50}]
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question {turn}?"})
        encoder.encode(tokenizer.render_chat(messages))
        misses = encoder.misses
        messages.append({"role": "assistant", "content": f"Answer {turn}."})
    encoder.encode(tokenizer.render_chat(messages))
    assert encoder.misses - misses == 1  # only the newest message was tokenized


PLAIN_WORDS = [w for w in WORDS if w not in ("<|eot_id|>", "<|start_header_id|>")]  # no chat markers


def long_text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(PLAIN_WORDS) for _ in range(words))


def test_cuts_fall_before_a_space_after_a_non_space_and_lose_nothing():
    text = "aaaa bbbb  cccc\n dddd   eeee"
    pieces = cut_at_spaces(text, 3)
    assert "".join(pieces) == text
    assert pieces == ["aaaa", " bbbb", "  cccc\n dddd", "   eeee"]  # not after the newline
    assert cut_at_spaces("x" * 100, 10) == ["x" * 100]  # no space: whole


def test_long_segments_tokenize_exactly_in_pieces(tokenizer):
    rng = random.Random(99)
    for piece_chars in (8, 64, 512):
        encoder = SegmentEncoder(tokenizer, piece_chars=piece_chars)
        assert encoder.self_check() and encoder.cuts
        for _ in range(60):
            messages = [{"role": "system", "content": long_text(rng, rng.randint(50, 400))},
                        {"role": "user", "content": long_text(rng, rng.randint(0, 300))}]
            text = tokenizer.render_chat(messages)
            assert encoder.encode(text).tolist() == tokenizer.encode(text, add_special_tokens=False), text
        assert encoder.misses > 120  # more pieces than segments: the texts really were cut


def test_prompts_sharing_a_long_prefix_tokenize_only_the_pieces_after_it(tokenizer):
    encoder = SegmentEncoder(tokenizer, piece_chars=200)
    document = long_text(random.Random(5), 2_000)
    encoder.encode(tokenizer.render_chat([{"role": "user", "content": document + " First question?"}]))
    misses = encoder.misses
    text = tokenizer.render_chat([{"role": "user", "content": document + " And a second one?"}])
    assert encoder.encode(text).tolist() == tokenizer.encode(text, add_special_tokens=False)
    # The document's pieces before the question's came from the cache; the last one (it holds the question)
    # and the text after the message (the next role's header) are new.
    assert 1 <= encoder.misses - misses <= 2
    assert len(encoder.layout(text)) > 10


def tokenizer_with(tmp_path, change: Callable[[dict], None], **options: Any) -> HfTokenizer:
    """The bundled tokenizer with its tokenizer.json changed in place by ``change``."""
    shutil.copytree(BUNDLED_TOKENIZER_DIR, tmp_path, dirs_exist_ok=True)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    change(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return HfTokenizer(tmp_path, **options)


def merge_letters_with_spaces_first(spec: dict) -> None:
    """Merges of a letter with the space after it, applied first (as a tokenizer trained on pre-tokens that hold
    both would have: only there can a cut change the ids) but ranked last (ids after every other token)."""
    model = spec["model"]
    for letter in "abcdefghijklmnopqrstuvwxyz":
        model["vocab"][letter + "Ġ"] = len(model["vocab"])
    model["merges"] = [[letter, "Ġ"] for letter in "abcdefghijklmnopqrstuvwxyz"] + model["merges"]


def tokenizer_variant(tmp_path, pre_tokenizer: dict) -> HfTokenizer:
    """The mock tokenizer with another pre-tokenizer, and merges of a letter with the space after it first."""
    def change(spec: dict) -> None:
        spec["pre_tokenizer"] = pre_tokenizer
        merge_letters_with_spaces_first(spec)
    return tokenizer_with(tmp_path, change)


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


@pytest.mark.parametrize(("pre_tokenizer", "claims", "cuts"), [
    # Llama 3's and Qwen's shape: a regex split, then bytes. Cuts before a space are exact.
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        BYTE_LEVEL]}, True, True),
    # SentencePiece's shape: a space becomes part of the word after it only at the text's start. No cuts.
    ({"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}, False, False),
    # The shape passes, but the pattern keeps a word's trailing spaces with it: the probe catches it.
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\S+\s*"}, "behavior": "Isolated", "invert": False},
        BYTE_LEVEL]}, True, False),
])
def test_cuts_follow_what_the_tokenizer_allows(tmp_path, pre_tokenizer, claims, cuts):
    variant = tokenizer_variant(tmp_path, pre_tokenizer)
    assert variant.cuts_at_spaces() is claims
    encoder = SegmentEncoder(variant, piece_chars=16)
    encoder.self_check()
    assert encoder.cuts is cuts
    rng = random.Random(7)
    for _ in range(40):  # whatever was decided, the ids are the engine's
        text = variant.render_chat([{"role": "user", "content": long_text(rng, rng.randint(20, 200))}])
        assert encoder.encode(text).tolist() == variant.encode(text, add_special_tokens=False), text


def make_service(models=None, default_mode="none", **kw) -> TokenizationService:
    config = TokenizationConfig(models=models or {}, default_mode=default_mode, **kw)
    service = TokenizationService(config, PodRegistry([], HealthConfig()), GatewayMetrics(), HttpClient(),
                                  InFlightLedger())
    service.load()
    return service


def local_models() -> dict:
    return {"m": ModelTokenizerConfig(path=str(BUNDLED_TOKENIZER_DIR))}


async def test_service_local_chat_and_completions(tokenizer):
    service = make_service(local_models())
    messages = [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}]
    ids = (await service.tokenize("m", "chat", InferenceRequest(model="m", messages=messages))).ids
    assert list(ids) == tokenizer.encode_chat([{"role": "user", "content": "part one\ntwo"}])
    ids = (await service.tokenize("m", "completions", InferenceRequest(model="m", prompt="Hello world"))).ids
    assert ids == tokenizer.encode("Hello world") and ids[0] == 0  # BOS, as the engine adds it
    assert (await service.tokenize("m", "completions", InferenceRequest(model="m", prompt=[5, 6, 7]))).ids == [5, 6, 7]
    assert (await service.tokenize("m", "completions", InferenceRequest(model="m", prompt=["a", "b"]))).ids == \
        tokenizer.encode("a")
    # vLLM tokenizes a Responses prompt with the tokenizer's special tokens (a second BOS here: real vLLM
    # 0.32 counts 329 input tokens where /tokenize of the same chat says 328).
    responses = InferenceRequest(model="m", instructions="Be brief.", input="Hi")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = list((await service.tokenize("m", "responses", responses)).ids)
    assert ids == tokenizer.encode_chat(chat, add_special_tokens=True) == [0, *tokenizer.encode_chat(chat)]


async def test_a_conversations_next_turn_counts_the_tokens_it_reused(tokenizer):
    service = make_service(local_models())
    messages = [{"role": "system", "content": "a system prompt " * 50}, {"role": "user", "content": "hi"}]
    first = await service.tokenize("m", "chat", InferenceRequest(model="m", messages=messages))
    service.remember("m", first, PromptHashes(1, first.ids))
    grown = [*messages, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and then?"}]
    second = await service.tokenize("m", "chat", InferenceRequest(model="m", messages=grown))
    assert list(second.ids) == tokenizer.encode_chat(grown) and second.earlier is not None
    text = service._metrics.render().decode()
    reused = second.earlier.length
    assert f'gateway_prompt_tokens_reused_total{{model="m",source="reused"}} {float(reused)}' in text
    new = len(first.ids) + len(second.ids) - reused
    assert f'gateway_prompt_tokens_reused_total{{model="m",source="new"}} {float(new)}' in text


async def test_long_new_text_is_tokenized_off_the_loop_with_the_same_result(tokenizer):
    service = make_service(local_models(), offload_chars=100)
    local = service.local("m")
    assert isinstance(local, LocalTokenizer)
    misses = local.segments.misses
    messages = [{"role": "system", "content": "long system prompt " * 100}, {"role": "user", "content": "hi"}]
    ids = (await service.tokenize("m", "chat", InferenceRequest(model="m", messages=messages))).ids
    assert list(ids) == tokenizer.encode_chat(messages)
    assert local.segments.misses == misses  # the new segments were encoded in the worker thread


@pytest.mark.parametrize("fast_bpe", [False, True])
async def test_new_text_goes_to_a_thread_past_offload_chars_whichever_the_encoder(monkeypatch, fast_bpe):
    """One threshold for both encoders: tiktoken's at three times the Rust tokenizer's left a group's first
    prompts on the loop, and real pods' hit ratio fell (docs/benchmarks.md)."""
    threshold = 100
    local = make_service(local_models(), offload_chars=threshold, fast_bpe=fast_bpe).local("m")
    assert isinstance(local, LocalTokenizer) and local.tokenizer.fast_bpe is fast_bpe
    threads = []
    encode = local.tokenizer.encode_pieces
    monkeypatch.setattr(local.tokenizer, "encode_pieces",
                        lambda texts: threads.append(threading.current_thread()) or encode(texts))
    for size, on_loop in ((threshold - 30, True), (threshold + 10, False)):  # the template adds a few
        threads.clear()
        text = ("word " * size)[:size]
        ids = (await local.chat([{"role": "user", "content": text}], InferenceRequest(model="m"), None)).ids
        assert list(ids) == local.tokenizer.encode_chat([{"role": "user", "content": text}])
        assert threads and all((t is threading.main_thread()) is on_loop for t in threads), (size, threads)


async def test_unknown_model_is_counted_and_logged_once(caplog):
    service = make_service(default_mode="none")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert await service.tokenize("x", "chat", InferenceRequest(model="x", messages=[{"role": "user"}])) is None
    assert sum("approximate" in r.message for r in caplog.records) == 1
    text = service._metrics.render().decode()
    assert 'gateway_tokenization_total{mode="none",model="x",outcome="unavailable"} 3.0' in text


async def test_template_errors_fall_back_visibly():
    service = make_service(local_models())
    bad = InferenceRequest(model="m", messages=[{"role": "user", "content": 5}])  # the template cannot render it
    assert await service.tokenize("m", "chat", bad) is None
    assert 'outcome="render_error"' in service._metrics.render().decode()


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_remote_mode_matches_local(start_mock_pod, tokenizer, kind):

    from gateway.config import PodConfig

    pod = await start_mock_pod()
    registry = PodRegistry([PodConfig(url=pod.url, models=["mock-llama"])], HealthConfig())
    registry.all()[0].healthy = True
    http = HttpClient()
    service = TokenizationService(TokenizationConfig(default_mode="remote"), registry, GatewayMetrics(), http,
                                  InFlightLedger())
    await http.start()
    try:
        messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "remote please"}]
        req = InferenceRequest(model="mock-llama", messages=messages, prompt="remote please")
        ids = (await service.tokenize("mock-llama", kind, req)).ids
        expected = tokenizer.encode_chat(messages) if kind == "chat" else tokenizer.encode("remote please")
        assert list(ids) == expected
        await pod.stop()
        registry.all()[0].healthy = True
        assert await service.tokenize("mock-llama", kind, req) is None
    finally:
        await http.stop()
    assert 'outcome="remote_error"' in service._metrics.render().decode()


def test_plain_conversations_render_without_transformers_and_exactly_as_it_would(tokenizer, monkeypatch):
    rng = random.Random(99)
    conversations = [random_conversation(rng) for _ in range(100)]
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    expected = [tokenizer._transformers_render(c, g, False, t, None, None)
                for c in conversations for g in (True, False) for t in (None, tools)]
    calls = []
    monkeypatch.setattr(tokenizer._tok, "apply_chat_template", lambda *a, **k: calls.append(a) or "")
    assert [tokenizer.render_chat(c, add_generation_prompt=g, tools=t)
            for c in conversations for g in (True, False) for t in (None, tools)] == expected
    assert calls == []  # none of them went through transformers


@pytest.mark.parametrize("case", [
    {"messages": [{"role": "user", "content": "hi", "name": None}]},  # transformers drops None-valued keys
    {"messages": [{"role": "assistant", "content": "ok", "reasoning": "r"}]},  # and aliases reasoning
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
     "continue_final_message": True, "add_generation_prompt": False},
])
def test_what_transformers_rewrites_is_rendered_by_transformers(tokenizer, monkeypatch, case):
    real = tokenizer._tok.apply_chat_template
    calls = []
    monkeypatch.setattr(tokenizer._tok, "apply_chat_template", lambda *a, **k: calls.append(a) or real(*a, **k))
    messages = case.pop("messages")
    text = tokenizer.render_chat(messages, **case)
    assert len(calls) == 1
    assert text == real([{k: v for k, v in m.items() if v is not None} for m in messages], tokenize=False,
                        **{"add_generation_prompt": True, **case.get("chat_template_kwargs", {}),
                           **{k: v for k, v in case.items() if k != "chat_template_kwargs"}})


def test_a_template_that_renders_otherwise_outside_transformers_is_left_to_it(monkeypatch, caplog):
    real = HfTokenizer._transformers_render
    monkeypatch.setattr(HfTokenizer, "_transformers_render", lambda self, *a: real(self, *a) + "!")
    with caplog.at_level(logging.WARNING, logger="gateway.tokenization"):
        variant = HfTokenizer(BUNDLED_TOKENIZER_DIR)
    assert variant._template is None
    assert "renders differently outside transformers" in caplog.text
    assert variant.render_chat([{"role": "user", "content": "hi"}]).endswith("!")  # transformers' own path


async def test_a_pod_without_tokenize_is_not_asked_again_until_its_window_ends(start_mock_pod, start_backend,
                                                                               tokenizer, caplog):
    from aiohttp import web

    from gateway.config import PodConfig
    from gateway.tokenization import tokenizers

    asked = []

    async def no_route(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_post("/tokenize", no_route)
    bare_url = await start_backend(app)
    registry = PodRegistry([PodConfig(url=bare_url, name="bare", models=["mock-llama"])], HealthConfig())
    registry.all()[0].healthy = True
    http = HttpClient()
    service = TokenizationService(TokenizationConfig(default_mode="remote"), registry, GatewayMetrics(), http,
                                  InFlightLedger())
    await http.start()
    req = InferenceRequest(model="mock-llama", prompt="remote please")
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.tokenization"):
            assert [await service.tokenize("mock-llama", "completions", req) for _ in range(3)] == [None] * 3
        assert asked == ["/tokenize"]  # refused once, then not asked
        assert "do not serve /tokenize" in caplog.text
        metrics = service._metrics.render().decode()
        assert 'outcome="remote_http_404"} 1.0' in metrics and 'outcome="remote_unsupported"} 2.0' in metrics
        assert service._no_tokenize["bare"] - time.monotonic() > tokenizers.NO_TOKENIZE_S - 60
        service._no_tokenize["bare"] = time.monotonic()  # its window over: asked again
        assert await service.tokenize("mock-llama", "completions", req) is None and len(asked) == 2
        # Another pod of the model that has /tokenize is asked instead.
        pod = await start_mock_pod()
        registry.add(PodConfig(url=pod.url, name="full", models=["mock-llama"]))
        registry.get("full").healthy = True
        service._no_tokenize["bare"] = float("inf")
        assert (await service.tokenize("mock-llama", "completions", req)).ids == tokenizer.encode("remote please")
        assert len(asked) == 2
    finally:
        await http.stop()
