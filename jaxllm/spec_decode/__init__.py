"""Speculative decoding: the config (config.py), the proposers (ngram_proposer.py,
draft_model.py, proposers.py) and the acceptance counters (metrics.py)."""
