"""Tests of trtvocab/checkpoints (see docs/testing.md)."""
