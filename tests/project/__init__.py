"""Tests of the project as a whole: the import graph, the docs, the README's commands (docs/testing.md)."""
