"""Evaluation helpers (held-out perplexity, model x domain matrices)."""
