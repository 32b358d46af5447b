"""KV-cache pressure: the monitor that sets each pod's mode from a pressure source (:mod:`gateway.pressure.monitor`;
the sources are plugins, ``plugins/pressure_sources``). The modes themselves are state that workflow planning and
pending load read too, so they live below both (:mod:`gateway.load.pressure_modes`)."""
