"""Token ids for routing, per model: local (HF tokenizer, cached by segment) or remote (a pod's
``/tokenize``), with the outcome of every attempt counted.

Owner: the :class:`TokenizationService` owns the loaded tokenizers and their caches. It never raises
into the request path: when tokens cannot be had it returns ``None`` and routing falls back to the
approximate (text) prefix match, which the metrics and a one-time log line make visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from gateway.config import TokenizationConfig
from gateway.core.inference_api import InferenceRequest, RequestKind
from gateway.http_client import HttpClient
from gateway.kv.hashing import PromptHashes
from gateway.load.ledger import InFlightLedger
from gateway.loop_histogram import LoopHistogram
from gateway.metrics import Children, GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.tokenization import openai_responses
from gateway.tokenization.anthropic import NotRenderable
from gateway.tokenization.conversation import CHAT_KINDS, chat_messages, chat_tools
from gateway.tokenization.hf import HfTokenizer
from gateway.tokenization.local import LocalTokenizer, PastEveryMatch, Tokens

log = logging.getLogger("gateway.tokenization")

# How long a request waits for the local tokenizers still loading at start (a load takes 1-3 s, more on a
# loaded machine); a load that failed stops the gateway's start.
LOAD_WAIT_S = 60.0


# A pod that answers ``/tokenize`` with 404 or 405 has no such route (an engine without it, a proxy that does
# not pass it on): it is not asked again for this long (seen: one refused call more for every request), and an
# engine upgraded meanwhile is asked again after it.
NO_TOKENIZE_S = 300.0

class TokenizationMetrics:
    """Tokenization's families, on the gateway's registry (:meth:`GatewayMetrics.owned`). Producer:
    :class:`TokenizationService`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.attempts = Counter(
            "gateway_tokenization", "Tokenization attempts for routing, by model, mode and outcome",
            ["model", "mode", "outcome"], registry=registry,
        )
        self.prompt_tokens_reused = Counter(
            "gateway_prompt_tokens_reused", "Chat prompt tokens taken from the conversation's earlier turn "
            "(reused) or rendered and tokenized for this request (new)", ["model", "source"], registry=registry,
        )
        self.seconds = LoopHistogram(
            "gateway_tokenization_seconds", "Time to get a request's token ids", ["mode"],
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1), registry=registry,
        )
        # By the model's configured base name, mode and outcome: bounded sets.
        self.attempts_of, self.prompt_tokens_reused_of = Children(self.attempts), Children(self.prompt_tokens_reused)

    def done(self, model: str, mode: str, outcome: str, seconds: float | None) -> None:
        self.attempts_of(model, mode, outcome).inc()
        if seconds is not None:
            self.seconds.labels(mode).observe(seconds)


