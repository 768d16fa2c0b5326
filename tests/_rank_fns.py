"""Module-level functions run on each rank by tests (spawned processes must import them)."""
