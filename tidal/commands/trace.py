"""`tidal trace`: generate from prompts and record every forward's routed experts to JSONL."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tidal.errors import ConfigError
from tidal.jsonl import iter_jsonl, read_text


def configure(p) -> None:
    from tidal.cli import add_model_args, add_sampling_args

    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt-file", required=True,
                   help="a text file (one prompt) or .jsonl (one prompt per line: a string or {\"prompt\": ...})")
    p.add_argument("--out", required=True, help="trace file to write (JSON lines)")
    p.set_defaults(func=run, max_tokens=256)


def read_prompts(path: Path) -> list[str]:
    if path.suffix != ".jsonl":
        return [read_text(path, "prompt file")]
    return [item["prompt"] if isinstance(item, dict) else str(item) for _, item in iter_jsonl(path, "prompt file")]


def run(args) -> int:
    from tidal.cli import engine_from_args, sampling_from_args
    from tidal.experts.trace import RecordingExperts

    prompts = read_prompts(Path(args.prompt_file))
    engine = engine_from_args(args)
    if engine.tokenizer is None:
        raise ConfigError("this model has no tokenizer.json, so it cannot take text prompts")
    params = sampling_from_args(args)
    with open(args.out, "w") as out:
        recorder = RecordingExperts(engine.loaded.experts, out)
        engine.loaded.model.set_expert_runtime(recorder)
        # One prompt at a time: each decode step of the trace is one token of one request.
        for i, prompt in enumerate(prompts):
            out.write(json.dumps({"request": i, "prompt_tokens": len(engine.tokenizer.encode(prompt))}) + "\n")
            engine.generate([engine.tokenizer.encode(prompt)], params)
            recorder.flush()
    print(f"wrote {recorder.step} forward steps of {len(prompts)} prompts to {args.out}", file=sys.stderr)
    return 0
