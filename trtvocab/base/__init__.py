"""Names, dtypes, units, input checks and safe file handling that every layer shares (docs/architecture.md)."""
