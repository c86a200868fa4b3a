"""FTW (tidal/weights/ftw.py): conversion from Hugging Face directories, loading into the host pool,
damage detection, atomic writes, and conversion memory."""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.test_parity import PROMPTS
from tests.models.tiny import FAMILIES, make_reference, reference_greedy, save
from tidal.engine.engine import Engine
from tidal.errors import CheckpointError
from tidal.types import SamplingParams
from tidal.weights import ftw

REPO = Path(__file__).resolve().parents[2]


def engines(src: Path, out: Path, **kw) -> tuple[Engine, Engine]:
    kw = {"device": "cpu", "dtype": "float32", "progress": False, **kw}
    return Engine(str(src), **kw), Engine(str(out), **kw)


def assert_same_weights(a: Engine, b: Engine) -> None:
    pa, pb = a.loaded.pool, b.loaded.pool
    assert pa.layers == pb.layers
    for layer in pa.layers:
        assert torch.equal(pa.gate_up[layer], pb.gate_up[layer]), layer
        assert torch.equal(pa.down[layer], pb.down[layer]), layer
    da, db = dict(a.loaded.model.named_parameters()), dict(b.loaded.model.named_parameters())
    assert da.keys() == db.keys()
    for name in da:
        assert torch.equal(da[name], db[name]), name


