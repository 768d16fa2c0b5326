"""The two ways through an artifact: build (recipe -> artifact) and runtime (artifact -> logits on a backend)."""
