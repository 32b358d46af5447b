"""Workflow-aware KV-cache actions (``docs/architecture.md``, "Workflow cache actions")."""
