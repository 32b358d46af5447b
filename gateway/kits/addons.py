"""Kits installed beside the shipped ones: a feature added without a line in the assembly.

An add-on kit is found through the ``gateway.kits`` entry point group, like the plugins
(:mod:`gateway.plugin_registry`): its entry point names a :class:`~gateway.plugin_registry.PluginSpec` whose
options Struct is the kit's config and whose ``build`` makes the kit from a :class:`KitContext` (the
foundation, and every kit composed before it by name). It runs when the config names it under ``kits:``,
with its options::

    kits:
      notice: {text: "maintenance at 22:00 UTC"}

It starts after the kits it ``requires`` and serves its ``routes()``; when the file is read again, the kit's
``reloads()`` entry under its own name gets its options again, decoded. Adding or removing an add-on, or
options it does not reload, wait for a restart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from gateway.config import GatewayConfig
from gateway.kits.foundation import Foundation
from gateway.kits.kit import Apply, Kit, Route, Running
from gateway.plugin_registry import PluginRegistry

KIT_GROUP = "gateway.kits"
SECTION = "kits"  # GatewayConfig's section: add-on name → its options


@dataclass(frozen=True, slots=True)
class KitContext:
    """What an add-on kit is built from: the config, the foundation, and the kits composed before it."""

    config: GatewayConfig
    foundation: Foundation
    kits: Mapping[str, Kit]


class AddOn(Kit):
    """One add-on kit in the assembly (``kit``): its name, requirements, running parts and routes, and its
    part of the ``kits`` section applied when the file is read again."""

    def __init__(self, kit: Kit, registry: PluginRegistry, installed: frozenset[str]) -> None:
        self.kit = kit
        self.name = kit.name
        self.requires = kit.requires
        self._registry = registry
        self._installed = installed

    def running(self) -> Iterable[Running]:
        return self.kit.running()

    def routes(self) -> Iterable[Route]:
        return self.kit.routes()

    def reloads(self) -> Mapping[str, Apply]:
        apply = self.kit.reloads().get(self.name)
        return {SECTION: lambda section: apply(self._options(section))} if apply is not None else {}

    def checks(self) -> Mapping[str, Apply]:
        return {SECTION: self._check}

    def _options(self, section: Mapping[str, Any]) -> Any:
        return self._registry.options(self.name, section.get(self.name))

    def _check(self, section: Mapping[str, Any]) -> None:
        if (named := frozenset(section)) != self._installed:
            raise ValueError(f"kits: {sorted(named ^ self._installed)} added or removed: that needs a restart")
        self._options(section)  # raises PluginOptionsError naming the option


def build_addons(config: GatewayConfig, base: Foundation, composed: Iterable[Kit]) -> tuple[AddOn, ...]:
    """The add-on kits the config names, in its order, each built from the kits composed before it (raises
    :class:`~gateway.plugin_registry.UnknownPlugin` or :class:`~gateway.plugin_registry.PluginOptionsError`)."""
    if not config.kits:
        return ()
    registry = PluginRegistry(KIT_GROUP, "kit")
    by_name = {kit.name: kit for kit in composed}
    installed = frozenset(config.kits)
    out: list[AddOn] = []
    for name, raw in config.kits.items():
        kit = registry.build(name, KitContext(config, base, MappingProxyType(dict(by_name))), raw)
        if kit.name != name or name in by_name:
            raise ValueError(f"kits: {name!r} must build a kit named {name!r}, unlike any shipped one "
                             f"(it built {kit.name!r})")
        out.append(AddOn(kit, registry, installed))
        by_name[name] = kit
    return tuple(out)


def addon_options(config: GatewayConfig) -> dict[str, Any]:
    """Each add-on's options as it would run, with their defaults (nothing built)."""
    registry = PluginRegistry(KIT_GROUP, "kit")
    return {name: msgspec.to_builtins(registry.options(name, raw)) for name, raw in config.kits.items()}