class TokenizationService:
    def __init__(self, config: TokenizationConfig, pods: PodRegistry, metrics: GatewayMetrics,
                 http: HttpClient, ledger: InFlightLedger) -> None:
        self._config = config
        self._pods = pods
        self._metrics = metrics
        self._families = metrics.owned(TokenizationMetrics)
        self._local: dict[str, LocalTokenizer] = {}
        self._warned: set[str] = set()
        self._remote_timeout = aiohttp.ClientTimeout(total=config.remote_timeout_s)
        self._http = http
        self._ledger = ledger
        # Long new text is tokenized here, beside the event loop (encode_batch releases the GIL).
        self._threads = config.threads or len(os.sched_getaffinity(0))
        self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="tokenize")
        self._loading: asyncio.Future[None] | None = None  # the local tokenizers' load, once started
        self._no_tokenize: dict[str, float] = {}  # pods without /tokenize: until when (monotonic) none is asked

    def load(self) -> None:
        """Load every configured local tokenizer (slow: call from a worker thread at start-up)."""
        for model, cfg in self._config.models.items():
            if cfg.mode == "local" and cfg.path:
                tokenizer = HfTokenizer(cfg.path, fast_bpe=self._config.fast_bpe)
                self._local[model] = LocalTokenizer(tokenizer, self._config, self._executor, self._threads)
                log.info("model %s: local tokenizer from %s", model, cfg.path)

    def start(self) -> None:
        """Begin loading the local tokenizers on a thread (1-3 s of a start, most of it importing
        transformers): the gateway listens meanwhile, a request that needs one waits for it."""
        self._loading = asyncio.ensure_future(asyncio.to_thread(self.load))

    async def loaded(self) -> None:
        """Once every local tokenizer is loaded; raises what stopped one from loading."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    @property
    def loading(self) -> bool:
        return self._loading is not None and not self._loading.done()

    async def stop(self) -> None:
        if self._loading is not None:
            await asyncio.gather(self._loading, return_exceptions=True)  # a thread cannot be stopped: it ends
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

    def local(self, model: str) -> LocalTokenizer | None:
        return self._local.get(model)

    def mode_of(self, model: str) -> str:
        cfg = self._config.models.get(model)
        return cfg.mode if cfg else self._config.default_mode

    def has_local(self, model: str) -> bool:
        base = self._pods.base_model(model)
        return base in self._local and self.mode_of(base) == "local"

    async def tokenize(self, model: str, kind: RequestKind, req: InferenceRequest, *, avoid_local: bool = False,
                       past_every_match: PastEveryMatch | None = None) -> Tokens | None:
        """The prompt's token ids, or None. ``avoid_local``: ask a pod even if a local tokenizer is
        configured (its predictions drift from the engines'). ``past_every_match``: a chat prompt may come back
        with new text left out (``rest``: :meth:`finish`), :meth:`LocalTokenizer.chat` says what."""
        base = self._pods.base_model(model)
        mode = self.mode_of(base)
        started = time.perf_counter()
        if mode == "local" and not avoid_local and self.loading:
            await self._wait_for_load()
        try:
            if mode == "local" and base in self._local and not avoid_local:
                tokens = await self._local_tokens(self._local[base], kind, req, past_every_match)
            elif mode in ("local", "remote"):
                mode = "remote"
                ids = await self._remote_tokens(model, kind, req)
                tokens = Tokens(ids) if ids is not None else None
            else:
                tokens = None
                self._warn_once(base, "no tokenizer is configured for it")
        except _NotTokenizable as exc:
            self._families.done(base, mode, exc.outcome, None)
            return None
        self._families.done(base, mode, "ok" if tokens is not None else "unavailable",
                                        time.perf_counter() - started)
        if tokens is not None and tokens.fingerprint is not None and tokens.rest is None:
            self._count_reuse(base, tokens)
        return tokens

    def finish(self, model: str, tokens: Tokens) -> Tokens:
        """The whole prompt of one :meth:`tokenize` left text out of."""
        base = self._pods.base_model(model)
        tokens = self._local[base].finish(tokens)
        if tokens.fingerprint is not None:
            self._count_reuse(base, tokens)
        return tokens

    def _count_reuse(self, base: str, tokens: Tokens) -> None:
        reused = tokens.earlier.length if tokens.earlier is not None else 0
        self._families.prompt_tokens_reused_of(base, "reused").inc(reused)
        self._families.prompt_tokens_reused_of(base, "new").inc(len(tokens.ids) - reused)

    async def _wait_for_load(self) -> None:
        """A request that arrived while the tokenizers load waits for them (they tokenize as its pod would;
        past the bound it is tokenized by a pod, whose ids are as exact, or routed by text)."""
        with contextlib.suppress(Exception):  # timed out; or failed, and then the start fails too
            async with asyncio.timeout(LOAD_WAIT_S):
                await self.loaded()

    def remember(self, model: str, tokens: Tokens, hashes: PromptHashes) -> None:
        """A chat prompt's block hashes exist: its conversation's next turn may build on it."""
        local = self._local.get(self._pods.base_model(model))
        if local is not None and tokens.fingerprint is not None:
            local.remember(tokens, hashes)

    async def _local_tokens(self, local: LocalTokenizer, kind: RequestKind, req: InferenceRequest,
                            past_every_match: PastEveryMatch | None = None) -> Tokens | None:
        try:
            if kind in CHAT_KINDS:
                messages = chat_messages(kind, req, merge_inline_system=local.tokenizer.system_first)
                if not messages:
                    return None
                return await local.chat(messages, req, chat_tools(kind, req), self._special_prefix(local, kind),
                                        past_every_match)
            prompt = first_prompt(req.prompt)
            if isinstance(prompt, str):
                return Tokens(await local.prompt(prompt))
            return Tokens(prompt) if prompt is not None else None
        except NotRenderable as exc:
            log.debug("not tokenized exactly: %s", exc)
            raise _NotTokenizable("not_renderable") from None
        except Exception as exc:  # a template that rejects the conversation: the pod will say why
            log.debug("local tokenization failed: %s", exc)
            raise _NotTokenizable("render_error") from None

    async def _remote_tokens(self, model: str, kind: RequestKind, req: InferenceRequest) -> list[int] | None:
        if kind in CHAT_KINDS:
            try:
                messages = self._remote_messages(kind, req)
            except NotRenderable:
                raise _NotTokenizable("not_renderable") from None
            if not messages:
                return None
            body: dict[str, Any] = {"model": model, "messages": messages,
                                    "add_generation_prompt": req.add_generation_prompt is not False}
            if kind == RequestKind.RESPONSES:
                body["add_special_tokens"] = openai_responses.SPECIAL_TOKENS
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
        now = time.monotonic()
        pods = [p for p in pods if (until := self._no_tokenize.get(p.name)) is None or until <= now]
        if not pods:
            self._warn_once(model, "its pods do not serve /tokenize")
            raise _NotTokenizable("remote_unsupported")
        pod = min(pods, key=lambda p: self._ledger.on_pod(p.name))
        try:
            async with self._http.session.post(f"{pod.url}/tokenize", json=body, timeout=self._remote_timeout) as resp:
                if resp.status in (404, 405):
                    self._no_tokenize[pod.name] = now + NO_TOKENIZE_S
                if resp.status != 200:
                    raise _NotTokenizable(f"remote_http_{resp.status}")
                tokens = (await resp.json(content_type=None)).get("tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            raise _NotTokenizable("remote_error") from None
        if not isinstance(tokens, list):
            raise _NotTokenizable("remote_error")
        return tokens

    @staticmethod
    def _special_prefix(local: LocalTokenizer, kind: RequestKind) -> tuple[int, ...]:
        """What vLLM puts before the rendered prompt: the tokenizer's special tokens, for Responses only."""
        if kind != RequestKind.RESPONSES:
            return ()
        prefix = local.tokenizer.special_prefix
        if prefix is None:  # it adds tokens after the text too: not exactly reproducible from the template
            raise NotRenderable("the tokenizer adds special tokens after a Responses prompt")
        return prefix

    @staticmethod
    def _remote_messages(kind: RequestKind, req: InferenceRequest) -> list[dict[str, Any]] | None:
        """The conversation for a pod's ``/tokenize``. Whether the pod's template merges a Messages
        request's inline system messages is not known here: such a request is not tokenized remotely."""
        if kind == RequestKind.MESSAGES and any(m.get("role") == "system" for m in req.messages or ()):
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
