"""Tokenization exactly as the engine does it: chat template rendering, then token ids."""
