"""The shipped policies (entry points ``gateway.policies``), one a module: each turns its ``routing.options``
into a profile of the parts in ``filters/``, ``scorers/`` and ``pickers/``."""
