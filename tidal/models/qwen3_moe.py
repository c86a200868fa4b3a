"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, optional top-k renormalisation."""
from tidal.models.base import MoEDecoder


class Qwen3MoeModel(MoEDecoder):
    qk_norm = "head"
