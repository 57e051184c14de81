"""KV-Direct: the bounded, exact conversation cache (state store, planner, disk tier)."""
