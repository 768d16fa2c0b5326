"""Tests of trtvocab/quant (see docs/testing.md)."""
