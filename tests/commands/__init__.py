"""Tests of trtvocab/commands (see docs/testing.md)."""
