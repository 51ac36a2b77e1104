"""Engine layer: sampling, per-request output state, plain and batched generation."""
