"""Tests of trtvocab/accuracy (see docs/testing.md)."""
