"""CLI layer: `tandem generate | chat | models | doctor` (flag-compatible with mlx_lm.generate)."""
