"""The terminal chat loop shared by `tidal chat` (local engine) and `tidal chat --url` (a server)."""
from __future__ import annotations

import sys
from typing import Callable, Optional


def chat_repl(reply: Callable[[list[dict]], Optional[str]], system: Optional[str], banner: str) -> int:
    """Read user lines, ask `reply(messages)` to stream an answer (it returns the whole text, or None
    when the user interrupted it), and keep the conversation. /reset starts over; Ctrl-D quits."""
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    print(f"{banner}: type a message, /reset to start over, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = reply(messages)
        if text is None:
            print("\n[stopped]", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": text})
