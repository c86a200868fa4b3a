"""GPU memory planning: one budget split between dense weights, KV cache, workspace and expert slots."""
