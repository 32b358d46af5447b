"""A model's local tokenizer: its caches (segments, completion prompts, conversations) and the threads long
new text is tokenized on, and what it makes of a prompt (:class:`Tokens`).

Owner: each :class:`LocalTokenizer` owns its caches; the
:class:`~gateway.tokenization.tokenizers.TokenizationService` owns the local tokenizers, one a model.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from gateway.config import TokenizationConfig
from gateway.core.inference_api import InferenceRequest
from gateway.kv.hashing import PromptHashes
from gateway.lru import LruCache
from gateway.tokenization.hf import HfTokenizer
from gateway.tokenization.reuse import ConversationMemory, RememberedPrompt, Splitter, TemplateReuse, fingerprints
from gateway.tokenization.segments import SegmentEncoder

log = logging.getLogger("gateway.tokenization")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Tokens:
    """A prompt's token ids, and what they reused: the conversation's earlier prompt whose ids they
    begin with (None: tokenized whole)."""

    ids: Sequence[int]  # a packed array for chat prompts (cheap to extend and to copy), else a list
    earlier: RememberedPrompt | None = None
    # Local chat prompts only: where to remember this prompt for the conversation's next turn.
    fingerprint: int | None = None
    messages: int = 0
    # What is left to tokenize after ``ids`` (:meth:`LocalTokenizer.finish`): a next turn's new messages as
    # the template renders them after its earlier prompt, or a prompt's pieces after its head (laid out).
    rest: str | list[str | int] | None = None

    def rest_bytes(self) -> int:
        """The UTF-8 bytes of what is left (an added token: one)."""
        if isinstance(self.rest, str):
            return len(self.rest.encode())
        return sum(len(item.encode()) if isinstance(item, str) else 1 for item in self.rest or ())


# Whether no pod can hold a prompt past these of its ids (its tokens after them cannot add to any match).
PastEveryMatch = Callable[[Sequence[int]], bool]


# A template renders in about 20 µs plus 3.5 µs a message, whatever their length, and the hop to a
# thread and back costs about 100 µs: only a conversation longer than this renders off the loop.
_RENDER_ON_LOOP_MESSAGES = 32


class LocalTokenizer:
    """A model's local tokenizer, its caches (segments, completion prompts, conversations) and the
    threads long new text is tokenized on."""

    def __init__(self, tokenizer: HfTokenizer, config: TokenizationConfig, executor: Executor | None = None,
                 threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.segments = SegmentEncoder(tokenizer, config.segment_cache_size, config.piece_chars)
        if not self.segments.self_check():
            log.warning("tokenizer %s: segments do not tokenize independently; encoding prompts whole",
                        tokenizer.path)
        self._prompts: LruCache[str, list[int]] = LruCache(config.prompt_cache_size)
        self._offload_chars = config.offload_chars
        self._defer_max_chars = config.defer_max_chars
        self._executor = executor
        self._threads = threads
        self.reuse = TemplateReuse(tokenizer.render_chat, Splitter(self.segments.split)) if self.segments.exact \
            else None
        self.memory = ConversationMemory(config.reuse_tokens)
        generation = self.reuse.generation_prompt if self.reuse is not None else None
        self._generation_ids = self.segments.encode(generation) if generation else array("I")
        if self.reuse is not None and not self.reuse.plain:
            log.info("tokenizer %s: its chat template re-renders earlier turns; conversations are tokenized "
                     "whole each turn", tokenizer.path)

    async def _off_loop(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def chat(self, messages: list[dict[str, Any]], req: InferenceRequest,
                   tools: list[dict[str, Any]] | None, prefix: Sequence[int] = (),
                   past_every_match: PastEveryMatch | None = None) -> Tokens:
        """A conversation's prompt, after ``prefix`` (the special tokens vLLM puts before a Responses
        prompt; a conversation's next turn reuses only an earlier prompt with the same prefix).
        With ``past_every_match``, new text up to ``defer_max_chars`` may be left to :meth:`finish`: a next
        turn's new messages (rendered), or what follows the first new piece past which no pod holds a
        prompt tokenized from its first message."""
        render = {"add_generation_prompt": req.add_generation_prompt if req.add_generation_prompt is not None else True,
                  "continue_final_message": bool(req.continue_final_message), "tools": tools,
                  "chat_template_kwargs": req.chat_template_kwargs}
        reuse = self.reuse
        if reuse is None or not reuse.plain or render["continue_final_message"]:
            ids, rest = await self._whole(messages, render, prefix, past_every_match)
            return Tokens(ids, rest=rest)
        prints = fingerprints(messages, [tools, req.chat_template_kwargs, render["add_generation_prompt"],
                                         *([tuple(prefix)] if prefix else [])])
        earlier = self.memory.longest(prints) if reuse.allows(messages, tools) else None
        if earlier is not None:
            tail = reuse.tail(messages[earlier.messages - 1], messages[earlier.messages:], **render)
            if tail is not None:
                ids = earlier.ids[: earlier.length]  # one copy, grown in place (a 100k-token prompt is 400 kB)
                if past_every_match is not None and len(tail) <= self._defer_max_chars:
                    return Tokens(ids, earlier, prints[-1], len(messages), tail)
                ids.extend(await self._encode(tail))
                return Tokens(ids, earlier, prints[-1], len(messages))
        ids, rest = await self._whole(messages, render, prefix, past_every_match)
        return Tokens(ids, None, prints[-1], len(messages), rest)

    def finish(self, tokens: Tokens) -> Tokens:
        """The whole prompt of one whose rest :meth:`chat` left out (at most ``defer_max_chars``: on the
        loop)."""
        rest = tokens.rest
        assert rest is not None
        ids = array("I", tokens.ids)  # a new array: the head may still be read where it was handed out
        ids.extend(self._encode_here(rest) if isinstance(rest, str) else self._encode_layout(rest))
        return replace(tokens, ids=ids, rest=None)

    def remember(self, tokens: Tokens, hashes: PromptHashes) -> None:
        """Remember a chat prompt (with its block hashes, once made) for the conversation's next turn."""
        generation, ids = self._generation_ids, tokens.ids
        if tokens.fingerprint is None or not isinstance(ids, array) or ids[len(ids) - len(generation):] != generation:
            return  # not a prompt this template ends as usual: the next turn renders whole
        self.memory.remember(RememberedPrompt(tokens.fingerprint, tokens.messages, ids, len(ids) - len(generation),
                                              hashes), supersedes=tokens.earlier)

    async def _whole(self, messages: list[dict[str, Any]], render: dict[str, Any], prefix: Sequence[int] = (),
                     past_every_match: PastEveryMatch | None = None) -> tuple[array[int], list[str | int] | None]:
        """A prompt rendered and tokenized from its first message (and what is left of it, with
        ``past_every_match``: :meth:`_head`): a long conversation's template on the tokenization threads,
        long new text too (:meth:`_encode`), the piece cache read and filled on the event loop (it is not
        shared)."""
        if len(messages) > _RENDER_ON_LOOP_MESSAGES:
            text = await self._off_loop(lambda: self.tokenizer.render_chat(messages, **render))
        else:
            text = self.tokenizer.render_chat(messages, **render)
        ids = array("I", prefix)
        if past_every_match is not None and self.segments.exact:
            layout = self.segments.layout(text)
            head = self._head(layout, prefix, past_every_match)
            if head is not None:
                return head
            ids.extend(await self._encode_laid_out(layout))  # laid out once, whether or not it stopped early
        else:
            ids.extend(await self._encode(text))
        return ids, None

    def _head(self, layout: list[str | int], prefix: Sequence[int], past_every_match: PastEveryMatch
              ) -> tuple[array[int], list[str | int]] | None:
        """A laid-out prompt's ids as far as its first new piece past which no pod holds it, and the layout
        left. None where no such piece comes within ``offload_chars`` of new text (what was tokenized looking
        for it stays cached), or more than ``defer_max_chars`` of it would be left."""
        new = self.segments.uncached(layout)
        total = sum(map(len, new))
        if not new or total > self._offload_chars + self._defer_max_chars:
            return None
        fresh, spent = set(new), 0
        ids = array("I", prefix)
        for at, item in enumerate(layout):
            if isinstance(item, int):
                ids.append(item)
                continue
            ids.extend(self.segments.piece(item))
            if item not in fresh:
                continue
            spent += len(item)
            if spent > self._offload_chars:
                return None
            if at + 1 < len(layout) and total - spent <= self._defer_max_chars and past_every_match(ids):
                return ids, layout[at + 1:]
        return None

    async def _encode(self, text: str) -> array[int]:
        if len(text) <= self._offload_chars:
            return self._encode_here(text)
        if not self.segments.exact:
            return array("I", await self._off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=False)))
        return await self._encode_laid_out(self.segments.layout(text))

    async def _encode_laid_out(self, layout: list[str | int]) -> array[int]:
        """A laid-out text's ids, its new pieces on the tokenization threads where they pass ``offload_chars``."""
        new = self.segments.uncached(layout)
        if sum(map(len, new)) > self._offload_chars:
            self._remember_pieces(new, await self._encode_spread(new))
        return self._encode_layout(layout)

    def _encode_here(self, text: str) -> array[int]:
        """Text tokenized on the calling thread."""
        if not self.segments.exact:
            return array("I", self.tokenizer.encode(text, add_special_tokens=False))
        return self._encode_layout(self.segments.layout(text))

    def _encode_layout(self, layout: list[str | int]) -> array[int]:
        """A laid-out text's ids, what the piece cache lacks in one call (a next turn's answer and question:
        two pieces, one call)."""
        new = self.segments.uncached(layout)
        if new:
            self._remember_pieces(new, self.tokenizer.encode_pieces(new))
        return self.segments.encode(layout)

    def _remember_pieces(self, pieces: list[str], encoded: list[list[int]]) -> None:
        for piece, ids in zip(pieces, encoded, strict=True):
            self.segments.remember(piece, ids)

    async def _encode_spread(self, texts: list[str]) -> list[list[int]]:
        """New segments grouped over the tokenization threads, about as many characters each: a prompt of
        many new messages is tokenized by every core rather than one (so is one long segment, where the tokenizer
        allows it to be cut into pieces)."""
        shares = self._threads
        size = -(-sum(map(len, texts)) // shares)
        groups: list[list[str]] = [[]]
        filled = 0
        for text in texts:
            if filled >= size and len(groups) < shares:
                groups.append([])
                filled = 0
            groups[-1].append(text)
            filled += len(text)
        done = await asyncio.gather(*(self._off_loop(lambda g=g: self.tokenizer.encode_pieces(g)) for g in groups))
        return [ids for group in done for ids in group]

    async def prompt(self, prompt: str) -> list[int]:
        ids = self._prompts.touch(prompt)
        if ids is None:
            if len(prompt) > self._offload_chars:
                ids = await self._off_loop(lambda: self.tokenizer.encode(prompt))
            else:
                ids = self.tokenizer.encode(prompt)
            self._prompts.put(prompt, ids)
        return ids
