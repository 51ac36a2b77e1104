"""Models layer: loading (catalogue, GGUF import, mlx-lm folders) and the graph binding."""
