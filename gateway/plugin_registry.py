"""Name → plugin lookup through Python entry points, so the core never imports a plugin by name.

Each group (``gateway.policies``, ``gateway.filters``, ``gateway.scorers``, ``gateway.pickers``,
``gateway.pre_request``, ``gateway.response_complete``, ``gateway.cache_controllers``,
``gateway.pressure_sources``, ``gateway.discovery_sources``) is declared in ``pyproject.toml``; third-party
packages add plugins by declaring the same group. An entry point names a :class:`PluginSpec`: the msgspec
Struct its options decode into (unknown or mistyped options stop the start, naming the option) and the
function that builds it from the group's context and those options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

import msgspec

ContextT = TypeVar("ContextT")
OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)
BuiltT = TypeVar("BuiltT")


class UnknownPlugin(LookupError):
    def __init__(self, kind: str, name: str, known: list[str], where: str = "") -> None:
        super().__init__(f"{where + ': ' if where else ''}unknown {kind} {name!r}; known: {', '.join(known)}")
        self.kind = kind
        self.name = name
        self.known = known


class PluginOptionsError(ValueError):
    """A plugin's options do not decode into its options struct."""


class NoOptions(msgspec.Struct, forbid_unknown_fields=True):
    """For plugins that take none: any option given is a mistake."""


@dataclass(frozen=True, slots=True)
class PluginSpec(Generic[ContextT, OptionsT, BuiltT]):
    options: type[OptionsT]
    build: Callable[[ContextT, OptionsT], BuiltT]


def decode_options(kind: str, name: str, options_type: type[OptionsT], raw: Mapping[str, Any] | None) -> OptionsT:
    try:
        return msgspec.convert(dict(raw or {}), options_type)
    except msgspec.ValidationError as exc:
        raise PluginOptionsError(f"{kind} {name!r}: bad options: {exc}") from None


class PluginRegistry:
    def __init__(self, group: str, kind: str) -> None:
        self.group = group
        self.kind = kind
        self._entries = {ep.name: ep for ep in entry_points(group=group)}
        self._loaded: dict[str, PluginSpec[Any, Any, Any]] = {}

    def names(self) -> list[str]:
        return sorted(self._entries)

    def load(self, name: str) -> PluginSpec[Any, Any, Any]:
        if name not in self._loaded:
            if name not in self._entries:
                raise UnknownPlugin(self.kind, name, self.names())
            spec = self._entries[name].load()
            if not isinstance(spec, PluginSpec):
                raise TypeError(f"{self.kind} {name!r}: entry point {self._entries[name].value} is not a PluginSpec")
            self._loaded[name] = spec
        return self._loaded[name]

    def options(self, name: str, raw: Mapping[str, Any] | None) -> Any:
        """``raw`` decoded into the plugin's options struct (raises :class:`PluginOptionsError`)."""
        return decode_options(self.kind, name, self.load(name).options, raw)

    def build(self, name: str, context: Any, raw_options: Mapping[str, Any] | None = None) -> Any:
        spec = self.load(name)
        return spec.build(context, self.options(name, raw_options))
