"""Routing: a policy is filters → weighted scorers → picker over the candidate pods of a model."""
