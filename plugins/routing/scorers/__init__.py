"""The shipped scorers (entry points ``gateway.scorers``), one a module: each scores the candidates in
``[0, 1]``, higher is better."""
