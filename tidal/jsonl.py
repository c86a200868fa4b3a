"""JSON-lines files (prompt lists, routing traces): read with errors that name the file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from tidal.errors import ConfigError


def read_text(path: Path, what: str, prefix: str = "") -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{prefix}{path}: cannot read {what} ({e.strerror})") from None


def iter_jsonl(path: Path, what: str, prefix: str = "") -> Iterator[tuple[int, object]]:
    """Yield (line number, parsed value) for each non-blank line; `prefix` starts error messages."""
    for n, line in enumerate(read_text(path, what, prefix).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{prefix}{path}:{n}: not valid JSON ({e.msg})") from None
