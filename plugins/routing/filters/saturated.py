"""``saturated``: flow control's pods with room, for a request released after waiting."""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec, Pod, RoutingRequest


class Saturated:
    """Flow control's rule: a request released after waiting (its ``room`` set) goes to the pods that had
    room then, while any of them is left; a pinned request is exempt (its pin decides). The pods it drops
    are recorded as ``saturated``."""

    name = "saturated"

    def filter(self, request: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        room = request.room
        if not room or request.pin is not None:
            return pods
        return [p for p in pods if p.name in room] or pods


PLUGIN = PluginSpec(NoOptions, lambda context, options: Saturated())
