"""Token ids for routing, per model: local (HF tokenizer, cached by segment) or remote (a pod's
``/tokenize``), with the outcome of every attempt counted.

Owner: the :class:`TokenizationService` owns the loaded tokenizers and their caches. It never raises
into the request path: when tokens cannot be had it returns ``None`` and routing falls back to the
approximate (text) prefix match, which the metrics and a one-time log line make visible.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from gateway.backends.registry import PodRegistry
from gateway.config import TokenizationConfig
from gateway.core.requests import InferenceRequest
from gateway.http_client import HttpClient
from gateway.load.ledger import InFlightLedger
from gateway.lru import LruCache
from gateway.metrics import GatewayMetrics
from gateway.tokenization.anthropic import NotRenderable
from gateway.tokenization.conversation import CHAT_KINDS, chat_messages, chat_tools
from gateway.tokenization.hf import HfTokenizer
from gateway.tokenization.segments import SegmentEncoder

log = logging.getLogger("gateway.tokenization")


class LocalTokenizer:
    def __init__(self, tokenizer: HfTokenizer, config: TokenizationConfig) -> None:
        self.tokenizer = tokenizer
        self.segments = SegmentEncoder(tokenizer, config.segment_cache_size)
        if not self.segments.self_check():
            log.warning("tokenizer %s: segments do not tokenize independently; encoding prompts whole",
                        tokenizer.path)
        self._prompts: LruCache[str, list[int]] = LruCache(config.prompt_cache_size)
        self._offload_chars = config.offload_chars

    async def chat(self, messages: list[dict[str, Any]], req: InferenceRequest,
                   tools: list[dict[str, Any]] | None) -> list[int]:
        text = self.tokenizer.render_chat(
            messages,
            add_generation_prompt=req.add_generation_prompt if req.add_generation_prompt is not None else True,
            continue_final_message=bool(req.continue_final_message),
            tools=tools,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        if not self.segments.exact:
            if len(text) > self._offload_chars:
                return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        pieces = self.segments.split(text)
        new = self.segments.uncached(pieces)
        if sum(map(len, new)) > self._offload_chars:
            encoded = await asyncio.to_thread(
                lambda: [self.tokenizer.encode(p, add_special_tokens=False) for p in new]
            )
            for piece, ids in zip(new, encoded, strict=True):
                self.segments.remember(piece, ids)
        return self.segments.encode(pieces)

    async def prompt(self, prompt: str) -> list[int]:
        ids = self._prompts.touch(prompt)
        if ids is None:
            if len(prompt) > self._offload_chars:
                ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
            else:
                ids = self.tokenizer.encode(prompt)
            self._prompts.put(prompt, ids)
        return ids


class TokenizationService:
    def __init__(self, config: TokenizationConfig, pods: PodRegistry, metrics: GatewayMetrics,
                 http: HttpClient, ledger: InFlightLedger) -> None:
        self._config = config
        self._pods = pods
        self._metrics = metrics
        self._local: dict[str, LocalTokenizer] = {}
        self._warned: set[str] = set()
        self._remote_timeout = aiohttp.ClientTimeout(total=config.remote_timeout_s)
        self._http = http
        self._ledger = ledger

    def load(self) -> None:
        """Load every configured local tokenizer (slow: call from a worker thread at start-up)."""
        for model, cfg in self._config.models.items():
            if cfg.mode == "local" and cfg.path:
                self._local[model] = LocalTokenizer(HfTokenizer(cfg.path), self._config)
                log.info("model %s: local tokenizer from %s", model, cfg.path)

    def local(self, model: str) -> LocalTokenizer | None:
        return self._local.get(model)

    def mode_of(self, model: str) -> str:
        cfg = self._config.models.get(model)
        return cfg.mode if cfg else self._config.default_mode

    def has_local(self, model: str) -> bool:
        base = self._pods.base_model(model)
        return base in self._local and self.mode_of(base) == "local"

    async def tokenize(self, model: str, kind: str, req: InferenceRequest, *, avoid_local: bool = False
                       ) -> list[int] | None:
        """The prompt's token ids, or None. ``avoid_local``: ask a pod even if a local tokenizer is
        configured (its predictions drift from the engines')."""
        base = self._pods.base_model(model)
        mode = self.mode_of(base)
        started = time.perf_counter()
        try:
            if mode == "local" and base in self._local and not avoid_local:
                ids = await self._local_tokens(self._local[base], kind, req)
            elif mode in ("local", "remote"):
                mode = "remote"
                ids = await self._remote_tokens(model, kind, req)
            else:
                ids = None
                self._warn_once(base, "no tokenizer is configured for it")
        except _NotTokenizable as exc:
            self._metrics.tokenization_done(base, mode, exc.outcome, None)
            return None
        self._metrics.tokenization_done(base, mode, "ok" if ids is not None else "unavailable",
                                        time.perf_counter() - started)
        return ids

    async def _local_tokens(self, local: LocalTokenizer, kind: str, req: InferenceRequest) -> list[int] | None:
        try:
            if kind in CHAT_KINDS:
                messages = chat_messages(kind, req, merge_inline_system=local.tokenizer.system_first)
                return await local.chat(messages, req, chat_tools(kind, req)) if messages else None
            prompt = first_prompt(req.prompt)
            if isinstance(prompt, str):
                return await local.prompt(prompt)
            return prompt
        except NotRenderable as exc:
            log.debug("not tokenized exactly: %s", exc)
            raise _NotTokenizable("not_renderable") from None
        except Exception as exc:  # a template that rejects the conversation: the pod will say why
            log.debug("local tokenization failed: %s", exc)
            raise _NotTokenizable("render_error") from None

    async def _remote_tokens(self, model: str, kind: str, req: InferenceRequest) -> list[int] | None:
        if kind in CHAT_KINDS:
            try:
                messages = self._remote_messages(kind, req)
            except NotRenderable:
                raise _NotTokenizable("not_renderable") from None
            if not messages:
                return None
            body: dict[str, Any] = {"model": model, "messages": messages,
                                    "add_generation_prompt": req.add_generation_prompt is not False}
            if (tools := chat_tools(kind, req)) is not None:
                body["tools"] = tools
            for key in ("chat_template_kwargs", "continue_final_message"):
                if getattr(req, key) is not None:
                    body[key] = getattr(req, key)
        else:
            prompt = first_prompt(req.prompt)
            if not isinstance(prompt, str):
                return prompt
            body = {"model": model, "prompt": prompt}
        pods = self._pods.candidates(model)
        if not pods or not self._http.started:
            raise _NotTokenizable("remote_unavailable")
        pod = min(pods, key=lambda p: self._ledger.on_pod(p.name))
        try:
            async with self._http.session.post(f"{pod.url}/tokenize", json=body, timeout=self._remote_timeout) as resp:
                if resp.status != 200:
                    raise _NotTokenizable(f"remote_http_{resp.status}")
                tokens = (await resp.json(content_type=None)).get("tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            raise _NotTokenizable("remote_error") from None
        if not isinstance(tokens, list):
            raise _NotTokenizable("remote_error")
        return tokens

    @staticmethod
    def _remote_messages(kind: str, req: InferenceRequest) -> list[dict[str, Any]] | None:
        """The conversation for a pod's ``/tokenize``. Whether the pod's template merges a Messages
        request's inline system messages is not known here: such a request is not tokenized remotely."""
        if kind == "messages" and any(m.get("role") == "system" for m in req.messages or ()):
            raise NotRenderable("inline system messages, with the pod's template unknown")
        return chat_messages(kind, req)

    def _warn_once(self, model: str, why: str) -> None:
        if model not in self._warned:
            self._warned.add(model)
            log.warning("model %s: %s; routing it by approximate (text) prefix instead", model, why)


class _NotTokenizable(Exception):
    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def first_prompt(prompt: Any) -> str | list[int] | None:
    """The prompt routing looks at: a batch of prompts is routed by its first."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if _token_ids(prompt):
            return prompt
        first = prompt[0]
        if isinstance(first, str) or (isinstance(first, list) and _token_ids(first)):
            return first
    return None


def _token_ids(values: list[Any]) -> bool:
    """Token ids the engine could accept (anything else is the engine's to reject, not ours to hash)."""
    return bool(values) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in values)
