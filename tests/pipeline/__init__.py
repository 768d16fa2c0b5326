"""Tests of trtvocab/pipeline (see docs/testing.md)."""
