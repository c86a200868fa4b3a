"""Checkpoint formats: Hugging Face safetensors directories, dummy weights, the demo model."""
