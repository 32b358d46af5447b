"""A simulated vLLM or SGLang pod: the engine's HTTP API, metrics and KV events, without a GPU.

Owner: a :class:`MockPod` owns its engine, cache, publisher, registered LoRA adapters and fault switches.
Its HTTP API is the subset of vLLM's (and SGLang's) that routing depends on, in the same shapes: OpenAI
endpoints with ``usage.prompt_tokens_details.cached_tokens``, ``/tokenize``, the ``/render`` endpoints of
vLLM 0.32's scale-out mode, ``/metrics`` with the engines' metric names, and the cache-reset endpoints.

LoRA (``enable_lora``, vLLM's ``--enable-lora`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): adapters are
registered by name and path (``lora_adapters`` at start, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` later, which answer as vLLM 0.32 does), listed at ``/v1/models`` with their
``parent``, and a request naming one runs with it (:class:`~simulator.engine.LoraSlots`: batch slots,
host memory, the cost of a switch); a name the pod does not serve is a 404, as in vLLM.
``vllm:lora_requests_info`` says which adapters run and wait, one series per label set as vLLM's gauge
keeps them; ``mock_lora_activations_total`` and ``mock_lora_loads_total`` (the simulator's own) count the
switches into a slot and the reads from a path.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random
import time
import uuid
from typing import Any

import msgspec
import orjson
import zmq.asyncio
from aiohttp import web

from gateway.config import PodConfig
from gateway.kv.events import Encoding, KvEvent
from gateway.kv.hashing import namespace_root
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from simulator import anthropic as anthropic_api
from simulator import responses as responses_api
from simulator.block_hashes import SeededBlockHasher, VllmBlockHasher
from simulator.config import MockPodConfig
from simulator.engine import QUEUE_TIME_BUCKETS, EngineLimits, MockEngine, PromptRejected, Sequence, TimingModel
from simulator.kv_transfer import (
    SIDE_CHANNEL_PATH,
    KvLoadFailed,
    Nixl,
    SharedStorage,
    parse_kv_transfer_config,
)
from simulator.kvcache import LoraKey, PagedKvCache
from simulator.ports import free_port as free_port  # where the tests and scripts import it from
from simulator.ports import free_ports
from simulator.publisher import KvEventPublisher

log = logging.getLogger("simulator")

OUTPUT_TEXT = (
    " The quick brown fox jumps over the lazy dog while the gateway routes every request to the pod"
    " that already holds its prefix, and the cache stays warm from one stage to the next."
)


class UnknownModel(Exception):
    def __init__(self, model: object) -> None:
        super().__init__(f"The model `{model}` does not exist.")


class Faults(msgspec.Struct):
    """Switches for fault-injection tests (``POST /debug/faults``)."""

    error_fraction: float = 0.0  # answer HTTP 500 to this share of inference requests
    stall_s: float = 0.0  # wait this long before answering an inference request
    die_mid_stream_fraction: float = 0.0  # cut this share of streams after the first chunk
    # After the first chunk of this share of chat and completion streams: vLLM's error event (then [DONE])
    engine_error_fraction: float = 0.0
    malformed_event_fraction: float = 0.0  # ... a data line that is not JSON (then the rest of the stream)
    drop_event_fraction: float = 0.0  # lose this share of event batches in transit (still replayable)
    publish_events: bool = True


class _FaultRequest(Faults, forbid_unknown_fields=True):
    restart: bool = False


PRIORITY_HEADER = "X-Vllm-Priority"
# What vLLM writes into a stream when generation fails after its headers went out.
_ENGINE_ERROR_EVENT = (b'data: {"error": {"object": "error", "message": "simulated engine failure", '
                       b'"type": "InternalServerError", "param": null, "code": 500}}\n\n')


class MockPod:
    def __init__(self, config: MockPodConfig, tokenizer: HfTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or HfTokenizer(config.tokenizer or BUNDLED_TOKENIZER_DIR)
        self.faults = Faults()
        self.aborted_requests = 0
        self._rng = random.Random()
        self._started = int(time.time())
        self._output_tokens = self.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)
        self._token_text = {t: self.tokenizer.decode([t]) for t in set(self._output_tokens)}
        encoding = config.encoding or (Encoding.SGLANG if config.flavor == "sglang" else Encoding.CURRENT)
        self.publisher: KvEventPublisher | None = None
        self._encoding = encoding
        self.shared_storage: SharedStorage | None = None
        self.nixl: Nixl | None = None
        if config.kv_transfer_config:
            transfer = parse_kv_transfer_config(config.kv_transfer_config)
            if transfer.kv_connector == "NixlConnector":
                self.nixl = Nixl(transfer, config.host, lambda seq: self.engine.release(seq))
            else:
                self.shared_storage = SharedStorage(
                    str(transfer.kv_connector_extra_config.get("shared_storage_path", "/tmp")), config.block_size)
        self.engine = self._new_engine()
        # Registered LoRA adapters by name (vLLM's serving models' lora_requests), and the ids they got.
        self.adapters: dict[str, LoraKey] = {}
        self._adapter_ids = itertools.count(1)
        for name in config.lora_adapters:  # vLLM's static adapters: registered, and read into memory
            self._register(name, f"/adapters/{name}")
            self.engine.lora.load(name)
        # vLLM's lora_requests_info gauge: one series per label set it was ever set with, its last time.
        self._lora_info: dict[tuple[str, str], float] = {}
        self.responses = responses_api.ResponseStore() if config.responses_store else None
        # A request without max_tokens: vLLM writes until the model ends (or the context is full).
        self._default_max_tokens = max(config.default_max_tokens, len(self._output_tokens) if config.ends_answers
                                       else 0)
        self._runner: web.AppRunner | None = None
        self.port = config.port

    # Lifecycle

    def _new_engine(self) -> MockEngine:
        c = self.config
        hasher = VllmBlockHasher(c.hash_algo, c.int_block_hashes) if self._encoding is Encoding.CURRENT \
            else SeededBlockHasher(signed=c.flavor == "sglang")
        cache = PagedKvCache(c.num_blocks, c.block_size, hasher=hasher, token_hash_root=namespace_root(c.model),
                             null_block=c.flavor == "vllm")
        timing = c.timing or TimingModel(speed=c.speed)
        limits = EngineLimits(c.max_num_seqs, c.max_batched_tokens, c.max_model_len, c.max_loras, c.max_cpu_loras,
                              c.scheduling_policy)
        return MockEngine(cache, self._output_tokens, self._publish, timing, limits, self.nixl or self.shared_storage,
                          ends_answers=c.ends_answers)

    def _publish(self, events: list[KvEvent]) -> None:
        if self.publisher:
            self.publisher.publish(events)

    async def start(self) -> None:
        c = self.config
        if c.events_port is not None:
            any_events, any_replay = free_ports(2, c.host)
            events_port = c.events_port or any_events
            replay_port = None if c.replay_port is None else (c.replay_port or any_replay)
            self.publisher = KvEventPublisher(
                f"tcp://{c.host}:{events_port}",
                f"tcp://{c.host}:{replay_port}" if replay_port else None,
                topic=c.topic, encoding=self._encoding, context=zmq.asyncio.Context.instance(),
            )
            self.publisher.start()
        self.engine.start()
        self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, c.host, c.port, backlog=2048)
        await site.start()
        self.port = self._runner.addresses[0][1]
        if self.nixl is not None:
            self.nixl.port = self.port

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
        await self.engine.stop()
        if self.nixl is not None:
            await self.nixl.close()
        if self.publisher:
            await self.publisher.stop()

    async def kill(self) -> None:
        """Die as a crashed pod does: every connection cut at once (requests in flight get no answer), then
        nothing listens."""
        server = self._runner.server if self._runner is not None else None
        for handler in list(server.connections) if server is not None else []:
            if handler.transport is not None:
                handler.transport.abort()
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def pod_config(self) -> PodConfig:
        """How a gateway reaches this pod."""
        pub = self.publisher
        return PodConfig(
            url=self.url,
            models=[self.config.model, *self.adapters],
            flavor=self.config.flavor,
            kv_events=pub.endpoint if pub else None,
            kv_replay=pub.replay_endpoint if pub else None,
            kv_topic=self.config.topic,
            block_size=self.config.block_size,
        )

    def restart(self) -> None:
        """Simulate a crash and restart: requests fail, the cache is empty, seq restarts, and the block
        hashes reseed where the engine's would (not vLLM's sha256: those are the same in every process)."""
        old = self.engine
        for seq in [*old.waiting, *old.running]:
            old.abort(seq)
        if self.nixl is not None:
            self.nixl.restarted()
        old.cache.reset(announce=False)
        old.cache.hasher.reseed()
        if self.publisher:
            self.publisher.restart()

    # HTTP

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/messages", self._messages)
        r.add_post("/v1/messages/count_tokens", self._count_tokens)
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/responses", self._responses)
        r.add_get("/v1/responses/{response_id}", self._get_response)
        r.add_post("/v1/responses/{response_id}/cancel", self._cancel_response)
        r.add_post("/v1/embeddings", self._embeddings)
        r.add_post("/v1/chat/completions/render", self._render_chat)
        r.add_post("/v1/completions/render", self._render_completions)
        r.add_post("/tokenize", self._tokenize)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_get("/debug/blocks", self._debug_blocks)
        r.add_get("/debug/ttft", self._debug_ttft)
        r.add_post("/debug/faults", self._set_faults)
        if self.lora_enabled:
            r.add_post("/v1/load_lora_adapter", self._load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", self._unload_lora_adapter)
        if self.nixl is not None:
            r.add_post(SIDE_CHANNEL_PATH, self._nixl_read)
        if self.config.flavor == "sglang":
            r.add_post("/flush_cache", self._flush_cache)
            r.add_get("/server_info", self._server_info)
        else:
            r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        return app

    @staticmethod
    def _error(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> web.Response:
        """vLLM's error shape: a Python class as the type, the status as the code, the field it names."""
        body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

    # LoRA

    @property
    def lora_enabled(self) -> bool:
        return self.config.enable_lora or bool(self.config.lora_adapters)

    def _register(self, name: str, path: str) -> None:
        self.adapters[name] = LoraKey(name, path, next(self._adapter_ids))

    def _served(self, body: dict[str, Any]) -> LoraKey | None:
        """The adapter a request names (None: the base model); a model the pod does not serve is refused."""
        model = body.get("model")
        if model is None or model == self.config.model:
            return None
        adapter = self.adapters.get(model) if isinstance(model, str) else None
        if adapter is None:
            raise UnknownModel(model)
        return adapter

    def _lora_args(self, lora: LoraKey | None) -> dict[str, Any]:
        if lora is None:
            return {}
        return {"lora": lora, "token_hash_root": namespace_root(self.config.model, lora.name)}

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return self._error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.config.model:
            return self._error(400, f"The lora adapter '{name}' conflicts with a served base model.",
                               "InvalidUserInput")
        if name in self.adapters and not body.get("load_inplace"):
            return self._error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        # vLLM's add_lora reads the adapter into memory before it answers.
        if self.engine.lora.load(name):
            await asyncio.sleep(self.engine.timing.lora_load_s * self.engine.timing.speed)
        self._register(name, str(path))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        name = (await self._body(request)).get("lora_name")
        if not name:
            return self._error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.adapters:
            return self._error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        self.engine.lora.remove(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise web.HTTPBadRequest(text=f"invalid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the body must be a JSON object")
        return body

    async def _inference_faults(self) -> web.Response | None:
        f = self.faults
        if f.stall_s:
            await asyncio.sleep(f.stall_s)
        if f.error_fraction and self._rng.random() < f.error_fraction:
            return self._error(500, "injected failure", "InternalServerError")
        return None

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptRejected("messages must be a non-empty list")
        return self.tokenizer.encode_chat(
            messages,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tools=body.get("tools"),
            chat_template_kwargs=body.get("chat_template_kwargs"),
        )

    def _prompt_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        """The prompts of a completion request, in the shapes vLLM accepts: a string, token ids, or a list
        of either (nothing nested deeper)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            return [self._one_prompt(prompt, add_special_tokens)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            return [self._one_prompt(p, add_special_tokens) for p in prompt]
        raise PromptRejected("prompt must be a string, token ids, or a list of either")

    def _one_prompt(self, prompt: str | list[Any], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        vocab = len(self.tokenizer)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise PromptRejected(f"Token ids must be a non-empty list of integers in [0, {vocab}).")
        return prompt

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if failure := await self._inference_faults():
            return failure
        body = await self._body(request)
        try:
            ids = self._chat_ids(body)
        except (PromptRejected, ValueError, TypeError) as exc:
            return self._error(400, str(exc), param="messages")
        return await self._generate(request, body, ids, chat=True)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API, as vLLM 0.32 serves it (:mod:`simulator.anthropic`)."""
        if failure := await self._inference_faults():
            return failure
        body = await self._body(request)
        try:
            lora = self._served(body)
            ids = anthropic_api.prompt_ids(self.tokenizer, body)
            transfer = await self._transfer_in(body, ids)
            max_tokens = body.get("max_tokens")
            seq = self.engine.submit(ids, self._default_max_tokens if max_tokens is None else int(max_tokens),
                                     request.headers.get("x-request-id") or uuid.uuid4().hex,
                                     priority=_priority(request, {}), **transfer, **self._lora_args(lora))
        except UnknownModel as exc:
            return anthropic_api.error(404, str(exc))
        except KvLoadFailed:
            return anthropic_api.error(500, "Internal server error")
        except (PromptRejected, ValueError, TypeError) as exc:
            return anthropic_api.error(400, str(exc))
        model = lora.name if lora is not None else self.config.model
        try:
            if body.get("stream"):
                return await anthropic_api.stream(request, seq, model, self._token_text.__getitem__,
                                                  self.config.block_size)
            text = "".join([self._token_text[t] async for t in seq.tokens()])
            answer = anthropic_api.message(seq, model, text, self.config.block_size)
            return web.json_response(self._with_transfer_params(answer, seq))
        finally:
            if not seq.finished:
                self.aborted_requests += 1
                self.engine.abort(seq)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API, as vLLM 0.32 answers it (:mod:`simulator.responses`)."""
        if failure := await self._inference_faults():
            return failure
        body = await self._body(request)
        try:
            messages = responses_api.conversation(body, self.responses)
            ids = responses_api.prompt_ids(self.tokenizer, body, messages)
            max_tokens = body.get("max_output_tokens")
            seq = self.engine.submit(ids, self._default_max_tokens if max_tokens is None else int(max_tokens),
                                     request.headers.get("x-request-id") or uuid.uuid4().hex)
        except KeyError as exc:
            return responses_api.not_found(str(exc.args[0]))
        except (PromptRejected, ValueError, TypeError) as exc:
            return responses_api.error(400, str(exc), "input")  # vLLM names the input
        writer = responses_api.ResponseWriter(body, seq, self.config.model, self.config.block_size,
                                              self._token_text.__getitem__)
        try:
            if body.get("stream"):
                return await writer.stream(request, self.responses, messages)
            answer = writer.whole("".join([self._token_text[t] async for t in seq.tokens()]))
            writer.keep(self.responses, answer, messages)
            return web.Response(body=orjson.dumps(answer), content_type="application/json")
        finally:
            if not seq.finished:
                self.aborted_requests += 1
                self.engine.abort(seq)

    async def _get_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.responses.responses.get(response_id) if self.responses is not None else None
        if stored is None:
            return responses_api.not_found(response_id)
        return web.Response(body=orjson.dumps(stored), content_type="application/json")

    async def _cancel_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if self.responses is None or response_id not in self.responses.responses:
            return responses_api.not_found(response_id)
        return responses_api.error(400, "Cannot cancel a synchronous response.", "response_id")

    async def _count_tokens(self, request: web.Request) -> web.Response:
        try:
            ids = anthropic_api.prompt_ids(self.tokenizer, await self._body(request))
        except (ValueError, TypeError) as exc:
            return anthropic_api.error(400, str(exc))
        return web.json_response({"input_tokens": len(ids)})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if failure := await self._inference_faults():
            return failure
        body = await self._body(request)
        try:
            prompts = self._prompt_ids(body.get("prompt"), body.get("add_special_tokens", True))
        except (PromptRejected, ValueError, TypeError) as exc:
            return self._error(400, str(exc), param="prompt")
        return await self._generate(request, body, prompts[0], chat=False)

    async def _generate(
        self, request: web.Request, body: dict[str, Any], ids: list[int], chat: bool
    ) -> web.StreamResponse:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = self._default_max_tokens if max_tokens is None else max_tokens
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            lora = self._served(body)
            seq = self.engine.submit(ids, int(max_tokens), request_id, priority=_priority(request, body),
                                     **await self._transfer_in(body, ids), **self._lora_args(lora))
        except UnknownModel as exc:
            return self._error(404, str(exc), "NotFoundError", "model")
        except KvLoadFailed:
            return await self._load_failed(request, bool(body.get("stream")))
        except (PromptRejected, ValueError, TypeError) as exc:
            return self._error(400, str(exc), param="messages" if chat else "prompt")
        model = lora.name if lora is not None else self.config.model
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                return await self._stream(request, seq, chat, bool(options.get("include_usage")), model)
            tokens = [t async for t in seq.tokens()]
            return self._complete_response(seq, tokens, chat, model)
        finally:
            if not seq.finished:  # the client went away: free the engine's slot, as vLLM aborts
                self.aborted_requests += 1
                self.engine.abort(seq)

    async def _transfer_in(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        """What a request's ``kv_transfer_params`` make of it (NIXL): a prefill leg keeps its blocks for a
        decode pod; a decode leg pulls them first (raising :class:`KvLoadFailed` where vLLM fails it)."""
        params = body.get("kv_transfer_params")
        if self.nixl is None or not isinstance(params, dict):
            return {}
        if params.get("do_remote_decode"):
            return {"hold_blocks": not body.get("stream")}
        if not params.get("do_remote_prefill"):
            return {}
        cached = params.get("remote_prefill_cached_tokens")
        reported = cached if isinstance(cached, int) else None
        try:
            return {"pulled_tokens": await self.nixl.pull(params, len(ids)), "reported_cached_tokens": reported}
        except KvLoadFailed as exc:
            log.warning("KV load failed: %s", exc)
            if not self.nixl.recompute_on_failure:
                raise
            return {}

    def _with_transfer_params(self, answer: dict[str, Any], seq: Sequence) -> dict[str, Any]:
        """A finished prefill leg's answer carries the parameters to pull its blocks with."""
        if self.nixl is not None and seq.hold_blocks and seq.generated:
            answer["kv_transfer_params"] = self.nixl.produced(seq)
        return answer

    async def _load_failed(self, request: web.Request, stream: bool) -> web.StreamResponse:
        """vLLM's answer to a request whose KV could not be loaded: a 500, or, streamed, an error event
        after its 200."""
        if not stream:
            return self._error(500, "Internal server error", "InternalServerError")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        error = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                           "code": 500}}
        await resp.write(_sse(error) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _nixl_read(self, request: web.Request) -> web.Response:
        assert self.nixl is not None
        status, answer = self.nixl.read(await self._body(request))
        return web.json_response(answer, status=status)

    def _usage(self, seq: Sequence) -> dict[str, Any]:
        return {
            "prompt_tokens": seq.prompt_len,
            "completion_tokens": seq.generated,
            "total_tokens": seq.prompt_len + seq.generated,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
        }

    def _complete_response(self, seq: Sequence, tokens: list[int], chat: bool, model: str) -> web.Response:
        text = "".join(self._token_text[t] for t in tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _finish_reason(seq)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{seq.request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(seq),
        }
        return web.Response(body=orjson.dumps(self._with_transfer_params(body, seq)), content_type="application/json")

    async def _stream(
        self, request: web.Request, seq: Sequence, chat: bool, include_usage: bool, model: str
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{seq.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        die = self.faults.die_mid_stream_fraction and self._rng.random() < self.faults.die_mid_stream_fraction
        emitted = 0
        async for token in seq.tokens():
            if chat and not emitted:  # as vLLM: the role comes with the first token, once the prompt is prefilled
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                await resp.write(_sse({**base, "choices": [role]}))
            emitted += 1
            finish = _finish_reason(seq) if emitted >= seq.answer_length else None
            text = self._token_text[token]
            choice = ({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
            await resp.write(_sse({**base, "choices": [choice]}))
            if emitted == 1 and (fault := self._stream_fault()):
                await resp.write(fault)
                if fault is _ENGINE_ERROR_EVENT:  # as vLLM: the error, then the end of the stream
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    return resp
            if die:
                assert request.transport is not None
                request.transport.abort()
                return resp
        if include_usage:
            await resp.write(_sse({**base, "choices": [], "usage": self._usage(seq)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _stream_fault(self) -> bytes | None:
        """The event a stream's fault switches put after its first chunk, if any."""
        f = self.faults
        if f.engine_error_fraction and self._rng.random() < f.engine_error_fraction:
            return _ENGINE_ERROR_EVENT
        if f.malformed_event_fraction and self._rng.random() < f.malformed_event_fraction:
            return b"data: {not json\n\n"
        return None

    async def _embeddings(self, request: web.Request) -> web.Response:
        if failure := await self._inference_faults():
            return failure
        body = await self._body(request)
        try:
            inputs = self._prompt_ids(body.get("input"))
        except (PromptRejected, ValueError, TypeError) as exc:
            return self._error(400, str(exc), param="input")
        data = [{"object": "embedding", "index": i, "embedding": _pseudo_embedding(ids)}
                for i, ids in enumerate(inputs)]
        n = sum(len(ids) for ids in inputs)
        return web.json_response({"object": "list", "data": data, "model": self.config.model,
                                  "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            if "messages" in body:
                ids = self._chat_ids(body)
            else:
                ids = self._prompt_ids(body.get("prompt"), body.get("add_special_tokens", True))[0]
        except (PromptRejected, ValueError, TypeError) as exc:
            return self._error(400, str(exc))
        return web.json_response({"count": len(ids), "max_model_len": self.config.max_model_len,
                                  "tokens": ids})

    def _rendered(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        return {
            "request_id": uuid.uuid4().hex,
            "model": body.get("model", self.config.model),
            "token_ids": ids,
            "sampling_params": {"max_tokens": body.get("max_completion_tokens") or body.get("max_tokens")},
            "stream": bool(body.get("stream")),
        }

    async def _render_chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            return web.json_response(self._rendered(body, self._chat_ids(body)))
        except (PromptRejected, ValueError, TypeError) as exc:
            return self._error(400, str(exc))

    async def _render_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            prompts = self._prompt_ids(body.get("prompt"))
        except (PromptRejected, ValueError, TypeError) as exc:
            return self._error(400, str(exc))
        return web.json_response([self._rendered(body, ids) for ids in prompts])

    async def _models(self, request: web.Request) -> web.Response:
        c = self.config
        owner = "sglang" if c.flavor == "sglang" else "vllm"
        cards = [{"id": c.model, "object": "model", "created": self._started, "owned_by": owner,
                  "root": c.model, "parent": None, "max_model_len": c.max_model_len}]
        cards += [{"id": name, "object": "model", "created": self._started, "owned_by": owner,
                   "root": adapter.path, "parent": c.model, "max_model_len": c.max_model_len}
                  for name, adapter in self.adapters.items()]
        return web.json_response({"object": "list", "data": cards})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self._sglang_metrics() if self.config.flavor == "sglang" else self._vllm_metrics()
        return web.Response(text=text, content_type="text/plain")

    def _vllm_metrics(self) -> str:
        e, c = self.engine, self.engine.cache
        labels = f'engine="0",model_name="{self.config.model}"'
        return "".join([
            f"vllm:num_requests_running{{{labels}}} {len(e.running)}\n",
            f"vllm:num_requests_waiting{{{labels}}} {len(e.waiting)}\n",
            f"vllm:kv_cache_usage_perc{{{labels}}} {c.usage()}\n",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(c.stats.queries)}\n",
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(c.stats.hits)}\n",
            f"vllm:prompt_tokens_total{{{labels}}} {float(e.prompt_tokens_total)}\n",
            f"vllm:generation_tokens_total{{{labels}}} {float(e.generation_tokens_total)}\n",
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {float(e.ttft_count)}\n',
            f"vllm:time_to_first_token_seconds_count{{{labels}}} {float(e.ttft_count)}\n",
            f"vllm:time_to_first_token_seconds_sum{{{labels}}} {e.ttft_sum_s}\n",
            *self._queue_time_metrics(labels),
            *([f"vllm:external_prefix_cache_queries_total{{{labels}}} {float(e.external_queries)}\n",
               f"vllm:external_prefix_cache_hits_total{{{labels}}} {float(e.external_hits)}\n"]
              if e.connector is not None else []),
            f"vllm:request_success_total{{{labels},finished_reason=\"length\"}} {float(e.finished_requests)}\n",
            f'vllm:cache_config_info{{block_size="{c.block_size}",enable_prefix_caching="True",'
            f'engine="0",num_gpu_blocks="{c.num_blocks}",prefix_caching_hash_algo="{self.config.hash_algo}"}} 1.0\n',
            *(self._lora_metrics() if self.lora_enabled else []),
        ])

    def _queue_time_metrics(self, labels: str) -> list[str]:
        """``vllm:request_queue_time_seconds``: each request's time from arrival to first scheduled."""
        e, name, lines, seen = self.engine, "vllm:request_queue_time_seconds", [], 0
        for bound, count in zip([*QUEUE_TIME_BUCKETS, "+Inf"], e.queue_time_buckets, strict=True):
            seen += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(seen)}\n')
        return [*lines, f"{name}_count{{{labels}}} {float(seen)}\n", f"{name}_sum{{{labels}}} {e.queue_time_sum_s}\n"]

    def _lora_metrics(self) -> list[str]:
        e = self.engine
        running = ",".join(dict.fromkeys(s.lora.name for s in e.running if s.lora is not None))
        waiting = ",".join(dict.fromkeys(s.lora.name for s in e.waiting if s.lora is not None))
        self._lora_info[(waiting, running)] = time.time()
        return [*(f'vllm:lora_requests_info{{max_lora="{self.config.max_loras}",waiting_lora_adapters="{w}",'
                  f'running_lora_adapters="{r}"}} {at}\n' for (w, r), at in self._lora_info.items()),
                f"mock_lora_activations_total {float(e.lora.activations)}\n",
                f"mock_lora_loads_total {float(e.lora.loads)}\n"]

    def _sglang_metrics(self) -> str:
        e, c = self.engine, self.engine.cache
        labels = f'model_name="{self.config.model}"'
        hit_rate = c.stats.hits / c.stats.queries if c.stats.queries else 0.0
        return "".join([
            f"sglang:num_running_reqs{{{labels}}} {float(len(e.running))}\n",
            f"sglang:num_queue_reqs{{{labels}}} {float(len(e.waiting))}\n",
            f"sglang:token_usage{{{labels}}} {c.usage()}\n",
            f"sglang:cache_hit_rate{{{labels}}} {hit_rate}\n",
            f"sglang:max_total_num_tokens{{{labels}}} {float(c.num_blocks * c.block_size)}\n",
            f"sglang:prompt_tokens_total{{{labels}}} {float(e.prompt_tokens_total)}\n",
            f"sglang:cached_tokens_total{{{labels}}} {float(c.stats.hits)}\n",
            f"sglang:generation_tokens_total{{{labels}}} {float(e.generation_tokens_total)}\n",
        ])

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.reset_prefix_cache()
        return web.json_response({"success": ok}, status=200 if ok else 400)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        e = self.engine
        if e.running or e.waiting or not e.reset_prefix_cache():
            # SGLang refuses while requests run, and says so in a 200 body.
            return web.Response(text=f"Cache not flushed because there are pending requests. "
                                     f"#queue-req: {len(e.waiting)}, #running-req: {len(e.running)}")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")

    async def _server_info(self, request: web.Request) -> web.Response:
        c, pub = self.config, self.publisher
        kv_events = None
        if pub:
            kv_events = {"host": c.host, "port": int(pub.endpoint.rsplit(":", 1)[1]), "topic": c.topic,
                         "block_size": c.block_size, "dp_size": 1,
                         "replay_port": int(pub.replay_endpoint.rsplit(":", 1)[1]) if pub.replay_endpoint
                         else None}
        return web.json_response({"model_path": c.model, "served_model_name": c.model,
                                  "page_size": c.block_size, "dp_size": 1, "kv_events": kv_events})

    async def _debug_blocks(self, request: web.Request) -> web.Response:
        blocks = [{"hash": b.block_hash.hex() if isinstance(b.block_hash, bytes) else b.block_hash,
                   "token_hash": b.token_hash, "token_ids": list(b.token_ids),
                   "in_use": b.ref_count > 0}
                  for b in self.engine.cache.cached_blocks()]
        stats = self.engine.cache.stats
        return web.json_response({"block_size": self.config.block_size, "num_blocks": self.config.num_blocks,
                                  "blocks": blocks, "hits": stats.hits, "queries": stats.queries,
                                  "evictions": stats.evictions,
                                  "events_seq": self.publisher.seq if self.publisher else None})

    async def _debug_ttft(self, request: web.Request) -> web.Response:
        """Each recent request's time to first token at this pod, and its time in the waiting queue (vLLM's
        queue time: until first scheduled), by its ``x-request-id``."""
        return web.json_response({"ttft_s": self.engine.ttft_by_request, "queue_s": self.engine.queue_by_request})

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            change = msgspec.convert(await self._body(request), _FaultRequest)
        except msgspec.ValidationError as exc:
            return self._error(400, str(exc))
        self.faults = Faults(**{f: getattr(change, f) for f in Faults.__struct_fields__})
        if self.publisher:
            self.publisher.drop_fraction = change.drop_event_fraction
            self.publisher.sending = change.publish_events
        if change.restart:
            self.restart()
        return web.json_response(msgspec.to_builtins(self.faults))


def _finish_reason(seq: Sequence) -> str:
    return "stop" if seq.ended else "length"


def _priority(request: web.Request, body: dict[str, Any]) -> int:
    """The request's priority as vLLM 0.32 reads it: its ``X-Vllm-Priority`` header where that is an integer,
    else the body's ``priority`` (0). An FCFS engine takes it and ignores it."""
    header = request.headers.get(PRIORITY_HEADER)
    if header is not None:
        try:
            return int(header)
        except ValueError:
            pass
    value = body.get("priority", 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError("priority must be an integer")
    return value


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _pseudo_embedding(ids: list[int], dims: int = 16) -> list[float]:
    digest = hashlib.sha256(str(ids).encode()).digest()
    raw = [(b - 127.5) / 127.5 for b in digest[:dims]]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]
