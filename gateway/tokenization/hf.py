"""A Hugging Face tokenizer loaded from a local directory, used as vLLM uses it.

vLLM renders chat requests with the model's chat template (``add_generation_prompt=True`` by default)
and tokenizes the rendered text *without* adding special tokens (the template carries BOS); plain
completion prompts are tokenized *with* special tokens. Getting either wrong shifts every block.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from gateway.tokenization.conversation import normalize_messages
from gateway.tokenization.fast_bpe import ByteLevelBpe, UnsupportedTokenizer, agrees, sequence_steps

log = logging.getLogger("gateway.tokenization")

# The tokenizer shipped with the package (a small Llama-style BPE): the simulated pods' model and the
# benchmark's, so tests and the demo never reach a model hub (built by simulator.build_tokenizer).
BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parent / "bundled"

# Message keys transformers rewrites before rendering (it copies a model's reasoning under all three names): a
# conversation with one of them takes transformers' own path.
_REASONING_KEYS = frozenset({"reasoning_content", "thinking", "reasoning"})

# Conversations on which the direct render must match transformers' before it is used: roles, whitespace,
# unicode, a tool call, tools, and an empty content.
_RENDER_PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "naïve — 東京 ✓ 12 x=y"},
      {"role": "assistant", "content": ""}, {"role": "user", "content": "Go on.  "}], None),
    ([{"role": "user", "content": "Read a.py"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"a.py\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}],
     [{"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
         "type": "object", "properties": {"path": {"type": "string"}}}}}]),
]

# Normalizers that map each character by itself (or with the marks that follow it), so a cut before a
# space changes nothing they do.
_PER_CHARACTER_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})


def _renders_as_given(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether transformers would hand the template these messages and tools as they are: message dicts with no
    None value (it drops those keys) and no reasoning (it copies that under other names), tool schemas as dicts."""
    return all(type(m) is dict and None not in m.values() and _REASONING_KEYS.isdisjoint(m) for m in messages) \
        and (tools is None or all(type(t) is dict for t in tools))


def _component_spec(component: Any) -> dict[str, Any]:
    """A tokenizer component's JSON (its pickled state), without serializing the whole tokenizer and its
    vocabulary; {} when there is none."""
    return json.loads(component.__getstate__()) if component is not None else {}


