"""KV-cache pressure: each pod's mode (:mod:`gateway.pressure.modes`) and the monitor that sets it from a
pressure source (:mod:`gateway.pressure.monitor`; the sources are plugins, ``plugins/pressure_sources``)."""
