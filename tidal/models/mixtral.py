"""Mixtral: no q/k norm, top-k weights always renormalised; original checkpoints name experts w1/w3/w2."""
from tidal.models.base import MoEDecoder


class MixtralModel(MoEDecoder):
    qk_norm = None
    renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    )
