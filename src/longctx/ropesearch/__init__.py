"""LongRoPE2 factor search: the search space with its baselines, and the evolutionary search."""
