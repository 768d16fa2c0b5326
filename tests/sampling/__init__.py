"""Tests of trtvocab/sampling (see docs/testing.md)."""
