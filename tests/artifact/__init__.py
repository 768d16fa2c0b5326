"""Tests of trtvocab/artifact (see docs/testing.md)."""
