"""Shared building blocks of the model files: norms, RoPE, attention over paged KV, MoE, MLP."""
