"""OLMoE: RMSNorm over the full q and k projections (not per head), optional q/k/v clipping."""
from tidal.models.base import MoEDecoder


class OlmoeModel(MoEDecoder):
    qk_norm = "full"
