"""Tests of trtvocab/export (see docs/testing.md)."""
