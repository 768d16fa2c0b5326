"""trtvocab's tests, one folder per layer of the package (docs/testing.md)."""
