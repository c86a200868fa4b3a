"""Hugging Face model directories: find them, read their JSON, stream their safetensors.

Tensors are streamed one at a time through safetensors' memory map, so loading never holds a second
copy of the model. Every failure names the file (and tensor) at fault.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from tidal.errors import CheckpointError

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local directory as is; otherwise treat `model` as a Hub id and download it (when online)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: expected a model directory (config.json + *.safetensors)")
    looks_like_repo = str(model).count("/") == 1 and not str(model).startswith((".", "/", "~"))
    if not looks_like_repo:
        raise CheckpointError(f"{model}: no such model directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - it is a dependency
        raise CheckpointError(f"{model}: not a local directory and huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(repo_id=str(model), allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # network errors come in many classes; all mean the same to the user
        raise CheckpointError(
            f"{model}: not a local directory, and downloading it from the Hugging Face Hub failed "
            f"({type(e).__name__}); this machine may have no network access: download the model "
            f"elsewhere and pass its local directory to --model"
        ) from None


def read_json(path: Path, required: bool = True) -> dict | None:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path}: file not found")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives, read from the safetensors header without touching data."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def _read_header(file: Path) -> dict:
    """Parse and sanity-check a safetensors header so a corrupt file fails here, by name."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError(f"{file}: corrupted safetensors header (length {n} bytes)")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupted safetensors header ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupted safetensors header")
    data_len = size - 8 - n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            dtype = meta["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupted safetensors header entry for tensor {name!r}") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
        if not 0 <= begin <= end <= data_len:
            raise CheckpointError(f"{file}: tensor {name!r} lies outside the file (truncated file?)")
    return header


def list_tensors(model_dir: Path) -> dict[str, TensorInfo]:
    """Index every tensor of the checkpoint (one file, or several via model.safetensors.index.json)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: missing 'weight_map'")
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files found")
    infos: dict[str, TensorInfo] = {}
    for file in files:
        if not file.exists():
            raise CheckpointError(f"{file}: listed in model.safetensors.index.json but missing")
        for name, meta in _read_header(file).items():
            if name == "__metadata__":
                continue
            if name in infos:
                raise CheckpointError(f"{file}: tensor {name!r} also appears in {infos[name].file.name}")
            infos[name] = TensorInfo(name, file, _SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]))
    return infos


def iter_tensors(infos: dict[str, TensorInfo]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) file by file; each tensor is a view of the memory map until copied."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for info in infos.values():
        by_file.setdefault(info.file, []).append(info.name)
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensors ({e})") from None
