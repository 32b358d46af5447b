"""Prefill/decode disaggregation: the prefill leg of a request whose decode pod the router has chosen.

Owner: :class:`PrefillLegs`, the director's collaborator for models whose pods have roles. For each
decode attempt it decides whether a prefill leg is worth it (not when the decode pod already holds all
but ``uncached_token_threshold`` tokens of the prompt), chooses the prefill pod (the request's own policy
over the pods taking the prefill leg, on a routing view of its own, the decode pod excluded), counts the
leg in the in-flight ledger on that pod while it runs, sends it as a whole, non-streamed call, tries
another prefill pod when one fails before answering, and says how it went in a
:class:`~gateway.request.types.PrefillLeg`. It never fails the request: whatever goes wrong, the decode pod
serves the request whole, and the client's answer, stream, usage and errors come from the decode leg.

The connector the pods run decides what the legs carry. ``shared_storage`` (vLLM's ExampleConnector and
its kind): the prefill leg is the client's request cut to one token, and the decode leg is the client's
body byte for byte. ``nixl``: the prefill leg also asks for ``kv_transfer_params``, and the decode leg is
the client's body with the prefill pod's parameters added, the one body the gateway re-encodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.config import DisaggregationConfig
from gateway.core.errors import ErrorKind, GatewayError
from gateway.core.inference_api import RequestKind
from gateway.core.usage import Usage
from gateway.load.ledger import InFlightLedger
from gateway.metrics import LATENCY_BUCKETS
from gateway.pods.registry import Leg, PodRegistry
from gateway.proxy.forward import Proxy
from gateway.proxy.outcome import RetryableFailure
from gateway.request.pipeline import DispatchStep
from gateway.request.types import Attempt, ClientRequest, PrefillLeg, Split
from gateway.routing.policy import Decision, RoutingRequest
from gateway.routing.router import Router

log = logging.getLogger("gateway.disaggregation")

# The APIs whose requests are split; the rest of a disaggregated model's generating requests (responses)
# are served whole by a decode pod.
SPLIT_KINDS = frozenset({RequestKind.CHAT, RequestKind.COMPLETIONS, RequestKind.MESSAGES})
_DECODED_KINDS = SPLIT_KINDS | {"responses"}
# What a NIXL prefill leg asks for: compute the prompt and keep its blocks for a decode pod to pull.
NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


class _PrefillAnswer(msgspec.Struct):
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


_answer_decoder = msgspec.json.Decoder(_PrefillAnswer)


class _Refused(Exception):
    """The prefill pod answered, but not with a prefill the decode pod can use."""

    def __init__(self, outcome: Split) -> None:
        self.outcome = outcome


class DisaggregationMetrics:
    """P/D's families, on the gateway's registry (:meth:`GatewayMetrics.owned`). Producers: :class:`PrefillLegs`
    (the legs) and :class:`gateway.request.observers.RequestMetrics` (each request's prefill outcome)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "gateway_pd_requests",
            "Requests of disaggregated models by what became of their prefill leg: split, cached, short, "
            "no_prefill_pod, prefill_failed, prefill_refused, unsupported",
            ["model", "outcome"], registry=registry,
        )
        self.prefill_legs = Counter("gateway_prefill_legs", "Prefill legs sent, by pod and status (the pod's own; "
                                    "502: unreachable or broke off; 504: timed out; 499: the "
                                    "client left)", ["pod", "status"], registry=registry)
        self.prefill_seconds = Histogram("gateway_prefill_seconds", "Time of a request's prefill leg, every try "
                                         "included", buckets=LATENCY_BUCKETS, registry=registry)


