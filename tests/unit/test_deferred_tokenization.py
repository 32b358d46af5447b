"""Text no pod holds, tokenized when the request's attempt ends rather than before routing
(``tokenization.defer_new_text``): a conversation's next turn routed on its earlier prompt, a first turn on its
ids as far as the first new piece no pod holds (the prefix index says); the head is the whole prompt's, the
whole prompt is exact and remembered once the attempt ends, and what holds the prompt (the working set, the
free queue, keep-warm's kept prompt) ends up holding all of it."""

from __future__ import annotations

import time
from array import array
from dataclasses import replace
from typing import Any

import pytest

from gateway.auth import ApiKey
from gateway.config import ApiKeyConfig, PlacementConfig, ServerConfig, VerificationConfig
from gateway.core.facts import ContextHeld
from gateway.kv.events import BlockStored
from gateway.kv.hashing import PromptHashes, namespace_root
from gateway.kv.index import PrefixIndex
from gateway.kv.verification import PredictionVerifier
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.ledger import InFlightLedger
from gateway.metrics import GatewayMetrics
from gateway.proxy.outcome import Ending, RelayOutcome
from gateway.request.context_steps import ContextPlacement, ContextResolution, PlacementLosses
from gateway.request.steps import PromptTokenization
from gateway.routing.policy import Decision, PrefixMatch, RoutingRequest
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.context import ContextSignals
from tests.unit.test_keep_warm_cost import Conversation
from tests.unit.test_pipeline import MODEL, attempt_of, chat, client_request, pods, policy, routing_of, tokens  # noqa: F401

BS = 16


def tokenization(service: TokenizationService, defer: bool = True, max_prompt_tokens: int | None = None,
                 counted: bool = False, index: PrefixIndex | None = None) -> PromptTokenization:
    if index is None:  # the two pods' views, holding nothing
        index = PrefixIndex()
        for pod in ("p0", "p1"):
            index.view(pod, 0, MODEL, BS)
    return PromptTokenization(pods(), service, PredictionVerifier(VerificationConfig(), GatewayMetrics()),
                              ServerConfig(max_prompt_tokens=max_prompt_tokens), lambda key: counted,
                              index if defer else None)


def conversation(topic: str) -> list[list[dict[str, str]]]:
    """Three turns of one conversation, its text its own (the tokenizer's piece cache is shared by the tests)."""
    system = {"role": "system", "content": f"You answer questions about the {topic} handbook. " * 20}
    first = [system, {"role": "user", "content": f"What does chapter one of the {topic} handbook say? " * 30}]
    second = [*first, {"role": "assistant", "content": "It says a cache keeps what was computed."},
              {"role": "user", "content": "And chapter two, about routing?"}]
    third = [*second, {"role": "assistant", "content": "That a request goes where its prefix is."},
             {"role": "user", "content": "Thanks. One more: eviction?"}]
    return [first, second, third]


async def prepared(step: PromptTokenization, messages: list[dict[str, str]], key: Any = None) -> RoutingRequest:
    request = client_request({"model": MODEL, "messages": messages, "max_tokens": 4}, key=key)
    routing = routing_of(request)
    waiting = step.prepare(request, policy(), routing)
    assert waiting is not None
    await waiting
    return routing


def finish(step: PromptTokenization, routing: RoutingRequest) -> None:
    step.attempt_finished(attempt_of(client_request(chat()), routing), RelayOutcome(200, Ending.COMPLETE))


