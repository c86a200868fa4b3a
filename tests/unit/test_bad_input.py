"""Bad input at the edges: one clear line naming what is wrong, and a non-zero exit."""
import json
import subprocess
import sys

import pytest



def run_cli(*args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "tidal", *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A complete small checkpoint with a tokenizer (the placeholder demo model's recipe)."""
    from tidal.weights.demo import write_random_demo_model

    return None, write_random_demo_model(tmp_path_factory.mktemp("demo") / "m")


def copy_model(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_missing_directory(tmp_path):
    rc, _, err = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert rc == 2 and "nope" in last_line(err) and "no such model directory" in last_line(err)


def test_hub_id_without_network_says_so():
    rc, _, err = run_cli("generate", "--model", "Qwen/Qwen3-30B-A3B", "--prompt", "x", timeout=300)
    line = last_line(err)
    assert rc == 2 and "Qwen/Qwen3-30B-A3B" in line and "network" in line


def test_unknown_model_type(good, tmp_path):
    d = copy_model(good[1], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama4_moe_x"
    (d / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli("generate", "--model", str(d), "--prompt", "x")
    assert rc == 2 and "llama4_moe_x" in last_line(err) and "config.json" in last_line(err)


def test_shape_mismatch_names_the_tensor(good, tmp_path):
    d = copy_model(good[1], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = 8  # q_proj in the file no longer matches
    (d / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli("generate", "--model", str(d), "--prompt", "x")
    line = last_line(err)
    assert rc == 2 and "self_attn." in line and "_proj.weight" in line and "shape" in line


def test_missing_and_unused_tensors(good, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_model(good[1], tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    rc, _, err = run_cli("generate", "--model", str(d), "--prompt", "x")
    assert rc == 2 and "model.layers.1.self_attn.k_norm.weight" in last_line(err) and "missing" in last_line(err)

    tensors["model.layers.1.self_attn.k_norm.weight"] = tensors["model.norm.weight"][:16].clone()
    tensors["model.layers.0.mlp.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(d / "model.safetensors"))
    rc, _, err = run_cli("generate", "--model", str(d), "--prompt", "x")
    assert rc == 2 and "model.layers.0.mlp.extra.weight" in last_line(err) and "not used" in last_line(err)


def test_missing_expert(good, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_model(good[1], tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    rc, _, err = run_cli("generate", "--model", str(d), "--prompt", "x")
    assert rc == 2 and "layer 0 expert 3 up_proj" in last_line(err)


@pytest.mark.parametrize("damage", ["header", "truncate"])
def test_corrupted_safetensors(good, tmp_path, damage):
    d = copy_model(good[1], tmp_path / "m")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "header":
        data[8:40] = b"\x00garbage{{{{" + b"!" * 20
    else:
        data = data[: len(data) // 2]
    f.write_bytes(bytes(data))
    rc, _, err = run_cli("generate", "--model", str(d), "--prompt", "x")
    assert rc == 2 and "model.safetensors" in last_line(err)


def test_unreadable_tokenizer(good, tmp_path):
    d = copy_model(good[1], tmp_path / "m")
    (d / "tokenizer.json").write_text("{not json")
    rc, _, err = run_cli("generate", "--model", str(d), "--prompt", "x")
    assert rc == 2 and "tokenizer.json" in last_line(err)


def test_bad_flag_values(good):
    rc, _, err = run_cli("generate", "--model", str(good[1]), "--prompt", "x", "--device", "tpu")
    assert rc == 2 and "--device" in err
    rc, _, err = run_cli("generate", "--model", str(good[1]), "--prompt", "x", "--top-p", "0")
    assert rc == 2 and "top_p" in last_line(err)
    rc, _, err = run_cli("generate", "--model", str(good[1]), "--prompt", "x", "--max-tokens", "-3")
    assert rc == 2 and "max_tokens" in last_line(err)


def test_good_model_runs(good):
    rc, out, err = run_cli("generate", "--model", str(good[1]), "--prompt", "hello", "--max-tokens", "4",
                           "--ignore-eos")
    assert rc == 0, err
