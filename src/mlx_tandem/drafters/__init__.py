"""Drafters: implementations of the engine's draft-source port (engine/draft_source.py).

    draft_model    a small model drafting for every row (snapshot restore)
    prompt_lookup  n-gram prompt lookup
    row_sampling   the drafter-side per-row sampler
    factory        build a drafter and depth policy from user settings
"""
