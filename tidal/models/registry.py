"""model_type -> model class, imported lazily so a CLI call loads only the family it needs."""
from __future__ import annotations

import importlib

_MODELS = {
    "qwen3_moe": ("tidal.models.qwen3_moe", "Qwen3MoeModel"),
    "mixtral": ("tidal.models.mixtral", "MixtralModel"),
    "olmoe": ("tidal.models.olmoe", "OlmoeModel"),
    "qwen3_next": ("tidal.models.qwen3_next", "Qwen3NextModel"),
    "qwen3_5_moe": ("tidal.models.qwen3_5_moe", "Qwen35MoeModel"),
    "qwen3_5_moe_text": ("tidal.models.qwen3_5_moe", "Qwen35MoeModel"),
}


def supported_model_types() -> frozenset[str]:
    return frozenset(_MODELS)


def model_class(model_type: str):
    module, name = _MODELS[model_type]
    return getattr(importlib.import_module(module), name)
