"""Name → plugin lookup through Python entry points, so the core never imports a plugin by name.

Each group (``gateway.policies``, and later cache controllers, pressure sources, discovery sources)
is declared in ``pyproject.toml``; third-party packages add plugins by declaring the same group.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any


class UnknownPlugin(LookupError):
    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(known)}")
        self.name = name


class PluginRegistry:
    def __init__(self, group: str, kind: str) -> None:
        self.group = group
        self.kind = kind
        self._entries = {ep.name: ep for ep in entry_points(group=group)}
        self._loaded: dict[str, Any] = {}

    def names(self) -> list[str]:
        return sorted(self._entries)

    def load(self, name: str) -> Any:
        if name not in self._loaded:
            if name not in self._entries:
                raise UnknownPlugin(self.kind, name, self.names())
            self._loaded[name] = self._entries[name].load()
        return self._loaded[name]
