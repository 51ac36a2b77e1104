"""Drafters: implementations of the engine's draft-source port (engine/draft_source.py).

    draft_model    a small model drafting for every row (snapshot restore)
    prompt_lookup  n-gram prompt lookup
    assistant      Q-only layers over the target's K/V (a trained or Gemma 4 assistant)
    mtp            the target checkpoint's own multi-token-prediction layer
    lookup_first   prompt lookup where a row's text recurs, a stateless drafter elsewhere
    row_sampling   the drafter-side per-row sampler
    factory        build a drafter and depth policy from user settings
"""