def held_by(index: PrefixIndex, pod: str, ids: list[int]) -> None:
    """The pod's events stored these ids' full blocks."""
    full = len(ids) // BS * BS
    index.apply(index.view(pod, 0, MODEL, BS), [BlockStored(block_hashes=list(range(1, full // BS + 1)),
                                                            parent_block_hash=None, token_ids=ids[:full],
                                                            block_size=BS)])


async def test_a_first_turn_is_routed_on_its_ids_up_to_the_first_new_piece_no_pod_holds(tokens, tokenizer):  # noqa: F811
    index = PrefixIndex()
    step = tokenization(tokens, index=index)
    first, _, _ = conversation("first-turn")
    whole = tokenizer.encode_chat(first)
    system_only = tokenizer.encode_chat(first[:1], add_generation_prompt=False)
    held_by(index, "p0", system_only)  # a pod holds the system prompt: the question's first piece is past it
    routing = await prepared(step, first)
    head = list(routing.token_ids)
    assert len(system_only) < len(head) < len(whole) and whole[: len(head)] == head
    assert routing.hashes.token_count == len(head) and routing.untokenized_tokens > 0
    finish(step, routing)
    assert list(routing.token_ids) == whole and routing.complete_prompt is None
    assert routing.hashes.full(BS) == index.prompt_hashes(MODEL, None, whole).full(BS)

    held_by(index, "p1", whole)  # a pod holding all of it: nothing is left for later, the match may reach it
    again = await prepared(step, first)
    assert list(again.token_ids) == whole and again.complete_prompt is None and again.untokenized_tokens == 0


async def test_a_next_turn_is_routed_on_its_earlier_prompt_and_whole_once_its_attempt_ends(tokens, tokenizer):  # noqa: F811
    step = tokenization(tokens)
    turns = conversation("next-turn")
    first = await prepared(step, turns[0])
    finish(step, first)
    assert list(first.token_ids) == tokenizer.encode_chat(turns[0])

    second = await prepared(step, turns[1])
    whole = tokenizer.encode_chat(turns[1])
    head = list(second.token_ids)
    # Routed on the first prompt without its generation prompt: the whole prompt's head, its blocks the same.
    assert 0 < len(head) < len(tokenizer.encode_chat(turns[0])) <= len(whole) and whole[: len(head)] == head
    assert second.continued is first.hashes and second.untokenized_tokens > 0
    index = PrefixIndex()
    assert second.hashes.full(BS) == index.prompt_hashes(MODEL, None, whole).full(BS)[: len(head) // BS]

    finish(step, second)
    assert list(second.token_ids) == whole and second.untokenized_tokens == 0 and second.complete_prompt is None
    assert second.hashes.full(BS) == index.prompt_hashes(MODEL, None, whole).full(BS)

    third = await prepared(step, turns[2])  # the turn after builds on the whole second prompt
    assert third.continued is second.hashes
    finish(step, third)
    assert list(third.token_ids) == tokenizer.encode_chat(turns[2])


@pytest.mark.parametrize(("settings", "why"), [
    ({"defer": False}, "configured off"),
    ({"counted": True}, "the key's input tokens are limited: counted exactly before admission"),
    ({"max_prompt_tokens": 1400}, "twice the new text's bytes might pass the limit"),
])
async def test_a_prompt_is_tokenized_whole_where_a_count_must_be_exact_first(tokens, tokenizer, settings,  # noqa: F811
                                                                           why):
    step = tokenization(tokens, **settings)
    key = ApiKey(b"digest", ApiKeyConfig(hash="0" * 64, name="limited")) if settings.get("counted") else None
    turns = conversation(f"exact-{sorted(settings)[0]}")
    first = await prepared(step, turns[0], key)
    assert list(first.token_ids) == tokenizer.encode_chat(turns[0]) and first.complete_prompt is None, why
    finish(step, first)
    second = await prepared(step, turns[1], key)
    assert list(second.token_ids) == tokenizer.encode_chat(turns[1]), why
    assert second.untokenized_tokens == 0 and second.complete_prompt is None and second.continued is first.hashes


def test_the_working_set_holds_the_head_then_the_whole_prompt_as_one_stage_and_tells_the_others():
    registry, ledger, told = pods(), InFlightLedger(), []
    working_set = ResumableWorkingSet(PlacementConfig(), ledger, publish=told.append)
    other = ResumableWorkingSet(PlacementConfig(), InFlightLedger())  # another worker's
    index = PrefixIndex()
    for pod in registry.all():
        index.view(pod.name, 0, MODEL, BS)
    placement = ContextPlacement(index, working_set, PlacementLosses(GatewayMetrics()), clock=time.monotonic)
    resolution = ContextResolution(registry, index, working_set, ContextSignals())
    earlier = index.prompt_hashes(MODEL, None, list(range(64)))
    request = client_request(chat())
    # A next turn whose earlier prompt (64 tokens) is a live conversation's: recognised by the earlier prompt's
    # own last block, though it is routed on 60 tokens of it.
    working_set.hold("anon-7", False, "p1", BS, earlier.full(BS), 64, time.monotonic())
    working_set.idle("anon-7", time.monotonic())
    routing = routing_of(request, token_ids=list(range(60)), untokenized_tokens=40, continued=earlier,
                         hashes=index.prompt_hashes(MODEL, None, list(range(60))))
    resolution.prepare(request, policy(), routing)
    assert routing.context_key == "anon-7"

    attempt = replace(attempt_of(request, routing, "p1", registry, ledger), head_tokens=60)
    placement.dispatched(attempt)
    context = working_set.context("anon-7")
    assert context is not None and context.stages == 2 and len(context.hashes) == 3 and context.prompt_tokens == 100
    whole = list(range(60)) + list(range(500, 540))  # the new messages, tokenized when the attempt ends
    routing.token_ids, routing.hashes, routing.untokenized_tokens = whole, index.prompt_hashes(MODEL, None, whole), 0
    ledger.finish(attempt.dispatch)
    placement.attempt_finished(attempt, RelayOutcome(200, Ending.COMPLETE))
    assert context.stages == 2 and context.hashes == routing.hashes.full(BS) and context.prompt_tokens == 100
    assert context.thinking and working_set.demand.tokens("p1") == 6 * BS
    assert working_set.continued(routing.hashes.full(BS)) is context  # its next turn finds it by the whole

    for fact in told:  # the other worker sees the same context, grown, counted as one stage
        other.apply_remote("w1", fact)
    mirrored = other.context("anon-7")
    assert [f.grown for f in told if isinstance(f, ContextHeld)] == [False, False, True]
    assert mirrored is not None and mirrored.hashes == context.hashes and mirrored.stages == 2


def test_a_turn_dispatched_on_its_head_leaves_all_its_blocks_in_the_free_queue_and_keep_warm_the_whole_prompt():
    conversation = Conversation()
    conversation.grow_to(640)
    earlier = conversation.hashes
    whole = conversation.ids + array("I", range(9000, 9040))  # the next turn: its head is the earlier prompt
    hashes = PromptHashes(namespace_root("m"), whole, earlier, len(conversation.ids))
    request = client_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    routing = RoutingRequest(request.id, "m", "chat", request.parsed, base_model="m", token_ids=conversation.ids,
                             hashes=earlier, untokenized_tokens=10, context_key="workflow:w", context_keyed=True)
    routing.prefix = PrefixMatch(True, earlier, conversation.index.lookup("m", None, earlier, ["p0"]))
    attempt = replace(attempt_of(request, routing, "p0", conversation.pods, conversation.ledger),
                      decision=Decision(conversation.pods.get("p0"), "kv_aware", "cache_hit"), head_tokens=640)
    conversation.recency.dispatched(attempt)
    blocks = hashes.full(BS)
    stored = conversation.stored  # the pod computes the rest and its events store it
    conversation.index.apply(conversation.view, [BlockStored(
        block_hashes=blocks[stored:], parent_block_hash=blocks[stored - 1],
        token_ids=list(whole[stored * BS: len(blocks) * BS]),
        block_size=BS)])
    routing.token_ids, routing.hashes, routing.untokenized_tokens = whole, hashes, 0  # tokenized as it ended
    conversation.ledger.finish(attempt.dispatch)
    conversation.recency.attempt_finished(attempt, RelayOutcome(200, Ending.COMPLETE))
    assert conversation.queues.free_blocks("p0") == len(blocks)
    kept = conversation.keep_warm.prompts.get("workflow:w")
    assert kept is not None and list(kept.ids) == list(whole)
