"""The package version, in a module of its own so that writers can record it without
importing the whole package (``trtvocab/__init__`` imports the head, which imports them)."""

__version__ = "0.1.0"
