"""``none``: no hard flush; flushes stay soft (the workflow simply stops being pinned)."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec


def build(context: None, options: NoOptions) -> None:
    return None


PLUGIN = PluginSpec(NoOptions, build)
