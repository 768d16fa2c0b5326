"""Tests of trtvocab/parallel (see docs/testing.md)."""
