"""Tests of trtvocab/base (see docs/testing.md)."""
