"""Workflow-aware KV-cache actions (spec: ``specs/workflow-cache.md``)."""
