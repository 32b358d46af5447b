"""The HTTP edge: routes, the one middleware, and the mapping of domain errors to each API's error JSON."""
