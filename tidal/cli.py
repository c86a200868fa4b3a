"""The `tidal` command line: generate | chat (more subcommands register themselves below)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Optional

from tidal.errors import TidalError

if TYPE_CHECKING:
    from tidal.types import SamplingParams

log = logging.getLogger("tidal")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="Hugging Face directory, FTW directory, .gguf file or Hub id (default: the built-in demo model)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype (auto: the checkpoint's)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "ftw", "gguf", "dummy"],
                   help="dummy: random weights from a config.json (benchmarks)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    g.add_argument("--max-running", type=int, default=4, help="concurrent requests in a decode batch")
    g.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per forward (prefill chunk)")
    g.add_argument("--no-prefix-cache", action="store_true", help="never reuse KV of earlier requests")
    g = p.add_argument_group("offload")
    g.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="cap on everything Tidal allocates on the GPU (emulates a smaller card)")
    g.add_argument("--expert-cache-gib", type=float, default=None, help="expert cache size (overrides the planner)")
    g.add_argument("--expert-cache-slots", type=int, default=None, help="expert cache size in experts")
    g.add_argument("--moe-policy", default=None, choices=["qstar", "transfer", "cpu", "static"],
                   help="how cache misses are served (default: qstar when experts do not all fit)")
    g.add_argument("--offload-device", default=None, choices=["cpu", "cuda"],
                   help="where the expert cache lives (cpu: exercise the offload path without a GPU)")
    g.add_argument("--no-adapt", action="store_true", help="keep the profiled bandwidths fixed while serving")
    g.add_argument("--cpu-threads", type=int, default=None, help="CPU expert workers (default: physical cores)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args) -> "SamplingParams":
    from tidal.types import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def engine_from_args(args):
    from tidal.engine.engine import Engine

    model = args.model
    if model is None:
        from tidal.weights.demo import demo_model_path
        model = str(demo_model_path())
    engine = Engine(model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  max_model_len=args.max_model_len, max_running=args.max_running,
                  max_batch_tokens=args.max_batch_tokens, progress=sys.stderr.isatty(), **offload_kwargs(args))
    if not getattr(args, "quiet", False):
        print(engine.summary(), file=sys.stderr)
    return engine


def offload_kwargs(args) -> dict:
    return dict(gpu_memory=args.gpu_memory, expert_cache_gib=args.expert_cache_gib,
                expert_cache_slots=args.expert_cache_slots, moe_policy=args.moe_policy,
                offload_device=args.offload_device, adapt=not args.no_adapt, cpu_threads=args.cpu_threads,
                prefix_cache=not args.no_prefix_cache)


def stream(engine, prompt_ids: list[int], params, out=sys.stdout) -> str:
    """Generate for one prompt, writing text to `out` as it arrives; returns the whole text."""
    rid = engine.add_request(prompt_ids, params)
    parts = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.new_text:
                parts.append(o.new_text)
                out.write(o.new_text)
                out.flush()
    return "".join(parts)


def cmd_generate(args) -> int:
    params = sampling_from_args(args)
    engine = engine_from_args(args)
    if engine.tokenizer is None:
        raise TidalError("this model has no tokenizer.json, so it cannot take a text prompt")
    stream(engine, engine.tokenizer.encode(args.prompt), params)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    if args.url:
        from tidal.server.client_chat import chat_with_server
        return chat_with_server(args)
    params = sampling_from_args(args)
    engine = engine_from_args(args)
    if engine.tokenizer is None:
        raise TidalError("this model has no tokenizer.json, so it cannot chat")

    def reply(messages: list[dict]):
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        try:
            return stream(engine, ids, params)
        except KeyboardInterrupt:
            engine.abort_all()
            return None

    from tidal.repl import chat_repl

    return chat_repl(reply, args.system, "tidal chat")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="Serve MoE LLMs larger than your GPU, exactly.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--quiet", action="store_true", help="no start-up summary on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", required=True)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--url", default=None, help="chat with a running `tidal serve` at this URL instead")
    p.add_argument("--api-key", default=None, help="API key of that server (default: env TIDAL_API_KEY)")
    p.set_defaults(func=cmd_chat, max_tokens=512)

    from tidal.commands import bench, convert, doctor, profile, trace
    from tidal.server.serve import add_serve_parser

    add_serve_parser(sub)

    profile.configure(sub.add_parser("profile", help="measure host->GPU and CPU expert bandwidth"))
    bench.configure(sub.add_parser("bench", help="benchmarks (decode)"))
    trace.configure(sub.add_parser("trace", help="record routed experts per step and layer"))
    doctor.configure(sub.add_parser("doctor", help="report this machine and plan a model on it"))
    convert.configure(sub.add_parser("convert", help="convert a model directory or .gguf file to FTW, or --verify one"))
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except TidalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
