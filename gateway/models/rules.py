"""Public model names and what they mean (``models.rules``): the target a request is given, the fallbacks
tried after it, and whether the answer names the target.

- an *alias* names one target (``gpt-4o-mini`` → ``llama-3.1-8b``);
- a *split* names several, with weights (a canary at 10%). Which one a request gets is decided by its
  *sticky key*, so that a conversation never changes model mid-way: the response it continues
  (``previous_response_id``) where the target that answered it is pinned, else its workflow or session (the
  signals of :mod:`gateway.workflow.context`), its Responses ``conversation``, the response it continues,
  else, for a chat, its first messages (every turn of one conversation re-sends them). The key is hashed
  into the weights, so every worker and replica gives a new key the same target without asking anyone;
  the target is then pinned to the key and the public name (:class:`SplitPinned` over the state bus; one
  session may ask for several), so that a reload changing the weights moves new conversations only. A
  request with no key at all is drawn at random by the weights;
- *fallbacks* follow the chosen target, in order (the director tries them: :mod:`gateway.request.director`).

A name no rule mentions is served as it is. Owner: :class:`ModelRules` owns the rules in force (replaced
whole on reload) and the split pins.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.config import ModelRule, ModelsConfig
from gateway.core.facts import Publish, SplitPinned, unshared
from gateway.core.inference_api import InferenceRequest, RequestKind
from gateway.lru import LruCache
from gateway.workflow.context import ContextSignals

RESPONSE_KEY = "response:"  # a Responses answer's id, as a sticky key


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """What a request's model name means: the targets to try, the first the chosen one."""

    public: str
    targets: tuple[str, ...]
    expose_target: bool = False
    # How long a request may wait in flow control for a target that has a fallback after it.
    fallback_wait_s: float = 0.0
    # Whether the target was chosen among several (a split), and the sticky key it was chosen by (None: a
    # request with no key, drawn by the weights).
    split: bool = False
    sticky: str | None = None

    def fallback_after(self, target: str) -> bool:
        """Whether another target follows ``target``."""
        return self.targets[-1] != target


def as_is(model: str) -> ModelRoute:
    """A name no rule mentions: served as it is."""
    return ModelRoute(model, (model,), expose_target=True)


class ModelRules:
    def __init__(self, config: ModelsConfig, signals: ContextSignals, publish: Publish = unshared,
                 max_pins: int = 100_000, draw: Callable[[], float] = random.random) -> None:
        self._signals = signals
        self._publish = publish
        self._draw = draw
        # (Public name, sticky key) → the target it was given (one session may use several public names).
        self._pins: LruCache[tuple[str, str], str] = LruCache(max_pins)
        self.reconfigure(config)

    def reconfigure(self, config: ModelsConfig) -> None:
        """A reloaded config: new requests get the new rules; pinned conversations keep their target while
        the rule still offers it."""
        self.config = config
        self._rules: Mapping[str, ModelRule] = config.rules
        self._routes = {public: _route(public, rule) for public, rule in config.rules.items()}

    def route(self, model: str, kind: RequestKind, headers: Any, body: InferenceRequest, owner: str = "") -> ModelRoute:
        """The targets of a request naming ``model``, the chosen one first (``owner``: its API key's tag, whose
        workflows and sessions it names)."""
        route = self._routes.get(model)
        if route is None:
            return as_is(model)
        rule = self._rules[model]
        if rule.target is not None:
            return route
        key = self._sticky_key(model, kind, headers, body, owner)
        target = self._chosen(model, rule, key) if key is not None else _weighted(rule, self._draw())
        return ModelRoute(model, (target, *rule.fallbacks), rule.expose_target, rule.fallback_wait_s, True, key)

    def answered(self, route: ModelRoute, target: str, response_id: str | None) -> None:
        """A split's Responses answer: the response that continues it gets the same target."""
        if route.split and response_id:
            self._pin(RESPONSE_KEY + response_id, route.public, target)

    def is_public(self, model: str) -> bool:
        """Whether ``model`` is a public name of a rule (its targets are the router's to find)."""
        return model in self._rules

    def public_names(self) -> dict[str, list[str]]:
        """Each public name and the targets it may be served by, fallbacks last."""
        return {public: [*rule.choices(), *rule.fallbacks] for public, rule in self._rules.items()}

    def cards(self, served: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``/v1/models``: the models ``served`` now (by a healthy pod), then each adapter the gateway
        registers on demand whose base model is served and no pod lists yet, then each public name one of
        whose targets is among them (with the targets it may be served by): what a request could be
        answered with now."""
        listed = {str(card.get("id")) for card in served}
        cards = list(served)
        cards += [{"id": name, "object": "model", "owned_by": "gateway", "parent": adapter.base_model}
                  for name, adapter in self.config.adapters.items()
                  if name not in listed and adapter.base_model in listed]
        servable = listed | {str(card["id"]) for card in cards}
        cards += [{"id": public, "object": "model", "owned_by": "gateway", "targets": targets}
                  for public, targets in self.public_names().items()
                  if public not in listed and any(t in servable for t in targets)]
        return cards

    def apply_remote(self, origin: str, fact: SplitPinned) -> None:
        self._pins.put((fact.public, fact.key), fact.target)

    def _sticky_key(self, public: str, kind: RequestKind, headers: Any, body: InferenceRequest, owner: str
                    ) -> str | None:
        # The response it continues, where the target that answered it is known: first, since the conversation
        # the gateway names for a continued response (its first response's id) was not the first turn's key.
        continued = RESPONSE_KEY + body.previous_response_id if body.previous_response_id else None
        if continued is not None and (public, continued) in self._pins:
            return continued
        # A workflow, a session or a Responses conversation (the one a stored response continues included).
        if (context := self._signals.context_key(headers, body, owner)) is not None:
            return context
        return continued or _opening(kind, body)

    def _chosen(self, public: str, rule: ModelRule, key: str) -> str:
        pinned = self._pins.touch((public, key))
        if pinned is not None and pinned in rule.choices():
            return pinned
        target = _weighted(rule, _unit(key))
        self._pin(key, public, target)
        return target

    def _pin(self, key: str, public: str, target: str) -> None:
        self._pins.put((public, key), target)
        self._publish(SplitPinned(key, public, target))


def _route(public: str, rule: ModelRule) -> ModelRoute:
    first = rule.target if rule.target is not None else rule.targets[0].model
    return ModelRoute(public, (first, *rule.fallbacks), rule.expose_target, rule.fallback_wait_s)


def _weighted(rule: ModelRule, point: float) -> str:
    """The target at ``point`` (in [0, 1)) of the rule's weights laid end to end."""
    total = sum(t.weight for t in rule.targets)
    at = point * total
    for target in rule.targets:
        at -= target.weight
        if at < 0:
            return target.model
    return rule.targets[-1].model


def _unit(key: str) -> float:
    """``key`` hashed to a point in [0, 1), the same in every process."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


def _opening(kind: RequestKind, body: InferenceRequest) -> str | None:
    """A chat's first messages (the system prompt and the first user turn), which every turn of the
    conversation sends again: the conversation's key when it names no session."""
    if kind not in (RequestKind.CHAT, RequestKind.MESSAGES) or not body.messages:
        return None
    opening = msgspec.json.encode([body.system, body.messages[:2]])
    return "opening:" + hashlib.blake2b(opening, digest_size=12).hexdigest()
