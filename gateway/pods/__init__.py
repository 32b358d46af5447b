"""Pods the gateway routes to: the registry, their health and live state."""
