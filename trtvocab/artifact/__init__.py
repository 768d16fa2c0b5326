"""What a user writes and a build stores: the recipe, the manifest, the artifact folder (docs/architecture.md)."""
