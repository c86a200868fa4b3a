"""Subcommands of the `tidal` CLI beyond generate/chat: profile, bench."""
