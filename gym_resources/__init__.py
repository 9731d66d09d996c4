"""The reference resources server: the tools a rollout calls, with state of their own, one resource of
each class of `protocol.resources` (docs/turns.md, Resources)."""
