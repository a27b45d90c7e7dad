"""Evaluation: needle sequences, long-context tasks, perplexity by position and length."""
