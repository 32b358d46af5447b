"""The gateway's features as the assembly composes them: one kit each (:mod:`gateway.kits.kit`)."""
