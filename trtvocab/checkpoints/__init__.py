"""Reading checkpoints: safetensors and HF folders, GGUF, row-sliced readers, provenance."""
