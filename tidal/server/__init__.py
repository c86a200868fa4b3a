"""HTTP serving: OpenAI- and Anthropic-compatible APIs over the AsyncEngine (`tidal serve`).

The server owns JSON, chat templates, tokenization and tool/reasoning parsing; the engine below it
sees token ids and native types only.
"""
