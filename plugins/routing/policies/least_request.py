"""``least_request``: the candidate with the fewest requests in flight through this gateway.

The request pipeline counts a request in flight (in the ledger) before it is sent, so a burst spreads
out at once instead of piling onto whichever pod looked idle when the burst began.
"""

from __future__ import annotations

from gateway.plugin_api import NoOptions, PluginSpec, ProfileConfig
from plugins.routing.policies.shipped import part, scorer, shipped


def build(context: None, options: NoOptions) -> ProfileConfig:
    return shipped(scorers=(scorer("in_flight"),), picker=part("max_score", reason="least_in_flight"))


PLUGIN = PluginSpec(NoOptions, build)
