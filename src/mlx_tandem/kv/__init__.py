"""KV layer: per-row cache storage, batch-invariant attention, the state-rows contract."""
