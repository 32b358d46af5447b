"""A conversation's next turn reuses its earlier prompt's token ids only where that gives exactly the ids a
whole render would: proven over random conversations and templates that behave as real families do."""

from __future__ import annotations

import random
import shutil
from array import array
from pathlib import Path
from typing import Any

import pytest

from gateway.config import TokenizationConfig
from gateway.core.inference_api import InferenceRequest
from gateway.kv.hashing import PromptHashes
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from gateway.tokenization.local import LocalTokenizer
from gateway.tokenization.reuse import ConversationMemory, RememberedPrompt, fingerprints

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
# What each template's probes must conclude: reuse for every conversation, for plain ones, or never.
VERDICTS = {
    "message_local": ("rich", True), "default_system": ("rich", True), "tool_calls": ("rich", True),
    "past_reasoning": ("plain", True), "tools_in_first_user": ("plain", True),
    "system_in_last_user": ("none", False), "last_turn_marker": ("none", False),
}
TOOLS = [{"type": "function", "function": {"name": "grep", "description": "Search.",
                                           "parameters": {"type": "object", "properties": {}}}}]
WORDS = ["the", " gateway", "naïve", "東京", "  ", "\n", "\t", "x=1;", "🙂", "KV-cache", "'q'", "<|", "|>", "12"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalTokenizer]:
    out = {}
    for name in VERDICTS:
        directory = tmp_path_factory.mktemp(name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED_TOKENIZER_DIR / file, directory / file)
        shutil.copy(TEMPLATES / f"{name}.jinja", directory / "chat_template.jinja")
        out[name] = LocalTokenizer(HfTokenizer(directory), TokenizationConfig())
    return out


def test_each_template_is_probed_for_what_it_lets_reuse(tokenizers):
    for name, (verdict, plain) in VERDICTS.items():
        reuse = tokenizers[name].reuse
        assert reuse is not None
        assert (reuse.rich, reuse.plain) == (verdict == "rich", plain), name


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(n))


def turn(rng: random.Random, rich: bool, step: int) -> list[dict[str, Any]]:
    """What an agent adds between two requests: its answer (maybe a tool call, maybe with reasoning), then
    a tool result or a user message."""
    answer: dict[str, Any] = {"role": "assistant", "content": text(rng, rng.randint(0, 12))}
    if rich and rng.random() < 0.5:
        answer["reasoning"] = text(rng, 8)
    if rich and rng.random() < 0.5:
        answer["content"] = ""
        answer["tool_calls"] = [{"id": f"c{step}", "type": "function",
                                 "function": {"name": "grep", "arguments": '{"q": "x"}'}}]
        return [answer, {"role": "tool", "tool_call_id": f"c{step}", "content": text(rng, rng.randint(1, 30))}]
    user = {"role": "user", "content": text(rng, rng.randint(1, 20))}
    if rng.random() < 0.2:
        user["content"] = [{"type": "text", "text": text(rng, 5)}, {"type": "text", "text": text(rng, 5)}]
    return [answer, user]


@pytest.mark.parametrize("name", sorted(VERDICTS))
async def test_every_turn_tokenizes_exactly_as_a_whole_render(tokenizers, name):
    local = tokenizers[name]
    rng = random.Random(name)
    reused = 0
    for conversation in range(12):
        rich = conversation % 2 == 1
        tools = TOOLS if rich and conversation % 4 == 1 else None
        messages: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 20)}] if rng.random() < 0.7 else []
        messages.append({"role": "user", "content": text(rng, 15)})
        for step in range(6):
            request = InferenceRequest(model="m", messages=messages)
            tokens = await local.chat(messages, request, tools)
            whole = local.tokenizer.encode(local.tokenizer.render_chat(messages, tools=tools),
                                           add_special_tokens=False)
            assert list(tokens.ids) == whole, (name, conversation, step)
            reused += tokens.earlier is not None
            local.remember(tokens, PromptHashes(1, tokens.ids))
            messages = messages + turn(rng, rich, step)
    verdict = VERDICTS[name][0]
    if verdict == "none":
        assert reused == 0
    else:
        assert reused >= (60 if verdict == "rich" else 25)  # most turns after a conversation's first


async def test_a_conversation_edited_in_the_middle_is_tokenized_whole(tokenizers):
    local = tokenizers["message_local"]
    messages = [{"role": "user", "content": "one"}]
    first = await local.chat(messages, InferenceRequest(model="m", messages=messages), None)
    local.remember(first, PromptHashes(1, first.ids))
    edited = [{"role": "user", "content": "one, edited"}, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "two"}]
    again = await local.chat(edited, InferenceRequest(model="m", messages=edited), None)
    assert again.earlier is None  # the fingerprints differ from the first message on
    grown = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "two"}]
    later = await local.chat(grown, InferenceRequest(model="m", messages=grown), None)
    assert later.earlier is not None and later.earlier.messages == 1
    assert later.ids[: later.earlier.length] == later.earlier.ids[: later.earlier.length]


def test_the_memory_is_bounded_by_tokens_and_finds_the_longest_earlier_prompt():
    memory = ConversationMemory(max_tokens=90)
    prints = fingerprints([{"role": "user", "content": str(i)} for i in range(4)], None)
    memory.remember(RememberedPrompt(prints[0], 1, array("I", [1] * 40), 35, PromptHashes(1, [])))
    memory.remember(RememberedPrompt(prints[1], 2, array("I", [1] * 50), 45, PromptHashes(1, [])))
    found = memory.longest(prints)
    assert found is not None and found.messages == 2
    assert memory.longest(prints[:2]) is not None and memory.longest(prints[:2]).messages == 1  # not itself
    memory.remember(RememberedPrompt(prints[2], 3, array("I", [1] * 60), 55, PromptHashes(1, [])))
    assert len(memory) == 1 and memory.longest(prints).messages == 3  # the least recently used went


def test_a_conversation_holds_one_prompt_in_the_memory():
    memory = ConversationMemory(max_tokens=10_000)
    prints = fingerprints([{"role": "user", "content": str(i)} for i in range(3)], None)
    first = RememberedPrompt(prints[0], 1, array("I", [1] * 40), 35, PromptHashes(1, []))
    memory.remember(first)
    other = RememberedPrompt(prints[1] + 1, 2, array("I", [2] * 40), 35, PromptHashes(1, []))
    memory.remember(other)  # another conversation
    memory.remember(RememberedPrompt(prints[1], 2, array("I", [1] * 50), 45, PromptHashes(1, [])), supersedes=first)
    assert len(memory) == 2 and memory.longest(prints[:2]) is None  # the first turn was let go
    assert memory.longest(prints).messages == 2