class HfTokenizer:
    def __init__(self, path: str | Path, *, fast_bpe: bool = False) -> None:
        """``fast_bpe``: encode text between added tokens through tiktoken where it computes the same ids
        (:mod:`gateway.tokenization.fast_bpe`); the simulated pods leave it off, tokenizing as vLLM does."""
        # Never reach a model hub: tokenizers come from local directories only.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # The gateway's threads are its parallelism; the tokenizer's own thread pool would only fight them.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer  # heavy import, paid only by who tokenizes

        self.path = str(path)
        self._tok = AutoTokenizer.from_pretrained(self.path)
        # The Rust tokenizer underneath, called directly: the same ids without transformers' per-call
        # overhead (which dominates for the short segments that routing tokenizes).
        self._backend = getattr(self._tok, "backend_tokenizer", None)
        # Its batch call without character offsets (``encode_batch_fast``, tokenizers >= 0.21) where it has
        # one: the offsets are a third of the work, and routing needs the ids alone.
        self._encode_batch = getattr(self._backend, "encode_batch_fast", None) or getattr(
            self._backend, "encode_batch", None)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self._render_globals: dict[str, Any] = {}  # the compiled template's globals and the special tokens
        self._template = self._direct_template()
        self._fast = self._fast_bpe() if fast_bpe else None

    def __len__(self) -> int:
        return len(self._tok)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        messages = normalize_messages(messages)
        if self._template is not None and chat_template is None and not continue_final_message \
                and not chat_template_kwargs and _renders_as_given(messages, tools):
            with contextlib.suppress(Exception):  # a template's own refusal: transformers' path raises it
                return self._render_compiled(self._template, messages, tools, add_generation_prompt)
        return self._transformers_render(messages, add_generation_prompt, continue_final_message, tools,
                                         chat_template, chat_template_kwargs)

    def _transformers_render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                             continue_final_message: bool, tools: list[dict[str, Any]] | None,
                             chat_template: str | None, chat_template_kwargs: dict[str, Any] | None) -> str:
        return self._tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )

    def _render_compiled(self, template: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         add_generation_prompt: bool) -> str:
        """What ``render_jinja_template`` hands the compiled template, for what it would pass on unchanged. As
        ``Template.render`` does, but on the template's globals merged once (``render`` reads them through a
        ``ChainMap`` each call: half of what a next turn's small render cost)."""
        context = template.new_context({**self._render_globals, "messages": messages, "tools": tools,
                                        "documents": None, "add_generation_prompt": add_generation_prompt},
                                       shared=True)
        return template.environment.concat(template.root_render_func(context))

    def _direct_template(self) -> Any:
        """The model's chat template compiled as transformers compiles it, to render plain conversations
        without ``apply_chat_template``'s per-call copying and checks (a next turn's two small renders cost
        a third as much); None when the template is not one string, or renders any probe otherwise."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
            if not isinstance(self._tok.chat_template, str):
                return None
            template = _compile_jinja_template(self._tok.chat_template)
            self._render_globals = {**template.globals, **self._tok.special_tokens_map}
        except Exception:  # no template, or transformers moved its compiler: render through transformers
            return None
        for messages, tools in _RENDER_PROBES:
            for generation in (True, False):
                try:
                    expected = self._transformers_render(messages, generation, False, tools, None, None)
                except Exception:  # a template that refuses a probe proves nothing either way
                    continue
                try:
                    rendered = self._render_compiled(template, messages, tools, generation)
                except Exception:
                    rendered = None
                if rendered != expected:
                    log.warning("tokenizer %s: its chat template renders differently outside transformers; "
                                "rendering through transformers", self.path)
                    return None
        return template

    def _fast_bpe(self) -> ByteLevelBpe | None:
        """The tiktoken encoder for this tokenizer, where it gives the Rust tokenizer's ids; else None, and why."""
        if self._encode_batch is None:
            return None
        spec = json.loads(self._backend.to_str())
        try:
            fast = ByteLevelBpe(spec, name=self.path)
        except UnsupportedTokenizer as unsupported:
            log.info("tokenizer %s: encoded by the Rust tokenizer (tiktoken cannot take its %s)", self.path,
                     unsupported)
            return None
        except Exception:  # a pattern tiktoken's regex engine refuses, a vocabulary it cannot load
            log.warning("tokenizer %s: tiktoken refused it; encoded by the Rust tokenizer", self.path, exc_info=True)
            return None
        if not agrees(fast, self._rust_pieces, spec):
            log.warning("tokenizer %s: tiktoken's ids differ on probes; encoded by the Rust tokenizer", self.path)
            return None
        log.info("tokenizer %s: text between added tokens encoded through tiktoken", self.path)
        return fast

    @property
    def fast_bpe(self) -> bool:
        """Whether text between added tokens is encoded through tiktoken."""
        return self._fast is not None

    @cached_property
    def system_first(self) -> bool:
        """Whether the chat template refuses a system message after the first, as vLLM probes it (then a
        Messages request's inline system messages join the leading one)."""
        probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
        try:
            self.render_chat(probe, add_generation_prompt=False)
        except Exception:  # the template's own guard (e.g. ``raise_exception`` unless loop.first)
            return True
        return False

    def encode_chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False, **kwargs: Any
                    ) -> list[int]:
        """A conversation's prompt ids. vLLM adds the tokenizer's special tokens to the rendered template
        for the Responses API only (``add_special_tokens``), not for chat completions."""
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=add_special_tokens)

    @cached_property
    def special_prefix(self) -> tuple[int, ...] | None:
        """The tokens the tokenizer adds before a text with its special tokens (Llama: BOS), or None
        when it adds any after it too (then they are not a prefix that can be put before a prompt)."""
        plain = self.encode("a", add_special_tokens=False)
        full = self.encode("a", add_special_tokens=True)
        if full[len(full) - len(plain):] != plain:
            return None
        return tuple(full[: len(full) - len(plain)])

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self._encode_batch is not None:
            # The batch call releases the GIL while it works and encode does not (bench/scripts/tokenize_threads.py):
            # long new text tokenized in a worker thread then really runs beside the event loop.
            return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """Texts with no added token in them (what lies between a rendered prompt's added tokens), without
        special tokens: through tiktoken where it agrees, else in one call into the Rust tokenizer (either
        releases the GIL)."""
        return self._fast.encode_many(texts) if self._fast is not None else self._rust_pieces(texts)

    def _rust_pieces(self, texts: list[str]) -> list[list[int]]:
        if self._encode_batch is not None:
            return [e.ids for e in self._encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t, add_special_tokens=False) for t in texts]

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def added_tokens(self) -> dict[str, int]:
        """Tokens matched before the model's own tokenization runs (specials, chat markers)."""
        return {t.content: i for i, t in self._tok.added_tokens_decoder.items()}

    def cuts_at_spaces(self) -> bool:
        """Whether text cut before a space that follows a non-space tokenizes piece by piece as it does
        whole. True of byte-level BPE tokenizers whose pre-tokenizer splits by a regex (GPT-2's, Llama 3's,
        Qwen's, o200k's): no pre-token there spans a non-space and the space after it, none of their
        patterns looks behind, and greedy runs stop at the space. Not of SentencePiece-style ones
        (``Metaspace``, a prepended space), nor behind a normalizer that does more than map characters.
        :class:`~gateway.tokenization.segments.SegmentEncoder` checks the claim on probes before it relies on it."""
        if self._backend is None:
            return False
        normalizers = sequence_steps(_component_spec(self._backend.normalizer), "normalizers")
        if any(n.get("type") not in _PER_CHARACTER_NORMALIZERS for n in normalizers):
            return False
        regex_split = False
        for step in sequence_steps(_component_spec(self._backend.pre_tokenizer), "pretokenizers"):
            kind = step.get("type")
            if kind == "ByteLevel" and not step.get("add_prefix_space"):
                regex_split = regex_split or bool(step.get("use_regex"))
            elif kind == "Split" and "Regex" in (step.get("pattern") or {}) and step.get("behavior") == "Isolated" \
                    and not step.get("invert"):
                regex_split = True
            elif kind != "Digits":
                return False
        return regex_split

    def added_tokens_split_cleanly(self) -> bool:
        """Whether no added token eats neighbouring whitespace or needs word boundaries, so the text
        between added tokens tokenizes independently of what surrounds it."""
        return not any(t.lstrip or t.rstrip or t.single_word or t.normalized
                       for t in self._tok.added_tokens_decoder.values())
