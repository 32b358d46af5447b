"""Tokenizing only what is new: the next turn of a conversation reuses the token ids of the last.

An agent re-sends its whole conversation every turn, and only the last few hundred tokens are new. When a
request's messages begin with the messages of an earlier request (found by a rolling fingerprint of the
messages and of everything else that shapes the rendering: tools, template arguments), its token ids are
the earlier ones, without their generation prompt, followed by the tokens of the new messages rendered
*after the last earlier one*: the template renders ``[anchor] + new`` and the anchor's own rendering is
cut off the front. That is exact only for templates that render each message from itself and its
predecessor, and only when the cut falls between added tokens (segments tokenize independently there:
:mod:`gateway.tokenization.segments`):

- each template is probed once (:class:`TemplateReuse`) on conversations with a system prompt, tool
  calls and results, reasoning and tools, at every split; a template that renders an earlier turn
  differently once more follow (one that drops past reasoning, or moves the system prompt to the last user
  turn) is reused only for the plain conversations it passed, or not at all;
- every reuse checks that the anchor renders alone as it does in front of the new messages, that the cut
  falls on an added token, and that the prompt ends with the template's generation prompt;

anything else takes the full path. Owner: a :class:`ConversationMemory` owns the remembered prompts, an
LRU bounded by their tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from gateway.kv.hashing import PromptHashes
from gateway.lru import WeightedLru

_encode = msgspec.msgpack.Encoder().encode
_hash = xxhash.xxh3_64_intdigest


def fingerprints(messages: Sequence[dict[str, Any]], shape: Any) -> list[int]:
    """``out[k]``: a fingerprint of the first ``k + 1`` messages and of ``shape`` (whatever else changes the
    rendering), each chained onto the one before."""
    out = []
    parent = _hash(_encode(shape))
    for message in messages:
        parent = _hash(_encode(message), parent)
        out.append(parent)
    return out


@dataclass(slots=True)
class RememberedPrompt:
    """A conversation's prompt as its next turn may reuse it."""

    fingerprint: int  # of its messages (its key in the memory)
    messages: int  # how many messages it rendered
    ids: array[int]  # the whole prompt that was routed: the messages' token ids, then the generation prompt
    length: int  # of those, the messages' (the ids a next turn begins with)
    hashes: PromptHashes  # the block hashes of the whole prompt (filled as it was looked up)

    @property
    def tokens(self) -> int:
        """The whole prompt's length."""
        return len(self.ids)


def _tokens_of(prompt: RememberedPrompt) -> int:
    return prompt.tokens


class ConversationMemory:
    """Remembered prompts by the fingerprint of their messages; the least recently used go first once
    they hold more than ``max_tokens`` token ids in all."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        # The newest stays whatever its size: a conversation longer than the bound still has its last prompt.
        self._prompts: WeightedLru[int, RememberedPrompt] = WeightedLru(max_tokens, _tokens_of, keep_newest=True)

    def longest(self, prints: list[int]) -> RememberedPrompt | None:
        """The remembered prompt of the most leading messages, fewer than all of them (the request's own
        last message is new by definition of a next turn)."""
        for k in range(len(prints) - 2, -1, -1):
            found = self._prompts.get(prints[k])
            if found is not None and found.messages == k + 1:
                return self._prompts.touch(prints[k])
        return None

    def remember(self, prompt: RememberedPrompt, supersedes: RememberedPrompt | None = None) -> None:
        """Remember ``prompt``; the earlier prompt it was built on is forgotten: the conversation has moved
        on (a retry or a fork of that earlier turn is tokenized whole once), and each conversation then
        holds one prompt, not one per turn."""
        if supersedes is not None and self._prompts.get(supersedes.fingerprint) is supersedes:
            self._prompts.pop(supersedes.fingerprint)
        self._prompts.put(prompt.fingerprint, prompt)

    def __len__(self) -> int:
        return len(self._prompts)


class Splitter:
    """What :class:`TemplateReuse` needs of the segment encoder: where added tokens are."""

    def __init__(self, split: Callable[[str], list[str]]) -> None:
        self._split = split

    def ends_on_added_token(self, text: str) -> bool:
        pieces = self._split(text)
        return len(pieces) > 1 and pieces[-1] == ""


# Conversations that exercise what per-message rendering could get wrong: a system prompt, several
# turns, tool calls and their results, reasoning, text parts, whitespace at the edges.
_PLAIN = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Plan the change.\n"},
    {"role": "assistant", "content": " First, read the file."},
    {"role": "user", "content": [{"type": "text", "text": "Here it is:"}, {"type": "text", "text": "x = 1"}]},
    {"role": "assistant", "content": "Done."},
    {"role": "user", "content": "Thanks!  "},
]
_RICH = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the test."},
    {"role": "assistant", "content": "", "reasoning": "The test reads a file first.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "read", "arguments": "{\"path\": \"a.py\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "def f(): return 1"},
    {"role": "assistant", "content": "It returns 1.", "reasoning": "Now edit it."},
    {"role": "user", "content": "Go on."},
]
_TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                            "parameters": {"type": "object",
                                                           "properties": {"path": {"type": "string"}}}}}]


def is_plain(messages: Sequence[dict[str, Any]]) -> bool:
    """System, user and assistant messages of text alone (no tool calls or results, no reasoning)."""
    return all(m.get("role") in ("system", "user", "assistant") and not m.get("tool_calls")
               and not m.get("reasoning") and not m.get("reasoning_content") for m in messages)


class TemplateReuse:
    """Which conversations a template lets the next turn extend rather than render again: every one
    (``rich``), plain ones only, or none; and its generation prompt (the text ``add_generation_prompt``
    appends). Probed once, on the template as the gateway renders it."""

    def __init__(self, render: Callable[..., str], splitter: Splitter) -> None:
        self._render = render
        self._splitter = splitter
        self.generation_prompt: str | None = None
        self.rich = self._passes(_RICH, _TOOLS) and self._passes(_RICH, None)
        self.plain = self.rich or self._passes(_PLAIN, None)

    def allows(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        return self.rich or (self.plain and tools is None and is_plain(messages))

    def _passes(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        """Every split of every prefix of the conversation renders as its head and its anchored tail, cut
        on an added token, and the generation prompt is the same suffix each time, on an added token."""
        try:
            for end in range(2, len(conversation) + 1):
                messages = conversation[:end]
                whole = self._render(messages, add_generation_prompt=True, tools=tools)
                bare = self._render(messages, add_generation_prompt=False, tools=tools)
                generation = whole[len(bare):]
                if not whole.startswith(bare) or not self._splitter.ends_on_added_token(bare) or \
                        self.generation_prompt not in (None, generation):
                    return False
                self.generation_prompt = generation
                for k in range(1, end):
                    head = self._render(messages[:k], add_generation_prompt=False, tools=tools)
                    tail = self.tail(messages[k - 1], messages[k:], tools=tools, add_generation_prompt=True)
                    if tail is None or head + tail != whole or not self._splitter.ends_on_added_token(head):
                        return False
        except Exception:  # a template that refuses a probe (no system role, strict alternation): no reuse
            return False
        return True

    def tail(self, anchor: dict[str, Any], new: Sequence[dict[str, Any]], **render: Any) -> str | None:
        """The text the ``new`` messages add after ``anchor``, or None when the anchor does not render
        alone as it does in front of them (``render``: the template's arguments)."""
        alone = self._render([anchor], **{**render, "add_generation_prompt": False})
        together = self._render([anchor, *new], **render)
        return together[len(alone):] if together.startswith(alone) else None
