"""Qwen3.5-MoE, text only: the Qwen3-Next architecture with DeltaNet projections stored separately
(in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) and every layer MoE.

Checkpoints of the vision-language model name the decoder `model.language_model.*` and carry a
vision tower (`model.visual.*`), which is skipped with a log line. Text positions are the same on
the three M-RoPE axes, so M-RoPE reduces to ordinary (partial) RoPE here.
"""
from __future__ import annotations

import logging
from typing import Iterable

from tidal.experts.host_pool import HostExpertPool
from tidal.layers.linear_attention import GatedDeltaNetSplitProj
from tidal.models.qwen3_next import HybridDecoderLayer, Qwen3NextModel

log = logging.getLogger(__name__)

_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


class Qwen35DecoderLayer(HybridDecoderLayer):
    delta_net_cls = GatedDeltaNetSplitProj


class Qwen35MoeModel(Qwen3NextModel):
    layer_cls = Qwen35DecoderLayer
    renames = ((r"^model\.language_model\.", "model."),)

    def load_weights(self, tensors: Iterable, pool: HostExpertPool) -> None:
        skipped = 0

        def text_only():
            nonlocal skipped
            for name, tensor in tensors:
                if name.startswith(_VISION_PREFIXES):
                    skipped += 1
                    continue
                yield name, tensor

        super().load_weights(text_only(), pool)
        if skipped:
            log.info("skipped %d vision-tower tensors: Tidal serves the text model only", skipped)
