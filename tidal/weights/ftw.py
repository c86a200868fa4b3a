"""FTW, Tidal's fast weight format: the host pool's banks on disk, ready to be read straight in.

An FTW directory (written by `tidal convert SRC OUT`, SRC a Hugging Face directory or a .gguf file):

    OUT/
      ftw.json             the index, written last: its presence marks a complete conversion
      weights.ftw          the data: one region per tensor, each at a 4 KiB aligned offset
      config.json          the model's config (generated from metadata for a GGUF source)
      generation_config.json, tokenizer.json, tokenizer_config.json, ... copied from SRC

Regions, in file order:
- dense: every non-expert tensor under its canonical name (`model.layers.0.self_attn.q_proj.weight`,
  after the family's renames), row-major, in its checkpoint dtype;
- bank: for each MoE layer l, `model.layers.{l}.mlp.experts.gate_up_proj` [E, 2I, H] (expert e's
  gate rows, then its up rows) and `model.layers.{l}.mlp.experts.down_proj` [E, H, I]: byte for byte
  the host pool's banks (tidal/experts/host_pool.py), so loading is one sequential read per bank
  into the pool's own memory, no intermediate copy.
Between regions the file holds zero padding up to the next multiple of 4096 (O_DIRECT reads need
aligned file offsets); the file ends padded too.

ftw.json:
    {"format": "tidal-ftw", "version": 1, "alignment": 4096,
     "checksum": {"algorithm": "crc32", "chunk_bytes": 67108864},
     "model_type": "qwen3_moe", "source": {"format": "safetensors" | "gguf", "path": "..."},
     "files": {"weights.ftw": {"size": <bytes>}},
     "regions": {"<name>": {"kind": "dense" | "bank", "dtype": "bfloat16", "shape": [...],
                            "file": "weights.ftw", "offset": <bytes>, "size": <bytes>,
                            "crc32": [<crc of bytes [0, 64 MiB)>, <crc of [64 MiB, 128 MiB)>, ...],
                            "layer": <int, banks only>, "role": "gate_up" | "down" (banks only)}}}
Offsets and sizes are bytes; size = prod(shape) * element size. Checksums are zlib.crc32 over each
64 MiB chunk of a region (the last chunk shorter): crc32 ran at 2.0 GB/s on one core of our test
VM against 0.8 GB/s for blake2b(digest_size=16), and chunks let several threads verify one bank and
say where it is damaged. CRC is for detecting corruption, not tampering.

Guarantees:
- Conversion streams: resident memory holds one expert (or one <= 64 MiB piece of a dense tensor)
  at a time, never a bank or the model (tests/unit/test_ftw.py measures it). It writes into
  OUT.partial/ and renames it to OUT only after the data and the index are on disk (fsync), so a
  crash leaves no directory that loads; a later run deletes the stale OUT.partial.
- Loading checks the index against the file sizes before reading, so a truncated file is an error
  naming the first region it cuts, always. With verification on (`TIDAL_FTW_VERIFY=1`, or
  verify=True) every chunk's crc32 is checked as it is read: a flipped bit is an error naming the
  region and byte range. `tidal convert --verify OUT` checks a directory without loading a model.
- Reads run in parallel threads (os.preadv releases the GIL), 64 MiB per request, with O_DIRECT when
  the file system allows it (no page-cache copy of a file as large as the pool); where O_DIRECT is
  refused (older tmpfs) Tidal logs it and uses buffered reads. TIDAL_FTW_DIRECT=0 turns it off.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from tidal.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = "tidal-ftw"
VERSION = 1
ALIGN = 4096
CHUNK = 64 << 20
INDEX = "ftw.json"
DATA = "weights.ftw"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_SIDE_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


# -- low-level I/O helpers (shared with gguf.py) ----------------------------------------------------
def bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (works for bfloat16 too)."""
    if not t.is_contiguous():
        raise ValueError("bytes_view needs a contiguous tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def pread_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill `view` from file offset `offset`; a short file is a CheckpointError naming `what`."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{what}: unexpected end of file after {done} of {len(view)} bytes "
                                  "(truncated file?)")
        done += n


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data starts on a 4 KiB boundary (O_DIRECT needs it)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = elem
    for d in shape:
        nbytes *= d
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- the index ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Region:
    name: str
    kind: str                    # "dense" | "bank"
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    offset: int
    size: int
    crc32: tuple[int, ...]
    layer: Optional[int] = None
    role: Optional[str] = None   # banks: "gate_up" | "down"

    def to_json(self) -> dict:
        d = {"kind": self.kind, "dtype": _dtype_name(self.dtype), "shape": list(self.shape), "file": self.file,
             "offset": self.offset, "size": self.size, "crc32": list(self.crc32)}
        if self.kind == "bank":
            d.update(layer=self.layer, role=self.role)
        return d


