"""The Responses API's state: the stored responses (:mod:`gateway.responses.store`)."""
