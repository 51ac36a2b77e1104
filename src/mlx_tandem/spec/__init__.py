"""Speculative layer: draft sources, the depth policy and lossless verification."""
