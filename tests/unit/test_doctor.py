"""tidal doctor: runs on a CPU-only machine, and its prediction follows DESIGN.md's model."""
import subprocess
import sys
from types import SimpleNamespace

import torch

from tidal.commands.doctor import predict
from tidal.config import ModelConfig
from tidal.experts.bandwidth import BandwidthModel


def test_doctor_reports_machine_and_plans_a_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tidal", "doctor", "--model", "benchmarks/configs/olmoe-1b-7b.json",
                           "--seconds", "0.1"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TIDAL_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("CPU ", "RAM ", "GPU ", "olmoe", "predicted decode"):
        assert needle in out
    assert (tmp_path / "bandwidth.json").exists()   # the profile was stored for the engine to reuse


def test_prediction_matches_the_performance_model_by_hand():
    cfg = ModelConfig.from_file("benchmarks/configs/qwen3-30b-a3b.json")
    S = 3 * 2048 * 768 * 2
    X = 48 * 8 * S                                           # expert bytes per token
    bw = BandwidthModel(b_p=40e9, b_h=90e9, b_cpu_alone=80e9, b_cpu_concurrent=50e9)
    plan = SimpleNamespace(expert_slots=6144 // 4, total_experts=6144)   # a quarter of the pool cached
    dense = 3 * 2 ** 30
    embed = 151936 * 2048 * 2
    got = predict(cfg, bw, plan, dense, hbm=4.8e12)
    miss_t = 0.75 * X / (40e9 + 50e9)
    gpu_t = (dense - embed + 0.25 * X) / 4.8e12
    assert abs(got["tok_s"] - 1 / max(miss_t, gpu_t)) < 1e-6 * got["tok_s"]
    cpu_only = predict(cfg, bw, None, dense, hbm=0)
    assert abs(cpu_only["tok_s"] - 80e9 / (X + dense - embed)) < 1e-6 * cpu_only["tok_s"]
