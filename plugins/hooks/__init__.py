"""The shipped request hooks (entry points ``gateway.pre_request`` and ``gateway.response_complete``), one a
module (docs/routing.md, "A request hook")."""
