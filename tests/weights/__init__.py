"""Tests of trtvocab/weights (see docs/testing.md)."""
