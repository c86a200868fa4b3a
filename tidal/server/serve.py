"""`tidal serve`: load a model and serve the OpenAI and Anthropic APIs with uvicorn.

It binds 127.0.0.1 by default: a model server on a personal machine should not be reachable from the
network unless asked (`--host 0.0.0.0`), and then it should have an API key.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from tidal.errors import ConfigError

log = logging.getLogger(__name__)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `tidal serve` on the CLI's subparsers."""
    from tidal.cli import add_model_args
    from tidal.server.parsers import REASONING_PARSER_CHOICES, TOOL_PARSER_CHOICES

    p = subparsers.add_parser("serve", help="serve OpenAI- and Anthropic-compatible HTTP APIs")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY); default: $TIDAL_API_KEY")
    g.add_argument("--served-model-name", default=None,
                   help="model id reported to clients (default: the model directory's name)")
    g.add_argument("--tool-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                   help="tool-call format of the model's output (auto: read it from the chat template)")
    g.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSER_CHOICES,
                   help="reasoning format (auto: <think> tags when the chat template uses them)")
    g.add_argument("--keepalive", type=float, default=5.0, metavar="SECONDS",
                   help="send SSE keep-alives / pings after this long without output (long prefills)")
    p.set_defaults(func=cmd_serve)
    return p


def served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return "tidal-demo"
    path = Path(args.model).expanduser()
    return path.name if path.exists() else args.model


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args) -> int:
    import uvicorn

    from tidal.cli import engine_from_args
    from tidal.engine.async_engine import AsyncEngine
    from tidal.server.app import create_app

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.keepalive <= 0:
        raise ConfigError(f"--keepalive must be > 0 seconds, got {args.keepalive}")
    api_key = args.api_key or os.environ.get("TIDAL_API_KEY") or None
    if not _is_loopback(args.host) and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model "
                    "(set --api-key or TIDAL_API_KEY)", args.host)
    engine = engine_from_args(args)
    async_engine = AsyncEngine(engine)
    name = served_name(args)
    app = create_app(async_engine, name, api_key, tool_parser=args.tool_parser,
                     reasoning_parser=args.reasoning_parser, keepalive_s=args.keepalive)
    level = getattr(args, "log_level", "warning")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=level, access_log=level in ("debug", "info"))
    server = uvicorn.Server(config)
    print(f"tidal: serving {name} at http://{args.host}:{args.port} (OpenAI: /v1, Anthropic: /v1/messages)",
          file=sys.stderr)
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0
