"""Helpers for tests and local experiments, not used by the server: e.g. `tiny_vision`, a tiny multimodal Gemma-3."""