def is_ftw_dir(path: Path) -> bool:
    return path.is_dir() and (path / INDEX).is_file()


def read_index(directory: Path) -> tuple[dict, list[Region]]:
    """Parse and check ftw.json; CheckpointError names the field or region at fault."""
    path = directory / INDEX
    if not path.is_file():
        hint = (" (an unfinished conversion: run `tidal convert` again)" if directory.name.endswith(".partial")
                else "")
        raise CheckpointError(f"{directory}: no {INDEX}, so not a complete FTW directory{hint}")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an FTW index (format is not {FORMAT!r})")
    if not isinstance(index.get("version"), int) or index["version"] > VERSION:
        raise CheckpointError(f"{path}: FTW version {index.get('version')!r} is newer than this Tidal reads "
                              f"({VERSION}); upgrade Tidal or convert again")
    if index.get("checksum", {}).get("algorithm") != "crc32" or index["checksum"].get("chunk_bytes") != CHUNK:
        raise CheckpointError(f"{path}: unsupported checksum settings {index.get('checksum')!r}")
    regions = []
    for name, r in (index.get("regions") or {}).items():
        try:
            dtype = _DTYPES[r["dtype"]]
            shape = tuple(int(d) for d in r["shape"])
            region = Region(name, r["kind"], dtype, shape, str(r["file"]), int(r["offset"]), int(r["size"]),
                            tuple(int(c) for c in r["crc32"]), r.get("layer"), r.get("role"))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupted entry for region {name!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if (region.kind not in ("dense", "bank") or region.offset % ALIGN
                or region.size != numel * torch.tensor([], dtype=dtype).element_size()
                or len(region.crc32) != -(-region.size // CHUNK)
                or Path(region.file).name != region.file):
            raise CheckpointError(f"{path}: inconsistent entry for region {name!r}")
        regions.append(region)
    if not regions:
        raise CheckpointError(f"{path}: the index lists no regions")
    return index, sorted(regions, key=lambda r: (r.file, r.offset))


def check_sizes(directory: Path, regions: list[Region]) -> None:
    """Every region must lie inside its file: catches truncation before a byte is read."""
    sizes: dict[str, int] = {}
    for r in regions:
        if r.file not in sizes:
            try:
                sizes[r.file] = (directory / r.file).stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{directory / r.file}: data file missing (needed by region {r.name!r})") \
                    from None
        if r.offset + r.size > sizes[r.file]:
            raise CheckpointError(f"{directory / r.file}: truncated: region {r.name!r} needs bytes up to "
                                  f"{r.offset + r.size}, the file has {sizes[r.file]}")


# -- reading ------------------------------------------------------------------------------------------
class _ParallelReader:
    """Reads regions of one file into tensors: 64 MiB requests spread over threads, O_DIRECT when the
    destination is page aligned and the file system allows it, crc32 checked per chunk on demand."""

    def __init__(self, path: Path, threads: int, direct: bool):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.dfd: Optional[int] = None
        self.direct = False          # cleared for good when a direct read is refused; dfd stays open
        self._lock = threading.Lock()  # until close(), so no thread ever reads a closed or reused fd
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                log.info("%s: O_DIRECT refused (%s); reading through the page cache", path, e.strerror)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ftw-read")

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def _refuse_direct(self, e: OSError) -> None:
        with self._lock:
            if self.direct:
                log.info("%s: O_DIRECT read refused (%s); reading through the page cache", self.path, e.strerror)
                self.direct = False

    def _chunk(self, r: Region, view: memoryview, addr: int, start: int, verify: bool) -> None:
        """Bytes [start, start + len(view)) of region r into `view` (at address `addr`)."""
        what = f"{self.path}: region {r.name!r}"
        offset = r.offset + start
        done = 0
        if self.direct and addr % ALIGN == 0:
            n = len(view) // ALIGN * ALIGN
            try:
                if n:
                    pread_into(self.dfd, view[:n], offset, what)
                done = n
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self._refuse_direct(e)
        if done < len(view):
            try:
                pread_into(self.fd, view[done:], offset + done, what)
            except OSError as e:
                raise CheckpointError(f"{what}: cannot read ({e.strerror})") from None
        if verify:
            i = start // CHUNK
            if zlib.crc32(view) != r.crc32[i]:
                raise CheckpointError(f"{what}: checksum mismatch in bytes {start}..{start + len(view)} "
                                      "(corrupted file; convert the model again)")

    def read(self, r: Region, dst: torch.Tensor, verify: bool) -> None:
        """Region r into `dst` (contiguous, r's dtype and numel)."""
        view, base = bytes_view(dst), dst.data_ptr()
        assert len(view) == r.size, (r.name, len(view), r.size)
        futures = [self.pool.submit(self._chunk, r, view[a:a + CHUNK], base + a, a, verify)
                   for a in range(0, r.size, CHUNK)]
        wait(futures)  # no thread may still write into dst when we return or raise
        for f in futures:
            f.result()

    def read_converting(self, r: Region, dst: torch.Tensor, verify: bool, staging: torch.Tensor) -> None:
        """Region r into `dst` of another dtype, one 64 MiB chunk at a time through `staging`."""
        flat, elem = dst.view(-1), torch.tensor([], dtype=r.dtype).element_size()
        for a in range(0, r.size, CHUNK):
            n = min(CHUNK, r.size - a)
            part = staging[:n]
            self._chunk(r, bytes_view(part), part.data_ptr(), a, verify)
            flat[a // elem:(a + n) // elem].copy_(part.view(r.dtype))


class FtwCheckpoint:
    """An FTW directory opened for loading: index parsed, file sizes checked."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.index, self.regions = read_index(self.directory)
        check_sizes(self.directory, self.regions)

    @property
    def num_tensors(self) -> int:
        return len(self.regions)

    def iter_tensors(self, pool, verify: Optional[bool] = None, direct: Optional[bool] = None,
                     threads: Optional[int] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, tensor) for MoEDecoder.load_weights. Banks are read into the pool's own bank
        tensors and yielded as those tensors (set_stacked's copy of a tensor onto itself is a no-op)."""
        verify = _env_flag("TIDAL_FTW_VERIFY", False) if verify is None else verify
        direct = _env_flag("TIDAL_FTW_DIRECT", True) if direct is None else direct
        threads = threads or min(8, os.cpu_count() or 1)
        if verify:
            log.info("%s: verifying checksums while loading", self.directory)
        readers: dict[str, _ParallelReader] = {}
        staging: Optional[torch.Tensor] = None
        try:
            for r in self.regions:
                if r.file not in readers:
                    readers[r.file] = _ParallelReader(self.directory / r.file, threads, direct)
                reader = readers[r.file]
                if r.kind == "dense":
                    t = aligned_empty(r.shape, r.dtype)
                    reader.read(r, t, verify)
                    yield r.name, t
                    continue
                banks = pool.gate_up if r.role == "gate_up" else pool.down if r.role == "down" else None
                if banks is None or r.layer not in banks:
                    raise CheckpointError(f"{self.directory}: region {r.name!r} is a bank of a layer or role "
                                          "this config.json has no experts for")
                bank = banks[r.layer]
                if tuple(bank.shape) != r.shape:
                    raise CheckpointError(f"{self.directory}: region {r.name!r} has shape {r.shape}, the pool "
                                          f"expects {tuple(bank.shape)} from config.json")
                if bank.dtype == r.dtype:
                    if reader.direct and bank.data_ptr() % ALIGN:
                        # O_DIRECT needs a page-aligned destination; the bank is still untouched memory,
                        # so swapping in an aligned one costs nothing and keeps the read copy-free.
                        bank = banks[r.layer] = aligned_empty(r.shape, r.dtype)
                    reader.read(r, bank, verify)
                else:  # e.g. a bfloat16 FTW loaded with --dtype float32
                    if staging is None:
                        staging = aligned_empty((CHUNK,), torch.uint8)
                    reader.read_converting(r, bank, verify, staging)
                yield r.name, bank
        finally:
            for reader in readers.values():
                reader.close()


def verify_dir(directory: str | os.PathLike, progress: bool = True, threads: Optional[int] = None) -> int:
    """Check every region's checksums (a few 64 MiB chunks at a time, in parallel); returns the bytes
    checked, raises CheckpointError naming the first damaged region and counting the rest."""
    directory = Path(directory)
    _, regions = read_index(directory)
    check_sizes(directory, regions)
    threads = threads or min(4, os.cpu_count() or 1)
    chunks = [(r, a) for r in regions for a in range(0, r.size, CHUNK)]
    staging = [aligned_empty((CHUNK,), torch.uint8) for _ in range(min(threads, len(chunks)))]
    bad: list[str] = []
    bar = tqdm(total=sum(r.size for r in regions), unit="B", unit_scale=True, desc="verifying",
               disable=not progress, leave=False)
    readers = {f: _ParallelReader(directory / f, threads, _env_flag("TIDAL_FTW_DIRECT", True))
               for f in sorted({r.file for r in regions})}

    def check(r: Region, a: int, buf: torch.Tensor) -> int:
        part = buf[:min(CHUNK, r.size - a)]
        readers[r.file]._chunk(r, bytes_view(part), part.data_ptr(), a, True)
        return len(part)

    try:
        pool = next(iter(readers.values())).pool
        for i in range(0, len(chunks), len(staging)):
            futures = [pool.submit(check, r, a, buf) for (r, a), buf in zip(chunks[i:i + len(staging)], staging)]
            wait(futures)
            for f in futures:
                try:
                    bar.update(f.result())
                except CheckpointError as e:
                    bad.append(str(e))
    finally:
        bar.close()
        for reader in readers.values():
            reader.close()
    if bad:
        raise CheckpointError(bad[0] + (f" (and {len(bad) - 1} more damaged chunks)" if len(bad) > 1 else ""))
    return sum(r.size for r in regions)


# -- conversion sources -------------------------------------------------------------------------------
class SafetensorsSource:
    """A Hugging Face directory as a conversion source: tensors read with os.pread at the offsets in
    the safetensors headers (no memory map, so the resident set stays one tensor), names mapped to
    canonical ones with the family's renames, experts found per expert or stacked (transformers 5)."""

    origin = "safetensors"

    def __init__(self, directory: Path):
        import re

        from tidal.config import ModelConfig
        from tidal.models.base import _IGNORED, _PER_EXPERT, _STACKED
        from tidal.models.registry import model_class
        from tidal.weights.hf import _read_header, list_tensors, read_json

        self.path = directory
        self.config = read_json(directory / "config.json")
        self.generation_config = read_json(directory / "generation_config.json", required=False)
        cfg = ModelConfig.from_hf(self.config, source=str(directory / "config.json"))
        self.cfg = cfg
        family = model_class(cfg.model_type)
        renames, skipped = family.renames, getattr(family, "skipped", ())
        infos = list_tensors(directory)
        self._fds: dict[Path, int] = {}
        starts: dict[Path, int] = {}
        headers: dict[Path, dict] = {}
        for info in infos.values():
            if info.file not in starts:
                with open(info.file, "rb") as f:
                    starts[info.file] = 8 + int.from_bytes(f.read(8), "little")
                headers[info.file] = _read_header(info.file)
                self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        # name -> (fd, absolute offset, dtype, shape, file)
        self._loc = {}
        for name, info in infos.items():
            begin, _ = headers[info.file][name]["data_offsets"]
            self._loc[name] = (self._fds[info.file], starts[info.file] + begin, info.dtype, info.shape, info.file)
        self.dense: dict[str, str] = {}                              # canonical -> checkpoint name
        self._experts: dict[tuple[int, int, str], tuple[str, int]] = {}  # (l, e, role) -> (name, byte offset)
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        for name, info in infos.items():
            canon = name
            for pattern, repl in renames:
                canon = re.sub(pattern, repl, canon)
            if m := _PER_EXPERT.fullmatch(canon):
                want = (I, H) if m[3] != "down" else (H, I)
                self._check_shape(name, info.shape, want)
                self._experts[(int(m[1]), int(m[2]), m[3])] = (name, 0)
            elif m := _STACKED.fullmatch(canon):
                layer, elem = int(m[1]), info.dtype.itemsize
                if m[2] == "gate_up":
                    self._check_shape(name, info.shape, (E, 2 * I, H))
                    for e in range(E):
                        self._experts[(layer, e, "gate")] = (name, e * 2 * I * H * elem)
                        self._experts[(layer, e, "up")] = (name, (e * 2 * I + I) * H * elem)
                else:
                    self._check_shape(name, info.shape, (E, H, I))
                    for e in range(E):
                        self._experts[(layer, e, "down")] = (name, e * H * I * elem)
            elif (_IGNORED.fullmatch(canon) or (canon == "lm_head.weight" and cfg.tie_word_embeddings)
                  or any(re.fullmatch(p, canon) for p in skipped)):
                continue  # what load_weights would drop: not stored
            else:
                self.dense[canon] = name

    def _check_shape(self, name: str, shape, want) -> None:
        if tuple(shape) != tuple(want):
            raise CheckpointError(f"tensor {name!r}: shape {tuple(shape)}, expected {tuple(want)} from config.json")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def dense_names(self) -> list[str]:
        return list(self.dense)

    def dense_dtype(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.dtype:
        return dtype or self._loc[self.dense[name]][2]

    def dense_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._loc[self.dense[name]][3])

    def dense_pieces(self, name: str, dtype: Optional[torch.dtype] = None) -> Iterator[torch.Tensor]:
        """The tensor's elements in order, as flat pieces of at most 64 MiB (of the source dtype)."""
        fd, offset, src, shape, file = self._loc[self.dense[name]]
        numel = 1
        for d in shape:
            numel *= d
        step = CHUNK // src.itemsize
        for a in range(0, numel, step):
            piece = torch.empty(min(step, numel - a), dtype=src)
            pread_into(fd, bytes_view(piece), offset + a * src.itemsize, f"{file}: tensor {self.dense[name]!r}")
            yield piece if dtype is None else piece.to(dtype)

    def expert_layers(self) -> list[int]:
        return list(self.cfg.moe_layers)

    def expert_dtype(self, layer: int, dtype: Optional[torch.dtype] = None) -> torch.dtype:
        if dtype is not None:
            return dtype
        key = (layer, 0, "gate")
        if key not in self._experts:
            raise CheckpointError(f"checkpoint is missing expert weights: layer {layer} expert 0 gate_proj")
        return self._loc[self._experts[key][0]][2]

    def read_expert(self, layer: int, expert: int, role: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        key = (layer, expert, role)
        if key not in self._experts:
            raise CheckpointError(f"checkpoint is missing expert weights: layer {layer} expert {expert} {role}_proj")
        name, skip = self._experts[key]
        fd, offset, src, _, file = self._loc[name]
        H, I = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        out = torch.empty((I, H) if role != "down" else (H, I), dtype=src)
        pread_into(fd, bytes_view(out), offset + skip, f"{file}: tensor {name!r}")
        return out if dtype is None or dtype == src else out.to(dtype)

    def side_files(self) -> list[Path]:
        names = [f for f in _SIDE_FILES if (self.path / f).is_file()]
        names += sorted(f.name for f in self.path.glob("*.jinja") if f.name not in names)
        return [self.path / f for f in names]


def open_source(src: Path):
    """A conversion source for a Hugging Face directory (or Hub id, downloaded) or a .gguf file."""
    if not src.exists() and src.suffix != ".gguf":
        from tidal.weights.hf import resolve_model_path

        src = resolve_model_path(str(src))
    if src.is_file() and src.suffix == ".gguf":
        from tidal.weights.gguf import GGUFCheckpoint

        return GGUFCheckpoint(src)
    if src.is_dir():
        if is_ftw_dir(src):
            raise CheckpointError(f"{src}: already an FTW directory")
        return SafetensorsSource(src)
    raise CheckpointError(f"{src}: expected a Hugging Face model directory or a .gguf file")


# -- conversion ---------------------------------------------------------------------------------------
class _RegionWriter:
    """Appends one region to the data file, computing its chunk checksums on the way."""

    def __init__(self, f, offset: int, size: int, bar):
        self.f, self.offset, self.size, self.bar = f, offset, size, bar
        self.written, self.crcs, self._crc = 0, [], 0

    def write(self, t: torch.Tensor) -> None:
        view = bytes_view(t.contiguous())
        while len(view):
            room = CHUNK - self.written % CHUNK
            part, view = view[:room], view[room:]
            if self.written + len(part) > self.size:
                raise CheckpointError("internal error: a region got more bytes than its shape holds")
            self.f.write(part)
            self._crc = zlib.crc32(part, self._crc)
            self.written += len(part)
            if self.written % CHUNK == 0:
                self.crcs.append(self._crc)
                self._crc = 0
            self.bar.update(len(part))

    def finish(self, name: str) -> tuple[int, ...]:
        if self.written != self.size:
            raise CheckpointError(f"internal error: region {name!r} got {self.written} of {self.size} bytes")
        if self.written % CHUNK:
            self.crcs.append(self._crc)
        pad = _round_up(self.offset + self.size) - (self.offset + self.size)
        self.f.write(b"\0" * pad)
        return tuple(self.crcs)


def _expected_dense(cfg) -> dict[str, tuple[int, ...]]:
    """Canonical dense names and shapes of the model `cfg` builds (on the meta device: no memory)."""
    from tidal.models.registry import model_class

    model = model_class(cfg.model_type)(cfg, torch.float32, torch.device("meta"))
    return model.expected_dense_tensors()


def convert(src: str | os.PathLike, out: str | os.PathLike, dtype: Optional[torch.dtype] = None,
            overwrite: bool = False, progress: bool = True) -> Path:
    """Convert a Hugging Face directory or a .gguf file to an FTW directory `out`; returns `out`.

    dtype: store every floating tensor in this dtype (default: as in the source; quantised GGUF
    tensors become the GGUF's natural dtype, bfloat16)."""
    from tidal.config import ModelConfig

    src, out = Path(src).expanduser(), Path(out).expanduser()
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass --overwrite to replace it)")
    source = open_source(src)
    try:
        config = dict(source.config)
        if dtype is not None:
            config["torch_dtype"] = _dtype_name(dtype)
            config.pop("dtype", None)
        cfg = ModelConfig.from_hf(config, source=f"{src} config")
        expected = _expected_dense(cfg)
        have = set(source.dense_names())
        for name in source.dense_names():
            if name not in expected:
                raise CheckpointError(f"{src}: checkpoint tensor {name!r} is not used by the {cfg.model_type} "
                                      "model built from its config (wrong model_type or layer count?)")
            if tuple(source.dense_shape(name)) != tuple(expected[name]):
                raise CheckpointError(f"{src}: tensor {name!r} has shape {tuple(source.dense_shape(name))}, "
                                      f"expected {tuple(expected[name])} from the config")
        missing = sorted(set(expected) - have)
        if missing:
            raise CheckpointError(f"{src}: checkpoint is missing tensor {missing[0]!r}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        if sorted(source.expert_layers()) != sorted(cfg.moe_layers):
            raise CheckpointError(f"{src}: the checkpoint has experts in layers {sorted(source.expert_layers())}, "
                                  f"the config in {sorted(cfg.moe_layers)}")
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

        # Lay out every region before writing a byte: dense first, then each layer's two banks.
        plan = []  # (name, kind, dtype, shape, layer, role)
        for name in sorted(have, key=_natural_key):
            native = source.dense_dtype(name)
            dt = dtype if dtype is not None and native.is_floating_point else native
            plan.append((name, "dense", dt, tuple(expected[name]), None, None))
        for layer in sorted(cfg.moe_layers):
            bank_dtype = source.expert_dtype(layer, dtype)
            plan.append((f"model.layers.{layer}.mlp.experts.gate_up_proj", "bank", bank_dtype, (E, 2 * I, H),
                         layer, "gate_up"))
            plan.append((f"model.layers.{layer}.mlp.experts.down_proj", "bank", bank_dtype, (E, H, I),
                         layer, "down"))
        offsets, pos = [], 0
        for _, _, dt, shape, _, _ in plan:
            size = dt.itemsize
            for d in shape:
                size *= d
            offsets.append((pos, size))
            pos = _round_up(pos + size)

        partial = out.with_name(out.name + ".partial")
        if partial.exists():
            log.warning("%s: removing an unfinished earlier conversion", partial)
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        try:
            regions = _write_data(source, partial / DATA, plan, offsets, dtype, pos, progress)
            _finish(source, src, out, partial, config, regions, pos, cfg.model_type, overwrite)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    finally:
        source.close()
    log.info("converted %s -> %s (%.2f GB)", src, out, pos / 1e9)
    return out


def _natural_key(name: str):
    import re

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _write_data(source, path: Path, plan, offsets, dtype, total: int, progress: bool) -> list[Region]:
    regions = []
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress)
    try:
        with open(path, "wb") as f:
            for (name, kind, dt, shape, layer, role), (offset, size) in zip(plan, offsets):
                assert f.tell() == offset
                w = _RegionWriter(f, offset, size, bar)
                if kind == "dense":
                    for piece in source.dense_pieces(name, dt):
                        w.write(piece)
                else:
                    for e in range(shape[0]):
                        for r in (("gate", "up") if role == "gate_up" else ("down",)):
                            w.write(source.read_expert(layer, e, r, dt))
                regions.append(Region(name, kind, dt, shape, DATA, offset, size, w.finish(name), layer, role))
            f.flush()
            os.fsync(f.fileno())
    finally:
        bar.close()
    return regions


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(source, src: Path, out: Path, partial: Path, config: dict, regions: list[Region], data_size: int,
            model_type: str, overwrite: bool) -> None:
    """Side files, then the index (last, atomically), then the directory rename."""
    for file in source.side_files():
        if file.name != "config.json":
            shutil.copy2(file, partial / file.name)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if source.generation_config and not (partial / "generation_config.json").exists():
        (partial / "generation_config.json").write_text(json.dumps(source.generation_config, indent=2) + "\n")
    index = {"format": FORMAT, "version": VERSION, "alignment": ALIGN,
             "checksum": {"algorithm": "crc32", "chunk_bytes": CHUNK},
             "model_type": model_type, "source": {"format": source.origin, "path": str(src)},
             "files": {DATA: {"size": data_size}},
             "regions": {r.name: r.to_json() for r in regions}}
    tmp = partial / (INDEX + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / INDEX)
    _fsync_dir(partial)
    if out.exists():  # --overwrite: the old output stays whole until the new one is in place
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old)
    else:
        os.replace(partial, out)
    _fsync_dir(out.parent)
