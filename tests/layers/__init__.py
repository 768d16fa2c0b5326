"""Tests of the layers a model uses: vocab_parallel.py, lm_head.py, embedding.py, logits.py (docs/testing.md)."""
