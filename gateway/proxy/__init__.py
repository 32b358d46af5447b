"""Forwarding one attempt of a request to a pod and relaying its answer, byte for byte; what happened is
returned (:class:`~gateway.proxy.outcome.RelayOutcome`), never written anywhere."""
