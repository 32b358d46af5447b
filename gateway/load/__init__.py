"""Predicted load: GPU profiles (from Redis), Little's-law pending load, output-length prediction."""
