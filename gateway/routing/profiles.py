"""Routing profiles: a :class:`~gateway.routing.policy.Policy` declared in config, as llm-d's
``EndpointPickerConfig`` declares its scheduling profiles.

A profile (:class:`~gateway.config.ProfileConfig`) names its filters, its scorers with their weights, and
its picker; each is a plugin found by name through an entry-point group (``gateway.filters``,
``gateway.scorers``, ``gateway.pickers``) and built with its options, decoded into the plugin's options
Struct. A filter with a ``settle`` method (the pin) is a settler: it runs after the scorers. A new scorer
is one module, one entry point, and a line of config (docs/routing.md).

Profiles come from two places: ``routing.profiles`` in the config, and the shipped ones (``round_robin``,
``kv_aware``, ...), each a plugin of ``gateway.policies`` that turns its ``routing.options`` into a
profile. A configured profile may not take a shipped one's name.

Owner: :class:`Profiles` owns the three part registries and the profiles' declarations; the policies it
builds are the router's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from gateway.config import PartConfig, ProfileConfig, ScorerConfig, as_part
from gateway.plugin_registry import PluginOptionsError, PluginRegistry, UnknownPlugin
from gateway.routing.policy import NO_NEEDS, Needs, Policy, PolicyContext, Preparer, WeightedScorer

POLICY_GROUP = "gateway.policies"
FILTER_GROUP = "gateway.filters"
SCORER_GROUP = "gateway.scorers"
PICKER_GROUP = "gateway.pickers"


class ProfileError(PluginOptionsError):
    """A profile that cannot be built as declared: the message names the profile and the part."""


class Profiles:
    """The profiles the gateway knows, by name: those declared in ``routing.profiles`` and the shipped ones."""

    def __init__(self, shipped: PluginRegistry, options: Mapping[str, Mapping[str, Any]],
                 declared: Mapping[str, ProfileConfig]) -> None:
        self._shipped = shipped
        self._options = options
        self._declared = dict(declared)
        self._filters = PluginRegistry(FILTER_GROUP, "routing filter")
        self._scorers = PluginRegistry(SCORER_GROUP, "routing scorer")
        self._pickers = PluginRegistry(PICKER_GROUP, "routing picker")
        clash = sorted(set(self._declared) & set(shipped.names()))
        if clash:
            raise ProfileError(f"routing.profiles: {', '.join(clash)} is a shipped profile's name; "
                               "choose another name, or set the shipped one's routing.options")
        if optioned := sorted(set(self._declared) & set(options)):
            raise ProfileError(f"routing.options: {', '.join(optioned)} is a declared profile; "
                               "set its parts' options in routing.profiles")

    def names(self) -> list[str]:
        return sorted({*self._shipped.names(), *self._declared})

    def configured(self) -> set[str]:
        """The profiles the config names: declared, or shipped with options set."""
        return {*self._options, *self._declared}

    def profile(self, name: str) -> ProfileConfig:
        """The declaration of profile ``name`` (a shipped one's with its ``routing.options``); raises
        :class:`~gateway.plugin_registry.UnknownPlugin` when no profile has that name."""
        declared = self._declared.get(name)
        if declared is not None:
            return declared
        if name not in self._shipped.names():
            raise UnknownPlugin("routing policy", name, self.names())
        return self._shipped.build(name, None, self._options.get(name))

    def effective(self, name: str) -> dict[str, Any]:
        """Profile ``name`` with every part's options decoded and their defaults (``gateway config check``).
        Nothing is built."""
        profile = self.profile(name)
        return {
            "filters": [self._decoded(name, self._filters, as_part(f)) for f in profile.filters],
            "scorers": [{**self._decoded(name, self._scorers, s), "weight": s.weight} for s in _scorers(profile)],
            "picker": self._decoded(name, self._pickers, as_part(profile.picker)),
        }

    def build(self, name: str, context: PolicyContext) -> Policy:
        """A fresh policy for profile ``name``: its parts built on ``context``."""
        profile = self.profile(name)
        filters = [self._built(name, self._filters, as_part(f), context) for f in profile.filters]
        plain = [f for f in filters if not hasattr(f, "settle")]
        settlers = [f for f in filters if hasattr(f, "settle")]
        scorers = [WeightedScorer(self._built(name, self._scorers, s, context), s.weight) for s in _scorers(profile)]
        picker = self._built(name, self._pickers, as_part(profile.picker), context)
        needs = [_needs(part) for part in (*filters, *(ws.scorer for ws in scorers), picker)]
        return Policy(name=name, picker=picker, filters=plain, settlers=settlers, scorers=scorers,
                      preparers=_preparers(needs),
                      needs_tokens=any(n.tokens for n in needs), needs_load=any(n.load for n in needs),
                      places_contexts=any(n.places_contexts for n in needs))

    @staticmethod
    def _decoded(profile: str, plugins: PluginRegistry, part: PartConfig) -> dict[str, Any]:
        options = _in_profile(profile, lambda: plugins.options(part.name, part.options))
        return {"name": part.name, "options": msgspec.to_builtins(options)}

    @staticmethod
    def _built(profile: str, plugins: PluginRegistry, part: PartConfig, context: PolicyContext) -> Any:
        return _in_profile(profile, lambda: plugins.build(part.name, context, part.options))


def _in_profile(profile: str, call: Callable[[], Any]) -> Any:
    """``call()``, its unknown-plugin or bad-options error naming the profile it is part of."""
    try:
        return call()
    except UnknownPlugin as exc:
        raise UnknownPlugin(exc.kind, exc.name, exc.known, where=f"routing profile {profile!r}") from None
    except PluginOptionsError as exc:
        raise ProfileError(f"routing profile {profile!r}: {exc}") from None


def _scorers(profile: ProfileConfig) -> list[ScorerConfig]:
    return [ScorerConfig(s) if isinstance(s, str) else s for s in profile.scorers]


def _needs(part: Any) -> Needs:
    return getattr(part, "needs", NO_NEEDS)


def _preparers(needs: Iterable[Needs]) -> list[Preparer]:
    """Every preparer the parts need, once each (the first of a name), in the order they were named."""
    out: dict[str, Preparer] = {}
    for n in needs:
        for preparer in n.preparers:
            out.setdefault(preparer.name, preparer)
    return list(out.values())