@pytest.fixture
def tiny_ftw(tmp_path):
    src = save(make_reference("qwen3_moe"), tmp_path / "hf")
    return src, ftw.convert(src, tmp_path / "ftw", progress=False)


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_roundtrip_is_bit_identical(family, original_format, tmp_path):
    src = save(make_reference(family), tmp_path / "hf", original_format)
    out = ftw.convert(src, tmp_path / "ftw", progress=False)
    assert {p.name for p in out.iterdir()} >= {"ftw.json", "weights.ftw", "config.json", "generation_config.json"}
    assert not (tmp_path / "ftw.partial").exists()
    index = json.loads((out / "ftw.json").read_text())
    for r in index["regions"].values():
        assert r["offset"] % 4096 == 0
    a, b = engines(src, out)
    assert_same_weights(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_identical(family, tmp_path):
    model = make_reference(family, seed=1)
    src = save(model, tmp_path / "hf")
    a, b = engines(src, ftw.convert(src, tmp_path / "ftw", progress=False), page_size=8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = [r.output_ids for r, _ in b.generate(PROMPTS, params)]
    assert got == [r.output_ids for r, _ in a.generate(PROMPTS, params)]
    assert got == [reference_greedy(model, ids, 24) for ids in PROMPTS]


def test_bank_layout_is_the_host_pool_layout(tiny_ftw):
    """Each bank region is byte for byte the pool's bank: [E, 2I, H] gate rows then up rows, [E, H, I]."""
    src, out = tiny_ftw
    engine = Engine(str(src), device="cpu", dtype="float32", progress=False)
    data = (out / "weights.ftw").read_bytes()
    for name, r in json.loads((out / "ftw.json").read_text())["regions"].items():
        if r["kind"] == "bank":
            bank = (engine.loaded.pool.gate_up if r["role"] == "gate_up" else engine.loaded.pool.down)[r["layer"]]
            assert list(bank.shape) == r["shape"]
            assert data[r["offset"]:r["offset"] + r["size"]] == bank.numpy().tobytes(), name


def test_dtype_conversion_on_both_sides(tmp_path):
    model = make_reference("olmoe")
    src = save(model, tmp_path / "hf")
    out = ftw.convert(src, tmp_path / "ftw", dtype=torch.bfloat16, progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf16 = Engine(str(src), device="cpu", dtype="bfloat16", progress=False)
    ftw16 = Engine(str(out), device="cpu", progress=False)  # auto dtype: the FTW's bfloat16, read directly
    assert ftw16.loaded.pool.dtype == torch.bfloat16
    assert_same_weights(hf16, ftw16)
    ftw32 = Engine(str(out), device="cpu", dtype="float32", progress=False)  # bf16 regions -> fp32 pool
    for layer in hf16.loaded.pool.layers:
        assert torch.equal(ftw32.loaded.pool.gate_up[layer], hf16.loaded.pool.gate_up[layer].float())
        assert torch.equal(ftw32.loaded.pool.down[layer], hf16.loaded.pool.down[layer].float())


def test_truncation_is_always_detected(tiny_ftw, tmp_path):
    _, out = tiny_ftw
    regions = json.loads((out / "ftw.json").read_text())["regions"]
    data = out / "weights.ftw"
    full = data.read_bytes()
    last_name, last = list(regions.items())[-1]
    data.write_bytes(full[:last["offset"] + last["size"] - 1])  # one byte short
    with pytest.raises(CheckpointError, match=rf"truncated: region '{last_name}'"):
        Engine(str(out), device="cpu", progress=False)
    mid_name, mid = list(regions.items())[len(regions) // 2]
    data.write_bytes(full[:mid["offset"] + 100])
    with pytest.raises(CheckpointError, match=rf"truncated: region '{mid_name}'"):
        Engine(str(out), device="cpu", progress=False)
    with pytest.raises(CheckpointError, match="truncated"):
        ftw.verify_dir(out, progress=False)
    data.write_bytes(full[:last["offset"] + last["size"]])  # only the final padding is gone: still whole
    Engine(str(out), device="cpu", progress=False)


def test_bit_flip_is_detected_with_verify(tiny_ftw, monkeypatch):
    src, out = tiny_ftw
    ftw.verify_dir(out, progress=False)
    monkeypatch.setenv("TIDAL_FTW_VERIFY", "1")
    Engine(str(out), device="cpu", progress=False)  # intact: verifies and loads
    regions = json.loads((out / "ftw.json").read_text())["regions"]
    name = "model.layers.2.mlp.experts.down_proj"
    r = regions[name]
    with open(out / "weights.ftw", "r+b") as f:
        f.seek(r["offset"] + r["size"] // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(CheckpointError, match=rf"region '{name}': checksum mismatch in bytes 0\.\.{r['size']}"):
        Engine(str(out), device="cpu", progress=False)
    with pytest.raises(CheckpointError, match=rf"region '{name}': checksum mismatch"):
        ftw.verify_dir(out, progress=False)
    # Without verification the size checks pass and the flip goes unseen: that is what verify is for.
    monkeypatch.setenv("TIDAL_FTW_VERIFY", "0")
    Engine(str(out), device="cpu", progress=False)


def test_failed_conversion_leaves_nothing_loadable(tmp_path, monkeypatch):
    src = save(make_reference("mixtral"), tmp_path / "hf")
    out = tmp_path / "ftw"

    def crash(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ftw, "_finish", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ftw.convert(src, out, progress=False)
    assert not out.exists() and not (tmp_path / "ftw.partial").exists()
    monkeypatch.undo()
    # A conversion killed outright leaves OUT.partial without ftw.json: it never loads ...
    done = ftw.convert(src, out, progress=False)
    partial = tmp_path / "ftw.partial"
    partial.mkdir()
    (partial / "weights.ftw").write_bytes((done / "weights.ftw").read_bytes())
    (partial / "config.json").write_text((done / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no ftw.json, so not a complete FTW directory .*unfinished"):
        Engine(str(partial), device="cpu", load_format="ftw", progress=False)
    with pytest.raises(CheckpointError):
        Engine(str(partial), device="cpu", progress=False)
    # ... and the next conversion clears it away.
    ftw.convert(src, tmp_path / "ftw", overwrite=True, progress=False)
    assert not partial.exists()


def test_existing_output_needs_overwrite(tiny_ftw):
    src, out = tiny_ftw
    with pytest.raises(CheckpointError, match="already exists"):
        ftw.convert(src, out, progress=False)
    (out / "weights.ftw").write_bytes(b"junk")
    ftw.convert(src, out, overwrite=True, progress=False)
    ftw.verify_dir(out, progress=False)
    assert not out.with_name(out.name + ".old").exists()


def test_corrupted_index(tiny_ftw):
    _, out = tiny_ftw
    index = json.loads((out / "ftw.json").read_text())
    first = next(iter(index["regions"]))
    index["regions"][first]["size"] += 4
    (out / "ftw.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"inconsistent entry for region '{first}'"):
        Engine(str(out), device="cpu", progress=False)
    index["version"] = 99
    (out / "ftw.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="newer than this Tidal reads"):
        Engine(str(out), device="cpu", progress=False)
    (out / "ftw.json").write_text("{")
    with pytest.raises(CheckpointError, match="ftw.json: not valid JSON"):
        Engine(str(out), device="cpu", progress=False)


def _has_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


def test_o_direct_refused_falls_back_to_buffered_reads(tiny_ftw, monkeypatch, caplog):
    src, out = tiny_ftw
    reference = Engine(str(src), device="cpu", dtype="float32", progress=False)
    real_open, real_pread = os.open, ftw.pread_into

    def no_direct_open(path, flags, *a):  # a file system that refuses O_DIRECT at open (older tmpfs)
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct_open)
    with caplog.at_level(logging.INFO, logger="tidal.weights.ftw"):
        assert_same_weights(reference, Engine(str(out), device="cpu", dtype="float32", progress=False))
    assert any("O_DIRECT refused" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(os, "open", real_open)
    caplog.clear()

    def refusing_pread(fd, view, offset, what):  # ... or that refuses the reads themselves
        if _has_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pread(fd, view, offset, what)

    monkeypatch.setattr(ftw, "pread_into", refusing_pread)
    with caplog.at_level(logging.INFO, logger="tidal.weights.ftw"):
        assert_same_weights(reference, Engine(str(out), device="cpu", dtype="float32", progress=False))
    assert any("O_DIRECT read refused" in r.getMessage() for r in caplog.records)


def test_direct_reads_land_in_the_pool_without_a_copy(tiny_ftw, monkeypatch):
    """With O_DIRECT on, banks are page aligned and every byte of them came through the direct fd."""
    _, out = tiny_ftw
    real_pread, direct_bytes = ftw.pread_into, []

    def counting(fd, view, offset, what):
        if _has_direct(fd):
            direct_bytes.append(len(view))
        return real_pread(fd, view, offset, what)

    monkeypatch.setattr(ftw, "pread_into", counting)
    engine = Engine(str(out), device="cpu", dtype="float32", progress=False)
    pool = engine.loaded.pool
    if not direct_bytes:
        pytest.skip("this file system refuses O_DIRECT")
    assert all(pool.gate_up[l].data_ptr() % 4096 == 0 and pool.down[l].data_ptr() % 4096 == 0 for l in pool.layers)
    bank_bytes = sum(pool.gate_up[l].nbytes + pool.down[l].nbytes for l in pool.layers)
    assert sum(direct_bytes) >= bank_bytes - 4096 * 2 * len(pool.layers)  # all but sub-page tails


def test_convert_command(tiny_ftw, tmp_path, capsys):
    from tidal.commands import convert as cmd

    src, _ = tiny_ftw
    parser = argparse.ArgumentParser()
    cmd.configure(parser)
    args = parser.parse_args([str(src), str(tmp_path / "out"), "--verify"])
    assert args.func(args) == 0
    assert "every checksum matches" in capsys.readouterr().err
    args = parser.parse_args(["--verify", str(tmp_path / "out")])
    assert args.func(args) == 0
    with open(tmp_path / "out" / "weights.ftw", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        args.func(args)


_MEMORY_SCRIPT = r"""
import json, sys, time, torch
from pathlib import Path
from tidal.weights import ftw
from tidal.runner.loader import load_model
import tidal.models.qwen3_moe, tidal.config, tidal.weights.hf

def status(key):  # bytes; VmHWM is this process's peak RSS since the last reset
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def reset_peak():  # Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

src, out = Path(sys.argv[1]), Path(sys.argv[2])
# Warm-up: the first model built on the meta device imports torch's meta kernels (~75 MB of modules,
# the same for any model size); the conversion does that to check tensor names and shapes.
ftw._expected_dense(tidal.config.ModelConfig.from_file(src / "config.json"))
reset_peak(); before = status("VmRSS"); t0 = time.perf_counter()
ftw.convert(src, out, progress=False)
t1 = time.perf_counter(); convert_peak = status("VmHWM")
reset_peak(); before_load = status("VmRSS")
loaded = load_model(out, torch.device("cpu"), None, "ftw", progress=False)
t2 = time.perf_counter(); load_peak = status("VmHWM")
print(json.dumps({"convert_growth": convert_peak - before, "load_growth": load_peak - before_load,
                  "pool": loaded.pool.total_bytes, "convert_s": t1 - t0, "load_s": t2 - t1}))
"""


def test_conversion_memory_stays_bounded(tmp_path):
    """Convert a ~200 MB checkpoint (128 experts x 4 layers, one safetensors file) in a subprocess: its
    peak RSS may grow by well under one bank (34 MB), let alone the model; loading it back grows peak
    RSS by about the pool's size (banks are read in place, no second copy). Peak RSS is read from
    /proc/self/status VmHWM after resetting it, not from getrusage's ru_maxrss: a subprocess inherits
    the parent's ru_maxrss across fork+exec, which here is far above anything the conversion uses."""
    from safetensors.torch import save_file

    E, H, I, L = 128, 256, 128, 4
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256,
           "hidden_size": H, "intermediate_size": 512, "moe_intermediate_size": I, "num_hidden_layers": L,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": E,
           "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float32"}
    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(256, H, generator=g), "lm_head.weight": torch.randn(256, H, generator=g),
               "model.norm.weight": torch.ones(H)}
    for l in range(L):
        p = f"model.layers.{l}."
        tensors.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                        p + "self_attn.q_proj.weight": torch.randn(256, H, generator=g),
                        p + "self_attn.k_proj.weight": torch.randn(128, H, generator=g),
                        p + "self_attn.v_proj.weight": torch.randn(128, H, generator=g),
                        p + "self_attn.o_proj.weight": torch.randn(H, 256, generator=g),
                        p + "self_attn.q_norm.weight": torch.ones(64), p + "self_attn.k_norm.weight": torch.ones(64),
                        p + "mlp.gate.weight": torch.randn(E, H, generator=g)})
        for e in range(E):
            tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(I, H, generator=g)
            tensors[p + f"mlp.experts.{e}.up_proj.weight"] = torch.randn(I, H, generator=g)
            tensors[p + f"mlp.experts.{e}.down_proj.weight"] = torch.randn(H, I, generator=g)
    model_bytes = sum(t.nbytes for t in tensors.values())
    save_file(tensors, str(src / "model.safetensors"))
    del tensors
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(src), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    grew, bank = m["convert_growth"], E * 2 * I * H * 4
    print(f"model {model_bytes / 1e6:.0f} MB, bank {bank / 1e6:.0f} MB: conversion peak RSS +{grew / 1e6:.1f} MB "
          f"in {m['convert_s']:.2f} s; load peak RSS +{m['load_growth'] / 1e6:.0f} MB for a "
          f"{m['pool'] / 1e6:.0f} MB pool in {m['load_s']:.2f} s")
    assert model_bytes > 190e6
    assert grew < bank / 2 < model_bytes / 8
    assert 0.9 * m["pool"] < m["load_growth"] < 1.1 * model_bytes
