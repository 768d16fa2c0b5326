"""Tests of trtvocab/kernels (see docs/testing.md)."""
