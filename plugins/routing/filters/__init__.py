"""The shipped filters (entry points ``gateway.filters``), one a module: each keeps the candidates its rule
allows. ``saturated``, ``adapter_resident`` and ``pin`` are the gateway's own rules, which every shipped
profile declares around its own filters (:mod:`plugins.routing.policies.shipped`)."""
