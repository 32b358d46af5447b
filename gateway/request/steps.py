"""The built-in steps that shape a request: token ids, load and workflow planning (validation is
:mod:`gateway.request.validation`'s, admission flow control's: :mod:`gateway.request.flow_control`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from gateway.auth import owner_tag
from gateway.config import ServerConfig
from gateway.core.errors import GatewayError, bad_request
from gateway.kv.hashing import PromptHashes, namespace_root
from gateway.kv.index import PrefixIndex
from gateway.kv.verification import PredictionVerifier
from gateway.load.pending import PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.proxy.outcome import RelayOutcome
from gateway.request.observers import OutputMetrics
from gateway.request.timings import Step
from gateway.request.types import Attempt, ClientRequest
from gateway.request.validation import check_output_tokens, check_token_ids_in_vocabulary, output_tokens
from gateway.routing.policy import Policy, RoutingRequest
from gateway.tokenization.local import Tokens
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.planning import RequestPlan, WorkflowService

log = logging.getLogger("gateway.tokenization")


class PromptTokenization:
    """prepare: the prompt's token ids and block hashes (``routing.token_ids``, ``routing.hashes``), when
    the policy needs them; a prompt longer than the model's context, or an answer longer than the context
    leaves beside it (the prompt counted when it is tokenized, else at least one token), is refused here,
    before any pod is bothered (the context is the target's, known once the model name is resolved). The
    next turn of a conversation reuses its earlier prompt's ids and hashes and works only on what it adds
    (``routing.continued`` is that earlier prompt's hashes). For a model whose predictions drift from the
    engines' (:mod:`gateway.kv.verification`), the ids come from a pod's ``/tokenize`` instead of the local
    tokenizer (or, without one, there are none: routing is approximate), and now and then the configured
    tokenizer is asked too, as a probe of whether it agrees again (``routing.probe_tokens``).

    finish (first of all): text no pod holds is tokenized when the request's first attempt ends, not before
    it is routed (``tokenization.defer_new_text``): a next turn is routed on its earlier prompt, and a prompt
    tokenized from its first message on its ids as far as the first new piece past which the prefix index
    says no pod holds it. Then the whole prompt replaces the head in the routing view and is remembered for
    the conversation's next turn. Not where a count must be exact first: a key whose input tokens are
    limited, a prompt that might pass the context or leave too little room for the answer, a drifting model,
    a prefill leg."""

    timed_as = Step.TOKENIZE

    def __init__(self, pods: PodRegistry, tokens: TokenizationService, verifier: PredictionVerifier,
                 server: ServerConfig, counted: Callable[[str], bool] = lambda key: False,
                 index: PrefixIndex | None = None) -> None:
        self._pods = pods
        self._tokens = tokens
        self._verifier = verifier
        self._max_prompt_tokens = server.max_prompt_tokens
        # Whether the prompts of the key with this name are counted exactly whatever the policy (its input
        # tokens are limited: an estimate would let a burst pass the limit).
        self._counted = counted
        # Where text no pod holds is looked for, to be tokenized after routing (none: every prompt whole first).
        self._index = index

    def prepare(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> Awaitable[None] | None:
        if output_tokens(request.kind, request.parsed) is not None:
            check_output_tokens(request.kind, request.parsed, self._context(routing))
        counted = request.key is not None and self._counted(request.key.config.name)
        if not policy.needs_tokens and not counted:
            return None
        if self._verifier.drifting(routing.base_model):
            return self._tokenize_drifting(request, routing)
        defer = self._index is not None and not counted and routing.leg is None
        return self._tokenize(request, routing, head=_HeadCheck(self._index, routing) if defer else None)

    async def _tokenize_drifting(self, request: ClientRequest, routing: RoutingRequest) -> None:
        if self._verifier.probe_due(routing.base_model):
            probe = await self._tokens.tokenize(routing.model, request.kind, request.parsed)
            routing.probe_tokens = len(probe.ids) if probe is not None else None
        if self._tokens.has_local(routing.model):
            await self._tokenize(request, routing, avoid_local=True)

    async def _tokenize(self, request: ClientRequest, routing: RoutingRequest, avoid_local: bool = False,
                        head: _HeadCheck | None = None) -> None:
        prompt = request.parsed.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):  # token ids: the rest pay nothing
            local = self._tokens.local(self._pods.base_model(routing.model))
            if local is not None:
                check_token_ids_in_vocabulary(prompt, len(local.tokenizer))
        tokens = await self._tokens.tokenize(routing.model, request.kind, request.parsed, avoid_local=avoid_local,
                                             past_every_match=head)
        if tokens is None:
            return
        context = self._context(routing)
        limit = self._max_prompt_tokens or context
        if tokens.rest is not None and not _surely_fits(request, tokens, limit, context):
            tokens = self._tokens.finish(routing.model, tokens)
        ids = tokens.ids
        if limit and len(ids) > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {len(ids)}.",
                param="messages", code="context_length_exceeded")
        check_output_tokens(request.kind, request.parsed, context, len(ids))
        earlier = tokens.earlier
        routing.token_ids = ids
        routing.hashes = (head.hashes_of(ids) if head is not None else None) or PromptHashes(
            _root(routing), ids, earlier.hashes if earlier else None, earlier.length if earlier else 0,
            more_follow=tokens.rest is not None)
        routing.continued = earlier.hashes if earlier else None
        if tokens.rest is None:
            self._tokens.remember(routing.model, tokens, routing.hashes)
            return
        routing.untokenized_tokens = max(1, tokens.rest_bytes() // 4)  # as a body is guessed
        routing.complete_prompt = partial(self._complete, routing, tokens)

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        routing = attempt.routing
        if (complete := routing.complete_prompt) is not None:
            routing.complete_prompt = None
            complete()

    def _complete(self, routing: RoutingRequest, tokens: Tokens) -> None:
        """Tokenize what a prompt's head left: the routing view holds the whole prompt from now on, and the
        conversation's next turn builds on it."""
        try:
            tokens = self._tokens.finish(routing.model, tokens)
        except Exception:  # a tokenizer that fails on text it rendered: the next turn renders whole
            log.exception("request %s: tokenizing what followed the prompt's head failed", routing.request_id)
            return
        head = routing.hashes
        routing.token_ids = tokens.ids
        routing.hashes = PromptHashes(_root(routing), tokens.ids, head, head.token_count if head else 0)
        routing.untokenized_tokens = 0
        self._tokens.remember(routing.model, tokens, routing.hashes)

    def _context(self, routing: RoutingRequest) -> int | None:
        """The target's context length, as its pods list it (an adapter's, else its base model's)."""
        return self._pods.max_model_len(routing.model) or self._pods.max_model_len(routing.base_model)


class _HeadCheck:
    """Whether no pod can hold a prompt past these of its ids (:meth:`PrefixIndex.reaches_end`), for one
    request; the hashes it made for the last ids asked about are the head's, kept for routing."""

    def __init__(self, index: PrefixIndex, routing: RoutingRequest) -> None:
        self._index = index
        self._root = _root(routing)
        self._last: PromptHashes | None = None

    def __call__(self, ids: Sequence[int]) -> bool:
        last = self._last
        self._last = PromptHashes(self._root, ids, last, last.token_count if last else 0, more_follow=True)
        return not self._index.reaches_end(self._last)

    def hashes_of(self, ids: Sequence[int]) -> PromptHashes | None:
        last = self._last
        return last if last is not None and last.token_count == len(ids) else None


def _root(routing: RoutingRequest) -> int:
    return namespace_root(routing.base_model or routing.model, routing.lora_name)


def _surely_fits(request: ClientRequest, tokens: Tokens, limit: int | None, context: int | None) -> bool:
    """Whether a prompt whose rest is not tokenized yet fits its limits whatever that rest's count: a token is
    a byte at least, and a SentencePiece tokenizer's word-start mark may add one a word, so twice the rest's
    UTF-8 bytes bounds it."""
    bound = len(tokens.ids) + 2 * tokens.rest_bytes()
    if limit and bound > limit:
        return False
    try:
        check_output_tokens(request.kind, request.parsed, context, bound)
    except GatewayError:
        return False
    return True


class LoadEstimation:
    """prepare: the request's predicted output length and its cost on each candidate pod
    (``routing.input_tokens``, ``predicted_output_tokens``, ``estimates``), when admission is on or the
    policy weighs load."""

    def __init__(self, pods: PodRegistry, load: PendingLoad, predictor: OutputLengthPredictor,
                 metrics: GatewayMetrics, admission_enabled: bool) -> None:
        self._pods = pods
        self._load = load
        self._predictor = predictor
        self._predicted = metrics.owned(OutputMetrics).predicted
        self._admission_enabled = admission_enabled

    def prepare(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> None:
        if not (self._admission_enabled or policy.needs_load):
            return
        parsed = request.parsed
        routing.input_tokens = request.prompt_tokens(routing)
        routing.predicted_output_tokens = self._predictor.predict(
            routing.base_model, routing.input_tokens, parsed.max_completion_tokens or parsed.max_tokens)
        self._predicted.observe(routing.predicted_output_tokens)
        routing.estimates = {p.name: self._load.estimate(p.name, routing.base_model, routing.input_tokens,
                                                         routing.predicted_output_tokens)
                             for p in self._pods.candidates(routing.model, leg=routing.leg)}


class WorkflowPlanning:
    """The planner (a workflow's cache action and the pin of its stage or session), then dispatch (where
    the stage went, the flushes that follow) and finish (what the stage ended with) of
    :mod:`gateway.workflow.planning`."""

    def __init__(self, workflows: WorkflowService) -> None:
        self._workflows = workflows

    def plan(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> RequestPlan:
        return self._workflows.plan(request.headers, request.parsed, routing.base_model,
                                    request.prompt_tokens(routing), policy.places_contexts,
                                    owner_tag(request.key))

    def dispatched(self, attempt: Attempt) -> None:
        self._workflows.record_dispatch(attempt.plan, attempt.decision, attempt.routing.base_model)

    def attempt_finished(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        usage = outcome.usage
        self._workflows.finished(attempt.plan, attempt.decision.pod.name, usage.prompt_tokens if usage else None)