@dataclasses.dataclass(eq=False)
class PrefillLegs:
    config: DisaggregationConfig
    pods: PodRegistry
    router: Router
    ledger: InFlightLedger
    proxy: Proxy
    metrics: DisaggregationMetrics
    dispatched: list[DispatchStep]  # the steps that see a prefill leg dispatched (the blocks its pod will hold)
    default_consumption: float
    clock: Callable[[], float] = time.monotonic

    def leg_of(self, kind: RequestKind, model: str) -> Leg | None:
        """The leg a request's own routing chooses a pod for: the decode leg for a generating request of a
        disaggregated model, else None (any pod serves it whole)."""
        return "decode" if kind in _DECODED_KINDS and self.pods.disaggregated(model) else None

    async def run(self, attempt: Attempt) -> PrefillLeg:
        """The prefill leg of ``attempt`` (its decode pod chosen and counted), done or skipped."""
        skipped = self._skipped(attempt)
        if skipped is not None:
            return PrefillLeg(skipped)
        try:  # the client's body as a dict, to write the legs' own bodies from (its numbers kept exact)
            client_body = msgspec.json.decode(attempt.sent_body)
        except msgspec.DecodeError:  # a number out of any float's range, in a field the gateway does not read
            return PrefillLeg(Split.UNSUPPORTED)
        started = self.clock()
        routing = dataclasses.replace(attempt.routing, leg="prefill", filtered_out={}, prefix=None,
                                      prefix_tokens={}, placement={})
        exclude = {attempt.decision.pod.name}
        outcome = Split.NO_PREFILL_POD
        tries = 0
        for number in range(self.config.prefill_attempts):
            try:
                decision = self.router.route(routing, attempt.policy, frozenset(exclude))
            except GatewayError as err:  # no prefill pod can take it: the decode pod serves it whole
                if err.kind is not ErrorKind.NO_POD:
                    log.warning("request %s: no prefill pod (%s)", attempt.request.id, err.message)
                break
            tries += 1
            try:
                answer, decode_body = await self._send(attempt, routing, decision, number, client_body)
            except RetryableFailure as exc:
                outcome = Split.PREFILL_FAILED
                exclude.add(decision.pod.name)
                log.warning("request %s: prefill pod %s failed (%s: %s)", attempt.request.id, decision.pod.name,
                            exc.cause, exc.error.message)
                continue
            except _Refused as exc:
                outcome = exc.outcome
                break
            return PrefillLeg(Split.SPLIT, decision, routing, answer.usage, self._took(started), tries, decode_body)
        return PrefillLeg(outcome, None, routing, None, self._took(started) if tries else 0.0, tries)

    def _took(self, started: float) -> float:
        seconds = self.clock() - started
        self.metrics.prefill_seconds.observe(seconds)
        return seconds

    def _skipped(self, attempt: Attempt) -> Split | None:
        """Why the request needs no prefill leg, if it needs none."""
        request, routing = attempt.request, attempt.routing
        if request.kind not in SPLIT_KINDS or _several_prompts(request.parsed.prompt):
            return Split.UNSUPPORTED
        prompt = request.prompt_tokens(routing)
        cached = attempt.decision.prefix_tokens
        if prompt - cached > self.config.uncached_token_threshold:
            return None
        return Split.CACHED if cached else Split.SHORT

    async def _send(self, attempt: Attempt, routing: RoutingRequest, decision: Decision, number: int,
                    client_body: dict[str, Any]) -> tuple[_PrefillAnswer, bytes | None]:
        """One try on one prefill pod, counted in the ledger while it runs."""
        request, pod = attempt.request, decision.pod
        nixl = self.config.connector_of(routing.base_model or request.model) == "nixl"
        estimate = routing.estimates.get(pod.name)
        dispatch = self.ledger.dispatch(request.id, pod.name,
                                         estimate.consumption if estimate else self.default_consumption,
                                         request.kind)
        leg = Attempt(request, attempt.policy, routing, attempt.plan, decision, dispatch, number, self.clock(),
                      attempt.upstream_headers)
        status = 502
        try:
            for step in self.dispatched:
                step.dispatched(leg)
            async with asyncio.timeout(self.config.prefill_timeout_s):
                status, body = await self.proxy.exchange(pod, request.path,
                                                          prefill_body(request, client_body, nixl),
                                                          attempt.upstream_headers)
        except TimeoutError:
            status = 504
            log.warning("request %s: prefill pod %s took longer than %g s", request.id, pod.name,
                        self.config.prefill_timeout_s)
            raise _Refused(Split.PREFILL_FAILED) from None
        except GatewayError as err:  # timed out or failed mid-answer: not worth another try
            status = 504 if err.kind is ErrorKind.UPSTREAM_TIMEOUT else 502
            raise _Refused(Split.PREFILL_FAILED) from None
        except RetryableFailure as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.ledger.finish(dispatch)
            self.metrics.prefill_legs.labels(pod.name, str(status)).inc()
        if status != 200:
            raise _Refused(Split.PREFILL_REFUSED)
        return self._accepted(request, pod.name, body, client_body, nixl)

    @staticmethod
    def _accepted(request: ClientRequest, pod: str, body: bytes, client_body: dict[str, Any], nixl: bool
                  ) -> tuple[_PrefillAnswer, bytes | None]:
        try:
            answer = _answer_decoder.decode(body)
        except msgspec.MsgspecError:
            log.warning("request %s: prefill pod %s answered 200 with a body that is no completion", request.id, pod)
            raise _Refused(Split.PREFILL_FAILED) from None
        if not nixl:
            return answer, None
        if not answer.kv_transfer_params:
            log.warning("request %s: prefill pod %s answered without kv_transfer_params (is it a NixlConnector "
                        "producer?)", request.id, pod)
            raise _Refused(Split.PREFILL_FAILED)
        return answer, msgspec.json.encode({**client_body, "kv_transfer_params": answer.kv_transfer_params})


def prefill_body(request: ClientRequest, client_body: dict[str, Any], nixl: bool) -> bytes:
    """The prefill leg's body: the client's request, to one token, whole (not streamed)."""
    body = {k: v for k, v in client_body.items() if k not in ("stream_options", "min_tokens")}
    body["stream"] = False
    body["max_tokens"] = 1
    if request.kind == RequestKind.CHAT:
        body["max_completion_tokens"] = 1
    if nixl:
        body["kv_transfer_params"] = NIXL_PREFILL_PARAMS
    return msgspec.json.encode(body)


def _several_prompts(prompt: Any) -> bool:
    """A completion request for several prompts (a list of strings or of token lists)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
