"""sampling: see docs/engine.md's file map."""
